"""In-process restart (fault_tolerance.restart = both): training.train.run under
nvidia_resiliency_ext.inprocess.Wrapper, inside ft_launcher.

A fault in one rank (an exception, or a hang: training.train.hang_watch, inprocess_soft_timeout) makes
every rank abort its process groups (training.train.gloo_abort) and call `run` again under a fresh store
prefix, resuming from the in-memory copy of the last completed step (training.train.rollback): no new
process, at most one step lost. What the Wrapper cannot handle (a lost process or node, a spent restart
budget) falls back to ft_launcher's in-job restart. Cost: the Wrapper's monitor process and store traffic
per rank, and the per-step rollback copy. How drains, hangs, the stores and the rank monitor fit in:
docs/recovery.md, "How `both` works".
"""
# No `from __future__ import annotations` here: the Wrapper finds the parameter to inject its
# CallWrapper into by the annotation *object*.
import contextlib
import logging
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, Optional

import torch.distributed as dist
from nvidia_resiliency_ext import inprocess
from nvidia_resiliency_ext.inprocess.attribution import Interruption, InterruptionRecord
from nvidia_resiliency_ext.inprocess.monitor_thread import RankShouldRestart
from nvidia_resiliency_ext.inprocess.store import PrefixStore as WrapperIterationStore
from torch.distributed.checkpoint.stateful import Stateful

from training.contract.config import TrainConfig
from training.contract.events import EventLog
from training.contract.job_failure import JobMustFail
from training.train.coordination import Coordination
from training.train.distributed import choose_device, default_launcher_env
from training.train.drain import DrainSignal, Drained
from training.train.gloo_abort import ProcessGroupAbort
from training.train.hang_watch import HangReport, HangWatch
from training.train.lost_ranks import LostRanks
from training.train.rollback import MemoryRollback

log = logging.getLogger(__name__)

# Fixed intervals (s). The monitor process must poll faster than the progress watchdog reports:
# its loop skips the timeout checks while timestamps keep arriving (NVRx 0.7.0).
MONITOR_PROCESS_INTERVAL = 0.5
PROGRESS_WATCHDOG_INTERVAL = 1.0
# Both below add directly to every in-process recovery, so they are short; polling every 0.1 s is 10
# small requests per rank per second to the rendezvous store.
MONITOR_THREAD_INTERVAL = 0.1  # how often a rank polls the store for a peer's fault
LAST_CALL_WAIT = 0.1  # after the first fault, for other ranks' reports before attributing it
# A rank whose collective broke because a peer's abort shut its sockets waits this long for its own
# monitor thread's interrupt (it arrives within an interval plus the last-call wait).
PEER_ABORT_WAIT = 3 * (MONITOR_THREAD_INTERVAL + LAST_CALL_WAIT)
TERMINATION_GRACE = 2.0  # SIGTERM -> SIGKILL of a rank killed at the hard timeout
# A rank's monitor process heartbeats into the store; a peer's monitor that sees its heartbeat this stale
# records it UNRESPONSIVE (NVRx 0.7.0 inprocess/sibling_monitor.py), which restarts the survivors, and LostRanks
# then arrives at the restart barrier for it: the world shrinks and the Wrapper hands a lost or cut-off node to
# the launcher. The monitor is a process of its own, not slowed by training; the timeout leaves four missed
# beats of room. LostRanks judges only the ranks that have not reached the barrier, whose monitors beat until
# they arrive (NVRx 0.7.0 inprocess/wrap.py disables them after the barrier): two missed beats suffice, and
# are what a lost node costs beyond an injob restart, where the rank dies with its collective.
HEARTBEAT_INTERVAL = 0.5
HEARTBEAT_TIMEOUT = 2.0
LOST_AFTER = 2 * HEARTBEAT_INTERVAL
BARRIER_MARGIN = 30.0  # barrier_timeout's room for slow ranks
_KIND = {Interruption.EXCEPTION: "exception", Interruption.SOFT_TIMEOUT: "hang", Interruption.HARD_TIMEOUT: "hang"}
# A collective's errors when a peer died or aborted: the fault is the peer's. gloo's socket errors,
# then ncclRemoteError's text. Not "NCCL communicator was aborted": this rank's own watchdog says
# that too, after a fault of its own.
_PEER_LOST = ("Connection reset by peer", "Connection closed by peer",
              "remote process exited or there was a network error")


