"""Multi-process training runs through the local cluster (ft_launcher, FSDP2, gloo): smoke, exact
resume after an injected fault (sync and async checkpoints), exactly-once data, faults fire once."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from training.contract.events import read_events
from training_helpers import REPO_ROOT, assert_bitwise_equal, completed, load_final_state, run_local

pytestmark = pytest.mark.slow

STEPS, RANKS, BATCH = 30, 2, 4
COMMON = ("--steps", str(STEPS), "checkpoint.interval=10", "checkpoint.save_final=true",
          "logging.sample_log=true", "logging.log_interval=10", "training.collective_timeout_s=30",
          f"training.batch_size={BATCH}",
          # calculated hang timeouts stay loose on a loaded 2-core box (max observed x 50)
          "fault_tolerance.timeout_safety_factor=50")


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """Uninterrupted: 1 node x 2 ranks, sync checkpoints."""
    return completed(run_local(tmp_path_factory.mktemp("ref") / "run", "--nodes", "1", "--nproc-per-node", "2",
                         *COMMON, "checkpoint.mode=sync"))


@pytest.fixture(scope="module")
def interrupted_sync(tmp_path_factory):
    """1 node x 2 ranks, sync checkpoints; rank 1 raises at step 17 -> in-job restart from step 10."""
    return completed(run_local(tmp_path_factory.mktemp("sync") / "run", "--nodes", "1", "--nproc-per-node", "2",
                         *COMMON, "checkpoint.mode=sync", "--faults", "exception@17:rank=1"))


@pytest.fixture(scope="module")
def interrupted_async(tmp_path_factory):
    """2 nodes x 1 rank, async checkpoints; rank 1 is SIGKILLed at step 23."""
    return completed(run_local(tmp_path_factory.mktemp("async") / "run", "--nodes", "2", "--nproc-per-node", "1",
                         *COMMON, "checkpoint.mode=async", "--faults", "sigkill@23:rank=1"))


def _events(run, name):
    return [e for e in read_events(run.run_dir) if e["event"] == name]


def test_smoke_loss_goes_down(reference):
    losses = [e["loss"] for e in _events(reference, "step")]
    assert [e["step"] for e in _events(reference, "step")] == list(range(1, STEPS + 1))
    assert sum(losses[-5:]) / 5 < 0.8 * sum(losses[:5]) / 5, losses
    assert [e["status"] for e in _events(reference, "run_end")] == ["completed"]
    assert [e["step"] for e in _events(reference, "ckpt_committed")] == [10, 20, 30]
    assert "step 30/30 | loss" in reference.output  # rank 0's progress line, echoed by the controller


def test_checkpoint_holds_step_data_position_and_calculated_timeouts(reference, scratch):
    out = scratch / "ckpt30.pt"
    dcp_to_torch_save(Path(reference.run_dir) / "checkpoints" / "step_00000030", out)
    state = torch.load(out, weights_only=False)
    assert state["train"]["step"] == 30
    assert state["train"]["data"]["consumed_samples"] == STEPS * RANKS * BATCH
    assert {"rng_rank0", "rng_rank1", "model", "optimizer"} <= set(state)
    timeouts = json.loads(state["train"]["ft"])["current_timeouts"]["section"]
    assert "step" in timeouts["calculated_sections"]
    assert 0 < timeouts["section"]["step"] < 180  # tighter than the configured step_section_timeout


@pytest.mark.parametrize("run_name", ["interrupted_sync", "interrupted_async"])
def test_exact_resume_is_bitwise_equal(run_name, request, reference, scratch):
    run = request.getfixturevalue(run_name)
    resumes = _events(run, "resume")
    assert [r["source_kind"] for r in resumes] == ["none", "disk"], resumes
    assert_bitwise_equal(load_final_state(run.run_dir, scratch), load_final_state(reference.run_dir, scratch))


@pytest.mark.parametrize("run_name, spec_key", [("interrupted_sync", "exception@17_rank=1"),
                                                 ("interrupted_async", "sigkill@23_rank=1")])
def test_fault_fires_once_and_restart_is_recorded(run_name, spec_key, request):
    run = request.getfixturevalue(run_name)
    assert len(_events(run, "fault_injected")) == 1
    assert (Path(run.run_dir) / "faults" / "fired" / spec_key).is_file()
    assert [(e["attempt"], e["restart_kind"]) for e in _events(run, "attempt_start")] == [(0, "fresh"), (1, "injob")]
    assert _events(run, "run_end")[-1]["status"] == "completed"


@pytest.mark.parametrize("run_name", ["interrupted_sync", "interrupted_async"])
def test_every_sample_consumed_exactly_once(run_name, request):
    run = request.getfixturevalue(run_name)
    records_per_step: Counter[int] = Counter()
    final: dict[tuple[int, int], list[int]] = {}  # (rank, step) -> indices; a replayed step overwrites
    for path in sorted((Path(run.run_dir) / "samples").glob("rank*.jsonl")):
        rank = int(path.stem.removeprefix("rank"))
        for line in path.read_text().splitlines():
            record = json.loads(line)
            final[(rank, record["step"])] = record["indices"]
            records_per_step[record["step"]] += 1
    assert any(n > RANKS for n in records_per_step.values()), "the fault should have made some steps run twice"
    assert sorted({step for _, step in final}) == list(range(1, STEPS + 1))
    counts = Counter(i for indices in final.values() for i in indices)
    assert sorted(counts) == list(range(STEPS * RANKS * BATCH))
    assert set(counts.values()) == {1}


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


def test_run_ends_with_the_goodput_report_and_timeline(interrupted_sync):
    out = interrupted_sync.output
    assert "Run: completed, final step 30, 2 attempt(s)" in out
    assert "Training goodput" in out and "Infra goodput" in out
    (fault_row,) = [line for line in out.splitlines() if line.strip().startswith("1  exception")]
    # rank 1, in-job restart, 6 steps recomputed (11-16) back to the checkpoint at step 10
    assert fault_row.split()[2] == "1" and "injob" in fault_row and fault_row.endswith("6 (back to 10)")
    report = json.loads((interrupted_sync.run_dir / "report.json").read_text())
    assert report["faults"][0]["time_lost_s"] > 0 and report["final_loss"] < report["first_loss"]
    assert (interrupted_sync.run_dir / "timeline.png").read_bytes().startswith(b"\x89PNG")
