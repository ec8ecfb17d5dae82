"""`ModelSpec`: everything the rest of the training package asks of a model, whichever it is. The trainer
builds, shards, initialises and loads through it; FLOPs/MFU, the data's vocabulary check, the peer-state
fingerprint and the capacity sizes read its `shape`; the exporter maps its state dict to the Hugging Face
layout. The fault-tolerance mechanisms never see it: they see state dicts.

`model_spec(cfg.model)` picks the implementation: `preset` or `huggingface` (imported only when asked
for, so a preset run never imports transformers).
"""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import torch
from torch import nn

from training.contract.config import ModelConfig
from training.contract.shapes import ModelShape

if TYPE_CHECKING:
    from transformers import PretrainedConfig


class ModelSpec(Protocol):
    @property
    def shape(self) -> ModelShape:
        """Vocabulary, parameter count and bytes, and what FLOPs per token need (training.contract.flops)."""

    @property
    def fingerprint(self) -> str:
        """Changes when the parameter layout changes (layout_fingerprint): peer state and resumes compare it."""

    def build(self, device: torch.device | str) -> nn.Module:
        """The model on `device`, uninitialised (meta: materialised shard by shard after sharding); its
        forward takes token ids (batch, seq) and returns float logits (batch, seq, vocab)."""

    def shard_units(self, model: nn.Module) -> list[tuple[nn.Module, str]]:
        """(parent, child name) of each module that is sharded on its own and checkpointed as a whole
        (the decoder layers), in forward order."""

    def init_weights(self, model: nn.Module, seed: int) -> None:
        """Deterministic weights from `seed`, on whole tensors (CPU) or on shards after `to_empty` (CUDA)."""

    def load_pretrained(self, model: nn.Module) -> bool:
        """At step 0: the pretrained weights into the sharded model, each rank reading its shards only;
        False when there are none (the model keeps its initial weights)."""

    def to_hf(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """A full model state dict in the Hugging Face layout of `hf_config` (identity for a HF model)."""

    def hf_config(self) -> PretrainedConfig:
        """The transformers config the exported model is loaded with."""

    @property
    def source_files(self) -> list[Path]:
        """Files that go with an export besides weights and config (tokenizer files)."""


def model_spec(model: ModelConfig) -> ModelSpec:
    if model.source == "preset":
        from training.models.preset import PresetSpec

        return PresetSpec(model.preset)
    from training.models.huggingface import HuggingFaceSpec

    return HuggingFaceSpec(model.path)
