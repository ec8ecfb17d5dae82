"""What production does to an async save's writer, in one process: a zygote killed by the OOM killer, a writer
stuck in I/O, a writer that SIGKILL cannot end, NVRx's worker dying, a GPU in sight. Each must fail at most the
save in flight, say so, and leave the next save a working writer."""
from __future__ import annotations

import contextlib
import gc
import os
import signal
import socket
import threading
import time
from pathlib import Path

import psutil
import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

from nvrx_fakes import FakeQueue, fake_nvrx  # noqa: F401 (a fixture)
from training.contract.events import EventLog, read_events
from training.train.checkpoint import manager, writer_process
from training.train.checkpoint.layout import committed_checkpoints
from training.train.checkpoint.manager import CheckpointManager
from training.train.checkpoint.shm_channel import ShmChannel
from training.train.checkpoint.writers import WriterDeadlines, _NvrxAsyncWriter
from training_helpers import checkpoint_manager

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


def _manager(tmp_path: Path, events: EventLog, **kw) -> CheckpointManager:
    return checkpoint_manager(tmp_path / "ckpt", mode="async", keep=3, events=events, **kw)


def _events(tmp_path: Path, name: str) -> list[dict]:
    return [e for e in read_events(tmp_path) if e["event"] == name]


def _gone(pid: int, timeout: float = 10.0) -> bool:
    """Whether process `pid` ended (a zombie counts) within `timeout`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.05)
    return False


def _returns_within(seconds: float, call) -> bool:  # noqa: ANN001
    """Whether `call()` returned within `seconds` (it runs on in a daemon thread if not)."""
    thread = threading.Thread(target=call, daemon=True)
    thread.start()
    thread.join(seconds)
    return not thread.is_alive()


def test_a_dead_zygote_is_replaced_and_saves_and_new_managers_go_on(tmp_path):
    """The OOM killer takes the zygote (its writer dies with it): the next save and the next iteration's
    manager get a new zygote and writer, and the rank's event log says so; no save fails."""
    events = EventLog(tmp_path, "rank0")
    m = _manager(tmp_path, events)
    m.save(1, {"w": torch.full((1024,), 1.0)})
    m.wait()
    for step in (2, 3):
        zygote, writer = writer_process._zygote.pid, m.writer_pid
        os.kill(zygote, signal.SIGKILL)
        assert _gone(zygote) and _gone(writer)
        if step == 3:  # an in-process restart: a new manager is built in the next iteration's setup
            m.abort()
            m = _manager(tmp_path, events)
        m.save(step, {"w": torch.full((1024,), float(step))})
        m.wait()
        assert writer_process._zygote.pid != zygote
        replaced = _events(tmp_path, "ckpt_writer_replaced")[-1]
        assert (replaced["process"], replaced["pid"], replaced["rank"]) == ("zygote", zygote, 0)
    assert [s for s, _ in committed_checkpoints(m.dir)] == [3, 2, 1]
    assert not _events(tmp_path, "ckpt_failed")
    m.close()


def _warm_zygote(tmp_path: Path) -> None:
    """A zygote that answers at once: started by a manager with the default deadlines (a new interpreter
    answers only once it has imported torch), so that a test's short deadline bounds the writer alone."""
    _manager(tmp_path / "warm", EventLog(tmp_path / "warm", "rank0")).close()


@pytest.mark.parametrize("when_busy", ["wait", "skip"])
def test_a_writer_that_gives_no_answer_fails_its_save_at_the_deadline_and_the_next_save_gets_a_new_one(
        tmp_path, when_busy):
    """A writer stuck in I/O (here: stopped) fails its save once the deadline passes, is killed, and the next
    save, in skip mode too, is written by a new writer; the rank's event log names the abandoned one."""
    _warm_zygote(tmp_path)
    events = EventLog(tmp_path, "rank0")
    m = _manager(tmp_path, events, when_busy=when_busy, deadlines=WriterDeadlines(write_s=2.0, collective_s=5.0))
    m.save(1, {"w": torch.full((1024,), 1.0)})
    m.wait()
    stuck = m.writer_pid
    os.kill(stuck, signal.SIGSTOP)
    try:
        m.save(2, {"w": torch.full((1024,), 2.0)})
        assert _returns_within(30, m.wait), "the save of a stuck writer was waited for past its deadline"
        [failed] = _events(tmp_path, "ckpt_failed")
        assert failed["step"] == 2 and "WriterTimedOut" in failed["error"] and "within 2 s" in failed["error"]
        assert _gone(stuck)
        m.save(3, {"w": torch.full((1024,), 3.0)})
        m.wait()
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(stuck, signal.SIGKILL)
    assert m.writer_pid != stuck
    assert [s for s, _ in committed_checkpoints(m.dir)] == [3, 1] and not list(m.dir.glob(".tmp-*"))
    [replaced] = _events(tmp_path, "ckpt_writer_replaced")
    assert (replaced["process"], replaced["pid"], replaced["new_pid"]) == ("writer", stuck, m.writer_pid)
    m.close()


