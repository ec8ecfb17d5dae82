"""Helpers for the training tests: run the local emulated cluster as a subprocess, read its results."""
from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from training.events import read_events

REPO_ROOT = Path(__file__).resolve().parents[2]


@dataclass
class LocalRun:
    run_dir: Path
    returncode: int
    output: str


def run_local(run_dir: Path, *args: str, timeout: float = 240, env: dict[str, str] | None = None) -> LocalRun:
    """`python -m training.local --run-dir RUN_DIR ARGS…`, to completion; `env` adds variables."""
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), **(env or {})}
    proc = subprocess.run([sys.executable, "-m", "training.local", "--run-dir", str(run_dir), *args],
                          cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    return LocalRun(run_dir, proc.returncode, proc.stdout + proc.stderr)


def load_final_state(run_dir: Path, scratch: Path) -> dict:
    """The run's final DCP dump as one plain dict (read without NVRx or a process group)."""
    out = scratch / f"{run_dir.name}-final.pt"
    dcp_to_torch_save(run_dir / "final", out)
    return torch.load(out, weights_only=False)


def flatten(tree: object, prefix: str = "") -> dict[str, object]:
    if isinstance(tree, dict):
        return {k: v for key, sub in tree.items() for k, v in flatten(sub, f"{prefix}{key}.").items()}
    if isinstance(tree, (list, tuple)):
        return {k: v for i, sub in enumerate(tree) for k, v in flatten(sub, f"{prefix}{i}.").items()}
    return {prefix.rstrip("."): tree}


def assert_bitwise_equal(a: dict, b: dict) -> None:
    fa, fb = flatten(a), flatten(b)
    assert fa.keys() == fb.keys()
    differing = [k for k in fa if not (torch.equal(fa[k], fb[k]) if isinstance(fa[k], torch.Tensor) else fa[k] == fb[k])]
    assert not differing, f"{len(differing)} of {len(fa)} entries differ, e.g. {differing[:5]}"


def events_named(run_dir: Path, name: str) -> list[dict]:
    """The run's events of one kind (training.events), in time order."""
    return [e for e in read_events(run_dir) if e["event"] == name]
