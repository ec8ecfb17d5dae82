"""Peer-replicated training state: a lost node costs no trip to FSx and (nearly) no step.

Every `interval` steps each rank copies its own part of the training state (the Stateful dict a DCP
checkpoint holds: model and optimizer shards, step and data position, RNG) into its node's memory,
and a background thread sends that copy to the same local rank on the next `replicas` nodes of the
ring (rank r -> r + L, r + 2L, … modulo the world, L ranks per node), over a gloo group of its own,
so no collective of the training step waits for it. Node memory is a directory (TRAINING_NODE_MEMORY:
the pod's memory-backed /dev/shm on the cluster, a directory per emulated node here) that outlives
the worker processes, so an in-job restart finds it; a node's replacement starts with it empty.

A copy is consistent or unused: its files are `<kind>-shard<r>-slot<k>.bin` (the tensors' bytes,
mapped), `.meta` (the structure around them) and `.ok` (step, world size, sizes), and the `.ok` is
removed before the slot is written and written (atomically) only once the bytes and structure are
complete. Two slots per shard and kind alternate, so the newest complete copy is never the one being
written; a slot is not overwritten while it is still being sent.

Restore (collective, at resume, before the FSx checkpoint): every node reports its complete copies;
the newest step for which every shard of this world has one (same world size and config) wins if it
is not older than the newest FSx checkpoint. Each rank takes its shard from its own node's memory,
or else from a node that holds a copy, point to point; then every rank loads it as the in-memory
rollback does. No step with a copy of every shard (two partners lost together, a resized world):
the FSx checkpoint, and a log line that says which shards had no copy.

Not NVRx's local checkpointing (nvidia_resiliency_ext.checkpointing.local): its
CliqueReplicationStrategy all-gathers each save's tensors on the calling thread (training would wait
for every transfer), its cliques need the world size divisible by jump x factor (an odd number of
nodes, which hot spares and resizes give, has no grouping), and each save's finalize all-gathers
over the whole world. The ring here replicates from a thread and works at any node count >= 2.
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
import threading
import time
from dataclasses import asdict, dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.tensor import DTensor

from training.contract.launcher import NODE_MEMORY_ENV
from training.contract.shapes import PEER_STATE_SLOTS
from training.train.rollback import CopyPlan, InPlaceState, load_into

log = logging.getLogger(__name__)

DEFAULT_MEMORY = "/dev/shm/training-peer-state"
OWN, REPLICA = "own", "replica"
_ALIGN = 64
COST_BUDGET = 0.05  # interval=None: replicate every step if a save costs at most this share of a step
CALIBRATION_STEPS = 5  # interval=None: steps saved every time before the interval is chosen
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
    kind: str
    shard: int
    slot: int
    step: int
    world_size: int
    fingerprint: str
    data_nbytes: int
    meta_nbytes: int


@dataclass
class _Slot:
    """A slot of this rank's own copy, as the last save laid it out: its mapped bytes, the state's
    structure with views into them in place of tensors, and how to refill each InPlaceState's part
    without its costly state_dict() (training/train/rollback.py's CopyPlan)."""
    data: torch.Tensor
    specs: list[Spec]
    structure: dict[str, Any]
    plans: dict[str, CopyPlan]


class NodeMemory:
    """A node's shard copies (module doc): the files of each (kind, shard, slot)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        root.mkdir(parents=True, exist_ok=True)

    def _path(self, kind: str, shard: int, slot: int, suffix: str) -> Path:
        return self.root / f"{kind}-shard{shard:05d}-slot{slot}.{suffix}"

    def invalidate(self, kind: str, shard: int, slot: int) -> None:
        """From here until the next commit the slot is no copy."""
        self._path(kind, shard, slot, "ok").unlink(missing_ok=True)

    def begin(self, kind: str, shard: int, slot: int, nbytes: int) -> torch.Tensor:
        """The slot's bytes, mapped for writing, after the slot stopped counting as a copy."""
        self.invalidate(kind, shard, slot)
        data = self._path(kind, shard, slot, "bin")
        if data.exists() and data.stat().st_size != nbytes:
            os.truncate(data, nbytes)
        return torch.from_file(str(data), shared=True, size=nbytes, dtype=torch.uint8)

    def commit(self, copy: Copy, meta: bytes) -> None:
        self._path(copy.kind, copy.shard, copy.slot, "meta").write_bytes(meta)
        ok = self._path(copy.kind, copy.shard, copy.slot, "ok")
        tmp = ok.with_suffix(".ok.tmp")
        tmp.write_text(json.dumps(asdict(copy)))
        os.replace(tmp, ok)  # the copy counts from here

    def copies(self) -> list[Copy]:
        found = []
        for ok in sorted(self.root.glob("*.ok")):
            try:
                found.append(Copy(**json.loads(ok.read_text())))
            except (OSError, ValueError, TypeError):
                continue  # replaced or removed meanwhile, or not ours: not a copy
        return found

    def read(self, copy: Copy) -> tuple[torch.Tensor, bytes]:
        data = torch.from_file(str(self._path(copy.kind, copy.shard, copy.slot, "bin")), shared=False,
                               size=copy.data_nbytes, dtype=torch.uint8)
        return data, self._path(copy.kind, copy.shard, copy.slot, "meta").read_bytes()

    def prune(self, keep: set[tuple[str, int]], newest: int) -> None:
        """Remove the copies of every (kind, shard) not in `keep` (shards this node no longer holds) and
        every copy of a step after `newest` (a step the run goes back on: kept, such a copy could later be
        taken for the same step trained again, which only a deterministic run would reproduce bit for bit)."""
        for copy in self.copies():
            if copy.step > newest:
                self.invalidate(copy.kind, copy.shard, copy.slot)
        for path in self.root.iterdir():
            kind, _, rest = path.name.partition("-shard")
            if rest[:5].isdigit() and (kind, int(rest[:5])) not in keep:
                path.unlink(missing_ok=True)


def memory_root(configured: str | None, run_dir: str) -> Path:
    """This run's directory in the node's memory."""
    base = configured or os.environ.get(NODE_MEMORY_ENV) or DEFAULT_MEMORY
    return Path(base) / hashlib.sha256(os.path.abspath(run_dir).encode()).hexdigest()[:12]


class PeerState:
    """One rank's side (module doc). `save` after each step (it decides whether this step is saved),
    `restore` once at resume, `close` at the end; all of them on every rank alike."""

    def __init__(self, root: Path, fingerprint: str, interval: int | None, replicas: int, timeout_s: float) -> None:
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.local_rank = int(os.environ.get("LOCAL_RANK", 0))
        per_node = int(os.environ.get("LOCAL_WORLD_SIZE", self.world))
        nodes = self.world // per_node
        self.replicas = min(replicas, nodes - 1)
        if self.replicas < replicas:
            log.warning("peer state: %d node(s), so %d replica(s) per shard instead of %d (on other nodes only)",
                        nodes, self.replicas, replicas)
        self.partners = [(self.rank + per_node * j) % self.world for j in range(1, self.replicas + 1)]
        self.sources = [(self.rank - per_node * j) % self.world for j in range(1, self.replicas + 1)]
        self.memory, self.fingerprint = NodeMemory(root), fingerprint
        self.node = f"{os.uname().nodename}:{root}"
        self.interval, self._calibrating = (interval, False) if interval else (1, True)
        self._saves = 0
        self._costs: list[float] = []
        self.chosen_at: int | None = None  # the step at which the interval was settled
        # What a drain weighs (training/train/drain.py): the newest step copied, and the last copy's measured
        # costs, on the training thread and on the replication thread (0: nothing sent yet).
        self.newest_step: int | None = None
        self.copy_s = self.send_s = 0.0
        self.bytes_per_rank = 0  # node memory per rank: a copy of its state per slot, own and replicas
        self.group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))  # collective
        self._slot = 0
        self._sent = [threading.Event() for _ in range(PEER_STATE_SLOTS)]
        for event in self._sent:
            event.set()
        self._slots: list[_Slot | None] = [None] * PEER_STATE_SLOTS
        self._queue: queue.Queue[tuple[int, int, torch.Tensor, bytes] | None] = queue.Queue()
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._replicate_loop, name="peer-state", daemon=True)
        self._thread.start()

    # ---- save ------------------------------------------------------------------------------------
    def save(self, step: int, state: dict[str, Stateful], step_time_s: float, *, force: bool = False) -> float | None:
        """Copy this rank's state at `step` into node memory and queue it for the partners, if `step`
        is one the interval saves (or `force`: a drain); the seconds it took the training thread, or None
        if not saved."""
        if step % self.interval and not force:
            return None
        started = time.perf_counter()
        slot = self._slot
        self._sent[slot].wait()  # never write a slot still being sent
        if self.error is not None:
            raise RuntimeError(f"peer state: replication failed: {self.error}") from self.error
        target = self._slots[slot]
        copies = self._refill(target, state) if target is not None else None
        if copies is None:  # first save of the slot, or the state's layout changed
            target, copies = self._lay_out(slot, state)
            self._slots[slot] = target
        else:
            self.memory.invalidate(OWN, self.rank, slot)
        with torch.no_grad():
            torch._foreach_copy_([buffer for buffer, _ in copies], [source for _, source in copies])
        if copies and copies[0][1].is_cuda:
            torch.cuda.current_stream().synchronize()
        skeleton = flatten(target.structure, [])  # the views' order is the layout's: _Ref(i) is spec i
        meta = pickle.dumps((skeleton, target.specs))
        data, nbytes = target.data, target.data.numel()
        self.memory.commit(Copy(OWN, self.rank, slot, step, self.world, self.fingerprint, nbytes, len(meta)), meta)
        if self.partners:
            self._sent[slot].clear()
            self._queue.put((step, slot, data, meta))
        self._slot = (slot + 1) % PEER_STATE_SLOTS
        cost = time.perf_counter() - started
        self.newest_step, self.copy_s = step, cost
        self._saves += 1
        self.bytes_per_rank = PEER_STATE_SLOTS * (1 + self.replicas) * nbytes
        if self._calibrate(cost, step_time_s) and self.chosen_at is None:
            self.chosen_at = step
        return cost

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
        data = self.memory.begin(OWN, self.rank, slot, nbytes)
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

    def _calibrate(self, cost: float, step_time_s: float) -> bool:
        """interval=None: over CALIBRATION_STEPS saves after each slot's first (which lays it out), every
        rank takes the interval that keeps the slowest rank's save within COST_BUDGET of its step (one
        all-reduce, the same on every rank). Whether the interval is settled."""
        if not self._calibrating:
            return True
        if self._saves > PEER_STATE_SLOTS:
            self._costs.append(cost / max(step_time_s, 1e-9))
        if len(self._costs) < CALIBRATION_STEPS:
            return False
        ratio = torch.tensor([sorted(self._costs)[len(self._costs) // 2]], dtype=torch.float64)
        dist.all_reduce(ratio, op=dist.ReduceOp.MAX, group=self.group)
        self.interval = max(1, math.ceil(ratio.item() / COST_BUDGET))
        self._calibrating = False
        if self.rank == 0:
            log.info("peer state: a save costs %.1f%% of a step: every %d step(s)", 100 * ratio.item(), self.interval)
        return True

    def _replicate_loop(self) -> None:
        while (item := self._queue.get()) is not None:
            step, slot, data, meta = item
            try:
                started = time.perf_counter()
                self._replicate(step, slot, data, meta)
                self.send_s = time.perf_counter() - started
            except BaseException as err:  # noqa: BLE001 - a dead peer: the training thread fails next
                self.error = err
                self._sent[slot].set()
                return
            self._sent[slot].set()

    def _replicate(self, step: int, slot: int, data: torch.Tensor, meta: bytes) -> None:
        """Send own slot (`data`: its mapped bytes) to every partner and receive every source's, as one
        exchange per save."""
        header = torch.tensor([step, data.numel(), len(meta)], dtype=torch.int64)
        headers = {s: torch.empty(3, dtype=torch.int64) for s in self.sources}
        _wait([*(dist.isend(header, p, group=self.group, tag=0) for p in self.partners),
               *(dist.irecv(h, s, group=self.group, tag=0) for s, h in headers.items())])
        received = {}
        requests = [r for p in self.partners for r in (
            dist.isend(data, p, group=self.group, tag=1),
            dist.isend(_as_tensor(meta), p, group=self.group, tag=2))]
        for s, h in headers.items():
            source_step, nbytes, meta_nbytes = h.tolist()
            buffer = self.memory.begin(REPLICA, s, slot, nbytes)
            meta_buffer = torch.empty(meta_nbytes, dtype=torch.uint8)
            received[s] = (source_step, nbytes, meta_buffer)
            requests += [dist.irecv(buffer, s, group=self.group, tag=1),
                         dist.irecv(meta_buffer, s, group=self.group, tag=2)]
        _wait(requests)
        for s, (source_step, nbytes, meta_buffer) in received.items():
            self.memory.commit(Copy(REPLICA, s, slot, source_step, self.world, self.fingerprint, nbytes,
                                    meta_buffer.numel()), _as_bytes(meta_buffer))

    def settle(self) -> None:
        """Wait until every queued copy has reached the partners; raises if replication failed."""
        for event in self._sent:
            event.wait()
        if self.error is not None:
            raise RuntimeError(f"peer state: replication failed: {self.error}") from self.error

    # ---- restore ---------------------------------------------------------------------------------
    def restore(self, state: dict[str, Stateful], not_older_than: int) -> int | None:
        """Load the newest step every shard has a copy of (module doc) into `state` and return it; None
        (and `state` untouched) when there is none, or the FSx checkpoint (`not_older_than`) is newer."""
        reports: list[Any] = [None] * self.world
        mine = self.memory.copies() if self.local_rank == 0 else None
        dist.all_gather_object(reports, (self.node, mine), group=self.group)
        node_of = [node for node, _ in reports]
        reporter = {node: rank for rank, (node, copies) in enumerate(reports) if copies is not None}
        held: dict[tuple[int, int], list[tuple[str, Copy]]] = {}  # (shard, step) -> [(node, copy)]
        for node, copies in reports:
            for c in copies or ():
                if c.world_size == self.world and c.fingerprint == self.fingerprint:
                    held.setdefault((c.shard, c.step), []).append((node, c))
        steps = [{step for (shard, step) in held if shard == r} for r in range(self.world)]
        common = set.intersection(*steps)
        if not common:
            if self.rank == 0 and (held or not_older_than > 0):  # not a first start: say why
                missing = [r for r in range(self.world) if not steps[r]]
                why = (f"no copy at all of shards {missing}: their nodes and partners lost together?" if missing
                       else "the shards' copies are of different steps")
                log.warning("peer state: no step for which every shard has a copy in some node's memory (%s); "
                            "loading the checkpoint instead", why)
            self._prune(node_of, newest=-1)  # the run goes on from the checkpoint: no copy may be mixed in
            return None
        step = max(common)
        if step < not_older_than:
            if self.rank == 0:
                log.info("peer state: newest complete step %d is older than checkpoint step %d: loading that",
                         step, not_older_than)
            self._prune(node_of, newest=-1)
            return None
        mine_saved, fetched = self._exchange(step, held, node_of, reporter)
        skeleton, specs = pickle.loads(mine_saved[1])
        load_into(state, unflatten(skeleton, views(mine_saved[0], specs)))
        dist.barrier(group=self.group)  # every transfer done: copies no node holds any more can go
        self._prune(node_of, newest=step)
        if self.rank == 0:
            log.info("peer state: resumed at step %d from node memory (shards fetched from a partner node: %s)",
                     step, fetched or "none")
        return step

    def _exchange(self, step: int, held: dict[tuple[int, int], list[tuple[str, Copy]]], node_of: list[str],
                  reporter: dict[str, int]) -> tuple[tuple[torch.Tensor, bytes], list[int]]:
        """Every rank's shard at `step`: from its own node's memory, else sent by a node that has it."""
        requests, fetched, mine = [], [], None
        for shard in range(self.world):
            holders = dict(sorted(held[(shard, step)], key=lambda h: h[0]))
            if node_of[shard] in holders:
                if shard == self.rank:
                    mine = self.memory.read(holders[node_of[shard]])
                continue
            fetched.append(shard)
            node, copy = next(iter(holders.items()))
            if reporter[node] == self.rank:
                data, meta = self.memory.read(copy)
                requests += [dist.isend(data, shard, group=self.group, tag=3),
                             dist.isend(_as_tensor(meta), shard, group=self.group, tag=4)]
            if shard == self.rank:
                data, meta_buffer = (torch.empty(copy.data_nbytes, dtype=torch.uint8),
                                     torch.empty(copy.meta_nbytes, dtype=torch.uint8))
                requests += [dist.irecv(data, reporter[node], group=self.group, tag=3),
                             dist.irecv(meta_buffer, reporter[node], group=self.group, tag=4)]
                mine = (data, meta_buffer)
        _wait(requests)
        assert mine is not None
        data, meta = mine
        return (data, meta if isinstance(meta, bytes) else _as_bytes(meta)), fetched

    def _prune(self, node_of: list[str], newest: int) -> None:
        """On each node (its local rank 0): drop what NodeMemory.prune drops for this world."""
        if self.local_rank != 0:
            return
        here = [r for r in range(self.world) if node_of[r] == self.node]
        per_node = len(here)
        keep = {(OWN, r) for r in here} | {(REPLICA, (r - per_node * j) % self.world)
                                           for r in here for j in range(1, self.replicas + 1)}
        self.memory.prune(keep, newest)

    def abort(self) -> None:
        """The attempt died, and this process may run the next (an in-process restart): stop the replication
        thread, without waiting on partners that may be gone. An idle thread takes the stop at once; one in
        a transfer fails within about a second once the Wrapper's abort has shut gloo's sockets
        (training/train/gloo_abort.py), and stops. Nothing more is sent."""
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
        with contextlib.suppress(Exception):
            dist.destroy_process_group(self.group)


def _as_tensor(data: bytes) -> torch.Tensor:
    """Bytes as a uint8 tensor, to send."""
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def _as_bytes(tensor: torch.Tensor) -> bytes:
    return tensor.numpy().tobytes()


def _wait(requests: list[Any]) -> None:
    for request in requests:
        request.wait()
