"""Drains: SIGTERM commits, it does not discard.

Kubernetes sends SIGTERM on a node drain, an eviction, the end of a spot instance or capacity block;
ft_launcher also sends it to stop the survivors of a failed rank, and there the rank must go at once (it
may be blocked in a collective with the dead rank). A drain is told apart by a marker file
(DRAIN_MARKER_ENV) written before the signal (the pod's preStop hook). A watcher thread, woken through
`signal.set_wakeup_fd` so no Python handler can leave a rank stuck, ends the process on a plain stop and
otherwise notes the drain; the train loop carries it in the loss all-reduce (no extra collective), and
all ranks together keep the step reached by a checkpoint or by peer state (`Drain`, the way by
`plan_drain`), whichever is cheaper and fits the time left. Cost: one thread per rank. The protocol: docs/recovery.md, "Drains".
"""
from __future__ import annotations

import logging
import math
import os
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any, Callable, Literal, NoReturn, Protocol

from training.contract.capacity import DRAIN_SAVE_MARGIN
from training.contract.events import EventLog
from training.contract.exit_codes import TERMINATED
from training.contract.launcher import DRAIN_MARKER_ENV
from training.train.agreement import every, every_rank, least
from training.train.checkpoint.layout import write_resume_step

log = logging.getLogger(__name__)

_STOP = 0  # not a signal number: tells the watcher to end


class Drained(BaseException):
    """Leave the training loop and the process: a BaseException, so the in-process Wrapper (which
    restarts on Exception) lets it through."""


def _noted(signum: int, frame: FrameType | None) -> None:
    """The Python-level handler: nothing to do, the watcher thread acts (module doc)."""


class DrainSignal:
    """SIGTERM for one training run: `start` installs the watcher, `stop` restores what was there."""

    def __init__(self, timeout_s: float, marker: str | None = None) -> None:
        self.timeout_s = timeout_s
        self.marker = marker if marker is not None else os.environ.get(DRAIN_MARKER_ENV)
        self.received_at: float | None = None  # monotonic time of the first SIGTERM of a drain
        self._pipe: tuple[int, int] | None = None
        self._restore: tuple[object, int] | None = None
        self._watcher: threading.Thread | None = None

    def start(self) -> None:
        read_fd, write_fd = os.pipe()
        os.set_blocking(write_fd, False)  # the interpreter's C handler must never block
        self._pipe = (read_fd, write_fd)
        self._watcher = threading.Thread(target=self._watch, name="drain-watcher", daemon=True)
        self._watcher.start()
        self._restore = (signal.signal(signal.SIGTERM, _noted),
                         signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False))

    def stop(self) -> None:
        if self._pipe is None or self._restore is None or self._watcher is None:
            return
        handler, wakeup_fd = self._restore
        signal.set_wakeup_fd(wakeup_fd)
        signal.signal(signal.SIGTERM, handler)  # type: ignore[arg-type]
        os.write(self._pipe[1], bytes([_STOP]))
        self._watcher.join()
        for fd in self._pipe:
            os.close(fd)
        self._pipe = self._restore = self._watcher = None

    def _watch(self) -> None:
        assert self._pipe is not None
        while True:
            numbers = os.read(self._pipe[0], 64)
            if not numbers or _STOP in numbers:
                return
            if signal.SIGTERM not in numbers:
                continue  # another signal with a Python handler (SIGINT)
            if self.marker is None or not os.path.exists(self.marker):
                os._exit(TERMINATED)  # a stop, not a drain: go now, as SIGTERM's default would
            if self.received_at is None:
                self.received_at = time.monotonic()
                log.warning("SIGTERM with the drain marker %s: draining at the end of this step", self.marker)

    @property
    def flag(self) -> float:
        """What this rank adds to the step's all-reduce: above 0 on any rank means drain now."""
        return 0.0 if self.received_at is None else 1.0

    def time_left(self) -> float:
        """Seconds until the launcher's SIGKILL, as this rank sees it (a rank that got no signal
        counts from now: its launcher signals it at the latest when the drained node's ranks leave)."""
        start = self.received_at if self.received_at is not None else time.monotonic()
        return start + self.timeout_s - time.monotonic()


def agree_on_save(time_left: float, save_seconds: float | None) -> bool:
    """Whether every rank has time for one more save: one decision for all (a collective)."""
    need = -1.0 if save_seconds is None else save_seconds * DRAIN_SAVE_MARGIN  # never measured: try
    least_left, longest_need = least(time_left, -need)  # the least time left, the longest save
    return least_left > -longest_need


