"""Fencing: a worker of an older generation that keeps running (a node cut off from its peers but not
from the file system, a paused process) can never commit a save with, or over, a newer generation's
checkpoint, nor write into one; the newer checkpoint stays complete and loads exactly."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from training.train.checkpoint.layout import committed_checkpoints, current_generation
from training.train.checkpoint.manager import CheckpointManager
from training_helpers import REPO_ROOT

# Generation 1: saves step 1, then saves step 2 (w = 2.0) late, pausing at POINT until told to go on:
# `commit` before the save starts (its shards and commit come after generation 2 started),
# `write` inside its write of the shards (after generation 2 started, while it saves step 2 itself).
_OLD_GENERATION = r"""
import sys, time
from pathlib import Path
import torch
from training.train.checkpoint.manager import CheckpointManager

directory, point, signals = sys.argv[1], sys.argv[2], Path(sys.argv[3])

def wait_for(name):
    while not (signals / name).exists():
        time.sleep(0.01)

def pause_in_write(step, write):
    if step != 2:
        return write()
    (signals / "old-paused").touch()
    wait_for("old-go")
    try:
        return write()
    finally:
        (signals / "old-wrote").touch()

m = CheckpointManager(directory, mode="sync", keep=3, write_hook=pause_in_write if point == "write" else None)
m.save(1, {"w": torch.full((1024,), 1.0)})
if point == "commit":
    (signals / "old-paused").touch()
    wait_for("old-go")
m.save(2, {"w": torch.full((1024,), 2.0)})
"""


def _wait_for(path: Path, proc: subprocess.Popen, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[1][-2000:]
        time.sleep(0.01)


def _start_old_generation(directory: Path, point: str, signals: Path) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", _OLD_GENERATION, str(directory), point, str(signals)], cwd=REPO_ROOT,
                            env={**os.environ, "PYTHONPATH": str(REPO_ROOT)}, stderr=subprocess.PIPE, text=True)
    _wait_for(signals / "old-paused", proc)
    return proc


def _newest_weights(directory: Path) -> tuple[int, torch.Tensor]:
    target = {"w": torch.zeros(1024)}
    loaded = CheckpointManager(directory, mode="sync", keep=3).load(target)
    assert loaded is not None
    return loaded.step, target["w"]


@pytest.fixture
def signals(tmp_path):
    path = tmp_path / "signals"
    path.mkdir()
    return path


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")  # single-process DCP
def test_a_late_save_of_an_older_generation_never_replaces_a_newer_checkpoint(tmp_path, signals):
    directory = tmp_path / "ckpt"
    old = _start_old_generation(directory, "commit", signals)
    new = CheckpointManager(directory, mode="sync", keep=3)
    assert (new.generation, current_generation(directory)) == (2, 2)
    new.save(2, {"w": torch.full((1024,), 2.5)})  # the newer generation's step 2 (its state differs here)

    (signals / "old-go").touch()  # the old generation wakes up and saves step 2 too
    _, stderr = old.communicate(timeout=60)
    assert old.returncode == 0, stderr[-2000:]
    assert "checkpoint at step 2 failed, nothing made visible" in stderr and "fenced: written by generation 1" in stderr

    step, weights = _newest_weights(directory)
    assert step == 2 and torch.equal(weights, torch.full((1024,), 2.5))
    assert [s for s, _ in committed_checkpoints(directory)] == [2, 1]
    assert not list(directory.glob(".tmp-*"))  # the late save's files are gone


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
def test_a_late_shard_write_never_lands_in_a_newer_generations_save(tmp_path, signals):
    directory = tmp_path / "ckpt"
    old = _start_old_generation(directory, "write", signals)  # paused inside its write of step 2's shards

    def let_the_old_writer_write_first(step, write):
        (signals / "old-go").touch()
        _wait_for(signals / "old-wrote", old)
        return write()

    new = CheckpointManager(directory, mode="sync", keep=3, write_hook=let_the_old_writer_write_first)
    new.save(2, {"w": torch.full((1024,), 2.5)})
    _, stderr = old.communicate(timeout=60)
    assert old.returncode == 0, stderr[-2000:]
    assert "checkpoint at step 2 failed, nothing made visible" in stderr  # its directory was an older generation's

    step, weights = _newest_weights(directory)
    assert step == 2 and torch.equal(weights, torch.full((1024,), 2.5))
    assert not list(directory.glob(".tmp-*"))
