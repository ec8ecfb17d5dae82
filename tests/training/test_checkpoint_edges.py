"""The checkpoint directory's edges: a replacement or a deletion cut short by a crash, a full file system."""
from __future__ import annotations

import contextlib
import errno
import logging
import os
import shutil
import signal
import threading
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import CheckpointException

from training.contract.events import EventLog
from training.contract.launcher import resume_step_file
from training.train.checkpoint import layout
from training.train.checkpoint.layout import committed_checkpoints, out_of_space
from training.train.checkpoint.manager import CheckpointManager
from training.train.metrics import RunCollector
from training_helpers import REPO_ROOT, checkpoint_manager, events_named, fork_ranks

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")

def _replaces_and_dies(directory: Path) -> None:
    """Saves steps 1 and 2, then saves step 2 again (a resume from step 1 trained it again) and dies
    (SIGKILL) as the commit renames the new save in, after the old checkpoint made way for it."""
    m = checkpoint_manager(directory, mode="sync", keep=3)
    for step in (1, 2):
        m.save(step, {"w": torch.full((64,), float(step))})
    real_rename = os.rename

    def rename(src, dst):
        if os.path.basename(str(src)).startswith(".tmp-"):
            os.kill(os.getpid(), signal.SIGKILL)
        real_rename(src, dst)

    os.rename = rename  # a forked rank's own module: the test process keeps the real one
    m.save(2, {"w": torch.full((64,), 20.0)})


def _manager(tmp_path, keep: int = 3) -> CheckpointManager:
    return checkpoint_manager(tmp_path / "ckpt", mode="sync", keep=keep, events=EventLog(tmp_path, "rank0"))


def _steps(directory) -> list[int]:
    return [step for step, _ in committed_checkpoints(directory)]


def test_a_crash_while_a_checkpoint_is_replaced_keeps_one_of_the_two(tmp_path):
    directory = tmp_path / "ckpt"
    [rank] = fork_ranks(lambda _: _replaces_and_dies(directory), tmp_path / "logs", world=1, timeout=120)
    assert rank.code == -9, rank.output[-2000:]
    manager = _manager(tmp_path)  # the next worker group
    assert _steps(directory) == [2, 1]
    target = {"w": torch.zeros(64)}
    assert manager.load(target).step == 2 and torch.equal(target["w"], torch.full((64,), 2.0))  # the old one
    assert not [p.name for p in directory.iterdir() if p.name.startswith(".")]


def test_a_replaced_checkpoint_holds_the_new_save(tmp_path):
    m = _manager(tmp_path)
    m.save(2, {"w": torch.full((64,), 2.0)})
    m.save(2, {"w": torch.full((64,), 20.0)})
    target = {"w": torch.zeros(64)}
    assert _manager(tmp_path).load(target).step == 2 and torch.equal(target["w"], torch.full((64,), 20.0))
    assert not [p.name for p in m.dir.iterdir() if p.name.startswith(".replaced-")]


def test_an_interrupted_deletion_is_invisible_and_finished_later(tmp_path, monkeypatch, caplog):
    m = _manager(tmp_path, keep=1)
    m.save(1, {"w": torch.zeros(64)})
    # a prune before this version deleted in place: a step_N that lost its marker, and shards
    leftover = m.dir / "step_00000000"
    shutil.copytree(committed_checkpoints(m.dir)[0][1], leftover)
    (leftover / "COMMITTED").unlink()
    real_rmtree = shutil.rmtree

    def cut_short(path, *args, **kwargs):  # a deletion that stops after one file (an I/O error, a crash)
        os.unlink(min(e.path for e in os.scandir(path) if e.is_file()))
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(shutil, "rmtree", cut_short)
    caplog.set_level(logging.WARNING)
    m.save(2, {"w": torch.ones(64)})  # prunes step 1 (keep=1); the deletion fails half-way
    assert _steps(m.dir) == [2]
    m.close()  # the deletion runs in a thread of its own: close waits for it
    assert any("cannot delete" in r.getMessage() for r in caplog.records)
    monkeypatch.setattr(shutil, "rmtree", real_rmtree)
    _manager(tmp_path, keep=1)  # the next worker group finishes both
    assert sorted(p.name for p in m.dir.iterdir() if p.is_dir()) == ["step_00000002"]


