"""Single-process checks of the components: model presets, the data stream, the checkpoint manager."""
from __future__ import annotations

import contextlib
import dataclasses
import errno
import json
import os
import signal
import threading
import time
from multiprocessing.reduction import ForkingPickler
from pathlib import Path

import numpy as np
import psutil
import pytest
import torch

from training.contract.config import (MODEL_PRESETS, DataConfig, TrainConfigError, TrainingConfig,
                                      load_train_config)
from training.contract.events import EventLog, read_events
from training.contract.job_failure import JobMustFail, requests_dir
from training.contract.launcher import free_port, resume_step_file
from training.contract.shapes import PRESETS
from training.data.stream import TokenStream, write_token_file
from training.models.llama import build_model
from training.models.spec import model_spec
from training.train.checkpoint import manager, writer_process
from training.train.checkpoint.layout import committed_checkpoints
from training.train import trainer
from training.train.checkpoint.writers import _NvrxAsyncWriter
from training.train.distributed import DistInfo, init_distributed
from training.train.faults import FaultInjected
from training.train.optimizer_step import OptimizerStep
from training.train.trainer import build, lr_at, run
from nvrx_fakes import FakeQueue, fake_nvrx  # noqa: F401 (a fixture)
from training_helpers import checkpoint_manager, fork_rank, fork_ranks

# DCP without a process group (these single-process checks) says so in a warning each time.
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


def test_presets_and_forward():
    assert tuple(PRESETS) == MODEL_PRESETS
    n_8b = sum(p.numel() for p in build_model("8b").parameters())  # meta device: no memory
    assert 7.9e9 < n_8b < 8.1e9
    model = build_model("tiny", "cpu")
    model.init_weights(0)
    logits = model(torch.randint(0, 256, (2, 16)))
    assert logits.shape == (2, 16, 256)
    # causal: the first position's output does not depend on later tokens
    tokens = torch.randint(0, 256, (1, 16))
    changed = tokens.clone()
    changed[0, 8:] = (changed[0, 8:] + 1) % 256
    assert torch.allclose(model(tokens)[0, :8], model(changed)[0, :8], atol=1e-6)


def _stream(rank, world=2, rows=1, path=None):
    return TokenStream(TrainingConfig(seq_len=16, batch_size=3, seed=7), DataConfig(path=path), rank=rank,
                       world_size=world, vocab_size=256, rows=rows)


def test_stream_slices_are_disjoint_deterministic_and_resumable():
    a, b = _stream(0), _stream(1)
    [first_a], [first_b] = a.next_step(), b.next_step()
    assert first_a.indices == [0, 1, 2] and first_b.indices == [3, 4, 5]
    assert torch.equal(first_a.inputs[:, 1:], first_a.targets[:, :-1])
    again = _stream(0)
    assert torch.equal(again.next_step()[0].inputs, first_a.inputs)
    resumed = _stream(1)
    resumed.load_state_dict(b.state_dict())
    assert resumed.next_step()[0].indices == [9, 10, 11] == b.next_step()[0].indices


def _steps(world: int, accumulation_steps: int, steps: int, position: dict[str, int]) -> list[list[int]]:
    """The sample ids of each of `steps` optimizer steps (all ranks, all micro-batches) from `position`."""
    streams = [_stream(r, world, rows=accumulation_steps) for r in range(world)]
    for s in streams:
        s.load_state_dict(position)
    held = [[i for s in streams for batch in s.next_step() for i in batch.indices] for _ in range(steps)]
    position.update(streams[0].state_dict())
    assert all(s.state_dict() == position for s in streams)  # every rank agrees on the global position
    return held


def test_a_global_batch_kept_across_4_2_6_ranks_holds_the_same_samples_each_step_and_each_once():
    """Global batch 36 = 4 ranks x 3 x 3 = 2 x 6 x 3 = 6 x 2 x 3 (ranks x micro-batches x batch_size)."""
    position = {"consumed_samples": 0}
    resized = _steps(4, 3, 2, position) + _steps(2, 6, 2, position) + _steps(6, 2, 2, position)
    unresized = _steps(2, 6, 6, {"consumed_samples": 0})
    assert [sorted(step) for step in resized] == [sorted(step) for step in unresized]
    assert [len(step) for step in resized] == [36] * 6
    assert sorted(i for step in resized for i in step) == list(range(6 * 36))  # each sample exactly once
    assert position == {"consumed_samples": 6 * 36}