DrainPath = Literal["committed", "checkpoint", "peers", "none"]
UNKNOWN, IMPOSSIBLE = math.nan, math.inf  # a cost never measured; a way this rank cannot take


@dataclass(frozen=True)
class DrainView:
    """One rank's view of the ways to keep the step reached: their estimated costs in seconds, UNKNOWN or
    IMPOSSIBLE."""
    time_left_s: float
    checkpoint_s: float
    peers_s: float
    signalled: bool  # this rank got the SIGTERM: its node is being drained
    committed: bool = False  # the step reached is committed already (every rank knows it alike)


@dataclass(frozen=True)
class DrainPlan:
    """The way every rank takes, and the costs it was chosen from (the slowest rank's)."""
    path: DrainPath
    time_left_s: float
    checkpoint_s: float
    peers_s: float


def replicas_survive(drained_nodes: set[int], nodes: int, replicas: int) -> bool:
    """Whether every drained node's shards have a copy on a node that is not drained: peer state copies a
    node's shards to the next `replicas` nodes of the ring (training.train.peer_state)."""
    return all(any((n + j) % nodes not in drained_nodes for j in range(1, replicas + 1)) for n in drained_nodes)


def _slowest(costs: list[float]) -> float:
    """The cost of a way for all ranks: IMPOSSIBLE if any rank cannot, UNKNOWN if any never measured it."""
    if any(math.isinf(c) for c in costs):
        return IMPOSSIBLE
    return UNKNOWN if any(math.isnan(c) for c in costs) else max(costs)