def test_abort_returns_when_sigkill_cannot_end_the_writer(tmp_path, monkeypatch):
    """A writer in uninterruptible I/O does not end on SIGKILL until the I/O returns (here: the signal never
    lands): an in-process restart's abort must not wait for it, and the next manager gets a new writer."""
    events = EventLog(tmp_path, "rank0")
    m = _manager(tmp_path, events)
    m.save(1, {"w": torch.full((1024,), 1.0)})
    m.wait()
    unkillable = m.writer_pid
    monkeypatch.setattr(writer_process.signal, "pidfd_send_signal", lambda *args: None)
    monkeypatch.setattr(writer_process, "_KILL_GRACE_S", 0.5, raising=False)
    try:
        assert _returns_within(30, m.abort), "abort waits for a writer that cannot end"
        monkeypatch.undo()
        again = _manager(tmp_path, events)
        assert again.writer_pid != unkillable
        again.save(2, {"w": torch.full((1024,), 2.0)})
        again.close()
    finally:
        with contextlib.suppress(ProcessLookupError):  # it leaves by itself once its socket closed
            os.kill(unkillable, signal.SIGKILL)
    assert [s for s, _ in committed_checkpoints(again.dir)] == [2, 1]


def test_replacing_the_writer_leaks_no_file_descriptor(tmp_path):
    """Every abort (every in-process restart) replaces the writer: the rank's open files stay as many."""
    events = EventLog(tmp_path, "rank0")

    def iteration(step: int) -> None:
        m = _manager(tmp_path, events)
        m.save(step, {"w": torch.full((1024,), float(step))})
        m.wait()
        m.abort()

    def open_fds() -> int:
        gc.collect()  # what only the garbage collector would close is not what this counts
        return len(os.listdir("/proc/self/fd"))

    def settled_fds(expected: int) -> int:
        """The count once other threads of this worker (an earlier test's) are done with a file of theirs:
        a leak stays, one per replacement here, and a transient file goes."""
        for _ in range(10):
            if (count := open_fds()) == expected:
                break
            time.sleep(0.2)
        return count

    iteration(1)
    before = open_fds()
    for step in range(2, 7):
        iteration(step)
    assert settled_fds(before) == before


def _write_request(path: Path, state: dict) -> writer_process.WriteRequest:
    """The request a rank sends its writer for a save of `state` into `path`, planned as DCP plans it."""
    planner = DefaultSavePlanner()
    planner.set_up_planner(state, is_coordinator=True)
    storage = dcp.FileSystemWriter(path)
    storage.set_up_storage_writer(True)
    local = storage.prepare_local_plan(planner.create_local_plan())
    plans, _ = planner.create_global_plan([local])
    plan = planner.finish_plan(storage.prepare_global_plan(plans)[0])
    return writer_process.WriteRequest(path, plan, {item.index: planner.resolve_data(item) for item in plan.items})


