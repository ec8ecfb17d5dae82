"""In-memory rollback for in-process restarts: after every step each rank keeps a host copy of its own
part of the training state (the same Stateful dict that DCP checkpoints: model and optimizer shards,
step and data position, RNG), so that a restart resumes from the last completed step instead of the
last checkpoint on disk.

The copies live in the process, which an in-process restart keeps; a new process (in-job restart)
starts empty and loads from disk. Two steps are kept: ranks can be one step apart when a fault
strikes (FSDP2's optimizer step is local, so a rank may finish step N while a peer fails before the
end of it), and `restore` agrees on the newest step every rank holds.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.tensor import DTensor

KEEP = 2


def host_copy(value: Any) -> Any:
    """A detached host copy: DTensors as their local shard, containers recursed, other leaves as is
    (state_dict() returns fresh ints/strings)."""
    if isinstance(value, DTensor):
        value = value.to_local()
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, dict):
        return {k: host_copy(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(host_copy(v) for v in value)
    return value


def _fill(template: Any, saved: Any) -> Any:
    """`template` (a fresh state_dict()) holding `saved`: tensors copied in place, as DCP loads them
    (a DTensor keeps its new mesh and placements), other leaves replaced."""
    if isinstance(template, DTensor):
        template.to_local().copy_(saved)
        return template
    if isinstance(template, torch.Tensor):
        return template.copy_(saved)
    if isinstance(template, dict):
        return {k: _fill(template[k], v) if k in template else v for k, v in saved.items()}
    if isinstance(template, (list, tuple)):
        return type(template)(_fill(t, s) for t, s in zip(template, saved, strict=True))
    return saved


class MemoryRollback:
    def __init__(self) -> None:
        self._snapshots: dict[int, dict[str, Any]] = {}

    @property
    def steps(self) -> list[int]:
        return sorted(self._snapshots)

    def save(self, step: int, state: dict[str, Stateful]) -> None:
        snapshot = {key: host_copy(obj.state_dict()) for key, obj in state.items()}
        # One assignment publishes it: an asynchronous restart exception cannot leave it half-written.
        self._snapshots[step] = snapshot
        for old in self.steps[:-KEEP]:
            del self._snapshots[old]

    def restore(self, state: dict[str, Stateful]) -> int | None:
        """Load the newest step that every rank holds into `state` and return it; None (and `state`
        untouched) when some rank holds none. Collective: every rank calls it at the same point."""
        newest = torch.tensor([max(self._snapshots, default=-1)])
        if dist.is_initialized():
            dist.all_reduce(newest, op=dist.ReduceOp.MIN)
        step = int(newest.item())
        if step < 0:
            return None
        if step not in self._snapshots:  # ranks more than one step apart: cannot happen (see module doc)
            raise RuntimeError(f"in-memory rollback: step {step} agreed but this rank holds {self.steps}")
        snapshot = self._snapshots[step]
        templates = {key: obj.state_dict() for key, obj in state.items()}  # all first, as dcp.load
        for key, obj in state.items():
            obj.load_state_dict(_fill(templates[key], snapshot[key]))
        return step