@dataclass(frozen=True)
class Iteration:
    """One restart iteration, as `training.train.run` sees it."""
    number: int  # 0: first run of this process
    store: dist.Store  # rendezvous of this iteration's process group
    rollback: MemoryRollback
    call_wrapper: inprocess.CallWrapper
    budget: "RestartBudget"
    drain_signal: DrainSignal  # the process's: a SIGTERM between two iterations is seen by the next
    hang_watch: HangWatch  # the process's: the rank monitor's calculated timeouts, applied in-process

    @contextlib.contextmanager
    def unwatched(self) -> Iterator[None]:
        """The Wrapper's soft and hard timeouts and the hang watch off (a drain: it waits through whole
        saves, with no progress to report, and the launcher's grace period bounds it)."""
        with self.call_wrapper.disable_hang_protection(), self.hang_watch.paused():
            yield

    def restore(self, state: dict[str, Stateful]) -> int | None:
        """Load the in-memory copy of the last step every rank completed (None: there is none). Collective."""
        return self.rollback.restore(state)

    def step_done(self, step: int, state: dict[str, Stateful]) -> float:
        """Reports progress and keeps the step in memory; returns the seconds the save took."""
        self.call_wrapper.ping()  # manual progress: a rank hung in Python is detected too
        started = time.perf_counter()
        self.rollback.save(step, state)
        self.budget.completed(step)
        return time.perf_counter() - started


class FaultLog:
    """What each iteration died of, in the application store, for the message that ends the job."""

    def __init__(self, store: dist.Store) -> None:
        self._store = store

    def add(self, iteration: int, text: str) -> None:
        self._store.append(f"faults/{iteration}", text.replace("\n", " ") + "\n")

    def describe(self, iteration: int) -> str:
        key = f"faults/{iteration}"
        self._store.append(key, "")  # get() would wait for a missing key
        return "; ".join(self._store.get(key).decode().splitlines()) or "no fault recorded"


class RestartBudget(inprocess.initialize.Initialize):
    """The Wrapper's restart budget: restarts in a row without progress, so a long run survives any
    number of faults and a persistent one still ends it. Ends the Wrapper (RestartAbort, a
    BaseException: every rank leaves it, and the launcher's in-job restart takes over) naming what the
    last iteration died of.

    Charged as each iteration starts (the Wrapper's Initialize), for the one that just failed, wherever
    it failed: in setup (a checkpoint manager, a model build, peer state, the attempt record that
    cannot be made) as much as in a step. Progress is a step newer than any before that every rank
    completed: each rank publishes the newest step it completed in `store`, and every rank reads the
    same minimum, so every rank takes the same decision. It costs one store key per rank and restart.
    A rank lost (world shrunk) ends it at once, before the iteration starts."""

    def __init__(self, max_restarts: int, world_size: int, faults: FaultLog, store: dist.Store,
                 timeout: timedelta) -> None:
        self.max_restarts, self.world_size, self.faults = max_restarts, world_size, faults
        self._store, self._timeout = store, timeout  # the wait for every rank's key
        self._completed: int | None = None  # the newest step this rank completed
        self._progress: int | None = None  # the newest step every rank had completed as an iteration started
        self.without_progress = 0

    def completed(self, step: int) -> None:
        """This rank completed `step` (and holds it in memory)."""
        self._completed = step

    def __call__(self, state: inprocess.FrozenState) -> inprocess.FrozenState:
        if state.iteration == 0:
            return state
        failed = state.iteration - 1
        if state.world_size < self.world_size:
            raise inprocess.exception.RestartAbort(
                f"{self.world_size - state.world_size} rank(s) lost ({self.faults.describe(failed)}): "
                "FSDP shards cannot shrink in-process; leaving the restart to the launcher")
        every_rank = self._every_rank_completed(state)
        progressed = every_rank is not None and (self._progress is None or every_rank > self._progress)
        if progressed:
            self._progress = every_rank
        self.without_progress = 0 if progressed else self.without_progress + 1
        if self.without_progress > self.max_restarts:
            raise inprocess.exception.RestartAbort(
                f"{self.without_progress} in-process restarts in a row made no progress (budget {self.max_restarts}, "
                f"fault_tolerance.inprocess_max_restarts); the last failed with: {self.faults.describe(failed)}")
        return state

    def _every_rank_completed(self, state: inprocess.FrozenState) -> int | None:
        """The newest step every rank of this iteration had completed (None: some rank none)."""
        keys = [f"completed/{state.iteration}/{rank}" for rank in range(state.world_size)]
        self._store.set(keys[state.rank], "" if self._completed is None else str(self._completed))
        self._store.wait(keys, self._timeout)
        steps = [value.decode() for value in self._store.multi_get(keys)]
        return None if "" in steps else min(map(int, steps))


