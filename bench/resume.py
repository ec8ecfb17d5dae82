"""Exact resume on one GPU, the first check of bench/gpu.sh: the same short run twice on the local
cluster (one node, one rank, NCCL), with NVRx's async checkpoint writer; once uninterrupted, once with
an exception that makes ft_launcher restart the worker, which resumes from the last checkpoint NVRx
wrote. Both final states (checkpoint.save_final) must be bitwise equal. Prints one line,
`exact resume on CUDA (…): PASS` or `… FAIL: <why>`, and exits 0 on PASS, 1 on FAIL.

    python -m bench.resume [--runs-dir DIR]
"""
from __future__ import annotations

import argparse
import shutil
import sys
import time
from pathlib import Path

from bench.cluster import ClusterSpec, run_cluster
from bench.run import NO_CUDA, REPO_ROOT
from training.contract.events import read_events
from training.local.shape import ClusterShape
from training.train.final_state import bitwise_mismatch, load_final_state

LABEL = "exact resume on CUDA (NVRx async checkpoints, in-job restart)"
STEPS, INTERVAL = 24, 5
FAULT = "exception@13:rank=0"  # after the saves of steps 5 and 10: the restart loads one NVRx wrote
# Hang timeouts stay as configured (none calculated from the first steps): this check is about state.
OVERRIDES = ("model.preset=tiny", "training.device=cuda", "checkpoint.mode=async", f"checkpoint.interval={INTERVAL}",
             "checkpoint.save_final=true", f"fault_tolerance.calculate_timeouts_after={STEPS + 1}")


def _run(run_dir: Path, faults: tuple[str, ...]) -> int:
    shutil.rmtree(run_dir, ignore_errors=True)
    shape = ClusterShape(nodes=1, nproc_per_node=1, node_retries=0)
    return run_cluster(ClusterSpec(run_dir, shape, steps=STEPS, overrides=OVERRIDES, faults=faults))


def mismatch(reference: Path, interrupted: Path, scratch: Path) -> str | None:
    """None when `interrupted` resumed once from disk and ended bitwise equal to `reference`; else why not."""
    sources = [e["source_kind"] for e in read_events(interrupted) if e["event"] == "resume"]
    if sources != ["none", "disk"]:
        return f"the interrupted run's resumes were {sources}, not one from disk"
    return bitwise_mismatch(load_final_state(reference, scratch), load_final_state(interrupted, scratch))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.resume", description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs-dir", type=Path, default=None, help="default runs/gpu-resume-<date>")
    args = parser.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print(f"{LABEL}: no CUDA device visible: nothing checked", file=sys.stderr)
        return NO_CUDA
    runs = args.runs_dir or REPO_ROOT / "runs" / f"gpu-resume-{time.strftime('%Y-%m-%d_%H%M%S')}"
    failure = None
    for name, faults in (("reference", ()), ("interrupted", (FAULT,))):
        status = _run(runs / name, faults)
        if status != 0:
            failure = f"the {name} run failed (status {status}); logs in {runs / name / 'logs'}"
            break
    else:
        failure = mismatch(runs / "reference", runs / "interrupted", runs)
    print(f"{LABEL}: {'PASS' if failure is None else 'FAIL: ' + failure} (runs in {runs})", flush=True)
    return 0 if failure is None else 1


if __name__ == "__main__":
    sys.exit(main())
