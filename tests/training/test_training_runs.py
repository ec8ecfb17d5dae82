"""Multi-process training runs through the local cluster (ft_launcher, FSDP2, gloo): smoke, what a checkpoint
holds, and training without the launcher."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from training.contract.events import read_events
from training_helpers import GLOBAL_BATCH, INTERVAL, RANKS, REPO_ROOT, STEPS

pytestmark = pytest.mark.slow

# The uninterrupted run is conftest's `reference` (training_helpers.COMMON: 1 node x 2 ranks, sync saves every
# INTERVAL steps, 2 micro-batches of 2 per rank). Exact resume after a fault, each sample consumed once across the
# restarts, a fault firing once and the goodput report after it: test_fault_matrix.py, on its ckpt-crash and
# mixed-injob runs.


def _events(run, name):
    return [e for e in read_events(run.run_dir) if e["event"] == name]


def test_smoke_loss_goes_down(reference):
    losses = [e["loss"] for e in _events(reference, "step")]
    assert [e["step"] for e in _events(reference, "step")] == list(range(1, STEPS + 1))
    assert sum(losses[-5:]) / 5 < 0.8 * sum(losses[:5]) / 5, losses
    assert [e["status"] for e in _events(reference, "run_end")] == ["completed"]
    assert [e["step"] for e in _events(reference, "ckpt_committed")] == list(range(INTERVAL, STEPS + 1, INTERVAL))
    assert f"step {STEPS}/{STEPS} | loss" in reference.output  # rank 0's progress line, echoed by the controller


def test_checkpoint_holds_step_data_position_and_calculated_timeouts(reference, scratch):
    out = scratch / f"ckpt{STEPS}.pt"
    dcp_to_torch_save(Path(reference.run_dir) / "checkpoints" / f"step_{STEPS:08d}", out)
    state = torch.load(out, weights_only=False)
    assert state["train"]["step"] == STEPS
    assert state["train"]["data"]["consumed_samples"] == STEPS * GLOBAL_BATCH
    assert {f"rng_rank{r}" for r in range(RANKS)} | {"model", "optimizer"} <= set(state)
    timeouts = json.loads(state["train"]["ft"])["current_timeouts"]["section"]
    assert "step" in timeouts["calculated_sections"]
    assert 0 < timeouts["section"]["step"] < 180  # tighter than the configured step_section_timeout


def test_train_without_launcher_is_a_noop_for_nvrx_and_resumes(tmp_path):
    """`python -m training.train` alone: one process, NVRx monitoring off with a log line; a second
    invocation with more steps continues from the first one's last checkpoint."""
    def train(steps):
        return subprocess.run([sys.executable, "-m", "training.train", f"run_dir={tmp_path}",
                               f"training.steps={steps}", "checkpoint.interval=4", "checkpoint.mode=sync"],
                              cwd=REPO_ROOT, env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
                              capture_output=True, text=True, timeout=120)

    first = train(8)
    assert first.returncode == 0, first.stderr[-3000:]
    assert "NVRx hang detection is off" in first.stdout
    second = train(12)
    assert second.returncode == 0, second.stderr[-3000:]
    events = read_events(tmp_path)
    assert [(e["step"], e["source_kind"]) for e in events if e["event"] == "resume"] == [(0, "none"), (8, "disk")]
    assert [e["step"] for e in events if e["event"] == "step"] == list(range(1, 13))
