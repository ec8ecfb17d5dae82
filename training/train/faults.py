"""Fault injection, the rank side: what each kind of fault (training.contract.faults: the spec format,
the kinds and their options) does when it fires, and the injector that fires a rank's faults once per run.

Once-per-run: before firing, the faulty rank records the fault durably (an fsynced file under
`<run_dir>/faults/fired/`); after the restart that the fault causes, the recorded fault is not
fired again, even though the resumed run passes the same step again. A persistent fault ignores
the record. disk-full's `count` failures belong to one firing: a restart in between ends them.

The checkpoint faults wrap the torch DCP FileSystemWriter (sync saves, and async saves on CPU);
NVRx's CUDA async writer runs in a worker process that the hook cannot reach.
"""
from __future__ import annotations

import errno
import logging
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, NoReturn, TypeVar

import psutil

from training.contract.events import EventLog
from training.contract.faults import (KINDS, FaultSpec, controller_requests_dir, fired_dir, lighthouse_lost_marker,
                                      lost_marker, node_index, partitioned_marker)
from training.contract.launcher import DRAIN_MARKER_ENV, POD_PID_ENV
from training.contract.replica_groups import replica_group
from training.train.checkpoint.layout import committed_checkpoints
from training.train.node_strike import WAIT_S as NODE_STRIKE_WAIT_S, Strike
from training.train.outage import begin_outage, in_outage

log = logging.getLogger(__name__)
T = TypeVar("T")
CONTROLLER_WAIT_S = 30.0  # a drain or partition fault waits this long for the controller to act
STRIKE_WAIT_S = NODE_STRIKE_WAIT_S + 10.0  # a struck rank waits this long for its node's strike


class FaultInjected(RuntimeError):
    """Raised by the `exception` fault."""


# ---- what each kind does -----------------------------------------------------------------------
def _kill_self() -> NoReturn:
    os.kill(os.getpid(), signal.SIGKILL)
    raise AssertionError("unreachable: SIGKILL is delivered before os.kill returns to Python")


def _raise(spec: FaultSpec, ctx: FireContext) -> None:
    raise FaultInjected(f"injected fault {spec.text}")


def _sigkill(spec: FaultSpec, ctx: FireContext) -> None:
    _kill_self()


def _hang(spec: FaultSpec, ctx: FireContext) -> None:
    """No heartbeat, no collective: the peers block in the next one. A signal ends it (the rank
    monitor's, or the launcher's when it stops the worker group), or an exception raised into this
    thread by an in-process restart, which is why it sleeps in short naps."""
    log.warning("fault %s: rank hangs from now on", spec.text)
    while True:
        time.sleep(1)


def _signal_node(spec: FaultSpec, ctx: FireContext, sig: signal.Signals, marker: str = "") -> NoReturn:
    """Halfway through the step (half the previous one's duration from now: a failing node mostly fails
    mid-step, not at a step's edge), send `sig` to this node's top process first (the pod's PID 1,
    training.pod.launch, or else ft_launcher; so that nothing can restart or report anything), then to every
    process under it, this one last: what a lost or hung machine does to a pod. This rank's striker process
    strikes (training.train.node_strike), after the other node faults of this step fired too. Meanwhile this
    rank does nothing more, as a struck node does: on a loaded machine the striker may run late, and the
    node's ranks must not complete further steps (and fire later faults) before it lands."""
    me = psutil.Process()
    pod = os.environ.get(POD_PID_ENV)  # set by training.pod.launch; a forked pod's command line is its parent's
    node = [p for p in me.parents() if str(p.pid) == pod] or [
        p for p in me.parents() if any(part == "ft_launcher" or part.endswith("/ft_launcher") for part in p.cmdline())]
    if not node:
        raise FaultInjected(f"injected fault {spec.text}: neither training.pod.launch nor ft_launcher among this rank's "
                            "parent processes")
    striker = _striker()
    striker.stdin.write(Strike(time.monotonic() + ctx.step_s / 2, int(sig), node[-1].pid, me.pid,
                               tuple(map(str, ctx.together)), marker).line())
    striker.stdin.flush()
    deadline = time.monotonic() + ctx.step_s / 2 + STRIKE_WAIT_S
    while time.monotonic() < deadline:
        time.sleep(0.05)  # short sleeps: the Wrapper's asynchronous interrupt lands between two calls
    raise FaultInjected(f"injected fault {spec.text}: its strike did not land within {STRIKE_WAIT_S:.0f} s")


_striker_process: subprocess.Popen | None = None


def _striker() -> subprocess.Popen:
    """This process's node_strike process, started at once: a rank that may fire a node fault starts it
    with its injector, so that a strike halfway through a step of a few milliseconds does not wait for
    an interpreter's start. A session of its own: the launcher's stop of this rank's process group does
    not reach it; it leaves at EOF, when this process ends without firing."""
    global _striker_process
    if _striker_process is None or _striker_process.poll() is not None:
        _striker_process = subprocess.Popen([sys.executable, "-m", "training.train.node_strike"],
                                            stdin=subprocess.PIPE, start_new_session=True)
    return _striker_process


