"""Resume never discards training: a checkpoint loads at another world size, is set aside only on
evidence of damage, and training refuses to start from scratch while checkpoints exist."""
from __future__ import annotations

import errno
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.stateful import Stateful

from training.contract.events import EventLog
from training.contract.exit_codes import CONFIG_ERROR
from training.contract.launcher import RESUME_STEP_FILE
from training.train.checkpoint.inspection import Damaged, Held, inspect_checkpoint
from training.train.checkpoint.layout import committed_checkpoints
from training.local.shape import ClusterShape
from training.train.checkpoint.manager import (CheckpointLoadError, CheckpointManager, CheckpointMismatch,
                                               FreshStartRefused)
from training_helpers import (checkpoint_manager, completed, events_named, once_per_session, run_forked, run_local,
                              samples_by_step)

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


def _manager(tmp_path: Path) -> CheckpointManager:
    return checkpoint_manager(tmp_path / "ckpt", mode="sync", keep=3, events=EventLog(tmp_path, "rank0"))


def _saved(tmp_path: Path, *steps: int) -> CheckpointManager:
    m = _manager(tmp_path)
    for step in steps:
        m.save(step, {"w": torch.full((64,), float(step)), "rng_rank0": torch.full((4,), float(step))})
    return m


def _shards(path: Path) -> list[Path]:
    return sorted(path.glob("*.distcp"))


# ---- what counts as damage -----------------------------------------------------------------------

def test_an_intact_checkpoint_says_what_it_holds(tmp_path):
    m = _saved(tmp_path, 1)
    found = inspect_checkpoint(committed_checkpoints(m.dir)[0][1])
    assert found == Held(frozenset({"w", "rng_rank0"}), world_size=1)


@pytest.mark.parametrize("damage, evidence", [
    (lambda p: [s.write_bytes(s.read_bytes()[:10]) for s in _shards(p)], "is truncated"),
    (lambda p: [s.unlink() for s in _shards(p)], "is missing"),
    (lambda p: (p / ".metadata").write_bytes(b"\x80\x04garbage"), "unreadable marker or .metadata"),
    (lambda p: (p / ".metadata").unlink(), "is missing"),
    (lambda p: (p / "COMMITTED").write_text("{half"), "unreadable marker or .metadata"),
])
def test_damage_is_named_and_sets_the_checkpoint_aside(tmp_path, damage, evidence):
    m = _saved(tmp_path, 1, 2)
    newest = committed_checkpoints(m.dir)[0][1]
    damage(newest)
    found = inspect_checkpoint(newest)
    assert isinstance(found, Damaged) and evidence in found.evidence
    target = {"w": torch.zeros(64), "rng_rank0": torch.zeros(4)}
    assert _manager(tmp_path).load(target).step == 1  # the previous one
    assert torch.equal(target["w"], torch.full((64,), 1.0))
    [fallback] = events_named(tmp_path, "ckpt_fallback")
    assert fallback["path"] == str(newest) and evidence in fallback["error"]
    assert [p.name.rsplit("-", 1)[0] for p in m.dir.glob("corrupt-*")] == ["corrupt-step_00000002"]


def test_a_transient_load_error_fails_the_attempt_and_leaves_the_checkpoint(tmp_path, monkeypatch):
    m = _saved(tmp_path, 1, 2)

    def io_error(*args, **kwargs):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(dcp, "load", io_error)
    with pytest.raises(CheckpointLoadError) as err:
        _manager(tmp_path).load({"w": torch.zeros(64), "rng_rank0": torch.zeros(4)})
    assert "step_00000002 is intact but could not be loaded" in str(err.value)
    assert "Input/output error" in str(err.value) and "left in place" in str(err.value)
    assert [s for s, _ in committed_checkpoints(m.dir)] == [2, 1]
    assert not list(m.dir.glob("corrupt-*")) and not events_named(tmp_path, "ckpt_fallback")


