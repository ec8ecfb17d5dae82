"""A process killed in the middle of a checkpoint write leaves the previous checkpoint as the newest
loadable one; the half-written save is invisible and removed by the next manager. A training process
killed while its writer process writes takes the writer with it."""
from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import psutil
import pytest
import torch
import torch.distributed.checkpoint as dcp

from training.train.checkpoint import writer_process
from training.train.checkpoint.layout import committed_checkpoints
from training_helpers import checkpoint_manager, fork_ranks

def _die(*args, **kwargs) -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _saves_then_dies(directory: Path, mode: str, point: str) -> None:
    """Saves step 1, then kills itself (SIGKILL) at `point` of the save of step 2; prints its writer's pid."""
    def die_while_the_writer_writes(step, write):  # async: the writer process is writing step 2's shards
        def watch():
            while True:
                shards = list(m.dir.glob(".tmp-step_00000002.g*/__0_0.distcp"))
                if shards and shards[0].stat().st_size > 0:
                    _die()
                time.sleep(0.001)
        if step == 2:
            threading.Thread(target=watch, daemon=True).start()
        return write()

    writer_process.start_zygote()  # this rank's own, forked while it has one thread
    m = checkpoint_manager(directory, mode=mode, keep=3,
                           write_hook=die_while_the_writer_writes if point == "writing" else None)
    print(m.writer_pid, flush=True)
    m.save(1, {"w": torch.full((4096,), 1.0)})
    m.wait()
    # a forked rank's own classes and module: the test process keeps the real ones
    if point == "finish":  # every shard written, DCP metadata not yet
        dcp.FileSystemWriter.finish = _die
    elif point == "rename":  # metadata and COMMITTED marker written, the commit rename not yet
        os.rename = _die
    m.save(2, {"w": torch.full((4096 if point != "writing" else 64 << 20,), 2.0)})
    m.wait()


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")  # single-process DCP load
@pytest.mark.parametrize("mode, point", [("async", "writing"), ("sync", "finish"), ("sync", "rename")])
def test_killed_mid_save_leaves_previous_checkpoint_newest(tmp_path, mode, point):
    directory = tmp_path / "ckpt"
    [rank] = fork_ranks(lambda _: _saves_then_dies(directory, mode, point), tmp_path / "logs", world=1, timeout=120)
    assert rank.code == -9, rank.output[-2000:]
    if mode == "async":  # the writer process dies with the training process, mid-write
        writer = int(rank.output.split()[0])
        deadline = time.monotonic() + 10
        while psutil.pid_exists(writer) and psutil.Process(writer).status() != psutil.STATUS_ZOMBIE:
            assert time.monotonic() < deadline, f"writer process {writer} outlived its training process"
            time.sleep(0.05)
    assert list(directory.glob(".tmp-step_00000002.g1"))  # the interrupted save's debris
    assert [step for step, _ in committed_checkpoints(directory)] == [1]

    manager = checkpoint_manager(directory, mode="sync", keep=3)
    assert not list(directory.glob(".tmp-*"))  # removed at start
    target = {"w": torch.zeros(4096)}
    step = manager.load(target).step
    assert step == 1 and torch.equal(target["w"], torch.full((4096,), 1.0))