def test_a_ranks_micro_batches_are_its_contiguous_share_of_the_step():
    s = _stream(1, world=2, rows=2)
    assert [b.indices for b in s.next_step()] == [[6, 7, 8], [9, 10, 11]]
    assert [b.indices for b in s.next_step()] == [[18, 19, 20], [21, 22, 23]]


def test_stream_from_token_file(tmp_path):
    path = write_token_file(tmp_path / "corpus.bin", n_tokens=2000, vocab_size=256)
    assert np.fromfile(path, dtype=np.uint16).size == 2000
    s = _stream(0, path=str(path))
    [batch] = s.next_step()
    tokens = np.fromfile(path, dtype=np.uint16).astype(np.int64)
    assert batch.inputs[1].tolist() == tokens[16:32].tolist()


def _manager(tmp_path, mode="sync", **kw):
    return checkpoint_manager(tmp_path / "ckpt", mode=mode, keep=2, events=EventLog(tmp_path, "rank0"), **kw)


def _events(tmp_path, name):
    return [e for e in read_events(tmp_path) if e["event"] == name]


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_save_commit_prune_and_load(tmp_path, mode):
    m = _manager(tmp_path, mode)
    for step in (1, 2, 3):
        m.save(step, {"w": torch.full((8,), float(step))})
        m.wait()
    assert [s for s, _ in committed_checkpoints(m.dir)] == [3, 2]  # keep=2
    assert not list(m.dir.glob(".tmp-*"))
    assert resume_step_file(m.dir).read_text() == "4\n"
    target = {"w": torch.zeros(8)}
    assert m.load(target).step == 3 and torch.equal(target["w"], torch.full((8,), 3.0))
    assert [e["step"] for e in _events(tmp_path, "ckpt_committed")] == [1, 2, 3]
    assert len(_events(tmp_path, "ckpt_blocked")) == 3
    m.close()


@pytest.mark.parametrize("when_busy", ["skip", "wait"])
def test_async_save_overlaps_and_at_most_one_in_flight(tmp_path, when_busy):
    release = threading.Event()

    def held_write(step, write):  # this rank's write of its shards, held until released
        release.wait(10)
        return write()

    m = _manager(tmp_path, "async", when_busy=when_busy, write_hook=held_write)
    m.save(1, {"w": torch.ones(4)})  # returns while the write is held: training goes on
    assert committed_checkpoints(m.dir) == []
    if when_busy == "wait":
        threading.Timer(0.5, release.set).start()
    m.save(2, {"w": torch.ones(4)})  # skip: dropped at once; wait: blocks until save 1 is committed
    release.set()
    m.wait()
    blocked = {e["step"]: e["seconds"] for e in _events(tmp_path, "ckpt_blocked")}
    if when_busy == "skip":
        assert [s for s, _ in committed_checkpoints(m.dir)] == [1]
        assert list(blocked) == [1]
    else:
        assert [s for s, _ in committed_checkpoints(m.dir)] == [2, 1]
        assert blocked[2] >= 0.4 > blocked[1]
    m.close()


def _disk_full_at(failing_step):
    def hook(step, write):
        if step == failing_step:
            raise OSError(errno.ENOSPC, "No space left on device")
        return write()
    return hook


def _shard_path_taken_at(failing_step):
    """A directory where the writer's shard file goes: the write itself fails (async: in the writer process)."""
    def hook(step, write):
        if step == failing_step:
            for tmp in Path(hook.dir).glob(f".tmp-step_{step:08d}.g*"):
                (tmp / "__0_0.distcp").mkdir()
        return write()
    return hook


