"""Fencing: a worker of an older generation that keeps running (a node cut off from its peers but not
from the file system, a paused process) can never commit a save with, or over, a newer generation's
checkpoint, nor write into one; the newer checkpoint stays complete and loads exactly."""
from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

from training.train.checkpoint.layout import committed_checkpoints, current_generation
from training_helpers import checkpoint_manager

_PAUSE_S = 30  # longest a test waits for the other generation
_FAILED = "checkpoint at step 2 failed, nothing made visible"


class _OldGeneration:
    """Generation 1 (sync, or async through its writer process) in this process, as a worker that kept
    running would be in another: it saved step 1; `save_step_2_late` saves step 2 (w = 2.0) after
    generation 2 started. With `pause_in_write`, its write of step 2's shards waits for `go` (while
    generation 2 saves step 2 itself) and sets `wrote` once it has written."""

    def __init__(self, directory: Path, mode: str, pause_in_write: bool) -> None:
        self.paused, self.go, self.wrote = threading.Event(), threading.Event(), threading.Event()
        self.manager = checkpoint_manager(directory, mode=mode, keep=3,
                                          write_hook=self._pause_in_write if pause_in_write else None)
        self.manager.save(1, {"w": torch.full((1024,), 1.0)})
        self.manager.wait()

    def _pause_in_write(self, step, write):  # noqa: ANN001, ANN202 (a WriteHook)
        if step != 2:
            return write()
        self.paused.set()
        assert self.go.wait(_PAUSE_S)
        try:
            return write()
        finally:
            self.wrote.set()

    def save_step_2_late(self) -> None:
        self.manager.save(2, {"w": torch.full((1024,), 2.0)})
        self.manager.close()  # async: the commit of step 2 is tried here


def _newest_weights(directory: Path) -> tuple[int, torch.Tensor]:
    target = {"w": torch.zeros(1024)}
    loaded = checkpoint_manager(directory, mode="sync", keep=3).load(target)
    assert loaded is not None
    return loaded.step, target["w"]


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")  # single-process DCP
@pytest.mark.parametrize("old_mode", ["sync", "async"])
def test_a_late_save_of_an_older_generation_never_replaces_a_newer_checkpoint(tmp_path, caplog, old_mode):
    directory = tmp_path / "ckpt"
    old = _OldGeneration(directory, old_mode, pause_in_write=False)
    new = checkpoint_manager(directory, mode="sync", keep=3)
    assert (new.generation, current_generation(directory)) == (2, 2)
    new.save(2, {"w": torch.full((1024,), 2.5)})  # the newer generation's step 2 (its state differs here)

    old.save_step_2_late()  # the old generation wakes up and saves step 2 too
    assert _FAILED in caplog.text and "fenced: written by generation 1" in caplog.text

    step, weights = _newest_weights(directory)
    assert step == 2 and torch.equal(weights, torch.full((1024,), 2.5))
    assert [s for s, _ in committed_checkpoints(directory)] == [2, 1]
    assert not list(directory.glob(".tmp-*"))  # the late save's files are gone


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
@pytest.mark.parametrize("old_mode", ["sync", "async"])
def test_a_late_shard_write_never_lands_in_a_newer_generations_save(tmp_path, caplog, old_mode):
    directory = tmp_path / "ckpt"
    old = _OldGeneration(directory, old_mode, pause_in_write=True)
    late = threading.Thread(target=old.save_step_2_late)
    late.start()
    assert old.paused.wait(_PAUSE_S)  # inside its write of step 2's shards

    def let_the_old_writer_write_first(step, write):
        old.go.set()
        assert old.wrote.wait(_PAUSE_S)
        return write()

    new = checkpoint_manager(directory, mode="sync", keep=3, write_hook=let_the_old_writer_write_first)
    new.save(2, {"w": torch.full((1024,), 2.5)})
    late.join(_PAUSE_S)
    assert not late.is_alive() and _FAILED in caplog.text  # its directory was an older generation's

    step, weights = _newest_weights(directory)
    assert step == 2 and torch.equal(weights, torch.full((1024,), 2.5))
    assert not list(directory.glob(".tmp-*"))
