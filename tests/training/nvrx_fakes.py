"""NVRx 0.7.0's async checkpointing faked at the names training.train.checkpoint.writers imports (its worker,
queue and finalization need CUDA): as much of AsyncCallsQueue as _NvrxAsyncWriter reaches, behaving as NVRx's
own does where it matters (nvidia_resiliency_ext/checkpointing/async_ckpt/core.py, PersistentAsyncCaller)."""
from __future__ import annotations

import copy
import signal
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest


class WouldBlockForever(AssertionError):
    """NVRx's queue would wait here without end."""


class FakeWorker:
    """PersistentAsyncCaller.process (an mp.Process): alive until `kill`."""
    pid = 4242

    def __init__(self) -> None:
        self.exitcode: int | None = None

    def is_alive(self) -> bool:
        return self.exitcode is None

    def kill(self) -> None:
        self.exitcode = -signal.SIGKILL


class FakeCaller:
    """PersistentAsyncCaller: `cur_item` is the call its worker reported finished, None until it has."""

    def __init__(self) -> None:
        self.process = FakeWorker()
        self.cur_item: int | None = None


@dataclass
class _Call:  # NVRx's _ActiveAsyncRequest
    idx: int
    request: Any


class FakeQueue:
    """AsyncCallsQueue whose worker writes only when polled or waited for: later than the training steps that
    follow the save, as NVRx's persistent worker may. Like NVRx's, it starts its worker at the first save and never checks
    that the worker lives: scheduling onto a dead worker (its preload) and a blocking wait for a dead worker's
    call wait for ever (here: WouldBlockForever); a poll says "not done" for ever."""

    built: list[FakeQueue] = []  # every queue, in the order built

    def __init__(self, persistent: bool = True) -> None:
        self.async_calls: deque[_Call] = deque()
        self.persistent_caller: FakeCaller | None = None
        self.closed: list[bool] = []  # the `abort` of each close()
        self._next_idx = 0
        FakeQueue.built.append(self)

    def schedule_async_request(self, request: Any) -> None:
        if self.persistent_caller is None:
            self.persistent_caller = FakeCaller()
        if not self.persistent_caller.process.is_alive():
            raise WouldBlockForever("schedule_async_call: preload_q.join() with a dead worker")
        self.async_calls.append(_Call(self._next_idx, request))
        self._next_idx += 1

    def maybe_finalize_async_calls(self, blocking: bool = False) -> None:
        while self.async_calls:
            caller, call = self.persistent_caller, self.async_calls[0]
            assert caller is not None
            if caller.cur_item is None:
                if caller.process.is_alive():
                    call.request.async_fn(*call.request.async_fn_args)
                    caller.cur_item = call.idx
                elif blocking:
                    raise WouldBlockForever("is_current_async_call_done: comp_q polled in a loop, a dead worker")
                else:
                    return
            self.async_calls.popleft()
            caller.cur_item = None
            for finalize in call.request.finalize_fns:
                finalize()

    def get_num_unfinalized_calls(self) -> int:
        return len(self.async_calls)

    def close(self, abort: bool = False) -> None:
        if not abort and self.persistent_caller is not None and not self.persistent_caller.process.is_alive():
            raise WouldBlockForever("close: 'DONE' sent to a dead worker, queue.join()")
        self.closed.append(abort)


class FakeFileSystemWriterAsync:
    written: list[dict] = []

    def __init__(self, path: Path) -> None:
        self.state: dict = {}
        self.wrote = False

    def get_save_function_and_args(self):  # noqa: ANN201
        return self._write, None, []

    def _write(self) -> None:
        self.written.append(copy.deepcopy(self.state))
        self.wrote = True

    def finalize(self) -> None:
        """NVRx's save_state_dict_async_finalize: a rank whose worker left no write results fails the save on
        every rank (retrieve_write_results' error, gathered, raised as a CheckpointException)."""
        if not self.wrote:
            raise RuntimeError("results_queue should not be empty")


@pytest.fixture()
def fake_nvrx(monkeypatch) -> list[dict]:
    """NVRx's async checkpointing faked at the names _NvrxAsyncWriter imports; returns the list of
    state dicts its worker wrote, each as read at write time."""
    from nvidia_resiliency_ext.checkpointing.async_ckpt import core, filesystem_async, state_dict_saver

    def plan(state_dict, writer, process_group=None):  # noqa: ANN001, ANN202
        writer.state = state_dict
        return writer, None, None

    monkeypatch.setattr(core, "AsyncCallsQueue", FakeQueue)
    monkeypatch.setattr(filesystem_async, "FileSystemWriterAsync", FakeFileSystemWriterAsync)
    monkeypatch.setattr(state_dict_saver, "save_state_dict_async_plan", plan)
    monkeypatch.setattr(state_dict_saver, "save_state_dict_async_finalize", lambda writer, *rest: writer.finalize())
    monkeypatch.setattr(FakeFileSystemWriterAsync, "written", [])
    monkeypatch.setattr(FakeQueue, "built", [])
    return FakeFileSystemWriterAsync.written
