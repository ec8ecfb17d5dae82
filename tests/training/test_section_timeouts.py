"""NVRx's checkpoint section timeout with async saves, against a real NVRx 0.7.0 rank monitor.

An async save's checkpoint section is a hand-off of milliseconds; a timeout learned from it (NVRx's
max x safety factor) killed a rank later waiting in the same section for a whole save. Each case runs
the rank in a forked child with NVRx's RankMonitorServer beside it, and NVRx's own calculation.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import time
from pathlib import Path

import pytest
import torch.distributed as dist
import torch.multiprocessing as mp
from nvidia_resiliency_ext.fault_tolerance.config import FaultToleranceConfig as NvrxConfig
from nvidia_resiliency_ext.fault_tolerance.rank_monitor_server import RankMonitorServer

from training.contract.config import CheckpointMode, FaultToleranceConfig
from training.contract.launcher import section_timeouts
from training.train.hang_watch import HangWatch
from training.train.monitor import RankMonitor
from training_helpers import fork_rank, reap

QUICK_S = 0.01  # a step, an async save's hand-off
WAIT_S = 1.5  # a wait for the save in flight: thirty times the quick one, far below the configured 600 s
FT = FaultToleranceConfig(calculate_timeouts_after=3)
HANG_SEEN = 5
RANK_TIMEOUT_S = 60


@pytest.fixture()
def rank_monitor(tmp_path: Path):
    """NVRx's rank monitor server on a socket, checking every 0.1 s with the config's section timeouts."""
    cfg = NvrxConfig(workload_check_interval=0.1, rank_section_timeouts=section_timeouts(FT),
                     rank_out_of_section_timeout=FT.out_of_section_timeout,
                     initial_rank_heartbeat_timeout=FT.initial_rank_heartbeat_timeout,
                     rank_heartbeat_timeout=FT.rank_heartbeat_timeout, safety_factor=FT.timeout_safety_factor)
    socket_path = str(tmp_path / "rmon.socket")
    server = RankMonitorServer.run_in_subprocess(cfg, socket_path, mp_ctx=mp.get_context("fork"))
    yield socket_path
    server.kill()
    server.join()


def _rank(socket_path: str, mode: CheckpointMode, load: str | None, wait_s: float, state_file: Path,
          wait_in: str = "checkpoint", across_groups: bool = False, ft: FaultToleranceConfig = FT) -> int:
    """Fork a rank: quick steps and saves past calculate_timeouts_after, then one wait of `wait_s` in section
    `wait_in` (`across_groups`: within it, outside it, as ReplicaGroups.across_groups puts the waits for other
    groups); it writes its monitor's state to `state_file`. Its exit code (HANG_SEEN: restart=both's hang watch
    found the wait overdue), or minus the signal that killed it."""
    def body() -> int:
        os.environ.update(FT_RANK_MONITOR_IPC_SOCKET=socket_path, RANK="0")
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        watch = HangWatch() if ft.restart == "both" else None
        monitor = RankMonitor(ft, mode, watch)
        if load is not None:
            monitor.load_state_dict(load)
        monitor.end_setup()
        for _ in range(FT.calculate_timeouts_after + 1):
            with monitor.section("step"):
                time.sleep(QUICK_S)
            with monitor.section("checkpoint"):
                time.sleep(QUICK_S)
            monitor.step_done()
        state_file.write_text(monitor.state_dict())
        with monitor.section(wait_in), monitor.outside(wait_in) if across_groups else contextlib.nullcontext():
            time.sleep(wait_s)
            overdue = watch is not None and watch.overdue() is not None
        monitor.shutdown()
        return HANG_SEEN if overdue else 0

    log = state_file.with_suffix(".log")
    pid = fork_rank(body, log, {})
    codes = reap([pid], RANK_TIMEOUT_S)
    assert pid in codes, f"the rank still ran after {RANK_TIMEOUT_S} s: {log.read_text()[-2000:]}"
    return codes[pid]


def _checkpoint_timeout(state_file: Path) -> float:
    return json.loads(state_file.read_text())["current_timeouts"]["section"]["section"]["checkpoint"]


def test_async_saves_keep_the_configured_checkpoint_timeout(rank_monitor, tmp_path):
    state = tmp_path / "state.json"
    assert _rank(rank_monitor, "async", None, WAIT_S, state) == 0  # was killed (SIGKILL) by the rank monitor
    assert _checkpoint_timeout(state) == FT.checkpoint_section_timeout
    assert json.loads(state.read_text())["current_timeouts"]["section"]["section"]["step"] < 1  # still learned


def test_a_learned_checkpoint_timeout_from_a_checkpoint_is_put_back(rank_monitor, tmp_path):
    learned, resumed = tmp_path / "sync.json", tmp_path / "async.json"
    assert _rank(rank_monitor, "sync", None, 0, learned) == 0
    assert _checkpoint_timeout(learned) < 1  # sync saves learn it: NVRx's max x safety factor of quick saves
    assert _rank(rank_monitor, "async", learned.read_text(), WAIT_S, resumed) == 0
    assert _checkpoint_timeout(resumed) == FT.checkpoint_section_timeout


def _timeouts(state_file: Path) -> dict[str, float]:
    return json.loads(state_file.read_text())["current_timeouts"]["section"]["section"]


def test_with_replica_groups_a_step_waiting_for_another_group_outlives_the_learned_timeout(rank_monitor, tmp_path):
    # a survivor group's step waits in the cross-group all-reduce while another group fails or heals: torchft's
    # step timeout ends that wait (ReplicaGroups.across_groups, outside the step section), not the rank monitor
    # with a timeout learned from quick steps; a rank that hangs in its own work is still stopped at it
    inside, outside = tmp_path / "inside.json", tmp_path / "outside.json"
    assert _rank(rank_monitor, "async", None, WAIT_S, inside, wait_in="step") == -9  # killed: learned < 1 s
    assert _timeouts(inside)["step"] < 1
    assert _rank(rank_monitor, "async", None, WAIT_S, outside, wait_in="step", across_groups=True) == 0
    assert _timeouts(outside)["step"] < 1


def test_under_restart_both_a_resumed_rank_learns_the_timeouts_injob_would_and_its_watch_applies_them(
        rank_monitor, tmp_path):
    # restart=both raises the launcher's timeouts above the Wrapper's hard timeout. NVRx merges a new calculation
    # with the current timeouts: were those the floor, a rank resumed from the rollback or a checkpoint learned
    # half the floor (50 s), and a hang waited that long in the watch instead of injob's few seconds
    both = dataclasses.replace(FT, restart="both")
    first, resumed = tmp_path / "first.json", tmp_path / "resumed.json"
    assert _rank(rank_monitor, "async", None, 0, first, ft=both) == 0
    assert _timeouts(first)["step"] < 1  # what checkpoints hold: the learned timeout, not the floor
    # a step open for WAIT_S: past the learned timeout, the watch reports it; the launcher's floor spares the rank
    assert _rank(rank_monitor, "async", first.read_text(), WAIT_S, resumed, wait_in="step", ft=both) == HANG_SEEN
    assert _timeouts(resumed)["step"] < 1
