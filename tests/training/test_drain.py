"""Drains (training/train/drain.py): which way keeps the step reached, decided from measured costs the same
on every rank; the estimates each way's cost comes from; the drain of one rank driven in this process; and,
in a process of its own, a SIGTERM that lands between two of the in-process Wrapper's iterations."""
from __future__ import annotations

import math
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from training.contract.capacity import DRAIN_SAVE_MARGIN
from training.contract.events import EventLog, read_events
from training.train.checkpoint.layout import committed_checkpoints
from training.train.drain import (IMPOSSIBLE, UNKNOWN, Drain, Drained, DrainView, checkpoint_cost, peers_cost,
                                  plan_drain, replicas_survive)
from training.contract.launcher import DRAIN_MARKER_ENV
from training_helpers import checkpoint_manager, fork_ranks


def _views(checkpoint_s: float, peers_s: float, time_left_s: float = 100.0, signalled=(1,), world=2, committed=False):
    return [DrainView(time_left_s, checkpoint_s, peers_s, signalled=rank in signalled, committed=committed)
            for rank in range(world)]


@pytest.mark.parametrize("checkpoint_s, peers_s, path", [
    (30.0, 4.0, "peers"),  # the partners hold it sooner than FSx
    (4.0, 30.0, "checkpoint"),
    (5.0, 5.0, "checkpoint"),  # a tie: the checkpoint, which survives any later loss
    (80.0, 4.0, "peers"),  # the checkpoint does not fit the time left (twice its cost)
    (UNKNOWN, 4.0, "peers"),  # a measured way that fits beats one never measured
    (UNKNOWN, IMPOSSIBLE, "checkpoint"),  # never measured, and nothing else: try
    (IMPOSSIBLE, UNKNOWN, "peers"),
    (80.0, 60.0, "none"),  # nothing fits
    (IMPOSSIBLE, IMPOSSIBLE, "none"),  # checkpoints off, no peer state
])
def test_the_drain_takes_the_cheaper_way_that_fits(checkpoint_s, peers_s, path):
    assert plan_drain(_views(checkpoint_s, peers_s), ranks_per_node=1, replicas=1).path == path


def test_a_committed_step_needs_no_way():
    assert plan_drain(_views(0.0, 4.0, committed=True), ranks_per_node=1, replicas=1).path == "committed"


def test_the_slowest_rank_and_the_least_time_left_decide():
    views = [DrainView(100.0, 10.0, 4.0, signalled=True), DrainView(30.0, 12.0, 20.0, signalled=False)]
    plan = plan_drain(views, ranks_per_node=1, replicas=1)
    assert (plan.path, plan.time_left_s, plan.checkpoint_s, plan.peers_s) == ("checkpoint", 30.0, 12.0, 20.0)
    assert plan_drain([DrainView(100.0, UNKNOWN, 4.0, True), DrainView(100.0, 9.0, IMPOSSIBLE, False)],
                      ranks_per_node=1, replicas=1).path == "checkpoint"  # a rank without partners: no peers way


def test_peers_only_where_every_drained_node_keeps_a_partner():
    assert replicas_survive({1}, nodes=4, replicas=1)
    assert not replicas_survive({1, 2}, nodes=4, replicas=1)  # node 1's shards are on node 2, drained too
    assert replicas_survive({1, 2}, nodes=4, replicas=2)  # and on node 3
    assert not replicas_survive({0, 1}, nodes=2, replicas=1)  # the whole job drained
    # 2 nodes x 2 ranks: a signal on either rank of node 1 drains node 1; node 0 holds its copies
    assert plan_drain(_views(30.0, 4.0, signalled=(3,), world=4), ranks_per_node=2, replicas=1).path == "peers"
    everyone = _views(30.0, 4.0, signalled=(0, 3), world=4)
    assert plan_drain(everyone, ranks_per_node=2, replicas=1).path == "checkpoint"


def _checkpoint_cost(**changes):
    return checkpoint_cost(12, **{"enabled": True, "saved_step": 10, "in_flight": None, "last_save_s": 8.0,
                                  **changes})


