"""One decision for all ranks: the small collectives after which every rank takes the same branch.

Why: a rank that decides alone (to save, to skip, which step to load) pairs its next collective with a
different one on its peers, which hangs or returns garbage. Each function here is a collective: every rank
of `group` calls it at the same point, in the same order. Without a process group it computes locally, so a
one-rank run and a unit test call the same code. What it costs: one collective of a few bytes on gloo (the
CPU backend beside NCCL); an object's costs its pickle.
"""
from __future__ import annotations

from typing import Callable, TypeVar

import torch
import torch.distributed as dist

T = TypeVar("T")


def distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def least(*values: float, group: dist.ProcessGroup | None = None) -> list[float]:
    """Each of `values`, the smallest that any rank holds (exact for whole numbers below 2**53)."""
    return _reduce(values, dist.ReduceOp.MIN, group)


def most(*values: float, group: dist.ProcessGroup | None = None) -> list[float]:
    """Each of `values`, the largest that any rank holds."""
    return _reduce(values, dist.ReduceOp.MAX, group)


def every(holds: bool, group: dist.ProcessGroup | None = None) -> bool:
    """Whether `holds` is true on every rank."""
    return least(1.0 if holds else 0.0, group=group)[0] > 0


def from_rank0(compute: Callable[[], T]) -> T:
    """`compute()` on rank 0, its result on every rank (what only rank 0 may look at: the file system)."""
    if not distributed():
        return compute()
    box = [compute() if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]  # type: ignore[return-value]


def first_found(compute: Callable[[], T | None]) -> T | None:
    """`compute()` on every rank; the lowest rank's result that is not None, on every rank."""
    return next((f for f in every_rank(compute()) if f is not None), None)


def every_rank(value: T, group: dist.ProcessGroup | None = None) -> list[T]:
    """Each rank's `value`, in rank order, on every rank."""
    if not distributed():
        return [value]
    gathered: list[T | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, value, group=group)
    return gathered  # type: ignore[return-value]


def total(values: torch.Tensor) -> list[float]:
    """Each of `values` summed over the ranks, on the device `values` is on: on GPUs one NCCL all-reduce of
    the training group, so that a step's loss carries other numbers without a collective of their own."""
    if distributed():
        dist.all_reduce(values)
    return values.tolist()


def _reduce(values: tuple[float, ...], op: dist.ReduceOp, group: dist.ProcessGroup | None) -> list[float]:
    reduced = torch.tensor(values, dtype=torch.float64)
    if distributed():
        dist.all_reduce(reduced, op=op, group=group)
    return reduced.tolist()