@pytest.mark.parametrize("metadata, error", [
    (b"cno_such_module_of_an_older_image\nThing\n.", "ModuleNotFoundError"),  # pickle protocol 0: GLOBAL, STOP
    (b"ctorch.distributed.checkpoint.metadata\nNoSuchClassInThisTorch\n.", "AttributeError"),
])
def test_a_class_this_image_lacks_is_not_damage(tmp_path, metadata, error):
    """An image upgrade that moved a pickled class: the checkpoint stays, the attempt fails saying why."""
    m = _saved(tmp_path, 1, 2)
    newest = committed_checkpoints(m.dir)[0][1]
    (newest / ".metadata").write_bytes(metadata)
    found = inspect_checkpoint(newest)
    assert isinstance(found, str) and error in found and "another torch or training image version" in found
    with pytest.raises(CheckpointLoadError, match="could not be inspected"):
        _manager(tmp_path).load({"w": torch.zeros(64), "rng_rank0": torch.zeros(4)})
    assert [s for s, _ in committed_checkpoints(m.dir)] == [2, 1]
    assert not list(m.dir.glob("corrupt-*")) and not events_named(tmp_path, "ckpt_fallback")


class _Module(Stateful):
    """A Stateful as the trainer's model and optimizer are: dcp.load asks it for its state dict."""

    def __init__(self, size: int) -> None:
        self.layer = torch.nn.Linear(size, 4)

    def state_dict(self):
        return self.layer.state_dict()

    def load_state_dict(self, state):
        self.layer.load_state_dict(state)


@pytest.mark.parametrize("saved, target, cause", [
    # a key the config no longer has (another optimizer's state)
    ({"w": torch.zeros(64)}, {"w": torch.zeros(64), "extra": torch.zeros(2)},
     "RuntimeError: Missing key in checkpoint state_dict: extra."),
    # another preset: "Size mismatch between saved torch.Size([64]) and current: torch.Size([32]) for w"
    ({"w": torch.zeros(64)}, {"w": torch.zeros(32)}, "Size mismatch between saved torch.Size([64]) and current"),
    ({"model": _Module(64)}, {"model": _Module(32)}, "and current: torch.Size([4, 32]) for model.weight"),
])
def test_a_checkpoint_that_cannot_match_the_model_is_no_damage_and_no_retry_can_load_it(tmp_path, monkeypatch,
                                                                                          saved, target, cause):
    m = _manager(tmp_path)
    m.save(1, saved)
    read = []
    monkeypatch.setattr(dcp.FileSystemReader, "read_data", lambda *a, **k: read.append(a))
    with pytest.raises(CheckpointMismatch) as err:
        _manager(tmp_path).load(target)
    assert "step_00000001 is intact but cannot be loaded into this run's model and optimizer" in str(err.value)
    assert cause in str(err.value) and "Restore the config it was written with" in str(err.value)
    assert not isinstance(err.value, CheckpointLoadError)  # the retryable kind
    assert not read  # decided from the metadata: no shard read (at 8b, a reload from FSx)
    assert [s for s, _ in committed_checkpoints(m.dir)] == [1] and not list(m.dir.glob("corrupt-*"))


def test_per_rank_state_of_a_larger_world_may_be_missing(tmp_path):
    _saved(tmp_path, 3)
    target = {"w": torch.zeros(64), "rng_rank0": torch.zeros(4), "rng_rank1": torch.full((4,), -1.0)}
    loaded = _manager(tmp_path).load(target, optional=frozenset({"rng_rank1"}))
    assert (loaded.step, loaded.world_size, loaded.missing) == (3, 1, ("rng_rank1",))
    assert torch.equal(target["w"], torch.full((64,), 3.0))
    assert torch.equal(target["rng_rank1"], torch.full((4,), -1.0))  # left for the caller to derive


# ---- no silent fresh start -----------------------------------------------------------------------

