"""Peer-replicated training state: a lost node costs no trip to FSx and at most `interval` steps.

Every few steps each rank copies its part of the training state (the Stateful dict a DCP checkpoint
holds) into its node's memory, a directory that outlives the worker processes, and a background thread
sends it to the same local rank on the next `replicas` nodes of a ring, over a gloo group of its own,
so no collective of the step waits for it. At resume the newest step of which every shard has a
verified copy is loaded, unless an FSx checkpoint is newer. Not NVRx's local checkpointing, which
all-gathers each save on the training thread and cannot group an odd number of nodes: this ring sends
from a thread and works at any node count >= 2. Cost: node memory for two copies of each shard a node
holds; a copy on the training thread every `every` steps, and a wait where a send is late. What it
guarantees, for a user: docs/recovery.md, "Peer state".
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import os
import pickle
import queue
import re
import statistics
import threading
import time
import zlib
from collections import deque
from dataclasses import asdict, dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.tensor import DTensor

from training.contract.capacity import PeerSchedule
from training.contract.config import PeerStateConfig
from training.contract.events import EventLog
from training.contract.launcher import NODE_MEMORY_ENV
from training.contract.shapes import PEER_STATE_SLOTS
from training.train.agreement import every_rank, least, most
from training.train.drain import peers_cost
from training.train.rollback import CopyPlan, InPlaceState, load_into

log = logging.getLogger(__name__)

DEFAULT_MEMORY = "/dev/shm/training-peer-state"
OWN, REPLICA = "own", "replica"
_ALIGN = 64
CALIBRATION_STEPS = 5  # interval=None: steps saved every time before the interval is chosen
RECHECK_SAVES = 20  # interval=None: saves after which the interval is measured and agreed again
# For the replication thread to stop after an abort: a transfer with a live partner ends well within it; one
# with a dead partner ends when the Wrapper's abort shuts the sockets, which may come only after the wait.
ABORT_WAIT_S = 1.0


class _Ref(NamedTuple):
    """Where a tensor stood in a state dict: its index in the flat list of tensors."""
    index: int


def flatten(value: Any, tensors: list[torch.Tensor]) -> Any:
    """`value` with every tensor (a DTensor as its local shard) moved to `tensors` and replaced by a _Ref."""
    if isinstance(value, DTensor):
        value = value.to_local()
    if isinstance(value, torch.Tensor):
        tensors.append(value.detach())
        return _Ref(len(tensors) - 1)
    if isinstance(value, dict):
        return {k: flatten(v, tensors) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(flatten(v, tensors) for v in value)
    return value


def unflatten(skeleton: Any, tensors: list[torch.Tensor]) -> Any:
    if isinstance(skeleton, _Ref):
        return tensors[skeleton.index]
    if isinstance(skeleton, dict):
        return {k: unflatten(v, tensors) for k, v in skeleton.items()}
    if isinstance(skeleton, (list, tuple)):
        return type(skeleton)(unflatten(v, tensors) for v in skeleton)
    return skeleton


Spec = tuple[int, tuple[int, ...], torch.dtype]  # byte offset, shape, dtype


def layout(tensors: list[torch.Tensor]) -> tuple[list[Spec], int]:
    specs, offset = [], 0
    for t in tensors:
        specs.append((offset, tuple(t.shape), t.dtype))
        offset += -(-t.numel() * t.element_size() // _ALIGN) * _ALIGN
    return specs, offset


def views(data: torch.Tensor, specs: list[Spec]) -> list[torch.Tensor]:
    """Typed views into the flat bytes `data`, one per spec."""
    out = []
    for offset, shape, dtype in specs:
        nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        out.append(data[offset:offset + nbytes].view(dtype).view(shape))
    return out


@dataclass(frozen=True)
class Copy:
    """A complete copy of one shard at one step in a node's memory (its `.ok` record)."""
    kind: str  # OWN (the rank's own shard) or REPLICA (a source's): said, not part of the copy's name
    shard: int
    slot: int
    step: int
    world_size: int
    fingerprint: str
    data_nbytes: int
    meta_nbytes: int
    checksum: int  # CRC-32 of the bytes, then the structure (`checksum`)


def checksum(data: torch.Tensor, meta: bytes) -> int:
    """CRC-32 of a copy's bytes and structure (zlib releases the GIL: the training thread runs on)."""
    return zlib.crc32(meta, zlib.crc32(data.numpy()))