def _forget_the_parents_striker() -> None:
    global _striker_process
    _striker_process = None  # a forked child's strikes are its own


os.register_at_fork(after_in_child=_forget_the_parents_striker)


def _lose_node(spec: FaultSpec, ctx: FireContext) -> NoReturn:
    """The strike marks the node lost first: whoever plays the Job (training.local) then replaces its pod as
    the Job does a lost node's, uncounted, and not as a pod whose PID 1 was killed (an OOM kill: counted)."""
    _signal_node(spec, ctx, signal.SIGKILL, str(lost_marker(ctx.run_dir, node_index())))


def _hang_node(spec: FaultSpec, ctx: FireContext) -> NoReturn:
    """Every process of the node stops, none dies: its sockets stay open and answer nothing, as on a
    machine whose kernel hangs; only whoever plays the kubelet can tell (training.local's controller)."""
    _signal_node(spec, ctx, signal.SIGSTOP)


def _ask_controller(spec: FaultSpec, ctx: FireContext, done_marker: str | None, what: str, who: str) -> None:
    """Ask whoever plays Kubernetes or the network (training.local's controller) to act on this node,
    and wait until it says it did (`done_marker` exists), so the fault lands at this step or the next,
    as a fault should, not some polls later."""
    requests = controller_requests_dir(ctx.run_dir, spec.kind)
    requests.mkdir(parents=True, exist_ok=True)
    (requests / f"node{_target_node(spec)}").write_text(str(spec.duration or ""))
    log.warning("fault %s: asked for %s", spec.text, what)
    deadline = time.monotonic() + CONTROLLER_WAIT_S
    while done_marker is not None and not os.path.exists(done_marker) and time.monotonic() < deadline:
        time.sleep(0.01)
    if done_marker is None or not os.path.exists(done_marker):
        log.warning("fault %s: no sign of %s within %.0f s (only %s does that)", spec.text, what,
                    CONTROLLER_WAIT_S, who)


def _target_node(spec: FaultSpec) -> int:
    """The node a node fault acts on: the one it names, or this one (it named a rank running here)."""
    return spec.node if spec.node is not None else node_index()


def _request_drain(spec: FaultSpec, ctx: FireContext) -> None:
    """Drain marker, SIGTERM to the node's launcher, SIGKILL after the grace period; the marker is the
    pod's preStop hook's."""
    _ask_controller(spec, ctx, os.environ.get(DRAIN_MARKER_ENV), f"node {_target_node(spec)} to be drained",
                    "training.local plays the kubelet")


def _request_partition(spec: FaultSpec, ctx: FireContext) -> None:
    """The node's link goes down; this rank trains on into the next collective, which cannot finish."""
    node = _target_node(spec)
    _ask_controller(spec, ctx, str(partitioned_marker(ctx.run_dir, node)), f"node {node} to be cut off from the network",
                    "training.local --netns plays the network")


def _lose_lighthouse(spec: FaultSpec, ctx: FireContext) -> None:
    """The replica groups' Lighthouse is killed; this rank trains on into the next quorum, which its group's
    ManagerServer asks for again until the restarted Lighthouse answers."""
    _ask_controller(spec, ctx, str(lighthouse_lost_marker(ctx.run_dir)), "the Lighthouse to be killed",
                    "training.local --replica-groups plays the Lighthouse's Deployment")