def test_refuses_to_start_from_scratch_while_checkpoints_exist(tmp_path):
    m = _saved(tmp_path, 1)
    for shard in _shards(committed_checkpoints(m.dir)[0][1]):
        shard.write_bytes(b"")
    target = {"w": torch.zeros(64), "rng_rank0": torch.zeros(4)}
    with pytest.raises(FreshStartRefused, match="checkpoint.allow_fresh_start=true"):
        _manager(tmp_path).load(target)
    # set aside by that attempt: the next one still refuses, as it names what was set aside
    with pytest.raises(FreshStartRefused, match="corrupt-step_00000001-"):
        _manager(tmp_path).load(target)
    assert _manager(tmp_path).load(target, allow_fresh_start=True) is None
    assert _manager(tmp_path / "new").load(target) is None  # a new run has nothing to refuse


def test_resume_step_file_follows_commits(tmp_path):
    m = _manager(tmp_path)
    assert (m.dir / RESUME_STEP_FILE).read_text() == "1\n"  # the first attempt counts as progress
    m.save(5, {"w": torch.zeros(2)})
    assert (m.dir / RESUME_STEP_FILE).read_text() == "6\n"


# ---- runs at another world size (ranks forked from this process) ----------------------------------------------------

BATCH, GLOBAL_BATCH, FIRST, THEN, LAST = 2, 24, 20, 30, 40
# Measured here: at most 4.1e-7 apart over the 40 steps (a unit of the event log's sixth decimal), while
# the loss falls from 5.55 to 2.19.
REL_LOSS_TOLERANCE = 1e-5
# The global batch is kept at 24 sequences per step at every world size here: 4 ranks x 3 micro-batches of 2,
# 2 x 6 x 2, 6 x 2 x 2. Warm-up to the last step: the learning rate then depends on the step alone, not on
# training.steps, which each part of a resized run sets to where it stops (the cosine decay would follow it).
COMMON = ("checkpoint.mode=sync", "checkpoint.interval=10", "logging.sample_log=true", "logging.log_interval=10",
          f"training.batch_size={BATCH}", f"training.global_batch_size={GLOBAL_BATCH}", f"training.warmup_steps={LAST}",
          "training.collective_timeout_s=30", "fault_tolerance.timeout_safety_factor=50")


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory) -> Path:
    """The run directory of 4 ranks to step 20: checkpoints at 10 and 20. Ranks forked from this process, as in
    the resizes below: resharding and resuming are the trainer's (the local-cluster runs at the end test what the
    Job does with a rank's exit)."""
    return once_per_session(tmp_path_factory, "four-ranks",
                            lambda run_dir: completed(run_forked(run_dir, 4, "--steps", str(FIRST), *COMMON)).run_dir)


def _losses(run_dir: Path) -> list[float]:
    return [e["loss"] for e in events_named(run_dir, "step")]


