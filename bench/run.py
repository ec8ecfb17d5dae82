"""`make bench`: checkpoint stall, recovery per mechanism and goodput under faults, in one run.

Measures on the local emulated cluster (training.local) the figures `python -m training.plan --from-bench`
plans from, and projects from them a lost p5 node on EKS (bench.projection). `run_bench` says what runs, in
order; `main` says what it writes. A part that cannot be measured is reported as "not available: <reason>",
and the rest still runs. Cost: the full CPU profile keeps every CPU busy; --quick takes about 3 minutes on
2 cores.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Callable, TypeVar

from bench.checks import (peer_checks, projection_checks, recovery_checks, rollback_checks, spare_cpu_checks,
                          stall_checks)
from bench.floor import FloorResult, measure_floor
from bench.mechanisms import MECHANISMS, MechanismResult, Unavailable, measure_mechanism
from bench.plot import plot_result
from bench.profile import FULL, GPU, QUICK, Profile
from bench.projection import project
from bench.peer import PeerResult, measure_peer
from bench.peer_sizes import measure_peer_sizes
from bench.results import PEER, PEER_SIZES, ROLLBACK, SPARE_CPU, BenchResult, Machine, write_json
from bench.rollback import RollbackResult, measure_rollback
from bench.stall import StallResult, StallSpec, measure_stall, measure_stall_on_cluster, spare_cpu_world
from bench.table import format_markdown
from training.contract.k8s_delays import EKS

T = TypeVar("T")
REPO_ROOT = Path(__file__).resolve().parent.parent
NO_CUDA = 2  # --gpu without a CUDA device: nothing was measured


def say(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] [bench] {message}", flush=True)


def _failure(err: BaseException) -> str:
    return f"{type(err).__name__}: {err}".splitlines()[0][:300]


def run_stall(p: Profile, runs: Path) -> StallResult:
    if p.stall_preset is None:
        return measure_stall(StallSpec(p.state_bytes, p.stall_world, p.stall_saves, p.matmuls_per_step, p.device), runs)
    assert p.stall_interval is not None, "a real training run needs a fixed checkpoint interval"
    return measure_stall_on_cluster(p.stall_preset, p.device, p.stall_world, p.stall_interval, p.stall_saves, runs)


def run_stall_with_spare_cpu(p: Profile, world: int, runs: Path) -> StallResult:
    """The synthetic stall again with `world` ranks, each holding the same shard as in the first pass."""
    assert p.stall_preset is None, "the spare-CPU pass repeats the synthetic stall"
    return measure_stall(StallSpec(p.state_bytes // p.stall_world * world, world, p.stall_saves, p.matmuls_per_step,
                                   p.device), runs / "spare-cpu")


def _attempt(part: str, measure: Callable[[], T], unavailable: dict[str, str]) -> T | None:
    """measure(), or None with its failure recorded under `part`: a part that fails is reported, the
    others still run."""
    try:
        return measure()
    except Exception as err:  # noqa: BLE001
        traceback.print_exc()
        unavailable[part] = _failure(err)
        return None


def _measure_stall_part(part: str, measure: Callable[[], StallResult],
                        unavailable: dict[str, str]) -> StallResult | None:
    stall = _attempt(part, measure, unavailable)
    if stall is None:
        return None
    say(f"blocking per save: sync {stall.sync_blocking_s:.2f} s, async {stall.async_blocking_s:.2f} s; efficiency "
        f"sync {stall.efficiency_sync:.0%}, async {stall.efficiency_async:.0%}")
    return stall


def run_rollback(p: Profile, recovery: dict[str, MechanismResult],
                 unavailable: dict[str, str]) -> RollbackResult | None:
    if "inprocess" not in recovery:
        unavailable[ROLLBACK] = f"needs the in-process run ({unavailable.get('inprocess', 'not run')})"
        return None
    r = _attempt(ROLLBACK, lambda: measure_rollback(Path(recovery["inprocess"].run_dir), p.rollback_copy_bytes,
                                                    p.device), unavailable)
    if r is None:
        return None
    say(f"in-memory rollback: {r.save_s * 1e3:.2f} ms per step, {r.cost_ratio:.1%} of the step time; host copy "
        f"{r.copy_gbps:.1f} GB/s")
    return r


def run_peer(recovery: dict[str, MechanismResult], unavailable: dict[str, str]) -> PeerResult | None:
    if "peer_state" not in recovery:
        unavailable[PEER] = f"needs the peer-state run ({unavailable.get('peer_state', 'not run')})"
        return None
    r = _attempt(PEER, lambda: measure_peer(Path(recovery["peer_state"].run_dir)), unavailable)
    if r is not None:
        say(f"peer state: {r.save_s * 1e3:.2f} ms per copy, {r.cost_ratio:.1%} of the step time, every {r.interval} "
            f"step(s); {r.bytes_per_rank / 2**20:.1f} MiB of node memory per rank")
    return r


def run_bench(p: Profile, runs: Path, date: str) -> BenchResult:
    """Profile `p`'s parts, in this order: the floor of this machine; the checkpoint stall (sync vs async; in
    the full CPU profile, where its ranks keep every CPU busy, again on one rank fewer, leaving a CPU to the
    background writer as a GPU host's idle cores do); one fault run per recovery mechanism; the in-memory
    rollback's cost per step (from the in-process run) and host copy bandwidth; peer state's copy, send and
    restore at the tiny and the small preset's state (bench.peer_sizes). Then a lost p5 node on EKS is
    projected from those runs and Kubernetes' delays (bench.projection, labelled a projection)."""
    started = time.monotonic()
    cpus = os.cpu_count() or 1
    unavailable: dict[str, str] = {}
    say(f"profile {p.name}: floor ({p.floor_repeats}x, world {p.world})")
    floor: FloorResult | None = None
    try:
        floor = measure_floor(p.world, p.floor_repeats)
        say(f"floor {floor.median_s:.2f} s")
    except Exception as err:  # noqa: BLE001 - a part that fails is reported, the others still run
        unavailable["floor"] = _failure(err)
    say("checkpoint stall: checkpoints off, sync, async")
    stall = _measure_stall_part("checkpoint", lambda: run_stall(p, runs), unavailable)
    spare_world = spare_cpu_world(p.stall_world, cpus) if p.stall_spare_cpu else None
    stall_spare: StallResult | None = None
    if spare_world is not None:
        say(f"checkpoint stall again with {spare_world} rank(s) on {cpus} CPUs: one CPU spare for the writer")
        stall_spare = _measure_stall_part(SPARE_CPU, lambda: run_stall_with_spare_cpu(p, spare_world, runs),
                                          unavailable)
    recovery: dict[str, MechanismResult] = {}
    for m in (m for m in MECHANISMS if m.name in p.mechanisms):
        say(f"{m.label}: {p.faults} faults at steps {m.fault_schedule(p)[0]}, {p.nodes} node(s) x "
            f"{p.nproc_per_node} rank(s)")
        try:
            recovery[m.name] = measure_mechanism(m, p, runs / m.name)
            say(f"{m.label}: median recovery {recovery[m.name].median_recovery_s:.2f} s")
        except Unavailable as err:
            unavailable[m.name] = str(err)
            say(f"{m.label}: not available: {err}")
        except Exception as err:  # noqa: BLE001
            traceback.print_exc()
            unavailable[m.name] = _failure(err)
    say(f"in-memory rollback: cost per step, host copy of {p.rollback_copy_bytes >> 20} MiB")
    rollback = run_rollback(p, recovery, unavailable)
    peer = run_peer(recovery, unavailable) if "peer_state" in p.mechanisms else None
    peer_sizes = ()
    if p.peer_presets:
        say(f"peer state at {', '.join(p.peer_presets)} state: copy, send, restore")
        peer_sizes = _attempt(PEER_SIZES, lambda: measure_peer_sizes(p.peer_presets), unavailable) or ()
    machine = Machine.here(p.device)
    projections = project(EKS, recovery)
    checks = (*stall_checks(stall, unavailable.get("checkpoint", "not measured"), cpus),
              *spare_cpu_checks(stall_spare, unavailable.get(SPARE_CPU, "not measured"), cpus,
                                run=spare_world is not None),
              *recovery_checks(recovery, unavailable, floor, p.mechanisms),
              *projection_checks(projections, p.mechanisms),
              *rollback_checks(rollback, unavailable.get(ROLLBACK, "not measured")),
              *(peer_checks(peer, unavailable.get(PEER, "not measured")) if "peer_state" in p.mechanisms else ()))
    return BenchResult(date=date, profile=p, machine=machine, elapsed_s=time.monotonic() - started,
                       checkpoint=stall, checkpoint_spare_cpu=stall_spare, floor=floor, recovery=recovery,
                       rollback=rollback, peer=peer, unavailable=unavailable, checks=checks,
                       projections=projections, delays=EKS, peer_sizes=peer_sizes)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """`python -m bench.run [--quick] [--gpu] [--results-dir bench/results] [--runs-dir DIR]`."""
    parser = argparse.ArgumentParser(prog="python -m bench.run", description=__doc__.split("\n\n")[0])
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="2 faults per mechanism, 256 MiB state, 1 rank per node (about 3 min)")
    size.add_argument("--gpu", action="store_true", help="the one-GPU profile of bench/gpu.sh (needs CUDA)")
    parser.add_argument("--results-dir", type=Path, default=REPO_ROOT / "bench" / "results")
    parser.add_argument("--runs-dir", type=Path, default=None, help="run directories (default runs/bench-<date>)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Runs the profile the flags pick (--quick: 2 faults per mechanism, 256 MiB of state, one rank per node;
    --gpu: the one-GPU profile that bench/gpu.sh runs, needs CUDA) and writes <results-dir>/<date>.json
    (`python -m training.plan --from-bench` reads it), <date>.md (the printed tables) and <date>.png."""
    args = parse_args(argv)
    profile = GPU if args.gpu else QUICK if args.quick else FULL
    if profile.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            print("bench: no CUDA device visible (torch.cuda.is_available() is False): the GPU profile measures "
                  "nothing without one; run `make bench` for the CPU benchmark", file=sys.stderr)
            return NO_CUDA
    date = time.strftime("%Y-%m-%d_%H%M%S") + ("" if profile is FULL else f"_{profile.name}")
    runs = args.runs_dir or REPO_ROOT / "runs" / f"bench-{date}"
    result = run_bench(profile, runs, date)
    markdown = format_markdown(result)
    print(markdown)
    stem = args.results_dir / date
    write_json(result, stem.with_suffix(".json"))
    stem.with_suffix(".md").write_text(markdown)
    plot_result(result, stem.with_suffix(".png"))
    say(f"wrote {stem}.json, .md, .png; run directories in {runs}")
    say(f"plan from it: python -m training.plan --nodes 32 --gpus-per-node 8 --node-mtbf-hours 2000 "
        f"--from-bench {stem}.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
