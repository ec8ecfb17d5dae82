"""Synthetic bench inputs: event logs written as JSON lines with chosen times, and a whole BenchResult."""
from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

from bench.checks import (peer_checks, projection_checks, recovery_checks, rollback_checks, spare_cpu_checks,
                          stall_checks)
from bench.floor import FloorResult
from bench.mechanisms import MechanismResult
from bench.peer import PeerResult
from bench.peer_sizes import PeerSize
from bench.profile import QUICK
from bench.projection import project
from bench.results import BenchResult, Machine
from bench.rollback import RollbackResult
from bench.stall import StallResult
from training.contract.k8s_delays import EKS

T0 = 1_767_000_000.0
PEER = PeerResult(save_s=0.0015, step_s=0.05, cost_ratio=0.03, steps=120, interval=1, replicas=1,
                  bytes_per_rank=4 << 20)
PEER_SIZES = (PeerSize("tiny", bytes_per_rank=1 << 20, copy_s=0.002, send_s=0.01, restore_s=0.1, checksum_s=0.003),
              PeerSize("small", bytes_per_rank=300 << 20, copy_s=0.4, send_s=2.0, restore_s=3.0, checksum_s=1.0))


def write_events(run_dir: Path, records: list[dict]) -> Path:
    """rank0.jsonl with `t` relative to T0, as training.contract.events writes it."""
    directory = run_dir / "events"
    directory.mkdir(parents=True, exist_ok=True)
    lines = [json.dumps({**r, "t": T0 + r["t"], "source": "rank0"}) for r in records]
    (directory / "rank0.jsonl").write_text("\n".join(lines) + "\n")
    return run_dir


def stall_pass(run_dir: Path, steps: int, step_s: float, saves: dict[int, float]) -> Path:
    """A pass of `steps` steps of `step_s` each; after step k in `saves`, a save blocking saves[k] s."""
    t, records = 0.0, []
    for step in range(1, steps + 1):
        t += step_s
        records.append({"t": t, "event": "step", "step": step, "loss": 0.0, "step_time_s": step_s, "tokens": 0})
        if step in saves:
            records.append({"t": t, "event": "ckpt_start", "step": step})
            t += saves[step]
            records.append({"t": t, "event": "ckpt_blocked", "step": step, "seconds": saves[step]})
    records.append({"t": t, "event": "run_end", "step": steps, "status": "completed"})
    return write_events(run_dir, records)


def mechanism(recovery_s: float, steps_lost: int = 4) -> MechanismResult:
    return MechanismResult(median_recovery_s=recovery_s, median_detection_s=1.0, median_steps_lost=steps_lost,
                           max_steps_lost=steps_lost, median_time_lost_s=recovery_s, recovered=2, faults=2,
                           training_goodput=0.5, infra_goodput=0.6, wall_s=60.0, status="completed",
                           restart_kinds=("injob",), run_dir="runs/x", per_fault=(
                               {"recovery_s": recovery_s - 0.5}, {"recovery_s": recovery_s + 0.5}))


def sample_result(unavailable: dict[str, str] | None = None) -> BenchResult:
    unavailable = {"inprocess": "training/train/inprocess.py does not exist"} if unavailable is None else unavailable
    stall = StallResult(state_bytes=256 << 20, world_size=2, interval_steps=10, steps=30, sync_blocking_s=2.0,
                        async_blocking_s=0.1, sync_blocking_per_save_s=(2.0, 2.0), async_blocking_per_save_s=(0.1, 0.1),
                        blocking_ratio=0.05, step_wall_off_s=0.1, step_wall_sync_s=0.2, step_wall_async_s=0.101,
                        efficiency_sync=0.5, efficiency_async=0.99, run_dirs={},
                        cpu_per_save_sync_s=0.5, cpu_per_save_async_s=0.045, writer_cpu_per_save_async_s=0.4,
                        async_setup_s=1.2)
    recovery = {"injob": replace(mechanism(7.0), median_step_s=0.08), "node_replacement": mechanism(20.0),
                "hot_spare": mechanism(10.0), "peer_state": mechanism(9.0, steps_lost=0),
                "drain": mechanism(4.0, steps_lost=0), "k8s_restart": mechanism(13.0),
                "replica_groups": replace(mechanism(8.0, steps_lost=0), median_survivor_stall_s=1.2,
                                          max_survivor_stall_s=1.5, median_step_s=0.1)}
    floor = FloorResult(median_s=4.0, samples_s=(4.0,), world_size=2)
    spare = replace(stall, state_bytes=128 << 20, world_size=1, sync_blocking_per_save_s=(1.5, 1.5),
                    sync_blocking_s=1.5, efficiency_sync=0.6, efficiency_async=0.9)
    rollback = RollbackResult(save_s=0.0012, step_s=0.03, cost_ratio=0.04, steps=38, copy_bytes=128 << 20,
                              copy_s=0.025, copy_gbps=5.37)
    projections = project(EKS, recovery)
    checks = (*stall_checks(stall, "", cpus=2), *spare_cpu_checks(spare, "", 2, run=True),
              *recovery_checks(recovery, unavailable, floor, QUICK.mechanisms),
              *projection_checks(projections, QUICK.mechanisms), *rollback_checks(rollback, ""),
              *peer_checks(PEER, ""))
    machine = Machine(cpus=2, load_avg_1m=1.0, python="3.11", torch="2.13.0", nvrx="0.4.1", device="x86_64")
    return BenchResult(date="2026-11-30_000000_quick", profile=QUICK, machine=machine, elapsed_s=100.0,
                       checkpoint=stall, checkpoint_spare_cpu=spare, floor=floor, recovery=recovery,
                       rollback=rollback, peer=PEER, unavailable=unavailable, checks=checks,
                       projections=projections, peer_sizes=PEER_SIZES)