class _Save(NamedTuple):
    """A save for the replication thread: own `slot` at `step`, its mapped bytes and structure."""
    step: int
    slot: int
    data: torch.Tensor
    meta: bytes


@dataclass
class _Slot:
    """A slot of this rank's own copy, as the last save laid it out: its mapped bytes, the state's
    structure with views into them in place of tensors, and how to refill each InPlaceState's part
    without its costly state_dict() (training.train.rollback.CopyPlan)."""
    data: torch.Tensor
    specs: list[Spec]
    structure: dict[str, Any]
    plans: dict[str, CopyPlan]


class NodeMemory:
    """A node's shard copies: for each (shard, slot) the files `shard<r>-slot<k>.bin` (the tensors' bytes,
    mapped), `.meta` (the structure around them) and `.ok` (its `Copy`: step, world size, sizes, CRC-32 of
    bytes and structure). A copy is consistent or unused: `begin` removes the `.ok` before the slot is
    written, and `commit` writes it (atomically) only once the bytes and structure are complete. Not of the
    kind: a restart that gives this node other ranks makes its own copies a partner's and the replicas its
    own, and they count as such (else a partition's survivor prunes every copy it holds, and the steps they
    kept are lost)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        root.mkdir(parents=True, exist_ok=True)

    _NAMED = re.compile(r"shard(\d{5})-slot\d+\.")  # a (shard, slot)'s files, in _name's format

    @staticmethod
    def _name(shard: int, slot: int) -> str:
        return f"shard{shard:05d}-slot{slot}"

    def _path(self, shard: int, slot: int, suffix: str) -> Path:
        return self.root / f"{self._name(shard, slot)}.{suffix}"

    def invalidate(self, shard: int, slot: int) -> None:
        """From here until the next commit the slot is no copy."""
        self._path(shard, slot, "ok").unlink(missing_ok=True)

    def begin(self, shard: int, slot: int, nbytes: int) -> torch.Tensor:
        """The slot's bytes, mapped for writing, after the slot stopped counting as a copy."""
        self.invalidate(shard, slot)
        data = self._path(shard, slot, "bin")
        if data.exists() and data.stat().st_size != nbytes:
            os.truncate(data, nbytes)
        return torch.from_file(str(data), shared=True, size=nbytes, dtype=torch.uint8)

    def commit(self, copy: Copy, meta: bytes) -> None:
        self._path(copy.shard, copy.slot, "meta").write_bytes(meta)
        ok = self._path(copy.shard, copy.slot, "ok")
        tmp = ok.with_suffix(".ok.tmp")
        tmp.write_text(json.dumps(asdict(copy)))
        os.replace(tmp, ok)  # the copy counts from here

    def copies(self) -> list[Copy]:
        found = []
        for ok in sorted(self.root.glob("shard*-slot*.ok")):  # not an older format's record
            try:
                found.append(Copy(**json.loads(ok.read_text())))
            except (OSError, ValueError, TypeError):
                continue  # replaced or removed meanwhile, or not ours: not a copy
        return found

    def read(self, copy: Copy) -> tuple[torch.Tensor, bytes]:
        data = torch.from_file(str(self._path(copy.shard, copy.slot, "bin")), shared=False,
                               size=copy.data_nbytes, dtype=torch.uint8)
        return data, self._path(copy.shard, copy.slot, "meta").read_bytes()

    def prune(self, keep: set[int], newest: int) -> None:
        """Remove every copy of a step after `newest` (a step the run goes back on: kept, such a copy could
        later be taken for the same step trained again, which only a deterministic run would reproduce bit for
        bit), and the copies of shards not in `keep` (shards this node no longer holds) but their copies of
        `newest` itself: until a newer step is complete in the new roles, those may be the only copies of the
        step the run goes on from (`release` drops them then)."""
        held = set()
        for copy in self.copies():
            if copy.step > newest:
                self.invalidate(copy.shard, copy.slot)
            elif copy.step == newest and copy.shard not in keep:
                held.add(self._name(copy.shard, copy.slot))
        self._drop(keep, spare=held)

    def release(self, keep: set[int]) -> None:
        """Remove the copies of every shard not in `keep`, held over by `prune` or not."""
        self._drop(keep, spare=set())

    def _drop(self, keep: set[int], spare: set[str]) -> None:
        """Remove the files of shards not in `keep`, but those of the (shard, slot) names in `spare`, and every
        file not named as a copy's (an older format's: `own-shard…`, `replica-shard…`), which nothing reads."""
        for path in self.root.iterdir():
            named = self._NAMED.match(path.name)
            if named is None or (int(named[1]) not in keep and path.name.split(".")[0] not in spare):
                if path.is_file():
                    path.unlink(missing_ok=True)


