"""Arrive at the Wrapper's restart barrier for the ranks of a lost node (fault_tolerance.restart = both).

After a fault the Wrapper's survivors wait at its iteration barrier for every rank of the world. A dead rank's
own monitor process arrives for it and marks it terminated: the world shrinks and RestartBudget hands the
restart to the launcher. A lost node takes those monitor processes with it, so the survivors waited out the
barrier timeout (the hard timeout plus a margin: two minutes by default). This finalize hook, on each survivor,
marks terminated and arrives for every rank not at the barrier whose monitor's heartbeat is stale, the test
NVRx's sibling monitors apply (NVRx 0.7.0 inprocess/sibling_monitor.py). Cost: a thread per survivor while the
barrier is open (joined as the next iteration starts), four store requests per poll; a live rank taken for
lost (its monitor silent for the heartbeat timeout) costs an in-job restart where an in-process one would do.
"""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from datetime import timedelta

import torch.distributed as dist
from nvidia_resiliency_ext import inprocess
from nvidia_resiliency_ext.inprocess.store import PrefixStore as WrapperIterationStore
from nvidia_resiliency_ext.inprocess.store import StoreMixin

log = logging.getLogger(__name__)

JOIN_TIMEOUT_S = 5.0  # a store request in flight as the watch is stopped
# The key of NVRx 0.7.0's iteration barrier that lists the ranks arrived (inprocess/store.py, reentrant_barrier).
ARRIVED_KEY = f"{StoreMixin.BARRIER_PREFIX}:reentrant_barrier:{StoreMixin.ITERATION_BARRIER}:arrived"


class LostRanks(inprocess.finalize.Finalize):
    """The Wrapper's finalize: watches the restart barrier of the iteration that just failed.

    Args:
        connect: opens a client of the Wrapper's base store (its store_factory with its store_kwargs).
        stale_after: a heartbeat older than this is stale (a few of the Wrapper's heartbeat intervals).
        watch_for: how long a watch lasts at most (the Wrapper's barrier_timeout).
        interval: seconds between two polls of the store.
    """

    def __init__(self, connect: Callable[[], dist.Store], stale_after: timedelta, watch_for: timedelta,
                 interval: float) -> None:
        self._connect, self._stale_s = connect, stale_after.total_seconds()
        self._watch_s, self._interval = watch_for.total_seconds(), interval
        self._base: dist.Store | None = None
        self._stopped = threading.Event()
        self._thread: threading.Thread | None = None

    def __call__(self, state: inprocess.FrozenState) -> None:
        self._stopped.clear()
        self._thread = threading.Thread(target=self.watch, args=(state.iteration, state.world_size), daemon=True,
                                        name=f"lost-ranks-{state.iteration}")
        self._thread.start()

    def stop(self) -> None:
        """End the watch before the next iteration runs: its setup forks (the checkpoint writer), and a thread
        inside a store request at a fork leaves the child its locks held."""
        self._stopped.set()
        if self._thread is not None:
            self._thread.join(JOIN_TIMEOUT_S)
            self._thread = None

    def watch(self, iteration: int, world_size: int) -> set[int]:
        """Until the barrier of `iteration` opens (or watch_for passes): arrive for each lost rank. Returns
        the ranks arrived for. Never raises: the barrier's own timeout remains the fallback."""
        arrived_for: set[int] = set()
        deadline = time.monotonic() + self._watch_s
        try:
            if self._base is None:
                self._base = self._connect()
            store = WrapperIterationStore(iteration, self._base)
            while time.monotonic() < deadline:
                absent = self.absent(store, world_size)
                if not absent:  # the barrier is open
                    break
                lost = self.stale(store, absent) - arrived_for
                if lost:
                    log.warning("ranks %s lost with their node (heartbeat stale, not at the restart barrier): "
                                "marked terminated, the launcher restarts the rest", sorted(lost))
                    store.record_terminated_ranks(sorted(lost))
                    store.iteration_barrier(ranks=sorted(lost), rendezvous_count=world_size, timeout=timedelta(0))
                    arrived_for |= lost
                if self._stopped.wait(self._interval):
                    break
        except Exception as e:  # noqa: BLE001
            log.warning("watching the restart barrier for lost ranks failed (%s); the barrier's timeout decides", e)
        return arrived_for

    @staticmethod
    def absent(store: WrapperIterationStore, world_size: int) -> list[int]:
        """The ranks not at the barrier yet."""
        store.append(ARRIVED_KEY, "")  # get() would wait for a missing key
        arrived = {int(r) for r in store.get_packed(ARRIVED_KEY, ",") if r.strip()}
        return [rank for rank in range(world_size) if rank not in arrived]

    def stale(self, store: WrapperIterationStore, ranks: list[int]) -> set[int]:
        """Those of `ranks` whose monitor's heartbeat is stale (a rank without one yet is not judged)."""
        keys = [store.HEARTBEAT.format(rank=rank) for rank in ranks]
        if not store.check(keys):
            return set()
        now = time.time()
        return {rank for rank, beat in zip(ranks, store.multi_get(keys)) if now - float(beat) > self._stale_s}