def _corrupt_newest_checkpoint(spec: FaultSpec, ctx: FireContext) -> None:
    """Truncate every shard of the newest committed checkpoint to half (a torn write / bad disk),
    then die, so that the restart has to load it."""
    checkpoint_dir = ctx.checkpoint_dir
    newest = committed_checkpoints(checkpoint_dir)
    if newest:
        step, path = newest[0]
        shards = sorted(path.glob("*.distcp"))
        for shard in shards:
            os.truncate(shard, shard.stat().st_size // 2)
        log.warning("fault %s: truncated %d shard file(s) of %s", spec.text, len(shards), path)
    else:
        log.warning("fault %s: no committed checkpoint in %s to corrupt", spec.text, checkpoint_dir)
    _kill_self()


def _crash_mid_save(spec: FaultSpec, write: Callable[[], T]) -> T:
    write()  # this rank's shards are on disk; the save has not committed (no metadata, no marker)
    _kill_self()


def _fail_file_system(spec: FaultSpec, ctx: FireContext) -> None:
    assert spec.duration is not None  # parse_fault requires it
    begin_outage([ctx.run_dir, ctx.checkpoint_dir], spec.duration)


def _disk_full(spec: FaultSpec, write: Callable[[], T]) -> T:
    raise OSError(errno.ENOSPC, f"No space left on device (injected fault {spec.text})")


@dataclass(frozen=True)
class FireContext:
    """What a fault may need to know when it fires."""
    run_dir: Path
    checkpoint_dir: Path
    step_s: float  # how long the previous step took (0 before the second)
    together: tuple[Path, ...] = ()  # node faults: the fired records of the other node faults of this step


# What each kind does: before the step (KINDS' when="step"), or in place of this rank's write of a save.
AT_STEP: dict[str, Callable[[FaultSpec, FireContext], None]] = {
    "exception": _raise, "sigkill": _sigkill, "hang": _hang, "node-loss": _lose_node, "node-hang": _hang_node,
    "drain": _request_drain, "partition": _request_partition, "corrupt-ckpt": _corrupt_newest_checkpoint,
    "fs-eio": _fail_file_system, "lighthouse-loss": _lose_lighthouse,
}
NODE_STRIKES = frozenset({"node-loss", "node-hang"})  # kinds that strike the whole node (`node_strike`)
IN_WRITE: dict[str, Callable[[FaultSpec, Callable[[], T]], T]] = {"ckpt-crash": _crash_mid_save,
                                                                 "disk-full": _disk_full}
assert {k for k, v in KINDS.items() if v.when == "step"} == set(AT_STEP), "every step fault kind needs an action"
assert {k for k, v in KINDS.items() if v.when == "write"} == set(IN_WRITE), "every write fault kind needs an action"


class FaultInjector:
    """The faults of one rank. `maybe_fire(step)` is called before each step; `around_write` wraps
    this rank's write of every checkpoint save (CheckpointManager's write_hook)."""

    def __init__(self, specs: list[FaultSpec], run_dir: str | os.PathLike, rank: int, events: EventLog,
                 checkpoint_dir: str | os.PathLike) -> None:
        first_on_node = int(os.environ.get("LOCAL_RANK", 0)) == 0
        specs = [s for s in specs if s.group == replica_group()]  # rank and node are the group's own
        self._mine = [s for s in specs if s.rank == rank or (s.node == node_index() and first_on_node)]
        self._node_faults = [s for s in specs if s.kind in NODE_STRIKES]
        self._dir = fired_dir(run_dir)
        self._run_dir = Path(run_dir)
        self._checkpoint_dir = Path(checkpoint_dir)
        self._last_call: float | None = None
        self._rank = rank
        self._events = events
        self._failures_left: dict[str, int] = {}  # disk-full: saves still to fail in this firing
        self._spent: set[str] = set()  # once-per-run faults known fired: no stat of the run dir each step after
        if any(s.kind in NODE_STRIKES and self._due(s) for s in self._mine):
            _striker()

    def maybe_fire(self, step: int) -> None:
        now = time.monotonic()
        step_s, self._last_call = (now - self._last_call if self._last_call is not None else 0.0), now
        for spec in self._mine:
            at_step = AT_STEP.get(spec.kind)
            if at_step is not None and self._reached(spec, step) and self._due(spec):
                self._fire(spec, step)
                together = (tuple(self._dir / s.key for s in self._node_faults
                                  if s.step == spec.step and s.key != spec.key)
                            if spec.kind in NODE_STRIKES else ())
                at_step(spec, FireContext(self._run_dir, self._checkpoint_dir, step_s, together))

    def around_write(self, step: int, write: Callable[[], T]) -> T:
        """Run `write` (this rank's part of the save of `step`), or the fault that replaces it."""
        if in_outage():  # an fs-eio outage: the writer process, which it does not reach, would meet it too
            raise OSError(errno.EIO, f"{os.strerror(errno.EIO)} (injected file-system outage)")
        for spec in self._mine:
            in_write = IN_WRITE.get(spec.kind)
            if in_write is None or step < spec.step:
                continue
            if self._due(spec):
                self._fire(spec, step)
                self._failures_left[spec.key] = spec.count
            if self._failures_left.get(spec.key, 0) > 0:
                self._failures_left[spec.key] -= 1
                return in_write(spec, write)
        return write()

    @staticmethod
    def _reached(spec: FaultSpec, step: int) -> bool:
        """A once-per-run fault fires at its step or, if this rank never trains that step (a replica group
        that healed past it), at the first step after it; a persistent one only at its step, on every attempt."""
        return spec.step == step if spec.persistent else spec.step <= step

    def _due(self, spec: FaultSpec) -> bool:
        if spec.persistent:
            return True
        if spec.key not in self._spent and (self._dir / spec.key).exists():
            self._spent.add(spec.key)
        return spec.key not in self._spent

    def _fire(self, spec: FaultSpec, step: int) -> None:
        self._record(spec)
        if not spec.persistent:
            self._spent.add(spec.key)
        self._events.emit("fault_injected", kind=spec.kind, rank=self._rank, step=step, spec=spec.text)

    def _record(self, spec: FaultSpec) -> None:
        self._dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(self._dir / spec.key, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.write(fd, spec.text.encode())
            os.fsync(fd)
        finally:
            os.close(fd)
