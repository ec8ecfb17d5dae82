"""A Hugging Face causal LM from a local directory as a ModelSpec: built with transformers from its
config.json (AutoModelForCausalLM.from_config, never from a hub), sharded per decoder layer (the classes the
model declares in `_no_split_modules`), initialised with its own `_init_weights` from the seed, or loaded
from the directory's *.safetensors at step 0 through torch DCP's HuggingFaceStorageReader: each rank reads
the slices of its own shards, so no rank ever holds the whole model. Its state dict is already in the
Hugging Face layout.
"""
from __future__ import annotations

import logging
from functools import cached_property
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import HuggingFaceStorageReader
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

from training.contract.model_source import HF_CONFIG, ModelSourceError, hf_shape, read_hf_config
from training.contract.shapes import ModelShape
from training.models.layout import counted_shape, layout_fingerprint, units_of_classes, untied_state

log = logging.getLogger(__name__)

# Files an export copies from the source directory besides config.json: the tokenizer's.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "generation_config.json")


def _logits_only(module: nn.Module, args: tuple, output) -> torch.Tensor:
    """transformers returns a ModelOutput; the trainer (and every spec's forward) gives float logits."""
    return output.logits.float()


class HuggingFaceSpec:
    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        read_hf_config(self.path)  # the torch-free refusals first, with their messages
        try:  # no remote code: a model_type this transformers does not know is refused, not fetched
            self.config = AutoConfig.from_pretrained(self.path, local_files_only=True)
        except (ValueError, OSError) as err:
            raise ModelSourceError(f"{self.path / HF_CONFIG}: transformers cannot read it: {err}") from None
        if type(self.config) not in MODEL_FOR_CAUSAL_LM_MAPPING:
            raise ModelSourceError(f"{self.path / HF_CONFIG}: model_type {self.config.model_type!r} has no causal LM "
                                   "in transformers (AutoModelForCausalLM); only decoder language models train here")
        self.config.use_cache = False  # training: no key/value cache

    @cached_property
    def shape(self) -> ModelShape:
        model = self.build("meta")
        return counted_shape(hf_shape(self.config.to_dict(), str(self.path)), model, model.get_input_embeddings())

    def build(self, device: torch.device | str) -> nn.Module:
        # fp32 master weights whatever dtype the checkpoint was saved in; bf16 compute comes from FSDP's policy
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(self.config, dtype=torch.float32, attn_implementation="sdpa")
        model.register_forward_hook(_logits_only)
        return model

    def shard_units(self, model: nn.Module) -> list[tuple[nn.Module, str]]:
        classes = frozenset(model._no_split_modules or ())
        units = units_of_classes(model, classes)
        if not units:
            raise ModelSourceError(f"{self.path / HF_CONFIG}: {type(model).__name__} declares no decoder layer "
                                   f"classes to shard (_no_split_modules={sorted(classes)})")
        return units

    def init_weights(self, model: nn.Module, seed: int) -> None:
        torch.manual_seed(seed)
        for module in model.modules():  # transformers skips modules it marked initialised at construction
            module.__dict__.pop("_is_hf_initialized", None)
        model.initialize_weights()  # rotary tables included (PreTrainedModel._init_weights)
        model.tie_weights()

    @cached_property
    def fingerprint(self) -> str:
        return layout_fingerprint(self.build("meta"))

    @property
    def weight_files(self) -> list[Path]:
        return sorted(self.path.glob("*.safetensors"))

    def check_weights(self) -> None:
        """The directory's *.safetensors against the model the config builds: every tensor the model needs
        (a weight tied to another may be left out), with the model's shape. Reads the files' headers only."""
        from safetensors import safe_open

        files = self.weight_files
        if not files:
            return
        found: dict[str, tuple[list[int], Path]] = {}
        for file in files:
            with safe_open(file, framework="pt") as f:
                found |= {name: (list(f.get_slice(name).get_shape()), file) for name in f.keys()}
        model = self.build("meta")
        expected = untied_state(model, get_model_state_dict(model))
        missing = sorted(set(expected) - set(found))
        misshaped = [f"{name}: {found[name][0]} in {found[name][1].name}, the config makes {list(t.shape)}"
                     for name, t in expected.items() if name in found and found[name][0] != list(t.shape)]
        if missing or misshaped:
            raise ModelSourceError(
                f"{self.path}: the *.safetensors do not match {HF_CONFIG}"
                + (f"; missing {len(missing)} tensor(s): {missing[:8]}{' ...' if len(missing) > 8 else ''}"
                   if missing else "")
                + (f"; shapes differ: {misshaped[:8]}" if misshaped else ""))
        unused = sorted(set(found) - set(expected))
        if unused:
            log.warning("%s: %d tensor(s) the model does not use are ignored: %s", self.path, len(unused), unused[:8])

    def load_pretrained(self, model: nn.Module) -> bool:
        if not self.weight_files:
            return False
        state = untied_state(model, get_model_state_dict(model))
        # in place: the state dict's tensors are the model's (sharded) parameters; each rank reads its slices
        dcp.load(state, storage_reader=HuggingFaceStorageReader(str(self.path)))
        set_model_state_dict(model, state, options=StateDictOptions(strict=False))
        model.tie_weights()
        return True

    def hf_config(self) -> PretrainedConfig:
        return self.config

    def to_hf(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return state

    @property
    def source_files(self) -> list[Path]:
        return [self.path / name for name in TOKENIZER_FILES if (self.path / name).is_file()]