@pytest.mark.parametrize("mode", ["sync", "async"])
@pytest.mark.parametrize("failure, error", [
    (_disk_full_at, "rank 0: OSError: [Errno 28] No space left on device"),
    (_shard_path_taken_at, "rank 0: IsADirectoryError: [Errno 21] Is a directory: "),
])
def test_failed_save_leaves_nothing_visible_and_training_goes_on(tmp_path, mode, failure, error):
    hook = failure(2)
    hook.dir = tmp_path / "ckpt"
    m = _manager(tmp_path, mode, write_hook=hook)
    m.save(1, {"w": torch.ones(4)})
    m.wait()
    m.save(2, {"w": torch.ones(4)})  # no exception escapes (async: it fails in the background)
    m.wait()
    assert [s for s, _ in committed_checkpoints(m.dir)] == [1]
    assert not list(m.dir.glob(".tmp-*"))
    [failed] = _events(tmp_path, "ckpt_failed")
    assert failed["step"] == 2 and failed["error"].startswith(error)
    m.save(3, {"w": torch.ones(4)})
    m.wait()
    assert [s for s, _ in committed_checkpoints(m.dir)] == [3, 1]
    m.close()


# ---- the writer process (async saves on CPU) ------------------------------------------------------

_BIG = 16 << 20  # floats: a 64 MiB shard, long enough to write that a kill lands mid-write


def _kill_when_shard_appears(pids, directory):
    """A write hook that SIGKILLs the writer process (pids[0]) once its shard file holds bytes."""
    def hook(step, write):
        def kill_mid_write():
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                shards = list(directory.glob(f".tmp-step_{step:08d}.g*/__0_0.distcp"))
                if shards and shards[0].stat().st_size > 0:
                    os.kill(pids[0], signal.SIGKILL)
                    return
                time.sleep(0.001)

        if step == 2:
            threading.Thread(target=kill_mid_write, daemon=True).start()
        return write()
    return hook


def test_writer_process_killed_mid_write_fails_the_save_and_the_next_save_gets_a_new_one(tmp_path):
    pids: list[int] = []
    m = _manager(tmp_path, "async", write_hook=_kill_when_shard_appears(pids, tmp_path / "ckpt"))
    pids.append(m.writer_pid)
    m.save(1, {"w": torch.full((_BIG,), 1.0)})
    m.wait()
    m.save(2, {"w": torch.full((_BIG,), 2.0)})
    m.wait()
    [failed] = _events(tmp_path, "ckpt_failed")
    assert failed["step"] == 2 and "WriterProcessDied: checkpoint writer process" in failed["error"]
    assert [s for s, _ in committed_checkpoints(m.dir)] == [1] and not list(m.dir.glob(".tmp-*"))
    m.save(3, {"w": torch.full((_BIG,), 3.0)})
    m.wait()
    assert m.writer_pid != pids[0]  # a new writer process wrote step 3
    target = {"w": torch.zeros(_BIG)}
    assert m.load(target).step == 3 and torch.equal(target["w"], torch.full((_BIG,), 3.0))
    m.close()


def test_abort_kills_the_writer_process_and_its_save_never_commits(tmp_path):
    """An in-process restart or a dead iteration aborts the manager mid-write: its writer process is
    gone at once and the save stays an uncommitted .tmp- dir, removed by the next generation."""
    writing = threading.Event()

    def signal_writing(step, write):
        writing.set()
        return write()

    m = _manager(tmp_path, "async", write_hook=signal_writing)
    pid = m.writer_pid
    m.save(1, {"w": torch.full((_BIG,), 1.0)})
    assert writing.wait(30)
    m.abort()
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    time.sleep(0.5)  # a writer that outlived the abort would commit within this
    assert committed_checkpoints(m.dir) == []
    assert not _events(tmp_path, "ckpt_committed")
    again = _manager(tmp_path, "async")
    assert again.generation == 2 and not list(again.dir.glob(".tmp-*"))
    again.save(1, {"w": torch.ones(4)})
    again.close()
    assert [s for s, _ in committed_checkpoints(again.dir)] == [1]


def test_the_writer_process_is_out_of_reach_of_a_signal_to_the_ranks_process_group(tmp_path):
    """ft_launcher stops, and a drain signals, a rank with SIGTERM to its process group (os.killpg): the
    write a drain waits to commit must not get it."""
    m = _manager(tmp_path, "async")
    assert os.getpgid(m.writer_pid) != os.getpgid(0)