def test_the_writer_never_touches_cuda_where_a_gpu_is_visible(tmp_path, monkeypatch):
    """The torch writer on a CUDA machine without NVRx's async module: every rank's writer sees the GPUs, and
    one that made a CUDA context would make it on GPU 0 (for all eight ranks). The writer's loop, run here with
    CUDA said to be available and every CUDA entry point failing, writes the shard all the same."""
    def no_cuda(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        raise AssertionError("the checkpoint writer touched CUDA")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for name in ("current_stream", "Stream", "synchronize", "set_device", "current_device", "init", "_lazy_init"):
        monkeypatch.setattr(torch.cuda, name, no_cuda)
    path = tmp_path / "shard"
    path.mkdir()
    state = {"w": torch.arange(64, dtype=torch.float32).share_memory_()}
    ours, theirs = socket.socketpair()
    serving = threading.Thread(target=writer_process._serve, args=(ShmChannel(theirs),), daemon=True)
    serving.start()
    channel = ShmChannel(ours)
    channel.send(_write_request(path, state))
    answer = channel.recv()
    channel.close()
    serving.join(30)
    assert isinstance(answer, list), answer
    assert [r.storage_data.relative_path for r in answer] == ["__0_0.distcp"]


# ---- NVRx's persistent worker (CUDA only), with NVRx's pieces replaced by fakes ------------------------------

def test_a_dead_nvrx_worker_fails_its_save_at_the_next_poll_and_the_next_save_gets_a_new_one(fake_nvrx, tmp_path):
    reports = []
    writer = _NvrxAsyncWriter(None, reports.append)
    writer.start({"w": torch.ones(2)}, tmp_path / "s1", 1)
    [queue] = FakeQueue.built
    queue.persistent_caller.process.kill()  # the OOM killer, mid-write
    with pytest.raises(RuntimeError, match="results_queue should not be empty"):
        writer.done(blocking=False)  # not "still in flight" for ever
    assert queue.closed == [True] and [r.process for r in reports] == ["nvrx_worker"]
    writer.start({"w": torch.full((2,), 2.0)}, tmp_path / "s2", 2)
    assert writer.done(blocking=True)
    assert [w["w"][0].item() for w in fake_nvrx] == [2.0]
    writer.close(abort=False)


def test_a_blocking_wait_for_a_dead_nvrx_worker_fails_the_save(fake_nvrx, tmp_path):
    writer = _NvrxAsyncWriter(None, lambda replaced: None)
    writer.start({"w": torch.ones(2)}, tmp_path / "s1", 1)
    FakeQueue.built[0].persistent_caller.process.kill()
    with pytest.raises(RuntimeError, match="results_queue should not be empty"):
        writer.done(blocking=True)
    writer.close(abort=False)  # the dead worker's queue is gone: nothing waits for it


def test_an_nvrx_worker_dead_between_saves_is_replaced_before_the_next_save(fake_nvrx, tmp_path):
    reports = []
    writer = _NvrxAsyncWriter(None, reports.append)
    writer.start({"w": torch.ones(2)}, tmp_path / "s1", 1)
    assert writer.done(blocking=True)
    FakeQueue.built[0].persistent_caller.process.kill()  # idle
    writer.start({"w": torch.full((2,), 2.0)}, tmp_path / "s2", 2)
    assert writer.done(blocking=True)
    assert [w["w"][0].item() for w in fake_nvrx] == [1.0, 2.0]
    assert [r.reason for r in reports] == [f"died between saves (exit code {-signal.SIGKILL})"]
    writer.close(abort=False)


def test_a_manager_with_a_dead_nvrx_worker_reports_the_failed_save_and_commits_the_next(fake_nvrx, monkeypatch,
                                                                                        tmp_path):
    monkeypatch.setattr(manager, "make_async_writer",
                        lambda device, group, hook, deadlines, report: _NvrxAsyncWriter(group, report))
    m = _manager(tmp_path, EventLog(tmp_path, "rank0"), when_busy="skip")
    m.save(1, {"w": torch.ones(2)})
    FakeQueue.built[0].persistent_caller.process.kill()
    m.poll()
    [failed] = _events(tmp_path, "ckpt_failed")
    assert failed["step"] == 1 and "results_queue should not be empty" in failed["error"]
    m.save(2, {"w": torch.full((2,), 2.0)})  # not skipped: the save of step 1 has ended
    m.wait()
    assert [s for s, _ in committed_checkpoints(m.dir)] == [2]
    [replaced] = _events(tmp_path, "ckpt_writer_replaced")
    assert replaced["process"] == "nvrx_worker" and replaced["new_pid"] is None
    m.close()