def barrier_timeout(cfg: TrainConfig) -> timedelta:
    """How long the Wrapper's barriers wait: for a rank killed at the hard timeout, with room for slow ranks."""
    return timedelta(seconds=cfg.fault_tolerance.inprocess_hard_timeout + BARRIER_MARGIN)


def lost_ranks_watch(cfg: TrainConfig, coordination: Coordination) -> LostRanks:
    """The Wrapper's finalize: arrives at its restart barrier for the ranks of a lost node."""
    store = coordination.wrapper_store()
    return LostRanks(lambda: store["store_factory"](**store["store_kwargs"]), timedelta(seconds=LOST_AFTER),
                     barrier_timeout(cfg), HEARTBEAT_INTERVAL)


def wrapper_kwargs(cfg: TrainConfig, *, coordination: Coordination, master_port: int, on_cuda: bool,
                   initialize: inprocess.initialize.Initialize, finalize: LostRanks) -> dict[str, Any]:
    """The Wrapper's kwargs for this config; its store in `coordination`."""
    ft = cfg.fault_tolerance
    hard = timedelta(seconds=ft.inprocess_hard_timeout)
    barrier = barrier_timeout(cfg)
    logs = Path(cfg.run_dir).resolve() / "logs"
    return dict(
        **coordination.wrapper_store(),
        initialize=initialize,
        finalize=finalize,
        abort=ProcessGroupAbort({master_port, coordination.port}, on_cuda),
        health_check=inprocess.health_check.CudaHealthCheck() if on_cuda else None,  # no NVML/CUDA on CPU
        soft_timeout=timedelta(seconds=ft.inprocess_soft_timeout),
        hard_timeout=hard,
        heartbeat_interval=timedelta(seconds=HEARTBEAT_INTERVAL),
        heartbeat_timeout=timedelta(seconds=HEARTBEAT_TIMEOUT),  # a rank whose monitor process is silent is gone
        barrier_timeout=barrier,
        completion_timeout=barrier,
        monitor_thread_interval=timedelta(seconds=MONITOR_THREAD_INTERVAL),
        monitor_process_interval=timedelta(seconds=MONITOR_PROCESS_INTERVAL),
        progress_watchdog_interval=timedelta(seconds=PROGRESS_WATCHDOG_INTERVAL),
        last_call_wait=timedelta(seconds=LAST_CALL_WAIT),
        termination_grace_time=timedelta(seconds=TERMINATION_GRACE),
        monitor_process_logfile=str(logs / "inprocess_monitor_rank{rank}.log"),
        monitor_process_pidfile=str(logs / "inprocess_monitor_rank{rank}.pid"),
    )