def _rank_with_zygote(directory: Path, pids: Path) -> None:
    """A rank as training.train's main starts it: the writer zygote forked before the run's first thread, then
    a save, an in-process restart's abort, another save; it writes its writers' and zygote's pids to `pids` and
    waits for the test to SIGKILL it."""
    writer_process.start_zygote()
    first = checkpoint_manager(directory, mode="async", keep=3)
    first.save(1, {"w": torch.ones(4)})
    first.wait()
    first_writer = first.writer_pid
    first.abort()  # the iteration died
    second = checkpoint_manager(directory, mode="async", keep=3)
    second.save(2, {"w": torch.ones(4)})
    second.wait()
    pids.write_text(f"{first_writer} {second.writer_pid} {psutil.Process(second.writer_pid).ppid()}")
    time.sleep(600)


def test_writers_are_forked_from_the_ranks_zygote_and_die_with_the_rank(tmp_path):
    """An in-process restart (abort, new manager) and an in-job restart (a new rank) wait for no new
    interpreter: the zygote, a fork of the rank with torch imported, forks each writer; a SIGKILLed rank
    leaves neither behind."""
    pids = tmp_path / "pids"
    rank = fork_rank(lambda: _rank_with_zygote(tmp_path / "ckpt", pids), tmp_path / "rank.log", {})
    try:
        deadline = time.monotonic() + 60
        while not (pids.exists() and pids.read_text()) and time.monotonic() < deadline:
            time.sleep(0.02)
        first, second, zygote = map(int, pids.read_text().split())
        assert first != second, "the aborted iteration's writer wrote the next iteration's save"
        assert psutil.Process(zygote).ppid() == rank
        assert psutil.Process(zygote).cmdline() == psutil.Process(rank).cmdline(), "a new interpreter, not a fork"
        assert [s for s, _ in committed_checkpoints(tmp_path / "ckpt")] == [2, 1]
    finally:
        os.kill(rank, signal.SIGKILL)
        os.waitpid(rank, 0)
    for pid in (zygote, second):
        with contextlib.suppress(psutil.NoSuchProcess):
            psutil.Process(pid).wait(timeout=10)


def _forked_rank_saves(directory: Path) -> None:
    """A rank as training.pod.prefork starts it: forked with os.fork, which runs none of multiprocessing's
    after-fork hooks, from a process that had handed a shared tensor to another process through
    multiprocessing (its fd-passing listener started; the fork copies the listener's state, not its thread)
    and had a writer process of its own. The forked rank saves through a writer of its own."""
    ForkingPickler.dumps(torch.ones(4).share_memory_())  # torch's reductions: a handle to the tensor's memory
    parent = checkpoint_manager(f"{directory}-parent", mode="async", keep=1)
    parents = parent.writer_pid
    pid = os.fork()
    parent.abort()  # (in both) its writer's imports would only slow the child's down
    if pid == 0:
        code = 3
        try:
            m = checkpoint_manager(directory, mode="async", keep=1)
            assert m.writer_pid != parents, "the forked rank writes through its parent's writer process"
            m.save(1, {"w": torch.full((1024,), 1.0)})
            m.close()
            code = 0
        finally:
            os._exit(code)
    os.waitpid(pid, 0)


def test_a_rank_forked_without_multiprocessings_hooks_saves_through_its_own_writer_process(tmp_path):
    [rank] = fork_ranks(lambda _: _forked_rank_saves(tmp_path / "ckpt"), tmp_path / "logs", world=1, timeout=120)
    assert [s for s, _ in committed_checkpoints(tmp_path / "ckpt")] == [1], rank.output[-2000:]


def _bytes_written(pid):
    """What process `pid` has passed to write(2) and its kin so far (/proc/PID/io wchar)."""
    return int(Path(f"/proc/{pid}/io").read_text().split("wchar:")[1].split()[0])


def test_async_save_writes_its_shards_in_the_writer_process_not_the_training_process(tmp_path):
    """The shard write (serialisation, the write, fsync) is the writer process's: the training process
    passes only the staged tensors' handles, the plan and the small metadata."""
    m = _manager(tmp_path, "async")
    state = {"w": torch.rand(4 << 20)}  # 16 MiB
    m.save(1, state)
    m.wait()
    ours, writer = _bytes_written(os.getpid()), _bytes_written(m.writer_pid)
    m.save(2, state)
    m.wait()
    ours, writer = _bytes_written(os.getpid()) - ours, _bytes_written(m.writer_pid) - writer
    m.close()
    assert writer >= 16 << 20 and ours < 1 << 20, (ours, writer)


