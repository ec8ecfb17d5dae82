"""A Hugging Face causal LM from a local directory as a ModelSpec: built with transformers from its
config.json (AutoModelForCausalLM.from_config, never from a hub), sharded per decoder layer (the classes the
model declares in `_no_split_modules`), initialised with its own `_init_weights` from the seed, or loaded
from the directory's *.safetensors at step 0 through torch DCP's HuggingFaceStorageReader: each rank reads
the slices of its own shards, so no rank ever holds the whole model. Its state dict is the Hugging Face
layout, but for Mixtral's experts, which the hub holds one by one and transformers builds fused
(`hub_layout`): a rank reads its shard of them from each expert's slices, and an export splits them again.
"""
from __future__ import annotations

import logging
from collections.abc import Collection
from functools import cached_property
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import HuggingFaceStorageReader
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict
from torch.distributed.tensor import DTensor
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

from training.contract.model_source import HF_CONFIG, ModelSourceError, hf_shape, read_hf_config
from training.contract.shapes import ModelShape
from training.models.hub_layout import Piece, file_layout, hub_pieces, read_pieces
from training.models.layout import counted_shape, layout_fingerprint, units_of_classes, untied_state

log = logging.getLogger(__name__)

# Files an export copies from the source directory besides config.json: the tokenizer's.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "generation_config.json")


def _logits_only(module: nn.Module, args: tuple, output) -> torch.Tensor:
    """transformers returns a ModelOutput; the trainer (and every spec's forward) gives float logits."""
    return output.logits.float()


def _local_shard(tensor: torch.Tensor) -> tuple[torch.Tensor, tuple[int, ...]]:
    """A parameter's local shard and where it starts in the whole (a plain tensor is its own shard)."""
    if not isinstance(tensor, DTensor):
        return tensor, (0,) * tensor.dim()
    chunks = tensor.__create_chunk_list__()  # what DCP asks a DTensor: where its local shard lies
    return tensor.to_local(), tuple(chunks[0].offsets) if chunks else (0,) * tensor.dim()


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

    def _tensors_in_files(self) -> dict[str, tuple[list[int], Path]]:
        """Name -> (shape, file) of every tensor in the directory's *.safetensors, from their headers."""
        from safetensors import safe_open

        found: dict[str, tuple[list[int], Path]] = {}
        for file in sorted(self.path.glob("*.safetensors")):
            with safe_open(file, framework="pt") as f:
                found |= {name: (list(f.get_slice(name).get_shape()), file) for name in f.keys()}
        return found

    def _file_layout(self, state: dict[str, torch.Tensor], found: Collection[str]) -> dict[str, list[Piece]]:
        return file_layout(self.config.model_type, {name: t.shape for name, t in state.items()}, found)

    def check_weights(self) -> None:
        """The directory's *.safetensors against the model the config builds: every tensor the model needs
        (a weight tied to another may be left out; Mixtral's experts one by one as on the hub, or fused as
        transformers builds them: `hub_layout`), with the model's shape. Reads the files' headers only."""
        found = self._tensors_in_files()
        if not found:
            return
        model = self.build("meta")
        layout = self._file_layout(untied_state(model, get_model_state_dict(model)), found)
        expected = {piece.name: list(piece.shape) for pieces in layout.values() for piece in pieces}
        missing = sorted(set(expected) - set(found))
        misshaped = [f"{name}: {found[name][0]} in {found[name][1].name}, the config makes {shape}"
                     for name, shape in expected.items() if name in found and found[name][0] != shape]
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
        found = self._tensors_in_files()
        if not found:
            return False
        state = untied_state(model, get_model_state_dict(model))
        layout = self._file_layout(state, found)
        # in place: the state dict's tensors are the model's (sharded) parameters. A parameter whole in the
        # files is read by name through DCP, each rank its slices; one in pieces (Mixtral's experts on the
        # hub) is assembled by each rank from the slices of the pieces that fall in its shard.
        whole = {pieces[0].name: state[name] for name, pieces in layout.items() if pieces[0].whole}
        dcp.load(whole, storage_reader=HuggingFaceStorageReader(str(self.path)))
        files = {name: file for name, (_, file) in found.items()}
        with torch.no_grad():
            for name, pieces in layout.items():
                if not pieces[0].whole:
                    read_pieces(pieces, files, *_local_shard(state[name]))
        set_model_state_dict(model, state, options=StateDictOptions(strict=False))
        model.tie_weights()
        return True

    def hf_config(self) -> PretrainedConfig:
        return self.config

    def to_hf(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The hub's layout (Mixtral's experts one by one, as views of the fused parameters)."""
        return {piece.name: piece.of(tensor) for name, tensor in state.items()
                for piece in hub_pieces(self.config.model_type, name, tensor.shape)}

    @property
    def source_files(self) -> list[Path]:
        return [self.path / name for name in TOKENIZER_FILES if (self.path / name).is_file()]