def memory_root(configured: str | None, run_dir: str) -> Path:
    """This run's directory in the node's memory: under `configured` (peer_state.memory_dir), else
    $TRAINING_NODE_MEMORY (the local cluster's directory per emulated node), else DEFAULT_MEMORY in the pod's
    memory-backed /dev/shm. It outlives the worker processes, so an in-job restart finds it; a node's
    replacement starts with it empty."""
    base = configured or os.environ.get(NODE_MEMORY_ENV) or DEFAULT_MEMORY
    return Path(base) / hashlib.sha256(os.path.abspath(run_dir).encode()).hexdigest()[:12]


class PeerState:
    """One rank's side. `save` after each step (it decides whether this step is saved), `restore` once at
    resume and `discard` when another tier's state was loaded instead, `close` at the end; all of them on
    every rank alike.

    Two slots per shard alternate. The training thread copies the state into a slot (`_copy`); the
    replication thread checksums and commits it, sends it and waits for every partner to say it committed
    its copy (`_replicate`). A save does not overwrite the older slot before the newer one is committed on
    every partner, so at any instant some step has every shard somewhere unless a node and all its partners
    are lost.

    Args:
        config: the peer_state section: its interval (None: chosen from the measured cost) and replicas.
        root: this run's directory in the node's memory (`memory_root` of the section's memory_dir).
        fingerprint: what a copy must match to be loaded here (model, world size and data layout).
        timeout_s: the longest a collective or an exchange with a partner may take.
        events: rank 0's event log (None on the other ranks is allowed).
    """

    def __init__(self, config: PeerStateConfig, root: Path, fingerprint: str, *, timeout_s: float,
                 events: EventLog | None = None) -> None:
        interval, replicas = config.interval, config.replicas
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.local_rank = int(os.environ.get("LOCAL_RANK", 0))
        per_node = int(os.environ.get("LOCAL_WORLD_SIZE", self.world))
        nodes = self.world // per_node
        self.replicas = min(replicas, nodes - 1)
        if self.replicas < replicas:
            log.warning("peer state: %d node(s), so %d replica(s) per shard instead of %d (on other nodes only)",
                        nodes, self.replicas, replicas)
        # the ring: rank r sends to r + L, r + 2L, … (L ranks per node, modulo the world), the same local rank on
        # the next nodes, and receives from r - L, r - 2L, …
        self.partners = [(self.rank + per_node * j) % self.world for j in range(1, self.replicas + 1)]
        self.sources = [(self.rank - per_node * j) % self.world for j in range(1, self.replicas + 1)]
        self.memory, self.fingerprint = NodeMemory(root), fingerprint
        self.node = f"{os.uname().nodename}:{root}"
        self.events = events if self.rank == 0 else None  # rank 0 writes the run's events
        self.interval, self._adaptive = (interval, False) if interval else (1, True)
        self.every = PeerSchedule.fixed(self.interval).every  # steps between copies (`_keep_promise`)
        self._pending: tuple[int, int] | None = None  # (step, slot) of the copy queued and not yet acknowledged
        self._complete: int | None = None  # the newest step acknowledged by every partner (or resumed from)
        self._saves = 0
        self._window: list[tuple[float, float]] = []  # (copy s, step s) of the saves measured since the last agreement
        self._window_first = 0  # the number of the window's first save
        # the replication thread's seconds for each of the latest saves, in order: as many as a measuring window
        # (RECHECK_SAVES) reads, not one per save for the life of the process
        self.send_times: deque[float] = deque(maxlen=RECHECK_SAVES)
        self.chosen_at: int | None = None  # the step at which the interval was settled, or last changed
        # What a drain weighs (training.train.drain): the newest step copied and its copy's seconds on the
        # training thread; `send_s`, the last send's.
        self.newest_step: int | None = None
        self.copy_s = 0.0
        self.bytes_per_rank = 0  # node memory per rank: a copy of its state per slot, own and replicas
        self.group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))  # collective
        # the training thread's agreements (interval, held-over copies), apart from the replication thread's sends
        self._agree = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
        self._declined: list[str] | None = None  # restore found no step to load: each rank's node, for `discard`
        # restored from copies some node holds outside its new roles (NodeMemory.prune): the step and each rank's
        # node, until a newer step is acknowledged on every rank (`_release_held_over`)
        self._held_over: tuple[int, list[str]] | None = None
        self._slot = 0
        self._sent = [threading.Event() for _ in range(PEER_STATE_SLOTS)]  # set: committed here and on the partners
        for event in self._sent:
            event.set()
        self._slots: list[_Slot | None] = [None] * PEER_STATE_SLOTS
        self._queue: queue.Queue[_Save | None] = queue.Queue()
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._replicate_loop, name="peer-state", daemon=True)
        self._thread.start()

    @property
    def send_s(self) -> float:
        """The last send's seconds on the replication thread (0: nothing sent yet)."""
        return self.send_times[-1] if self.send_times else 0.0

    # ---- save ------------------------------------------------------------------------------------
    def save(self, step: int, state: dict[str, Stateful], step_time_s: float, *, force: bool = False) -> float | None:
        """After every step: copy this rank's state at `step` into node memory and queue it for the partners if
        `step` is one of every `every` (or `force`: a drain), and wait for the copy in flight where the step
        would otherwise count as reached more than `interval` steps past the newest acknowledged one
        (`_keep_promise`). The seconds it took the training thread (the waits included), or None if it neither
        copied nor waited."""
        if self._complete is None:
            self._complete = step - 1  # the step this attempt resumed from
        started = time.perf_counter()
        copied = force or step % self.every == 0
        if copied:
            self._copy(step, state, step_time_s)
        waited = self._keep_promise(step)
        if copied and self._held_over is not None:
            self._release_held_over()
        if not (copied or waited):
            return None
        return time.perf_counter() - started

    def _keep_promise(self, step: int) -> bool:
        """Wait for the copy in flight if without it the newest acknowledged step is more than `interval`
        behind `step`; whether it waited.

        The interval is the promise: a node lost at any instant costs at most `interval` steps, a step counting
        as reached once `save` returned for it (rank 0's step event follows). A copy taken at step t counts only
        once every partner acknowledged it, so a copy every `interval` steps alone would leave up to the interval
        plus the send's length in steps behind the step reached (two intervals, with a send slower than one).
        So copies are taken every `every` steps (at most the interval), and a copy in flight has until
        `interval` steps after the newest acknowledged one: here `save` waits for it, so no step counts as
        reached with the newest complete step further back than the interval, however slow the network. A
        fixed interval I copies every I // 2 + 1 steps, each with (I + 1) // 2 steps to reach the partners
        (training.contract.capacity.PeerSchedule.fixed; I = 1: every step, each copy acknowledged before the
        next step counts). The attempt's first step counts from where it resumed (`save`)."""
        if self._pending is not None and self._sent[self._pending[1]].is_set():
            self._acknowledged()
        if self._pending is None or step - self._complete <= self.interval:
            return False
        self._acknowledged()
        return True

    def _release_held_over(self) -> None:
        """After a restore that kept copies outside the nodes' new roles: once every rank's copy of a newer
        step is acknowledged by its partners (one all-reduce per copy until then, on every rank alike), they go."""
        [acknowledged] = least(self._complete, group=self._agree)
        assert self._held_over is not None
        step, node_of = self._held_over
        if acknowledged <= step:
            return
        self._held_over = None
        if self.local_rank == 0:
            self.memory.release(self._roles(node_of, self.node))

    def _acknowledged(self) -> None:
        """Wait until the copy in flight (if any) is committed on every partner; raises if replication failed."""
        if self._pending is not None:
            pending_step, slot = self._pending
            self._sent[slot].wait()
            self._pending = None
            if self.error is None:
                self._complete = pending_step
        if self.error is not None:
            raise RuntimeError(f"peer state: replication failed: {self.error}") from self.error

    def _copy(self, step: int, state: dict[str, Stateful], step_time_s: float) -> None:
        """Copy the state at `step` into the next slot and queue it for the partners."""
        started = time.perf_counter()
        slot = self._slot
        # The copy before this one must be committed on every partner before the one before it, which this
        # slot holds, is overwritten: else a node lost now leaves no step with every shard (class doc).
        self._acknowledged()
        copying = time.perf_counter()
        target = self._slots[slot]
        copies = self._refill(target, state) if target is not None else None
        if copies is None:  # first save of the slot, or the state's layout changed
            target, copies = self._lay_out(slot, state)
            self._slots[slot] = target
        else:
            self.memory.invalidate(self.rank, slot)
        with torch.no_grad():
            torch._foreach_copy_([buffer for buffer, _ in copies], [source for _, source in copies])
        if copies and copies[0][1].is_cuda:
            torch.cuda.current_stream().synchronize()
        skeleton = flatten(target.structure, [])  # the views' order is the layout's: _Ref(i) is spec i
        meta = pickle.dumps((skeleton, target.specs))
        self._sent[slot].clear()
        self._queue.put(_Save(step, slot, target.data, meta))  # the thread commits it, then sends it
        self._pending = (step, slot)
        self._slot = (slot + 1) % PEER_STATE_SLOTS
        done = time.perf_counter()
        self.newest_step, self.copy_s = step, done - started
        self._saves += 1
        self.bytes_per_rank = PEER_STATE_SLOTS * (1 + self.replicas) * target.data.numel()
        self._calibrate(step, done - copying, step_time_s)

    def _lay_out(self, slot: int, state: dict[str, Stateful]) -> tuple[_Slot, list[tuple[torch.Tensor, torch.Tensor]]]:
        """Lay the slot out for the state as it is now, through every state_dict(); with the (buffer,
        tensor) pairs to copy."""
        tensors: list[torch.Tensor] = []
        skeleton, spans = {}, {}
        for key, obj in state.items():
            first = len(tensors)
            skeleton[key] = flatten(obj.state_dict(), tensors)
            spans[key] = (first, len(tensors))
        specs, nbytes = layout(tensors)
        data = self.memory.begin(self.rank, slot, nbytes)
        buffers = views(data, specs)
        plans = {}
        for key, obj in state.items():
            first, end = spans[key]
            if isinstance(obj, InPlaceState) and (plan := CopyPlan.make(obj, list(zip(tensors[first:end],
                                                                                      buffers[first:end])))):
                plans[key] = plan
        return _Slot(data, specs, unflatten(skeleton, buffers), plans), list(zip(buffers, tensors))

    def _refill(self, target: _Slot, state: dict[str, Stateful]) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
        """(buffer, live tensor) pairs that refill `target` for the state as it is now: InPlaceStates by
        their plans, the others through state_dict(); None when the layout no longer fits."""
        copies = []
        for key, obj in state.items():
            plan = target.plans.get(key)
            if plan is not None:
                live = plan.refill(obj, target.structure[key])  # also refreshes the non-tensor leaves
                if live is None:
                    return None
                copies += zip(plan.buffers, live)
                continue
            tensors: list[torch.Tensor] = []
            skeleton = flatten(obj.state_dict(), tensors)
            buffers: list[torch.Tensor] = []
            flatten(target.structure[key], buffers)
            if [(b.shape, b.dtype) for b in buffers] != [(t.shape, t.dtype) for t in tensors]:
                return None
            target.structure[key] = unflatten(skeleton, buffers)
            copies += zip(buffers, tensors)
        return copies

    def _calibrate(self, step: int, copy_s: float, step_time_s: float) -> None:
        """interval=None: after CALIBRATION_STEPS measured saves, then every RECHECK_SAVES, every rank takes
        the interval the slowest rank's copy and send need. The copy's share of a step and the send's length in
        steps, medians over the window, the largest over all ranks (one all-reduce, the same on every rank),
        give training.contract.capacity.PeerSchedule.measured, the rule the capacity model projects with.
        Measured again, a cost that grows (a bigger state, a slower network) moves the interval with it. Until
        the first choice the interval is 1: a copy every step."""
        if not self._adaptive:
            self.chosen_at = step if self.chosen_at is None else self.chosen_at  # a fixed interval: settled at once
            return
        if self._saves <= PEER_STATE_SLOTS:  # a slot's first save lays it out: not measured
            return
        if not self._window:
            self._window_first = self._saves
        self._window.append((copy_s, step_time_s))
        if len(self._window) < (CALIBRATION_STEPS if self.chosen_at is None else RECHECK_SAVES):
            return
        step_s = max(statistics.median(s for _, s in self._window), 1e-9)
        copy_ratio = statistics.median(c / max(s, 1e-9) for c, s in self._window)
        # every save before this one has been sent (save waited for it): the same sends on every rank, the window's
        # saves but this one
        window_sends = self._saves - self._window_first
        sends = list(self.send_times)[-window_sends:] if window_sends else []
        send_steps = statistics.median(sends) / step_s if sends else 0.0
        copy_ratio, send_steps = most(copy_ratio, send_steps, group=self._agree)
        self._window = []
        chosen = PeerSchedule.measured(copy_ratio, send_steps)
        interval, every = chosen.interval, chosen.every
        if (interval, every) == (self.interval, self.every) and self.chosen_at is not None:
            return
        was = None if self.chosen_at is None else self.interval
        self.interval, self.every, self.chosen_at = interval, every, step
        if self.rank == 0:
            log.info("peer state: a copy costs %.1f%% of a step, a send %.2f steps: a copy every %d step(s), "
                     "at most %d step(s) lost to a node%s", 100 * copy_ratio, send_steps, every, interval,
                     "" if was is None else f" (was {was})")

    def _replicate_loop(self) -> None:
        while (save := self._queue.get()) is not None:
            started = time.perf_counter()
            try:
                self._replicate(save)
            except BaseException as err:  # noqa: BLE001 - a dead peer: the training thread fails next
                self.error = err
                self._sent[save.slot].set()
                return
            self.send_times.append(time.perf_counter() - started)  # before the event: save reads it after waiting
            self._sent[save.slot].set()

    def _replicate(self, save: _Save) -> None:
        """Commit own copy with its checksum; send it to every partner and receive every source's, as one
        exchange per save, done once every partner said it committed the copy."""
        data, meta = save.data, save.meta
        crc = checksum(data, meta)
        self.memory.commit(Copy(OWN, self.rank, save.slot, save.step, self.world, self.fingerprint, data.numel(),
                                len(meta), crc), meta)
        if not self.partners:
            return
        header = torch.tensor([save.step, data.numel(), len(meta), crc], dtype=torch.int64)
        headers = {s: torch.empty(4, dtype=torch.int64) for s in self.sources}
        _wait([*(dist.isend(header, p, group=self.group, tag=0) for p in self.partners),
               *(dist.irecv(h, s, group=self.group, tag=0) for s, h in headers.items())])
        received = {}
        requests = [r for p in self.partners for r in (
            dist.isend(data, p, group=self.group, tag=1),
            dist.isend(_as_tensor(meta), p, group=self.group, tag=2))]
        for s, h in headers.items():
            source_step, nbytes, meta_nbytes, source_crc = h.tolist()
            buffer = self.memory.begin(s, save.slot, nbytes)
            meta_buffer = torch.empty(meta_nbytes, dtype=torch.uint8)
            received[s] = (source_step, nbytes, meta_buffer, source_crc)
            requests += [dist.irecv(buffer, s, group=self.group, tag=1),
                         dist.irecv(meta_buffer, s, group=self.group, tag=2)]
        _wait(requests)
        for s, (source_step, nbytes, meta_buffer, source_crc) in received.items():
            self.memory.commit(Copy(REPLICA, s, save.slot, source_step, self.world, self.fingerprint, nbytes,
                                    meta_buffer.numel(), source_crc), _as_bytes(meta_buffer))
        # each source learns that its copy is committed here; this rank, that its copy is on every partner
        acks = {p: torch.empty(1, dtype=torch.int64) for p in self.partners}
        _wait([*(dist.isend(torch.tensor([step]), s, group=self.group, tag=5)
                 for s, (step, *_) in received.items()),
               *(dist.irecv(a, p, group=self.group, tag=5) for p, a in acks.items())])

    # ---- a drain's way (training.train.drain.Drain) ---------------------------------------------
    def drain_cost(self, step: int) -> float:
        """Seconds until every partner holds `step`, as last measured (training.train.drain.peers_cost)."""
        return peers_cost(step, partners=bool(self.partners), newest_step=self.newest_step, copy_s=self.copy_s,
                          send_s=self.send_s)

    def drain(self, step: int, state: dict[str, Stateful], step_time_s: float) -> bool:
        """Copy `step` into node memory unless it is there, and wait until every partner holds it. Whether
        they do: False where a partner was lost meanwhile (the restart resumes from what is left)."""
        try:
            if self.newest_step != step:
                self.save(step, state, step_time_s, force=True)
            self.settle()
            return True
        except RuntimeError as err:
            log.error("drain: peer state could not send step %d: %s", step, err)
            return False

    def settle(self) -> None:
        """Wait until every queued copy is committed here and on the partners; raises if replication failed."""
        for event in self._sent:
            event.wait()
        if self.error is not None:
            raise RuntimeError(f"peer state: replication failed: {self.error}") from self.error

    # ---- restore ---------------------------------------------------------------------------------
    def restore(self, state: dict[str, Stateful], not_older_than: int) -> int | None:
        """Load the newest step every shard has a verified copy of into `state` and return it; None (`state`
        and node memory untouched) when there is none, or a rank sees a newer FSx checkpoint
        (`not_older_than`): then `discard` once another tier's state is loaded.

        Collective, at resume, before the FSx checkpoint. Every node reports its complete copies; only those of
        this world size and fingerprint (the model and data config) count. Each rank takes its shard from its
        own node's memory, or else point to point from a node that holds a copy, and checks its CRC-32 before
        loading it: a copy that fails is dropped (a log line and a `peer_copy_rejected` event) and the next
        source is taken, another node's copy of the step, else an older step, else the checkpoint. With no step
        that has a copy of every shard (two partners lost together, a resized world), `_newest_complete` logs
        which shards had none. After a restore each node keeps its new roles' shards (its ranks' and their
        sources'); a copy of the restored step outside them (a restart that gave the nodes other ranks, three
        nodes or more) is kept until every rank's copy of a newer step is acknowledged (`_release_held_over`),
        since it may be the restored step's only copy of that shard: a second loss soon after still finds
        every shard."""
        mine = self.memory.copies() if self.local_rank == 0 else None
        reports = every_rank((self.node, mine, not_older_than), group=self.group)
        node_of = [node for node, _, _ in reports]
        reporter = {node: rank for rank, (node, copies, _) in enumerate(reports) if copies is not None}
        newest_checkpoint = max(n for _, _, n in reports)  # a listing that races a commit differs between ranks
        held: dict[tuple[int, int], list[tuple[str, Copy]]] = {}  # (shard, step) -> [(node, copy)]
        for node, copies, _ in reports:
            for c in copies or ():
                if c.world_size == self.world and c.fingerprint == self.fingerprint:
                    held.setdefault((c.shard, c.step), []).append((node, c))
        while (step := self._newest_complete(held, newest_checkpoint)) is not None:
            data, meta, (source, copy) = self._exchange(step, held, node_of, reporter)
            failed = every_rank(None if checksum(data, meta) == copy.checksum else (source, self.rank),
                                group=self.group)
            rejected = [f for f in failed if f is not None]
            if not rejected:
                break
            for node, shard in rejected:  # the next source: another node's copy of the step, else an older step
                held[(shard, step)] = [(n, c) for n, c in held[(shard, step)] if n != node]
                self._say_rejected(node, shard, step)
        else:
            self._declined = node_of
            return None
        skeleton, specs = pickle.loads(meta)
        load_into(state, unflatten(skeleton, views(data, specs)))
        self._slot = (copy.slot + 1) % PEER_STATE_SLOTS  # the restored copy's slot is the last to be overwritten
        dist.barrier(group=self.group)  # every transfer done: copies no node holds any more can go
        self._prune(node_of, newest=step)
        outside = sorted({c.shard for node, copies, _ in reports for c in copies or ()
                          if c.step == step and c.shard not in self._roles(node_of, node)})  # as prune keeps them
        self._held_over = (step, node_of) if outside else None
        if self.rank == 0:
            log.info("peer state: resumed at step %d from node memory (shards fetched from a partner node: %s)%s",
                     step, [r for r in range(self.world) if node_of[r] not in dict(held[(r, step)])] or "none",
                     f"; copies of shards {outside} outside their nodes' new roles kept until a newer step is on "
                     "every partner" if outside else "")
        return step

    def _newest_complete(self, held: dict[tuple[int, int], list[tuple[str, Copy]]], newest_checkpoint: int) -> int | None:
        """The newest step every shard has a copy of, if not older than the newest checkpoint; else None,
        and (rank 0) a log line that says why."""
        steps = [{step for (shard, step), holders in held.items() if shard == r and holders} for r in range(self.world)]
        common = set.intersection(*steps)
        if not common:
            if self.rank == 0 and (held or newest_checkpoint > 0):  # not a first start: say why
                missing = [r for r in range(self.world) if not steps[r]]
                why = (f"no copy at all of shards {missing}: their nodes and partners lost together?" if missing
                       else "the shards' copies are of different steps")
                log.warning("peer state: no step for which every shard has a copy in some node's memory (%s); "
                            "loading the checkpoint instead", why)
            return None
        step = max(common)
        if step < newest_checkpoint:
            if self.rank == 0:
                log.info("peer state: newest complete step %d is older than checkpoint step %d: loading that",
                         step, newest_checkpoint)
            return None
        return step

    def _say_rejected(self, node: str, shard: int, step: int) -> None:
        if self.rank != 0:
            return
        log.warning("peer state: the copy of shard %d at step %d in %s fails its CRC-32 check: not used, "
                    "taking the next source", shard, step, node)
        if self.events is not None:
            self.events.emit("peer_copy_rejected", shard=shard, step=step, node=node)

    def _exchange(self, step: int, held: dict[tuple[int, int], list[tuple[str, Copy]]], node_of: list[str],
                  reporter: dict[str, int]) -> tuple[torch.Tensor, bytes, tuple[str, Copy]]:
        """Every rank's shard at `step`: from its own node's memory, else sent by a node that has it; with
        the node and record of the copy it came from."""
        requests, mine = [], None
        for shard in range(self.world):
            holders = dict(sorted(held[(shard, step)], key=lambda h: h[0]))
            if node_of[shard] in holders:
                if shard == self.rank:
                    copy = holders[node_of[shard]]
                    mine = (*self._read(copy), (node_of[shard], copy))
                continue
            node, copy = next(iter(holders.items()))
            if reporter[node] == self.rank:
                data, meta = self._read(copy)
                requests += [dist.isend(data, shard, group=self.group, tag=3),
                             dist.isend(_as_tensor(meta), shard, group=self.group, tag=4)]
            if shard == self.rank:
                data, meta_buffer = (torch.empty(copy.data_nbytes, dtype=torch.uint8),
                                     torch.empty(copy.meta_nbytes, dtype=torch.uint8))
                requests += [dist.irecv(data, reporter[node], group=self.group, tag=3),
                             dist.irecv(meta_buffer, reporter[node], group=self.group, tag=4)]
                mine = (data, meta_buffer, (node, copy))
        _wait(requests)
        assert mine is not None
        data, meta, source = mine
        return data, meta if isinstance(meta, bytes) else _as_bytes(meta), source

    def _read(self, copy: Copy) -> tuple[torch.Tensor, bytes]:
        """A copy's bytes and structure; zeros of its sizes if it cannot be read (its check then fails)."""
        try:
            return self.memory.read(copy)
        except (OSError, RuntimeError) as err:
            log.warning("peer state: cannot read the copy of shard %d at step %d: %s", copy.shard, copy.step, err)
            return torch.zeros(copy.data_nbytes, dtype=torch.uint8), bytes(copy.meta_nbytes)

    def discard(self) -> None:
        """After `restore` found no step and another tier's state was loaded: drop every copy, so that none
        of a step the run goes back on can be mixed in later (NodeMemory.prune). Not before that load
        succeeded: a checkpoint that fails to load leaves node memory as it was."""
        if self._declined is not None:
            self._prune(self._declined, newest=-1)
            self._declined = None

    def _prune(self, node_of: list[str], newest: int) -> None:
        """On each node (its local rank 0): drop what NodeMemory.prune drops for this world."""
        if self.local_rank == 0:
            self.memory.prune(self._roles(node_of, self.node), newest)

    def _roles(self, node_of: list[str], node: str) -> set[int]:
        """The shards `node` holds copies of in the world laid out as `node_of`: its ranks' and their sources'."""
        here = [r for r in range(self.world) if node_of[r] == node]
        return set(here) | {(r - len(here) * j) % self.world for r in here for j in range(1, self.replicas + 1)}

    def abort(self) -> None:
        """The attempt died, and this process may run the next (an in-process restart): stop the replication
        thread, without waiting on partners that may be gone. An idle thread takes the stop at once; one in
        a transfer fails within about a second once the Wrapper's abort has shut gloo's sockets
        (training.train.gloo_abort), and stops. Nothing more is sent."""
        if not self._thread.is_alive():
            return
        with contextlib.suppress(queue.Empty):
            while True:  # what is queued would go to partners that may be gone
                self._queue.get_nowait()
        self._queue.put(None)
        self._thread.join(timeout=ABORT_WAIT_S)
        if self._thread.is_alive():
            log.warning("peer state: the replication thread is still in a transfer %.0f s after the abort; "
                        "it stops once the transfer fails", ABORT_WAIT_S)

    def close(self) -> None:
        """Stop replicating; what is queued is sent first (the run ends on every rank alike)."""
        self._queue.put(None)
        self._thread.join(timeout=60)
        for group in (self.group, self._agree):  # each a gloo group with a socket to every rank
            with contextlib.suppress(Exception):
                dist.destroy_process_group(group)


def _as_tensor(data: bytes) -> torch.Tensor:
    """Bytes as a uint8 tensor, to send."""
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def _as_bytes(tensor: torch.Tensor) -> bytes:
    return tensor.numpy().tobytes()


def _wait(requests: list[Any]) -> None:
    for request in requests:
        request.wait()
