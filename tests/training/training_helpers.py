"""Helpers for the training tests: run the local emulated cluster as a subprocess, read its results."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from training.contract.events import read_events
from training.train.final_state import bitwise_mismatch, load_final_state  # load_final_state: for the tests

REPO_ROOT = Path(__file__).resolve().parents[2]

# The fault runs' common shape (tests/training/conftest.py's `reference` is their uninterrupted run).
STEPS, INTERVAL, COLLECTIVE_TIMEOUT_S, RANKS, GLOBAL_BATCH = 20, 5, 30, 2, 8
COMMON = ("--steps", str(STEPS), f"checkpoint.interval={INTERVAL}", "checkpoint.save_final=true",
          "logging.log_interval=10", f"training.collective_timeout_s={COLLECTIVE_TIMEOUT_S}",
          # each of the 2 ranks accumulates 2 micro-batches of 2 (training.global_batch_size): every exact
          # resume below covers gradient accumulation, with FSDP2's reduce after the last micro-batch only
          "training.batch_size=2", f"training.global_batch_size={GLOBAL_BATCH}",
          # calculated hang timeouts stay loose on a loaded 2-core box (max observed x 50)
          "fault_tolerance.timeout_safety_factor=50")
# Both shapes have world size RANKS (2) with the same shards: one uninterrupted run is the reference of all.
ONE_NODE = ("--nodes", "1", "--nproc-per-node", "2")
TWO_NODES = ("--nodes", "2", "--nproc-per-node", "1")


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


def start_local(run_dir: Path, *args: str) -> subprocess.Popen:
    """`python -m training.local --run-dir RUN_DIR ARGS…`, started (output piped)."""
    return subprocess.Popen([sys.executable, "-m", "training.local", "--run-dir", str(run_dir), *args],
                            cwd=REPO_ROOT, env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def wait_for_step(run_dir: Path, step: int, proc: subprocess.Popen, timeout: float = 90) -> None:
    """Until rank 0 logged `step` (the run failing or `timeout` fails the test)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.communicate()[0][-3000:]
        try:
            if any(e["event"] == "step" and e["step"] >= step for e in read_events(run_dir)):
                return
        except FileNotFoundError:
            pass
        time.sleep(0.3)
    proc.kill()
    pytest.fail(f"no step {step} within {timeout} s: {proc.communicate()[0][-3000:]}")


def completed(run: LocalRun) -> LocalRun:
    """`run`, asserted to have exited 0 (the tail of its output as the message)."""
    assert run.returncode == 0, run.output[-4000:]
    return run


def assert_bitwise_equal(a: dict, b: dict) -> None:
    mismatch = bitwise_mismatch(a, b)
    assert mismatch is None, mismatch


def events_named(run_dir: Path, name: str) -> list[dict]:
    """The run's events of one kind (training.contract.events), in time order."""
    return [e for e in read_events(run_dir) if e["event"] == name]