@contextlib.contextmanager
def _hidden_env(name: str, hide: bool) -> Iterator[None]:
    saved = os.environ.pop(name, None) if hide else None
    try:
        yield
    finally:
        if saved is not None:
            os.environ[name] = saved


def make_wrapper(cfg: TrainConfig, coordination: Coordination, initialize: inprocess.initialize.Initialize,
                 finalize: LostRanks, wrapper_cls: type = inprocess.Wrapper) -> Any:
    on_cuda = choose_device(cfg.training.device).type == "cuda"
    kwargs = wrapper_kwargs(cfg, coordination=coordination, master_port=int(os.environ["MASTER_PORT"]),
                            on_cuda=on_cuda, initialize=initialize, finalize=finalize)
    Path(cfg.run_dir, "logs").mkdir(parents=True, exist_ok=True)
    # with LOCAL_RANK set, NVRx 0.7.0 adds NVML GPU/NIC health checks to every restart, which fail without a GPU
    with _hidden_env("LOCAL_RANK", hide=not on_cuda):
        return wrapper_cls(**kwargs)


def _interruption_records(call_wrapper: inprocess.CallWrapper) -> list[InterruptionRecord]:
    """The Wrapper's records of this iteration (who was interrupted first, and how); [] if the
    store cannot say (NVRx internals: best effort)."""
    try:
        return WrapperIterationStore(call_wrapper.iteration, call_wrapper.base_store).get_interruption_records()
    except Exception:  # noqa: BLE001
        return []


def _describe(records: list[InterruptionRecord]) -> str:
    return ", ".join(f"rank {r.rank}: {r.interruption.name}" for r in records)


def _peer_lost(err: BaseException) -> bool:
    return any(text in str(err) for text in _PEER_LOST)


class _FaultReporter:
    """Called on each rank as an iteration dies: records what it saw (fault_detected, fault log).
    A rank's own exception counts only if no rank was interrupted before it: otherwise it is a
    consequence (a collective failing because the abort shut its sockets)."""

    def __init__(self, cfg: TrainConfig, faults: FaultLog) -> None:
        self.rank = int(os.environ["RANK"])
        self.events = EventLog(cfg.run_dir, f"rank{self.rank}")
        self.faults = faults

    def __call__(self, call_wrapper: inprocess.CallWrapper, err: BaseException) -> None:
        records = _interruption_records(call_wrapper)
        by = f"inprocess wrapper (rank {self.rank})"
        if not isinstance(err, RankShouldRestart) and not records:
            detail = f"{type(err).__name__}: {err}"[:300]
            peer_lost = _peer_lost(err)
            self.faults.add(call_wrapper.iteration, f"rank {self.rank}{' lost a peer' if peer_lost else ''}: {detail}")
            self.events.emit("fault_detected", kind="rank" if peer_lost else "exception",
                             rank=None if peer_lost else self.rank, by=by, detail=detail)
        elif self.rank == 0:  # one report of the Wrapper's view per fault, not one per rank
            seen = _describe(records) or str(err) or type(err).__name__  # the message holds the records too
            self.faults.add(call_wrapper.iteration, f"Wrapper records: {seen}")
            first = records[0] if records else None
            self.events.emit("fault_detected", kind=_KIND.get(first.interruption, "rank") if first else "unknown",
                             rank=first.rank if first else None, by=by, detail=f"Wrapper interruption records: {seen}")


def _hang_reporter(call_wrapper: inprocess.CallWrapper) -> HangReport:
    """Records a hang as the Wrapper's monitor process does at its soft timeout: every rank's monitor thread
    sees the interruption, aborts, and the ranks restart in-process."""
    def report(section: str, open_s: float, timeout: float) -> None:
        rank = call_wrapper.state.rank
        log.error("rank %d: the %s section open for %.1f s, past its calculated timeout (%.1f s): a hang; "
                  "every rank restarts in-process", rank, section, open_s, timeout)
        WrapperIterationStore(call_wrapper.iteration, call_wrapper.base_store).record_interrupted(
            [InterruptionRecord(rank, Interruption.SOFT_TIMEOUT)])
    return report


