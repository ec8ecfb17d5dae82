"""What every model spec computes the same way from its modules: the units to shard, the parameter layout's
fingerprint, the state dict without tied aliases, the parameters counted on the built model."""
from __future__ import annotations

import hashlib
import json
from dataclasses import replace

import torch
from torch import nn

from training.contract.shapes import ModelShape


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
    """`shape` with the parameters counted on the built model (tied weights once); as many of them inactive
    per token as `shape` says (a mixture of experts' unrouted experts)."""
    parameters = sum(p.numel() for p in model.parameters())
    inactive = shape.parameters - shape.active_parameters
    return replace(shape, parameters=parameters, active_parameters=parameters - inactive,
                   embedding_parameters=sum(p.numel() for p in embedding.parameters()))