def test_a_slow_deletion_of_a_pruned_checkpoint_does_not_hold_the_training_thread(tmp_path, monkeypatch):
    m = _manager(tmp_path, keep=1)
    m.save(1, {"w": torch.zeros(64)})
    release = threading.Event()
    real_rmtree = shutil.rmtree

    def slow_rmtree(path, *args, **kwargs):  # a file system that takes its time to free a big shard
        if os.path.exists(path):
            release.wait(30)
        real_rmtree(path, *args, **kwargs)

    monkeypatch.setattr(shutil, "rmtree", slow_rmtree)
    m.save(2, {"w": torch.ones(64)})  # commits, prunes step 1: returns while its deletion is held
    assert _steps(m.dir) == [2]  # invisible at once
    assert sorted(p.name for p in m.dir.iterdir() if p.is_dir()) == [".pruned-step_00000001", "step_00000002"]
    release.set()
    m.close()  # waits for the deletion
    assert sorted(p.name for p in m.dir.iterdir() if p.is_dir()) == ["step_00000002"]


def test_a_full_file_system_is_loud(tmp_path, monkeypatch, caplog):
    def no_space(*args, **kwargs):
        raise CheckpointException("save failed", {1: (OSError(errno.ENOSPC, "No space left on device"), None)})

    m = _manager(tmp_path)
    monkeypatch.setattr(dcp, "save", no_space)
    caplog.set_level(logging.ERROR)
    m.save(5, {"w": torch.zeros(64)})
    [event] = events_named(tmp_path, "ckpt_no_space")
    assert event["step"] == 5 and event["path"] == str(m.dir) and "No space left on device" in event["error"]
    assert isinstance(event["free_bytes"], int)
    assert any(str(m.dir) in r.getMessage() and "is full" in r.getMessage() for r in caplog.records)
    metrics = {s.name: s.value for family in RunCollector(tmp_path, 0.0).collect() for s in family.samples}
    assert metrics.get("training_checkpoints_failed_no_space") is None  # no step yet: nothing to say
    EventLog(tmp_path, "rank0").emit("step", step=5, loss=1.0, step_time_s=1.0, tokens=1)
    metrics = {s.name: s.value for family in RunCollector(tmp_path, 0.0).collect() for s in family.samples}
    assert metrics["training_checkpoints_failed_no_space"] == 1 == metrics["training_checkpoints_failed"]


@pytest.mark.parametrize("err, full", [
    (OSError(errno.ENOSPC, "No space left on device"), True),
    (OSError(errno.EDQUOT, "Disk quota exceeded"), True),
    (CheckpointException("x", {3: (OSError(errno.EDQUOT, "quota"), None)}), True),
    (CheckpointException("x", {0: OSError(errno.EIO, "Input/output error")}), False),
    (RuntimeError("wrapped"), False),
])
def test_out_of_space_is_told_from_other_failures(err, full):
    assert out_of_space(err) is full


def test_a_chained_no_space_error_counts():
    try:
        try:
            raise OSError(errno.ENOSPC, "No space left on device")
        except OSError as cause:
            raise RuntimeError("write failed") from cause
    except RuntimeError as err:
        assert out_of_space(err)
    assert layout.free_bytes(REPO_ROOT) > 0


class _Group:
    writes_checkpoints = True


def test_the_manager_saves_every_interval_inside_its_section_and_a_group_not_elected_advances_progress(tmp_path):
    """The loop calls step_done after every step: the manager saves the interval's steps, each inside
    around_save (NVRx's checkpoint section), and with replica groups only the elected group writes; the other
    advances ft_launcher's progress file past the step, which a live group holds."""
    sections: list[int] = []
    state = {"w": torch.zeros(4)}
    manager = checkpoint_manager(tmp_path / "ckpt", mode="sync", keep=5, interval=3, save_final=True,
                                 around_save=lambda: _counted(sections))
    group = _Group()
    manager.shared_by(group)
    for step in range(1, 8):
        state["w"].fill_(step)
        group.writes_checkpoints = step < 5
        manager.step_done(step, state)
    manager.close(final=state)
    assert _steps(tmp_path / "ckpt") == [3]  # step 6's save was another group's
    assert resume_step_file(tmp_path / "ckpt").read_text().strip() == "7"
    assert len(sections) == 3  # steps 3 and 6, and the close
    final = {"w": torch.zeros(4)}
    dcp.load(final, checkpoint_id=tmp_path / "final")
    assert torch.equal(final["w"], torch.full((4,), 7.0))


@contextlib.contextmanager
def _counted(sections: list[int]):
    sections.append(1)
    yield
