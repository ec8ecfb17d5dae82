"""The checkpoint manager's collective decisions on two gloo ranks: with when_busy=skip, a rank that
sees a save finish later than its peer must still take the same save/skip decision at the same
call, or the ranks' collectives pair up wrongly (a hang, or garbage decisions)."""
from __future__ import annotations

import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

import training.train.checkpoint.manager as manager
from training.contract.config import CheckpointConfig
from training.train.checkpoint.layout import committed_checkpoints, start_generation
from training.train.checkpoint.writers import _TorchAsyncWriter
from training_helpers import checkpoint_manager, completed_ranks, fork_ranks

def _gloo(timeout_s: float) -> int:
    dist.init_process_group("gloo", timeout=timedelta(seconds=timeout_s))
    return dist.get_rank()


def _skipping_saves(directory: Path) -> None:
    """Each rank saves at every step (its own tensor, full of the step number), with a training step's
    all-reduce in between; rank 1 sees each finished save only at its third non-blocking check, two
    polls after rank 0 (which commits as soon as it sees it)."""
    rank = _gloo(10)
    if rank == 1:
        real_done, checks = _TorchAsyncWriter.done, {}

        def late_done(self, blocking):
            finished = real_done(self, blocking)
            if blocking or not finished:
                return finished
            checks[self._future] = checks.get(self._future, 0) + 1
            return checks[self._future] >= 3

        _TorchAsyncWriter.done = late_done  # a forked rank's own class: the test process keeps the real one
    m = checkpoint_manager(directory, mode="async", keep=10, when_busy="skip")
    for step in range(1, 7):
        m.poll()
        m.save(step, {f"w{rank}": torch.full((4,), float(step))})
        dist.all_reduce(torch.ones(1))  # the training step
        while not m._writer._future.done():  # each save's write ends within a step
            time.sleep(0.01)
    m.close()
    dist.destroy_process_group()


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")  # single-process DCP load
def test_skip_when_busy_is_one_decision_of_all_ranks(tmp_path):
    directory = tmp_path / "ckpt"
    completed_ranks(fork_ranks(lambda _: _skipping_saves(directory), tmp_path / "logs"))
    # saves 2, 4, 6 skipped on both ranks: rank 1 still had the previous one in flight
    assert [step for step, _ in committed_checkpoints(directory)] == [5, 3, 1]
    for step, path in committed_checkpoints(directory):
        state = {"w0": torch.zeros(4), "w1": torch.zeros(4)}
        dcp.load(state, checkpoint_id=path)
        assert all(torch.equal(t, torch.full((4,), float(step))) for t in state.values())


def _fenced_second_save(directory: Path, mode: str) -> None:
    """Rank 0's commit (rename, resume_step, prune) is slowed; after the first save a newer worker group
    starts (GENERATION moves on), so the second save is fenced. Each rank prints when `wait` returned and
    what it counts as saved."""
    rank = _gloo(20)
    real_commit = manager.commit

    def slow_commit(*args, **kwargs):
        time.sleep(1.5)
        try:
            return real_commit(*args, **kwargs)
        finally:
            print("commit-ended", time.monotonic(), flush=True)

    manager.commit = slow_commit  # a forked rank's own module: the test process keeps the real one
    m = manager.CheckpointManager(CheckpointConfig(dir=str(directory), mode=mode, keep=10), directory.parent)
    for step in (1, 2):
        if step == 2 and rank == 0:
            start_generation(directory)  # a newer worker group started: this save must not commit
        dist.barrier()
        m.save(step, {f"w{rank}": torch.full((4,), float(step))})
        m.wait()
        print("wait-returned", time.monotonic(), "saved", m.saved_step, flush=True)
    m.close()
    dist.destroy_process_group()


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_every_rank_learns_the_commits_outcome_before_it_goes_on(tmp_path, mode):
    """No rank returns from a save (a drain: leaves the process) while rank 0 may still be committing,
    and a fenced save is not counted as saved on any rank."""
    directory = tmp_path / "ckpt"
    outputs = completed_ranks(fork_ranks(lambda _: _fenced_second_save(directory, mode), tmp_path / "logs"))
    lines = [[line.split() for line in out.splitlines() if line.startswith(("commit-ended", "wait-returned"))]
             for out in outputs]
    commits_ended = [float(words[1]) for words in lines[0] if words[0] == "commit-ended"]
    returned = [[(float(words[1]), words[3]) for words in rank_lines if words[0] == "wait-returned"]
                for rank_lines in lines]
    for rank_returned in returned:  # after rank 0's commit of that save ended, on every rank
        assert all(at >= ended for (at, _), ended in zip(rank_returned, commits_ended, strict=True))
    for rank_returned in returned:  # step 2 was fenced: still step 1 on every rank
        assert [saved for _, saved in rank_returned] == ["1", "1"]
    assert [step for step, _ in committed_checkpoints(directory)] == [1]