def test_corrupt_newest_falls_back_to_previous(tmp_path, caplog):
    m = _manager(tmp_path, "sync")
    m.save(1, {"w": torch.full((4,), 1.0)})
    m.save(2, {"w": torch.full((4,), 2.0)})
    newest = committed_checkpoints(m.dir)[0][1]
    for shard in newest.glob("*.distcp"):
        shard.write_bytes(b"garbage")
    target = {"w": torch.zeros(4)}
    assert m.load(target).step == 1
    assert torch.equal(target["w"], torch.full((4,), 1.0))
    [fallback] = _events(tmp_path, "ckpt_fallback")
    assert fallback["path"] == str(newest)
    assert "falling back to step_00000001" in caplog.text
    assert [s for s, _ in committed_checkpoints(m.dir)] == [1]  # the corrupt one is set aside
    assert list(m.dir.glob("corrupt-step_00000002-*"))


def test_a_resume_loads_the_newest_checkpoint_of_any_group_and_leaves_the_others_damage_to_them(tmp_path, caplog):
    """Replica groups: one group writes each checkpoint; another resumes from whichever directory holds the
    newest, and a damaged one there is skipped, not set aside (its directory is read-only to this group)."""
    writer = checkpoint_manager(tmp_path / "group0", mode="sync", keep=5, events=EventLog(tmp_path, "rank0"))
    for step in (10, 20, 30):
        writer.save(step, {"w": torch.full((4,), float(step))})
    for shard in (tmp_path / "group0" / "step_00000030").glob("*.distcp"):
        shard.write_bytes(b"garbage")
    own = _manager(tmp_path, "sync", also_resume_from=(str(tmp_path / "group0"),))
    own.save(10, {"w": torch.full((4,), -1.0)})  # older than the other group's: not the one to load
    target = {"w": torch.zeros(4)}
    loaded = own.load(target)
    assert (loaded.step, loaded.path) == (20, tmp_path / "group0" / "step_00000020")
    assert torch.equal(target["w"], torch.full((4,), 20.0))
    assert "step_00000030 is damaged" in caplog.text and "skipped" in caplog.text
    assert [s for s, _ in committed_checkpoints(tmp_path / "group0")] == [30, 20, 10]  # left to its owner


def test_a_checkpoint_the_other_group_prunes_while_it_is_read_gives_way_to_its_newer_one(tmp_path, monkeypatch,
                                                                                            caplog):
    """The writing group saves and prunes on while a restarted group reads its newest checkpoint: the read
    fails as the files vanish, and the search goes back to the newest, which the prune left."""
    writer = checkpoint_manager(tmp_path / "group0", mode="sync", keep=1, events=EventLog(tmp_path, "rank0"))
    writer.save(10, {"w": torch.full((4,), 10.0)})
    real_load, reads = manager.dcp.load, []

    def load_while_the_writer_saves(state, checkpoint_id):
        reads.append(checkpoint_id.name)
        if len(reads) == 1:  # the writer commits step 20 and prunes step 10 mid-read
            writer.save(20, {"w": torch.full((4,), 20.0)})
        return real_load(state, checkpoint_id=checkpoint_id)

    monkeypatch.setattr(manager.dcp, "load", load_while_the_writer_saves)
    own = _manager(tmp_path, "sync", also_resume_from=(str(tmp_path / "group0"),))
    target = {"w": torch.zeros(4)}
    loaded = own.load(target)
    assert reads == ["step_00000010", "step_00000020"]
    assert (loaded.step, loaded.path) == (20, tmp_path / "group0" / "step_00000020")
    assert torch.equal(target["w"], torch.full((4,), 20.0))
    assert "step_00000010 was pruned by its group while this one read it" in caplog.text


# ---- NVRx's async writer (CUDA only), with NVRx's pieces replaced by fakes ------------------------


