"""Every node of a replica group beats in its group's rendezvous store; a node that falls silent takes its group
out of the quorum within seconds.

Why: a group's Manager, on its rank 0, heartbeats the Lighthouse for the whole group, so a lost, cut-off or
stopped node elsewhere in the group left the group in the quorum until NVRx's step timeout stopped its ranks,
and at R = 2 the other group could form no quorum meanwhile (torchft src/lighthouse.rs, `quorum_compute`: more
than half of the heartbeating groups). On EKS a lost node sends no TCP reset: only a beat tells. Cost: a thread
on each node's local rank 0, a store write and a read per beat; the group's first node reads every node's beat.
"""
from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from datetime import timedelta

import torch.distributed as dist

from training.contract.launcher import STORE_ENDPOINT_ENV
from training.train.coordination import Coordination

log = logging.getLogger(__name__)

PULSE_INTERVAL_S = 0.5
LEFT_EXIT_CODE = 1  # a fault like any other: ft_launcher restarts the group's workers in-job


def leave_group(why: str) -> None:
    """End this rank's process: its launcher restarts the group in-job, and on group rank 0 the Manager's
    heartbeats stop, so the Lighthouse drops the group."""
    log.error("replica group: %s; leaving, so that the other groups go on without this one and it restarts", why)
    logging.shutdown()
    os._exit(LEFT_EXIT_CODE)


class GroupPulse:
    """One node's beat, and its watch of the others': the group's first node watches every node, the others
    watch the first, so the reads grow with the nodes, not their square.

    Args:
        store: where the group's nodes beat (a client of the group's rendezvous store, this launcher cycle's prefix)
        rank: this rank's rank in its group, a node's local rank 0
        ranks_per_node: the group's ranks on each node (LOCAL_WORLD_SIZE)
        world_size: the group's ranks
        timeout_s: a node whose beat has not changed for this long is lost (parallel.node_pulse_timeout_s); so
            is this node when it cannot reach the store for as long
        leave: called once, with the reason, when a node is lost (default: leave_group)
        interval_s: seconds between two beats
    """

    def __init__(self, store: dist.Store, rank: int, ranks_per_node: int, world_size: int, timeout_s: float,
                 leave: Callable[[str], None] = leave_group, interval_s: float = PULSE_INTERVAL_S) -> None:
        self._store, self._rank, self._timeout_s = store, rank, timeout_s
        self._leave, self._interval_s = leave, interval_s
        self._ranks_per_node = ranks_per_node
        firsts = range(0, world_size, ranks_per_node)
        self.watched = [r for r in firsts if r != rank] if rank == 0 else [0]
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="group-pulse")

    @classmethod
    def from_env(cls, rank: int, world_size: int, timeout_s: float) -> GroupPulse | None:
        """This rank's pulse, on a node's local rank 0 under training.pod.launch (which hands the ranks the
        rendezvous store's endpoint); None elsewhere."""
        if int(os.environ.get("LOCAL_RANK", 0)) != 0:
            return None
        if not os.environ.get(STORE_ENDPOINT_ENV):
            log.info("replica group: no rendezvous store endpoint (%s): the nodes' pulse is off", STORE_ENDPOINT_ENV)
            return None
        # a request ends after timeout_s: a node cut off from the store learns it within one timeout
        store = Coordination.from_env(os.environ).client("pulse", timedelta(seconds=timeout_s))
        per_node = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
        return cls(store, rank, per_node, world_size, timeout_s)

    def start(self) -> GroupPulse:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stopped.set()
        if self._thread.is_alive():
            self._thread.join(self._timeout_s + self._interval_s)

    def _node(self, rank: int) -> int:
        return rank // self._ranks_per_node

    def _run(self) -> None:
        beat, reached = 0, time.monotonic()
        last: dict[int, tuple[bytes, float]] = {}  # watched rank -> its last beat, and when this node saw it change
        while not self._stopped.wait(self._interval_s):
            beat += 1
            try:
                self._store.set(f"beat/{self._rank}", str(beat))
                # a node that has not beaten yet is still starting: watched from its first beat on
                present = [r for r in self.watched if r in last or self._store.check([f"beat/{r}"])]
                values = self._store.multi_get([f"beat/{r}" for r in present]) if present else []
            except Exception as err:  # noqa: BLE001 - unreachable (cut off, or the store restarting)
                if time.monotonic() - reached > self._timeout_s:
                    self._leave(f"node {self._node(self._rank)} could not reach the group's rendezvous store for "
                                f"{time.monotonic() - reached:.1f} s ({err})")
                    return
                continue
            now = reached = time.monotonic()
            for r, value in zip(present, values):
                seen = last.get(r)
                if seen is None or seen[0] != value:
                    last[r] = (value, now)
                elif now - seen[1] > self._timeout_s:
                    self._leave(f"node {self._node(r)} (rank {r}) has not beaten for {now - seen[1]:.1f} s: lost, "
                                "cut off or stopped")
                    return