def _handle_failure(report: _FaultReporter, call_wrapper: inprocess.CallWrapper, err: BaseException) -> None:
    """Report the failure; returns (the caller re-raises `err`) or raises the Wrapper's interrupt.

    The Wrapper's monitor thread aborts the collectives, then raises RankShouldRestart into this
    thread asynchronously, once. It must land here, where it is expected: landing in the report
    would cut the report short, and landing inside the Wrapper's own handling of `err` (a peer's
    abort broke our collective before our monitor noticed) makes the Wrapper fail with
    InternalError instead of restarting. So a rank whose peer's abort broke its collective waits
    here for its own interrupt, a few monitor intervals at most. A peer aborts only after some rank's
    interruption is recorded (NVRx 0.7.0 inprocess/monitor_thread.py, MonitorThread.run): with none
    recorded the peer died (a lost node), no interrupt is on its way before this rank's own record, and
    the rank raises at once."""
    reported = False
    try:
        report(call_wrapper, err)
        reported = True
        if _peer_lost(err) and _interruption_records(call_wrapper):
            deadline = time.monotonic() + PEER_ABORT_WAIT
            while time.monotonic() < deadline:
                time.sleep(0.01)  # an asynchronous exception lands between two calls, not inside one
    except RankShouldRestart as interrupt:
        if not reported:
            report(call_wrapper, interrupt)
        raise


def run_inprocess(cfg: TrainConfig, train: Callable[[TrainConfig, Iteration], None]) -> None:
    """`train(cfg, iteration)` under the Wrapper until it returns; raises RestartAbort when the
    Wrapper gives up. Called with torch.distributed uninitialised (the Wrapper requires it)."""
    default_launcher_env()
    world_size = int(os.environ["WORLD_SIZE"])
    coordination = Coordination.from_env(os.environ)
    server = coordination.serve(int(os.environ["RANK"]))  # noqa: F841 (kept alive while the Wrapper runs)
    # Created once, outside the Wrapper: it outlives every iteration's process group.
    app_store = coordination.app_store()
    faults = FaultLog(app_store)
    report = _FaultReporter(cfg, faults)
    rollback = MemoryRollback()
    budget = RestartBudget(cfg.fault_tolerance.inprocess_max_restarts, world_size, faults,
                           dist.PrefixStore("budget", app_store), barrier_timeout(cfg))
    lost_ranks = lost_ranks_watch(cfg, coordination)
    wrapper = make_wrapper(cfg, coordination, budget, lost_ranks)

    drain_signal = DrainSignal(cfg.fault_tolerance.drain_timeout_s)
    hang_watch = HangWatch()

    @wrapper
    def wrapped(call_wrapper: Optional[inprocess.CallWrapper] = None) -> Drained | None:
        lost_ranks.stop()  # the last iteration's watch of its restart barrier
        n = call_wrapper.iteration
        try:
            with hang_watch.watching(_hang_reporter(call_wrapper)):
                train(cfg, Iteration(n, dist.PrefixStore(f"iteration{n}", app_store), rollback, call_wrapper, budget,
                                     drain_signal, hang_watch))
        except Drained as drained:  # every rank drains at the same step: for the Wrapper the run completed
            return drained  # (an exception would interrupt the ranks still committing); raised once out of it
        except JobMustFail:  # no fault to restart from: the rank asked for the Job to fail
            raise
        except BaseException as err:
            _handle_failure(report, call_wrapper, err)
            raise
        return None

    drain_signal.start()  # before the Wrapper: no iteration's start or end leaves SIGTERM unwatched
    try:
        drained = wrapped()
    except inprocess.exception.RestartAbort as err:
        log.error("in-process restart gave up: %s", err)
        raise
    finally:
        drain_signal.stop()
    if drained is not None:
        raise drained