def test_nvrx_writer_writes_the_cpu_state_of_its_step(fake_nvrx, tmp_path):
    step = torch.tensor(3.0)  # AdamW's step: a CPU tensor, incremented in place by the next step
    writer = _NvrxAsyncWriter(None, lambda replaced: None)
    writer.start({"optimizer": {"state": {"w": {"step": step, "exp_avg": torch.ones(2)}}}}, tmp_path / "s3", 3)
    step += 1  # training goes on while the save is in flight
    assert writer.done(blocking=True)
    [written] = fake_nvrx
    assert written["optimizer"]["state"]["w"]["step"].item() == 3.0


@pytest.mark.parametrize("fault, closed", [(None, [False]), ("exception@3", [True])])
def test_run_closes_nvrx_writer_and_aborts_it_when_the_iteration_dies(fake_nvrx, monkeypatch, tmp_path, fault, closed):
    """`run` is one in-process restart iteration: dying with a save in flight, it must stop NVRx's
    worker itself (close(abort=True)), not leave that to the queue's garbage collection."""
    def nvrx_writer(device, group, hook, deadlines, report):  # noqa: ANN001, ANN202 (on CPU too)
        return _NvrxAsyncWriter(group, report)

    monkeypatch.setattr(manager, "make_async_writer", nvrx_writer)
    for name, value in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                        "MASTER_PORT": str(free_port())}.items():
        monkeypatch.setenv(name, value)
    cfg = load_train_config(None, [f"run_dir={tmp_path}", "training.device=cpu", "training.steps=4",
                                   "checkpoint.interval=2", "checkpoint.mode=async",
                                   *([f"faults={fault}"] if fault else [])])
    if fault:
        with pytest.raises(FaultInjected):
            run(cfg)  # the save of step 2 is still in flight at the fault
    else:
        run(cfg)
        assert [s for s, _ in committed_checkpoints(cfg.checkpoint_dir)] == [4, 2]
    [queue] = FakeQueue.built
    assert queue.closed == closed


@pytest.mark.parametrize("reduce_every_micro_batch", [False, True], ids=["reduce_once", "reduce_every_micro_batch"])
def test_micro_batches_make_the_step_of_their_whole_batch_to_float_tolerance(one_rank_group, monkeypatch,
                                                                             reduce_every_micro_batch):
    """Gradient accumulation: two micro-batches of 2 take the optimizer step that one batch of the same 4
    samples takes, up to rounding (the sums are taken in another order: bitwise equality is not promised),
    and report the same mean loss, whether FSDP2 reduce-scatters after every micro-batch (sharded gradients
    accumulate) or only after the last (training.gradient_reduce). Plain SGD with lr 1, so that a parameter
    moves by its (clipped) gradient."""
    cfg = load_train_config(None, ["training.seq_len=16"])
    results, syncs = [], []
    for batch_size, accumulation_steps in ((4, 1), (2, 2)):
        torch.manual_seed(0)
        model, _ = build(cfg, model_spec(cfg.model), one_rank_group)
        set_sync = model.set_requires_gradient_sync
        monkeypatch.setattr(model, "set_requires_gradient_sync",
                            lambda on, **kw: (syncs.append(on), set_sync(on, **kw)))
        stream = TokenStream(TrainingConfig(seq_len=16, batch_size=batch_size, seed=7), DataConfig(), rank=0,
                             world_size=1, vocab_size=PRESETS["tiny"].vocab_size, rows=accumulation_steps)
        step = OptimizerStep(model, torch.optim.SGD(model.parameters()), one_rank_group, grad_clip=1.0,
                             reduce_every_micro_batch=reduce_every_micro_batch)
        results.append((step.run(stream.next_step(), lr=1.0).loss,
                        {k: v.full_tensor() for k, v in model.state_dict().items()}))
    # whether each backward reduce-scatters: the whole batch's, then the two micro-batches'
    assert syncs == [True, reduce_every_micro_batch, True]
    (whole_loss, whole), (accumulated_loss, accumulated) = results
    assert accumulated_loss == pytest.approx(whole_loss, rel=1e-6)
    for name, tensor in whole.items():
        torch.testing.assert_close(accumulated[name], tensor, rtol=1e-5, atol=1e-6, msg=name)


