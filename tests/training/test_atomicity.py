"""A process killed in the middle of a checkpoint write leaves the previous checkpoint as the newest
loadable one; the half-written save is invisible and removed by the next manager. A training process
killed while its writer process writes takes the writer with it."""
from __future__ import annotations

import os
import subprocess
import sys
import time

import psutil
import pytest
import torch

from training.train.checkpoint.layout import committed_checkpoints
from training.train.checkpoint.manager import CheckpointManager
from training_helpers import REPO_ROOT

# Saves step 1, then kills itself (SIGKILL) at the given point of the save of step 2.
_SCRIPT = r"""
import os, signal, sys, threading, time
import torch
import torch.distributed.checkpoint as dcp
from training.train.checkpoint.manager import CheckpointManager

directory, mode, point = sys.argv[1:]

def die(*args, **kwargs):
    os.kill(os.getpid(), signal.SIGKILL)

def die_while_the_writer_writes(step, write):  # async: the writer process is writing step 2's shards
    def watch():
        while True:
            shards = list(m.dir.glob(".tmp-step_00000002.g*/__0_0.distcp"))
            if shards and shards[0].stat().st_size > 0:
                die()
            time.sleep(0.001)
    if step == 2:
        threading.Thread(target=watch, daemon=True).start()
    return write()

m = CheckpointManager(directory, mode=mode, keep=3, write_hook=die_while_the_writer_writes if point == "writing" else None)
print(m.writer_pid, flush=True)
m.save(1, {"w": torch.full((4096,), 1.0)})
m.wait()

if point == "finish":         # every shard written, DCP metadata not yet
    dcp.FileSystemWriter.finish = die
elif point == "rename":       # metadata and COMMITTED marker written, the commit rename not yet
    os.rename = die
m.save(2, {"w": torch.full((4096 if point != "writing" else 64 << 20,), 2.0)})
m.wait()
"""


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")  # single-process DCP load
@pytest.mark.parametrize("mode, point", [("async", "writing"), ("sync", "finish"), ("sync", "rename")])
def test_killed_mid_save_leaves_previous_checkpoint_newest(tmp_path, mode, point):
    directory = tmp_path / "ckpt"
    proc = subprocess.run([sys.executable, "-c", _SCRIPT, str(directory), mode, point], cwd=REPO_ROOT,
                          env={**os.environ, "PYTHONPATH": str(REPO_ROOT)}, capture_output=True, text=True, timeout=120)
    assert proc.returncode == -9, proc.stderr[-2000:]
    if mode == "async":  # the writer process dies with the training process, mid-write
        writer = int(proc.stdout.split()[0])
        deadline = time.monotonic() + 10
        while psutil.pid_exists(writer) and psutil.Process(writer).status() != psutil.STATUS_ZOMBIE:
            assert time.monotonic() < deadline, f"writer process {writer} outlived its training process"
            time.sleep(0.05)
    assert list(directory.glob(".tmp-step_00000002.g1"))  # the interrupted save's debris
    assert [step for step, _ in committed_checkpoints(directory)] == [1]

    manager = CheckpointManager(directory, mode="sync", keep=3)
    assert not list(directory.glob(".tmp-*"))  # removed at start
    target = {"w": torch.zeros(4096)}
    step = manager.load(target).step
    assert step == 1 and torch.equal(target["w"], torch.full((4096,), 1.0))