def test_checkpoint_cost_counts_what_is_left_of_the_in_flight_save():
    assert _checkpoint_cost() == 8.0  # one save of step 12
    assert _checkpoint_cost(in_flight=(11, 3.0)) == 5.0 + 8.0  # the rest of step 11's save, then step 12's
    assert _checkpoint_cost(in_flight=(12, 3.0)) == 5.0  # the in-flight save is of the step reached
    assert _checkpoint_cost(saved_step=12) == 0.0
    assert math.isnan(_checkpoint_cost(last_save_s=None))
    assert _checkpoint_cost(enabled=False) == IMPOSSIBLE


def test_peers_cost_is_a_copy_and_a_send_as_last_measured():
    assert peers_cost(12, partners=True, newest_step=10, copy_s=0.5, send_s=3.0) == 3.5
    assert peers_cost(12, partners=True, newest_step=12, copy_s=0.5, send_s=3.0) == 3.0  # copied: the send only
    assert math.isnan(peers_cost(12, partners=True, newest_step=None, copy_s=0.0, send_s=0.0))
    assert peers_cost(12, partners=False, newest_step=12, copy_s=0.5, send_s=3.0) == IMPOSSIBLE


def test_the_margin_applies_to_both_ways():
    fits = 100.0 / DRAIN_SAVE_MARGIN
    assert plan_drain(_views(IMPOSSIBLE, fits), 1, 1).path == "peers"
    assert plan_drain(_views(IMPOSSIBLE, fits + 0.1), 1, 1).path == "none"


class _Signal:
    """A drain signalled on this rank with `left` seconds of the grace period to go."""
    def __init__(self, left: float) -> None:
        self.flag, self.left = 1.0, left

    def time_left(self) -> float:
        return self.left


@pytest.mark.parametrize("left, kept", [(100.0, True), (0.0, False)])
def test_the_drain_commits_the_step_reached_where_the_time_left_allows_then_leaves(tmp_path, left, kept):
    # one rank, the checkpoint way (no peer state): the step reached is committed, or not when no time is left
    ckpt = checkpoint_manager(tmp_path / "ckpt", mode="sync", keep=2)
    ckpt.save(10, {"w": torch.zeros(2)})  # measured: a save's length, and step 10 committed
    events = EventLog(tmp_path, "rank0")
    with pytest.raises(Drained):
        Drain(_Signal(left), ckpt, None, str(tmp_path / "ckpt"), events, world_size=1)(12, 0.1, {"w": torch.ones(2)})
    [drained] = [e for e in read_events(tmp_path) if e["event"] == "drained"]
    assert (drained["path"], drained["saved_step"]) == (("checkpoint", 12) if kept else ("none", 10))
    assert [step for step, _ in committed_checkpoints(tmp_path / "ckpt")] == ([12, 10] if kept else [10])


def _sigterm_between_two_iterations(marker: Path, run_dir: Path) -> None:
    """run_inprocess with a stand-in Wrapper that runs the wrapped function twice (an in-process restart)
    and sends this process SIGTERM, with the drain marker there, between the two calls."""
    import training.train.inprocess as inprocess_module
    from training.contract.config import load_train_config

    marker.touch()
    os.environ[DRAIN_MARKER_ENV] = str(marker)

    @dataclass
    class Call:
        iteration: int

    class Restarting:
        def __init__(self, fn):
            self.fn = fn

        def __call__(self):
            self.fn(call_wrapper=Call(0))
            os.kill(os.getpid(), signal.SIGTERM)  # no iteration running
            time.sleep(0.5)
            return self.fn(call_wrapper=Call(1))

    def train(cfg, iteration):
        print(f"iteration {iteration.number}: drain flag {iteration.drain_signal.flag}", flush=True)

    inprocess_module.make_wrapper = lambda cfg, coordination, budget, lost_ranks: Restarting  # this rank's own module
    inprocess_module.run_inprocess(load_train_config(None, [f"run_dir={run_dir}", "fault_tolerance.restart=both"]),
                                   train)
    print("left the Wrapper", flush=True)


def test_a_sigterm_between_two_inprocess_iterations_reaches_the_next(tmp_path):
    [rank] = fork_ranks(lambda _: _sigterm_between_two_iterations(tmp_path / "marker", tmp_path / "run"),
                        tmp_path / "logs", world=1, timeout=120)
    assert rank.code == 0, (rank.code, -signal.SIGTERM, rank.output[-3000:])
    assert "iteration 0: drain flag 0.0" in rank.output
    assert "iteration 1: drain flag 1.0" in rank.output  # the signal was not lost: the next iteration drains