def test_a_step_leaves_the_state_alone_until_before_update_returns(one_rank_group):
    """An async save's staging copy may still read the parameters and AdamW's state during the next step's
    forward and backward: a step changes them only after `before_update` (CheckpointManager.wait_staged), and
    what it waited is not counted as training."""
    cfg = load_train_config(None, ["training.seq_len=16"])
    model, optimizer = build(cfg, model_spec(cfg.model), one_rank_group)
    stream = TokenStream(TrainingConfig(seq_len=16, batch_size=2, seed=7), DataConfig(), rank=0, world_size=1,
                         vocab_size=PRESETS["tiny"].vocab_size)
    unchanged: list[bool] = []

    def before_update() -> float:
        if before is not None:
            unchanged.append(all(torch.equal(t, b) for t, b in zip(live, before)))
        return 0.25

    step = OptimizerStep(model, optimizer, one_rank_group, grad_clip=1.0, before_update=before_update)
    before = None
    step.run(stream.next_step(), lr=1e-3)  # AdamW's moments exist
    live = [*model.parameters(), *(t for s in optimizer.state.values() for t in s.values())]
    before = [t.detach().clone() for t in live]
    assert step.run(stream.next_step(), lr=1e-3).waited_s == 0.25
    assert unchanged == [True]
    assert not all(torch.equal(t, b) for t, b in zip(live, before))  # the step did change them after it


def test_a_rank_in_a_world_that_cannot_reach_the_global_batch_fails_the_job_before_training(monkeypatch, tmp_path):
    """The ranks' own check, behind training.local's and the chart's: here a one-process group that says
    it has 5 ranks, for a global batch of 24 in micro-batches of 2 (12 of them: 5 ranks cannot share them)."""
    def five_ranks(device: str, timeout_s: float, store=None) -> DistInfo:  # noqa: ANN001
        return dataclasses.replace(init_distributed(device, timeout_s, store), world_size=5)

    monkeypatch.setattr(trainer, "init_distributed", five_ranks)
    for name, value in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                        "MASTER_PORT": str(free_port())}.items():
        monkeypatch.setenv(name, value)
    cfg = load_train_config(None, [f"run_dir={tmp_path}", "training.device=cpu", "training.batch_size=2",
                                   "training.global_batch_size=24"])
    with pytest.raises(JobMustFail, match=r"cannot be reached by world size 5: .* allowed world sizes: "
                                          r"\[1, 2, 3, 4, 6, 12\]"):
        run(cfg)
    [request] = requests_dir(tmp_path).glob("*.json")  # every pod's PID 1 fails the Job on it
    assert "training.global_batch_size=24 cannot be reached by world size 5" in json.loads(request.read_text())["cause"]
    assert not (tmp_path / "checkpoints").exists()  # nothing built, nothing trained


def test_a_run_extended_by_a_resume_keeps_its_learning_rate_schedule_with_lr_decay_steps():
    """A 200-step run resumed with training.steps=400: with lr_decay_steps=200 every step of the first 200 has
    the learning rate it had, and the rest stay at the floor; without it the schedule stretches to 400 steps
    and the learning rate of the step after a resume at 150 jumps from 0.24 to 0.74 of the peak."""
    first = load_train_config(None, ["training.steps=200"])
    kept = load_train_config(None, ["training.steps=400", "training.lr_decay_steps=200"])
    stretched = load_train_config(None, ["training.steps=400"])
    assert [lr_at(s, kept) for s in range(1, 201)] == [lr_at(s, first) for s in range(1, 201)]
    assert all(lr_at(s, kept) == pytest.approx(0.1 * first.training.lr) for s in range(200, 401))
    peak = first.training.lr
    assert (round(lr_at(151, first) / peak, 2), round(lr_at(151, stretched) / peak, 2)) == (0.24, 0.74)


def test_the_decay_must_follow_the_warmup():
    with pytest.raises(TrainConfigError, match=r"training.lr_decay_steps=10 is not allowed: more than "
                                               r"training.warmup_steps \(10\)"):
        load_train_config(None, ["training.lr_decay_steps=10"])
