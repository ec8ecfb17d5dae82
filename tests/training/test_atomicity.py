"""A process killed in the middle of a checkpoint write leaves the previous checkpoint as the newest
loadable one; the half-written save is invisible and removed by the next manager."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from training.train.checkpoint.layout import committed_checkpoints
from training.train.checkpoint.manager import CheckpointManager
from training_helpers import REPO_ROOT

# Saves step 1, then kills itself (SIGKILL) at the given point of the save of step 2.
_SCRIPT = r"""
import os, signal, sys
import torch
import torch.distributed.checkpoint as dcp
from training.train.checkpoint.manager import CheckpointManager

directory, mode, point = sys.argv[1:]
m = CheckpointManager(directory, mode=mode, keep=3)
m.save(1, {"w": torch.full((4096,), 1.0)})
m.wait()

def die(*args, **kwargs):
    os.kill(os.getpid(), signal.SIGKILL)

if point == "write_data":     # shards half written (in async mode: in the background thread)
    real = dcp.FileSystemWriter.write_data
    def partial_write(self, plan, planner):
        tmp = m.dir / f".tmp-step_00000002.g{m.generation}"
        tmp.mkdir(exist_ok=True)
        (tmp / "__0_0.distcp").write_bytes(b"half")
        die()
    dcp.FileSystemWriter.write_data = partial_write
elif point == "finish":       # every shard written, DCP metadata not yet
    dcp.FileSystemWriter.finish = die
elif point == "rename":       # metadata and COMMITTED marker written, the commit rename not yet
    os.rename = die
m.save(2, {"w": torch.full((4096,), 2.0)})
m.wait()
"""


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")  # single-process DCP load
@pytest.mark.parametrize("mode, point", [("async", "write_data"), ("sync", "finish"), ("sync", "rename")])
def test_killed_mid_save_leaves_previous_checkpoint_newest(tmp_path, mode, point):
    directory = tmp_path / "ckpt"
    proc = subprocess.run([sys.executable, "-c", _SCRIPT, str(directory), mode, point], cwd=REPO_ROOT,
                          env={**os.environ, "PYTHONPATH": str(REPO_ROOT)}, capture_output=True, text=True, timeout=120)
    assert proc.returncode == -9, proc.stderr[-2000:]
    assert list(directory.glob(".tmp-step_00000002.g1"))  # the interrupted save's debris
    assert [step for step, _ in committed_checkpoints(directory)] == [1]

    manager = CheckpointManager(directory, mode="sync", keep=3)
    assert not list(directory.glob(".tmp-*"))  # removed at start
    target = {"w": torch.zeros(4096)}
    step = manager.load(target).step
    assert step == 1 and torch.equal(target["w"], torch.full((4096,), 1.0))
