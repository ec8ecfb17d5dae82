"""In-memory rollback for in-process restarts: each rank keeps its last two steps in host memory.

After every step each rank copies its own part of the training state (the Stateful dict DCP
checkpoints: model and optimizer shards, step and data position, RNG) into host buffers, so that an
in-process restart resumes from the last completed step, not from the last checkpoint on disk. The
copies live in the process: a new process (an in-job restart) starts empty and loads from disk. Two
steps are kept, as ranks can be a step apart when a fault strikes; `restore` agrees on the newest step
every rank holds. Cost: host memory for two copies of the rank's state (pinned on CUDA), and a copy
every step that the step waits for, kept cheap by reusing the buffers and, for model and optimizer,
by skipping state_dict() (`CopyPlan`).
"""
from __future__ import annotations

import contextlib
import weakref
from dataclasses import dataclass, field
from typing import Any, Iterator, Protocol, runtime_checkable

import torch
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.tensor import DTensor

from training.train.agreement import least

# Steps kept. Ranks can be one step apart when a fault strikes (FSDP2's optimizer step is local, so a rank may
# finish step N while a peer fails before the end of it): with two, every rank holds the step `restore` agrees on.
KEEP = 2


@runtime_checkable
class InPlaceState(Protocol):
    """A Stateful whose state_dict() is costly and hands out its live tensors (or views of them), which
    training updates in place: a save copies them again without calling state_dict() (`CopyPlan`).

    torch's state-dict helpers cost more per step than the copy (Python work per tensor), while the tensors
    they hand out are the same memory step after step (FSDP2 shards and AdamW's moments and step counts are
    updated in place)."""

    def state_dict(self) -> dict[str, Any]: ...

    def live_tensors(self) -> list[torch.Tensor]:
        """Cheaply, in the order of the structure holding them: every tensor whose memory state_dict()
        hands out (DTensors or local; more is allowed)."""

    def refresh(self, saved: dict[str, Any]) -> None:
        """Write into `saved`, a copy of an earlier state_dict(), the non-tensor leaves that can change
        while no tensor moves (an optimizer's learning rate)."""


Where = tuple[int, torch.Size, tuple[int, ...], torch.dtype, torch.device]