@pytest.mark.slow
def test_a_resize_from_4_to_2_to_6_ranks_keeps_the_global_batch_and_takes_every_sample_once(four_ranks, tmp_path):
    """4 ranks to step 20, 2 ranks to 30, 6 ranks to 40, against 2 ranks all the way: each step holds the same
    24 samples, every sample is taken exactly once, and the loss curves agree to float tolerance. Not bitwise:
    the gradient sums are taken in another order (micro-batches, ranks) at each world size."""
    run_dir, unresized = tmp_path / "run", tmp_path / "unresized"
    shutil.copytree(four_ranks, run_dir)
    shrunk = completed(run_forked(run_dir, 2, "--steps", str(THEN), *COMMON))
    grown = completed(run_forked(run_dir, 6, "--steps", str(LAST), *COMMON))
    completed(run_forked(unresized, 2, "--steps", str(LAST), *COMMON))
    resumes = [(e["step"], e["source_kind"], e["saved_world_size"]) for e in events_named(run_dir, "resume")]
    assert resumes[1:] == [(FIRST, "disk", 4), (THEN, "disk", 2)]
    assert [e["keys"] for e in events_named(run_dir, "state_derived")] == [[], [f"rng_rank{r}" for r in range(2, 6)]]
    for run, world, micro_batches in ((shrunk, 2, 6), (grown, 6, 2)):
        assert (f"resharded to {world}: global batch kept at {GLOBAL_BATCH} samples per step "
                f"(training.global_batch_size): {micro_batches} micro-batch(es) of {BATCH} per rank") in run.output
    steps = events_named(run_dir, "step")
    assert [e["step"] for e in steps] == list(range(1, LAST + 1))
    assert {e["tokens"] for e in steps} == {GLOBAL_BATCH * 64}  # the whole global batch at every world size
    # the same samples in each step as without the resizes, every sample exactly once
    resized, reference = samples_by_step(run_dir), samples_by_step(unresized)  # no fault: once each
    assert {s: sorted(ids) for s, ids in resized.items()} == {s: sorted(ids) for s, ids in reference.items()}
    assert sorted(i for ids in resized.values() for i in ids) == list(range(LAST * GLOBAL_BATCH))
    assert _losses(run_dir) == pytest.approx(_losses(unresized), rel=REL_LOSS_TOLERANCE)
    checkpoints = run_dir / "checkpoints"
    assert [s for s, _ in committed_checkpoints(checkpoints)] == [40, 30, 20] and not list(checkpoints.glob("corrupt-*"))
    assert [e["status"] for e in events_named(run_dir, "run_end")] == ["completed"] * 3


@pytest.mark.slow
def test_a_run_whose_checkpoints_cannot_load_refuses_then_starts_over_when_told(four_ranks, tmp_path):
    run_dir = tmp_path / "run"
    shutil.copytree(four_ranks, run_dir)
    for _, path in committed_checkpoints(run_dir / "checkpoints"):
        for shard in _shards(path):
            shard.write_bytes(b"")
    refused = run_forked(run_dir, 2, "--steps", str(THEN), *COMMON)
    assert refused.returncode == CONFIG_ERROR and "refusing to start at step 0" in refused.output, refused.output
    assert len(events_named(run_dir, "step")) == FIRST  # not one step trained from scratch
    fresh = completed(run_forked(run_dir, 2, "--steps", str(THEN), *COMMON, "checkpoint.allow_fresh_start=true"))
    assert "starting at step 0" in fresh.output
    assert [e["step"] for e in events_named(run_dir, "resume")][-1] == 0


def _failed_at_once(run, cause: str) -> None:
    """The Job failed on its first attempt with exit code 3, the rank's cause on the controller's last line."""
    assert run.returncode == 1, run.output[-4000:]
    assert len(events_named(run.run_dir, "attempt_start")) == 1 + 1  # the first run's, and this one: no restart
    assert f"exited with code {CONFIG_ERROR}: the training config or its checkpoints cannot work" in run.output
    last = run.output.strip().splitlines()[-1]
    assert cause in last and last.split("] ", 2)[-1].startswith("the job failed: rank"), run.output[-3000:]
    assert "made no progress" not in run.output


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["injob", "both"])
def test_checkpoints_of_another_model_fail_the_job_at_once_in_every_restart_mode(four_ranks, tmp_path, mode):
    """A changed preset: no restart can load the checkpoints, so none is tried, in-job or in-process."""
    run_dir = tmp_path / "run"
    shutil.copytree(four_ranks, run_dir)
    run = run_local(run_dir, *ClusterShape(nodes=1, nproc_per_node=2).argv(), "--steps", str(THEN), *COMMON,
                    "model.preset=small", f"fault_tolerance.restart={mode}")
    _failed_at_once(run, "step_00000020 is intact but cannot be loaded into this run's model and optimizer "
                         "(ValueError: Size mismatch between saved torch.Size([256, 64]) and current: "
                         "torch.Size([32000, 512])")
    assert [s for s, _ in committed_checkpoints(run_dir / "checkpoints")] == [20, 10]  # left in place
