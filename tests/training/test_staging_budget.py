"""Async saves' staging buffers against the node's limits: a /dev/shm that is really full (a small tmpfs mounted
over it in a private mount namespace) and a low RLIMIT_NOFILE, each in a forked rank whose death the test sees.
The rank must survive both: the save fails with a line that names the limit and the knob, or the limit is lifted."""
from __future__ import annotations

import ctypes
import os
import resource
import subprocess
from pathlib import Path

import pytest
import torch

from training.contract.events import EventLog, read_events
from training.train.checkpoint import writer_process
from training.train.checkpoint.staging import BY_VALUE_BYTES
from training.train.checkpoint.shm_budget import StagingBudgetError, raise_fd_limit
from training_helpers import checkpoint_manager, completed_ranks, fork_ranks

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
_CLONE_NEWNS = 0x00020000  # unshare(2)


def _full_dev_shm() -> None:
    """This process's /dev/shm becomes a 1 MiB tmpfs, its own (the test machine's stays as it is)."""
    assert ctypes.CDLL(None, use_errno=True).unshare(_CLONE_NEWNS) == 0, "unshare(CLONE_NEWNS) needs root"
    subprocess.run(["mount", "--make-rprivate", "/"], check=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", "/dev/shm"], check=True)


def _saves(run_dir: Path, state: dict[str, torch.Tensor], step: int = 1) -> None:
    writer_process.start_zygote()  # this child's own (one thread: forked)
    m = checkpoint_manager(run_dir / "ckpt", mode="async", keep=2, events=EventLog(run_dir, "rank0"))
    m.prepare(state)
    m.wait_for_writer()
    m.save(step, state)
    m.wait()
    m.close()


def test_a_full_dev_shm_fails_the_save_not_the_rank(tmp_path):
    def rank() -> None:
        _full_dev_shm()
        _saves(tmp_path, {"w": torch.ones(1 << 20)})  # 4 MiB to stage in 1 MiB

    completed_ranks(fork_ranks(lambda _: rank(), tmp_path / "logs", world=1))
    failed = [e for e in read_events(tmp_path) if e["event"] == "ckpt_failed"]
    assert len(failed) == 1 and "does not fit in /dev/shm" in failed[0]["error"], failed  # was torch's own line
    assert "checkpoint.mode=sync" in failed[0]["error"]


def _many_tensors(count: int = 300) -> dict[str, torch.Tensor]:
    """`count` tensors that each take a shared buffer (1b's state: about 340 of its 590 tensors)."""
    return {f"t{i}": torch.full((BY_VALUE_BYTES // 4,), float(i)) for i in range(count)}


def test_a_low_soft_fd_limit_is_lifted_for_the_save(tmp_path):
    def rank() -> None:
        hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
        resource.setrlimit(resource.RLIMIT_NOFILE, (512, hard))  # a container's 1024, scaled to this state
        _saves(tmp_path, _many_tensors())

    completed_ranks(fork_ranks(lambda _: rank(), tmp_path / "logs", world=1))
    events = [e["event"] for e in read_events(tmp_path)]
    assert "ckpt_committed" in events and "ckpt_failed" not in events, events  # was: MSG_CTRUNC, ckpt_failed


def test_a_hard_fd_limit_too_low_for_the_state_is_refused_in_one_line(tmp_path):
    refusal = tmp_path / "refusal"

    def rank() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (512, 512))
        try:
            _saves(tmp_path, _many_tensors())
        except StagingBudgetError as err:
            refusal.write_text(str(err))

    completed_ranks(fork_ranks(lambda _: rank(), tmp_path / "logs", world=1))
    line = refusal.read_text()
    assert "\n" not in line and "RLIMIT_NOFILE" in line and "300 staged tensors" in line and "512" in line


def test_saves_go_on_with_more_than_1024_descriptors_open(tmp_path):
    """With the limit lifted a rank may hold more descriptors than select(2)'s FD_SETSIZE (1024): the writer
    process's handle must still watch its process (select.select refuses a descriptor past it)."""
    def rank() -> None:
        raise_fd_limit()  # as the rank's staging does before it allocates its buffers
        held = [os.dup(0) for _ in range(1100)]  # the state's buffers, as many as 8b's take
        try:
            _saves(tmp_path, {"w": torch.ones(16)})
        finally:
            for fd in held:
                os.close(fd)

    completed_ranks(fork_ranks(lambda _: rank(), tmp_path / "logs", world=1))
    assert "ckpt_committed" in [e["event"] for e in read_events(tmp_path)]


def test_small_tensors_cost_no_descriptor(tmp_path):
    """AdamW's step counters and the norms' shards go by value: 150 large tensors and 300 small ones fit a hard
    limit that 450 buffers would not."""
    def rank() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (512, 512))
        state = {**_many_tensors(150), **{f"step{i}": torch.tensor(float(i)) for i in range(300)}}
        _saves(tmp_path, state)
        m = checkpoint_manager(tmp_path / "ckpt", mode="async", keep=2, events=EventLog(tmp_path, "rank0"))
        loaded = {k: torch.zeros_like(v) for k, v in state.items()}
        assert m.load(loaded).step == 1 and all(torch.equal(loaded[k], v) for k, v in state.items())

    # was refused (or, before the refusal, a truncated message: ckpt_failed)
    completed_ranks(fork_ranks(lambda _: rank(), tmp_path / "logs", world=1))
    assert "ckpt_committed" in [e["event"] for e in read_events(tmp_path)]