def plan_drain(views: list[DrainView], ranks_per_node: int, replicas: int) -> DrainPlan:
    """The drain's way, from every rank's view (the same on every rank: module doc)."""
    time_left = min(v.time_left_s for v in views)
    checkpoint = _slowest([v.checkpoint_s for v in views])
    drained = {rank // ranks_per_node for rank, v in enumerate(views) if v.signalled}
    covered = replicas_survive(drained, len(views) // ranks_per_node, replicas)
    peers = _slowest([v.peers_s for v in views]) if covered else IMPOSSIBLE
    if all(v.committed for v in views):
        return DrainPlan("committed", time_left, checkpoint, peers)
    return DrainPlan(_choose(checkpoint, peers, time_left), time_left, checkpoint, peers)


def _choose(checkpoint: float, peers: float, time_left: float) -> DrainPath:
    ways: tuple[tuple[float, DrainPath], ...] = ((checkpoint, "checkpoint"), (peers, "peers"))
    fitting = [(cost, path) for cost, path in ways if math.isfinite(cost) and cost * DRAIN_SAVE_MARGIN <= time_left]
    if fitting:
        return min(fitting)[1]  # on a tie the checkpoint: it survives any later loss
    return next((path for cost, path in ways if math.isnan(cost)), "none")  # never measured: try


def checkpoint_cost(step: int, *, enabled: bool, saved_step: int | None, in_flight: tuple[int, float] | None,
                    last_save_s: float | None) -> float:
    """Seconds until `step` is committed by the checkpoint path (DrainView.checkpoint_s): what is left of
    the in-flight save (`in_flight`: its step and seconds since it started), then a save of `step`
    unless that was the in-flight one; each save as long as the last one measured. 0.0: committed."""
    if not enabled:
        return IMPOSSIBLE
    if saved_step == step and in_flight is None:
        return 0.0
    if last_save_s is None:
        return UNKNOWN
    left = 0.0 if in_flight is None else max(last_save_s - in_flight[1], 0.0)
    return left + (0.0 if in_flight is not None and in_flight[0] == step else last_save_s)


def peers_cost(step: int, *, partners: bool, newest_step: int | None, copy_s: float, send_s: float) -> float:
    """Seconds until every partner holds `step` (DrainView.peers_s): a copy into node memory unless the
    step reached was copied already, then its send, each as long as the last one measured."""
    if not partners:
        return IMPOSSIBLE
    if newest_step is None:
        return UNKNOWN
    return (0.0 if newest_step == step else copy_s) + send_s


def agree_on_plan(view: DrainView, ranks_per_node: int, replicas: int) -> DrainPlan:
    """`plan_drain` over every rank's view: one all-gather, then the same decision on every rank."""
    return plan_drain(every_rank(view), ranks_per_node, replicas)


class CheckpointWay(Protocol):
    """The checkpoint way of a drain (CheckpointManager)."""
    saved_step: int | None

    def drain_cost(self, step: int) -> float: ...
    def committed(self, step: int) -> bool: ...
    def drain(self, step: int, state: dict[str, Any], time_left: Callable[[], float]) -> bool: ...
    def settle(self, step: int) -> bool: ...
    def abort(self) -> None: ...


class PeersWay(Protocol):
    """The peers way of a drain (PeerState)."""
    replicas: int

    def drain_cost(self, step: int) -> float: ...
    def drain(self, step: int, state: dict[str, Any], step_time_s: float) -> bool: ...


class Drain:
    """The drain of one attempt: every rank, at the same step, keeps the step reached the cheaper way that
    fits the time the launcher gives (`agree_on_plan`), then leaves by raising Drained.

    Args:
        signal: the run's DrainSignal: the time left, and whether this rank's node is the one drained
        ckpt: the checkpoint way (CheckpointManager)
        peer: the peers way (PeerState); None when peer state is off
        checkpoint_dir: where rank 0 writes the step a restart resumes at when the partners hold it
        events: rank 0's event log (None on the other ranks)
        world_size: the ranks of the run (those of a node: LOCAL_WORLD_SIZE)
    """

    def __init__(self, signal: DrainSignal, ckpt: CheckpointWay, peer: PeersWay | None,
                 checkpoint_dir: str, events: EventLog | None, world_size: int) -> None:
        self.signal, self.ckpt, self.peer, self.events = signal, ckpt, peer, events
        self.checkpoint_dir, self.world_size = Path(checkpoint_dir), world_size

    def __call__(self, step: int, step_time: float, state: dict[str, Any]) -> NoReturn:
        started = time.monotonic()
        plan = self._plan(step)
        if plan.path == "peers":
            kept = self._to_peers(step, step_time, state)
        elif plan.path == "checkpoint":
            kept = self.ckpt.drain(step, state, self.signal.time_left)
        else:  # committed already, or no way fits: the in-flight save's outcome, before anyone leaves
            kept = self.ckpt.settle(step)
        resumes_at = step if kept else self.ckpt.saved_step
        if self.events is not None:
            self.events.emit("drained", step=step, saved_step=resumes_at, path=plan.path,
                             checkpoint_s=_finite(plan.checkpoint_s), peers_s=_finite(plan.peers_s),
                             time_left_s=round(plan.time_left_s, 3), seconds=round(time.monotonic() - started, 3))
            way = {"committed": "already committed", "checkpoint": "committed to the checkpoint directory",
                   "peers": "held by the partner nodes' memory, where the replacement restores it from",
                   "none": "not kept"}[plan.path]
            log.warning("drain (SIGTERM) at step %d, way: %s (estimated: checkpoint %s, peers %s; %.0f s left): %s; "
                        "the restart resumes at step %s; leaving with exit code %d", step, plan.path,
                        _estimate(plan.checkpoint_s), _estimate(plan.peers_s), plan.time_left_s,
                        f"step {step} {way}" if kept else f"step {step} not kept", resumes_at, TERMINATED)
        raise Drained(f"drained at step {step}")

    def _plan(self, step: int) -> DrainPlan:
        view = DrainView(time_left_s=self.signal.time_left(), checkpoint_s=self.ckpt.drain_cost(step),
                         peers_s=self.peer.drain_cost(step) if self.peer is not None else IMPOSSIBLE,
                         signalled=self.signal.flag > 0, committed=self.ckpt.committed(step))
        ranks_per_node = int(os.environ.get("LOCAL_WORLD_SIZE", self.world_size))
        replicas = self.peer.replicas if self.peer is not None else 0
        return agree_on_plan(view, ranks_per_node, replicas)

    def _to_peers(self, step: int, step_time: float, state: dict[str, Any]) -> bool:
        """Peer state keeps the step reached; once every rank's partners hold it, rank 0 writes it as the step
        a restart resumes at (the launcher's progress counter). The in-flight save is abandoned, uncommitted."""
        assert self.peer is not None
        self.ckpt.abort()
        everywhere = every(self.peer.drain(step, state, step_time))
        if everywhere and self.events is not None:
            write_resume_step(self.checkpoint_dir, step + 1)
        return everywhere


def _finite(seconds: float) -> float | None:
    """A cost for the event log: None where never measured or impossible."""
    return round(seconds, 3) if math.isfinite(seconds) else None


def _estimate(seconds: float) -> str:
    """A cost for the log line."""
    return f"{seconds:.1f} s" if math.isfinite(seconds) else "not measured" if math.isnan(seconds) else "not possible"