def local_shard(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (a view), any other tensor itself."""
    return t.to_local() if isinstance(t, DTensor) else t


def _where(t: torch.Tensor) -> Where:
    """Where a tensor's elements are: two tensors alive at the same time and equal here view the same elements."""
    return t.data_ptr(), t.shape, t.stride(), t.dtype, t.device


def copy_into(value: Any, buffers: Any, copied: list[tuple[torch.Tensor, torch.Tensor]] | None = None) -> Any:
    """`value` as host tensors: DTensors as their local shard, containers recursed, other leaves as is
    (state_dict() returns fresh ints/strings). A tensor is copied into the tensor at the same place in
    `buffers` (an earlier result, or None) when shape and dtype match, else into a new one; each
    (source, buffer) pair is appended to `copied` if given. Copies from CUDA are asynchronous on the
    current stream: synchronize it before reading the result."""
    if isinstance(value, DTensor):
        value = value.to_local()
    if isinstance(value, torch.Tensor):
        fits = isinstance(buffers, torch.Tensor) and buffers.shape == value.shape and buffers.dtype == value.dtype
        target = buffers if fits else torch.empty(value.shape, dtype=value.dtype, pin_memory=value.is_cuda)
        if copied is not None:
            copied.append((value, target))
        return target.copy_(value.detach(), non_blocking=True)
    if isinstance(value, dict):
        old = buffers if isinstance(buffers, dict) else {}
        return {k: copy_into(v, old.get(k), copied) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        old = buffers if isinstance(buffers, (list, tuple)) and len(buffers) == len(value) else (None,) * len(value)
        return type(value)(copy_into(v, b, copied) for v, b in zip(value, old))
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


def load_into(state: dict[str, Stateful], saved: dict[str, Any]) -> None:
    """Load host copies `saved` (per key, as copy_into made them) into `state`: every state_dict() first,
    as dcp.load does (an optimizer's creates its state), then each load_state_dict()."""
    templates = {key: obj.state_dict() for key, obj in state.items()}
    for key, obj in state.items():
        obj.load_state_dict(_fill(templates[key], saved[key]))


@dataclass(frozen=True)
class CopyPlan:
    """How a save refills a snapshot's copy of an InPlaceState without its state_dict(): live tensor
    `sources[i]` (a position in its live_tensors()) into `buffers[i]`, while the listing is at `where`.

    A save into a snapshot whose plan still fits copies the live tensors straight into its buffers, with one
    `torch._foreach_copy_`; `refill` has the owner `refresh` the non-tensor leaves that change meanwhile
    (the learning rate). A plan is made from a state_dict() call, each tensor it hands out matched by address to one of
    the Stateful's live tensors. It fits while the Stateful is the one it was made for and every tensor it
    lists is where it was (address, shape, strides, dtype, device), position by position; the listing
    follows the structure (parameter order, each parameter's state in order), so a tensor that appears, is
    replaced, resized or moved to another place changes it. Anything else (a first save, a changed listing,
    a tensor state_dict() hands out that the listing lacks) goes through state_dict() and makes a new plan;
    `MemoryRollback.restore` drops every plan, as loading may replace tensors. A plan holds no live tensor:
    a dead iteration's model is freed as before."""
    owner: weakref.ref[InPlaceState]  # weak: a plan must not keep a dead iteration's state alive
    where: list[Where]
    sources: list[int]
    buffers: list[torch.Tensor]

    @staticmethod
    def make(obj: InPlaceState, copied: list[tuple[torch.Tensor, torch.Tensor]]) -> CopyPlan | None:
        """The plan for the (source, buffer) pairs of a copy of obj.state_dict() made just now (after
        it: that call may create state, as torch's helper does for an optimizer); None when some source
        is not among obj's live tensors."""
        where = [_where(local_shard(t)) for t in obj.live_tensors()]
        position = {w: i for i, w in enumerate(where)}
        try:
            sources = [position[_where(source)] for source, _ in copied]
        except KeyError:
            return None
        return CopyPlan(weakref.ref(obj), where, sources, [buffer for _, buffer in copied])

    def refill(self, obj: Stateful, saved: Any) -> list[torch.Tensor] | None:
        """When this plan fits `obj` now: its non-tensor leaves refreshed in `saved` (the copy the plan
        refills), the live tensors to copy into `buffers`; else None."""
        owner = self.owner()
        if owner is not obj or owner is None:
            return None
        live = [local_shard(t) for t in owner.live_tensors()]
        if [_where(t) for t in live] != self.where:
            return None
        owner.refresh(saved)
        return [live[i] for i in self.sources]


@dataclass
class _Snapshot:
    step: int | None = None  # None: no complete step here (never written, or being written)
    state: dict[str, Any] = field(default_factory=dict)  # host copy of each Stateful: the buffers a save reuses
    # per InPlaceState key: how the next save refills state[key]; only ever refers to state[key]'s buffers
    plans: dict[str, CopyPlan] = field(default_factory=dict)


class MemoryRollback:
    """The KEEP newest steps of this rank's state, each in its own set of host buffers, allocated at its
    first save and overwritten by later ones: fresh memory every step would mean page faults on every byte
    of the state, every step. For CUDA tensors the buffers are pinned and the copies run on a side stream, so
    a device-to-host copy goes at the link's speed without a pageable bounce; on CPU they are plain tensors.
    A buffer whose tensor changed shape or dtype, or appeared (AdamW creates its moments at the first step),
    is allocated anew (`copy_into`)."""

    def __init__(self) -> None:
        self._snapshots = [_Snapshot() for _ in range(KEEP)]
        self._stream: torch.cuda.Stream | None = None

    @property
    def steps(self) -> list[int]:
        return sorted(s.step for s in self._snapshots if s.step is not None)

    def save(self, step: int, state: dict[str, Stateful]) -> None:
        """Copy `state` at `step` over the older snapshot (or one that holds no complete step), which holds no
        step from the moment the write begins until the copy has completed. An asynchronous restart exception
        landing mid-copy therefore leaves the newest snapshot whole and the one being written unused: `restore`
        never reads a half-written set."""
        # The oldest snapshot, or one holding no step: never the newest complete one.
        target = min(self._snapshots, key=lambda s: -1 if s.step is None else s.step)
        target.step = None  # from here until the copy is complete, restore cannot pick it
        sources: list[torch.Tensor] = []  # for the buffers of the plans that fit
        buffers: list[torch.Tensor] = []
        values: dict[str, Any] = {}  # state_dict() of the others
        for key, obj in state.items():
            plan = target.plans.get(key)
            if plan is not None and (live := plan.refill(obj, target.state[key])) is not None:
                sources += live
                buffers += plan.buffers
            else:
                values[key] = obj.state_dict()
        with self._copying(), torch.no_grad():  # no_grad: some sources are parameters
            if buffers:
                torch._foreach_copy_(buffers, sources, non_blocking=True)
            for key, value in values.items():
                target.plans.pop(key, None)  # first: interrupted from here on, state[key] has no plan
                copied: list[tuple[torch.Tensor, torch.Tensor]] = []
                target.state[key] = copy_into(value, target.state.get(key), copied)
                obj = state[key]
                if isinstance(obj, InPlaceState) and (plan := CopyPlan.make(obj, copied)) is not None:
                    target.plans[key] = plan
        target.step = step  # one assignment publishes it

    @contextlib.contextmanager
    def _copying(self) -> Iterator[None]:
        """Where CUDA is in use: copies on a side stream that first waits for the step's kernels, and
        complete when the block ends (an exception inside leaves them pending, into an unpublished set)."""
        if not torch.cuda.is_initialized():
            yield
            return
        if self._stream is None:
            self._stream = torch.cuda.Stream()
        self._stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self._stream):
            yield
        self._stream.synchronize()

    def restore(self, state: dict[str, Stateful]) -> int | None:
        """Load the newest step that every rank holds into `state` and return it; None (and `state`
        untouched) when some rank holds none. Collective: every rank calls it at the same point."""
        for s in self._snapshots:
            s.plans.clear()  # loading may replace the live tensors (an optimizer's load does)
        step = int(least(max(self.steps, default=-1))[0])
        if step < 0:
            return None
        snapshot = next((s for s in self._snapshots if s.step == step), None)
        if snapshot is None:  # ranks more than one step apart: cannot happen (see KEEP)
            raise RuntimeError(f"in-memory rollback: step {step} agreed but this rank holds {self.steps}")
        for newer in (s for s in self._snapshots if s.step is not None and s.step > step):
            # a step the run goes back on: kept, it would make the next save overwrite `step`, the
            # only step every rank can resume from until that save completes
            newer.step = None
        load_into(state, snapshot.state)
        return step
