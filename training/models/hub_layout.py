"""Where a Hugging Face model's parameters lie in its safetensors files, so that a rank reads only the rows
and columns inside its own shard, never more of a parameter than its shard (`Piece`, `read_pieces`).

Every family but Mixtral holds each parameter whole under its own name. Mixtral's hub checkpoints hold one
tensor per expert, while transformers builds each layer's experts fused (`hub_pieces`); both layouts load
here (`file_layout`), and an export writes the hub's.
"""
from __future__ import annotations

import re
from collections.abc import Collection, Mapping, Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

# a fused expert parameter of transformers' Mixtral (MixtralExperts)
FUSED_EXPERTS = re.compile(r"^(?P<layer>.+)\.mlp\.experts\.(?P<kind>gate_up_proj|down_proj)$")


@dataclass(frozen=True)
class Piece:
    """One tensor of the files and its place in a parameter, so that a rank reads from each piece only the
    rows and columns inside its own shard: the files' tensor `name` of `shape`, a whole parameter (expert
    None), or the rows [first_row, first_row + shape[0]) of expert `expert` in a fused expert parameter."""
    name: str
    shape: tuple[int, ...]
    expert: int | None = None
    first_row: int = 0

    @property
    def whole(self) -> bool:
        return self.expert is None

    def of(self, parameter: torch.Tensor) -> torch.Tensor:
        """This piece of the whole `parameter` (a view)."""
        if self.whole:
            return parameter
        return parameter[self.expert, self.first_row:self.first_row + self.shape[0]]


def hub_pieces(model_type: str, name: str, shape: Sequence[int]) -> list[Piece]:
    """The pieces of parameter `name` in the hub's layout of `model_type`. Every family but Mixtral holds each
    parameter whole under its own name.

    Mixtral's hub checkpoints hold its router as `model.layers.N.block_sparse_moe.gate.weight` and one tensor
    per expert (`...block_sparse_moe.experts.E.w1.weight`, w2, w3), while transformers 5.23.0 builds each
    layer's experts fused: `mlp.experts.gate_up_proj` [experts, 2 x intermediate, hidden] holds expert E's w1
    (gate) rows then its w3 (up) rows, and `mlp.experts.down_proj` [experts, hidden, intermediate] its w2. That
    is transformers' own conversion, `_build_checkpoint_conversion_mapping()["mixtral"]` in
    transformers/conversion_mapping.py: WeightRenaming(".block_sparse_moe.", ".mlp."), w1 and w3 stacked over
    the experts (MergeModulelist(dim=0)) then concatenated (Concatenate(dim=1)) into gate_up_proj, w2 stacked
    into down_proj."""
    shape = tuple(shape)
    if model_type != "mixtral":
        return [Piece(name, shape)]
    fused = FUSED_EXPERTS.match(name)
    if fused is None:  # the router (mlp.gate) is renamed, every other parameter kept
        return [Piece(name.replace(".mlp.", ".block_sparse_moe."), shape)]
    experts, rows, columns = shape
    prefix = f"{fused['layer']}.block_sparse_moe.experts"
    if fused["kind"] == "gate_up_proj":  # each expert's w1 (gate) rows, then its w3 (up) rows
        half = rows // 2
        return [Piece(f"{prefix}.{e}.{w}.weight", (half, columns), e, first)
                for e in range(experts) for w, first in (("w1", 0), ("w3", half))]
    return [Piece(f"{prefix}.{e}.w2.weight", (rows, columns), e) for e in range(experts)]


def file_layout(model_type: str, shapes: Mapping[str, Sequence[int]],
                in_files: Collection[str]) -> dict[str, list[Piece]]:
    """Each parameter's pieces in files holding the tensors `in_files`: the hub's layout, unless the files
    hold Mixtral's fused expert parameters under their own names (save_original_format=False). transformers'
    `save_pretrained` writes the hub's layout unless `save_original_format=False`, which writes the fused
    parameters under their own names; both load here, and an export writes the hub's."""
    own_names = any(FUSED_EXPERTS.match(name) and name in in_files for name in shapes)
    return {name: [Piece(name, tuple(shape))] if own_names else hub_pieces(model_type, name, shape)
            for name, shape in shapes.items()}


def read_pieces(pieces: Sequence[Piece], files: Mapping[str, Path], shard: torch.Tensor,
                offsets: Sequence[int]) -> None:
    """Fill `shard`, the block of a fused expert parameter that starts at `offsets` (a rank's shard), from
    the safetensors `files` (tensor name -> file) of its `pieces`, reading only the slices inside the block."""
    start, end = list(offsets), [o + n for o, n in zip(offsets, shard.shape)]
    with ExitStack() as stack:
        opened: dict[Path, object] = {}
        for piece in pieces:
            rows = max(piece.first_row, start[1]), min(piece.first_row + piece.shape[0], end[1])
            if not start[0] <= piece.expert < end[0] or rows[0] >= rows[1]:
                continue  # another rank's
            file = files[piece.name]
            if file not in opened:
                opened[file] = stack.enter_context(safe_open(file, framework="pt"))
            block = opened[file].get_slice(piece.name)[rows[0] - piece.first_row:rows[1] - piece.first_row,
                                                       start[2]:end[2]]
            shard[piece.expert - start[0], rows[0] - start[1]:rows[1] - start[1]].copy_(block)
