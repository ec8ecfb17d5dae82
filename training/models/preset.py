"""The built-in presets (training.contract.shapes.PRESETS) as a ModelSpec: our Llama-style modules
(`llama`), initialised from the seed; no pretrained weights. Exported as a transformers LlamaForCausalLM."""
from __future__ import annotations

from functools import cached_property
from pathlib import Path

import torch
from torch import nn

from training.contract.shapes import PRESETS, ModelShape, preset_shape
from training.models.llama import Block, Transformer, build_model
from training.models.layout import layout_fingerprint, units_of_classes

# Our names -> transformers' Llama names, per block and outside the blocks.
_BLOCK_NAMES = {
    "attention.wq": "self_attn.q_proj", "attention.wk": "self_attn.k_proj", "attention.wv": "self_attn.v_proj",
    "attention.wo": "self_attn.o_proj", "feed_forward.w1": "mlp.gate_proj", "feed_forward.w3": "mlp.up_proj",
    "feed_forward.w2": "mlp.down_proj", "attention_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
}
_TOP_NAMES = {"tok_embeddings.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
              "output.weight": "lm_head.weight"}


def interleaved_to_half_rotation(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """Our rotary embedding turns interleaved pairs (x0, x1), (x2, x3) ... of each head (Meta's layout);
    transformers' Llama turns (x_i, x_{i + head_dim/2}). Permuting the rows of wq and wk moves each pair
    into transformers' positions, as its convert_llama_weights_to_hf.py does."""
    rows, columns = weight.shape
    return weight.view(heads, rows // heads // 2, 2, columns).transpose(1, 2).reshape(rows, columns)


class PresetSpec:
    def __init__(self, preset: str) -> None:
        self.preset = preset
        self.args = PRESETS[preset]

    @property
    def shape(self) -> ModelShape:
        return preset_shape(self.preset)

    def build(self, device: torch.device | str) -> Transformer:
        return build_model(self.preset, device)

    def shard_units(self, model: nn.Module) -> list[tuple[nn.Module, str]]:
        return units_of_classes(model, frozenset({Block.__name__}))

    def init_weights(self, model: nn.Module, seed: int) -> None:
        model.init_weights(seed)

    def load_pretrained(self, model: nn.Module) -> bool:
        return False

    @cached_property
    def fingerprint(self) -> str:
        return layout_fingerprint(self.build("meta"))

    def hf_config(self):
        from transformers import LlamaConfig

        a = self.args
        return LlamaConfig(vocab_size=a.vocab_size, hidden_size=a.dim, intermediate_size=a.ffn_hidden,
                           num_hidden_layers=a.n_layers, num_attention_heads=a.n_heads, num_key_value_heads=a.n_kv_heads,
                           max_position_embeddings=a.max_seq_len, rms_norm_eps=a.norm_eps, tie_word_embeddings=False,
                           rope_parameters={"rope_type": "default", "rope_theta": a.rope_theta},
                           architectures=["LlamaForCausalLM"], bos_token_id=None, eos_token_id=None)

    def to_hf(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        out = {}
        for name, tensor in state.items():
            if name in _TOP_NAMES:
                out[_TOP_NAMES[name]] = tensor
                continue
            _, index, rest = name.split(".", 2)  # layers.<i>.<module>.weight
            module = rest.removesuffix(".weight")
            if module in ("attention.wq", "attention.wk"):
                tensor = interleaved_to_half_rotation(
                    tensor, self.args.n_heads if module == "attention.wq" else self.args.n_kv_heads)
            out[f"model.layers.{index}.{_BLOCK_NAMES[module]}.weight"] = tensor
        return out

    @property
    def source_files(self) -> list[Path]:
        return []
