"""A replica group's nodes' pulse (training.train.group_pulse), in-process: a node that stops beating, or that
cannot reach the store, takes the group out; a group whose nodes all beat stays."""
from __future__ import annotations

import threading
import time

import torch.distributed as dist

from training.train.group_pulse import GroupPulse

INTERVAL_S, TIMEOUT_S = 0.05, 0.5


class Left:
    """The pulse's `leave`: records why, once."""

    def __init__(self) -> None:
        self.why: str | None = None
        self.at: float | None = None
        self.done = threading.Event()

    def __call__(self, why: str) -> None:
        self.why, self.at = why, time.monotonic()
        self.done.set()


def _pulse(store: dist.Store, rank: int, leave: Left) -> GroupPulse:
    # 3 nodes of 2 ranks: the nodes' local ranks 0 are ranks 0, 2 and 4
    return GroupPulse(store, rank, ranks_per_node=2, world_size=6, timeout_s=TIMEOUT_S, leave=leave,
                      interval_s=INTERVAL_S)


def test_the_first_node_watches_every_node_and_the_others_watch_the_first():
    store = dist.HashStore()
    assert _pulse(store, 0, Left()).watched == [2, 4]
    assert _pulse(store, 4, Left()).watched == [0]


def test_a_node_that_stops_beating_takes_the_group_out_within_the_timeout():
    store = dist.HashStore()
    left = [Left() for _ in range(3)]
    pulses = [_pulse(store, rank, leave).start() for rank, leave in zip((0, 2, 4), left)]
    try:
        assert not any(leave.done.wait(3 * TIMEOUT_S) for leave in left), [leave.why for leave in left]
        stopped = time.monotonic()
        pulses[2].stop()  # node 2 (rank 4) is lost
        assert left[0].done.wait(5 * TIMEOUT_S), "the first node never noticed"
        assert "node 2 (rank 4) has not beaten for" in left[0].why
        assert left[0].at - stopped < TIMEOUT_S + 4 * INTERVAL_S
    finally:
        for pulse in pulses:
            pulse.stop()
    assert left[1].why is None  # it watches the first node, which beat on


def test_a_node_that_cannot_reach_the_store_leaves():
    class CutOff(dist.HashStore):
        def set(self, key, value):
            raise RuntimeError("Connection timed out")

    leave = Left()
    started = time.monotonic()
    pulse = _pulse(CutOff(), 2, leave).start()
    try:
        assert leave.done.wait(5 * TIMEOUT_S)
    finally:
        pulse.stop()
    assert "node 1 could not reach the group's rendezvous store" in leave.why and "Connection timed out" in leave.why
    assert leave.at - started >= TIMEOUT_S


def test_a_node_not_started_yet_is_not_taken_for_lost():
    store = dist.HashStore()
    leave = Left()
    pulse = _pulse(store, 0, leave).start()
    try:
        assert not leave.done.wait(3 * TIMEOUT_S), leave.why
    finally:
        pulse.stop()
