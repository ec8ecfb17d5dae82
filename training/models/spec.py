"""`ModelSpec`: everything the rest of the training package asks of a model, whichever it is. The trainer
builds, shards, initialises and loads through it; FLOPs/MFU, the data's vocabulary check, the peer-state
fingerprint and the capacity sizes read its `shape`; the exporter maps its state dict to the Hugging Face
layout. The fault-tolerance mechanisms never see it: they see state dicts.

`model_spec(cfg.model)` picks the implementation: preset.py or huggingface.py (imported only when asked
for, so a preset run never imports transformers).
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import replace
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
        """Vocabulary, parameter count and bytes, and what FLOPs per token need (training/contract/flops.py)."""

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


def units_of_classes(model: nn.Module, class_names: frozenset[str]) -> list[tuple[nn.Module, str]]:
    """(parent, name) of every module whose class is one of `class_names`, outermost only, in order."""
    units: list[tuple[nn.Module, str]] = []

    def visit(parent: nn.Module) -> None:
        for name, child in parent.named_children():
            if type(child).__name__ in class_names:
                units.append((parent, name))
            else:
                visit(child)

    visit(model)
    return units


def layout_fingerprint(model: nn.Module) -> str:
    """A digest of the parameter layout (names, shapes, dtypes): what peer state and resume checks compare,
    so that state made for another layout is never loaded. Works on a meta model."""
    layout = [(name, list(t.shape), str(t.dtype)) for name, t in model.state_dict().items()]
    return hashlib.sha256(json.dumps(layout).encode()).hexdigest()[:16]


def untied_state(model: nn.Module, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`state` (the model's state dict) less the names of parameters tied to one named before them (a Hugging
    Face lm_head tied to the embedding): the safetensors files hold such a weight once, under the first name."""
    first: dict[int, str] = {}
    aliases = set()
    for name, parameter in model.named_parameters(remove_duplicate=False):
        if id(parameter) in first:
            aliases.add(name)
        first.setdefault(id(parameter), name)
    return {name: tensor for name, tensor in state.items() if name not in aliases}


def counted_shape(shape: ModelShape, model: nn.Module, embedding: nn.Module) -> ModelShape:
    """`shape` with the parameters counted on the built model (tied weights once)."""
    return replace(shape, parameters=sum(p.numel() for p in model.parameters()),
                   embedding_parameters=sum(p.numel() for p in embedding.parameters()))
