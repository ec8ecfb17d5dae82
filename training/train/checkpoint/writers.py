"""The DCP writers a CheckpointManager saves through, and the fault-injection hook into them.

Sync mode: `dcp.save` through `file_writer`, on every rank. Async mode (`make_async_writer`): the state is
staged (copied), then written in the background while training goes on. Cost: a staged copy of the state
besides the live one. Fault injection (training.train.faults) reaches a save through a `WriteHook` around
each rank's write of its shards, so an injected error fails the save on every rank as a real one would, and
an injected crash kills the rank. NVRx's CUDA async writer (`_NvrxAsyncWriter`) is not hooked.
"""
from __future__ import annotations

import functools
import logging
import os
import time
from concurrent import futures
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Protocol, TypeVar

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict_saver import AsyncSaveResponse
from torch.futures import Future
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.checkpoint.storage import WriteResult
from torch.utils._pytree import tree_map_only

from training.contract.config import TrainConfig
from training.contract.launcher import SAVE_DELAY_ENV
from training.train.checkpoint.staging import SharedStaging
from training.train.checkpoint.writer_process import Replaced, WriteRequest, WriterProcess, shared_writer_process

log = logging.getLogger(__name__)

T = TypeVar("T")
# hook(step, write) -> write(): called on each rank as it writes its shards of the save of `step`. It wraps that
# write inside DCP, in the training process (in async mode, in the background thread, `write` waiting for the
# writer process); the local cluster's --save-delay holds each hooked write back the same way.
WriteHook = Callable[[int, Callable[[], T]], T]


@dataclass(frozen=True)
class WriterDeadlines:
    """How long an async save may wait on its background writer (`writer_process`)."""
    write_s: float  # one rank's writer answering one request (fault_tolerance.checkpoint_section_timeout)
    collective_s: float  # one collective once every rank has reached it (training.collective_timeout_s)

    @classmethod
    def of(cls, cfg: TrainConfig) -> WriterDeadlines:
        return cls(cfg.fault_tolerance.checkpoint_section_timeout, cfg.training.collective_timeout_s)

    @property
    def group_timeout(self) -> timedelta:
        """The checkpoint group's collectives: the gather after the shard writes waits for the slowest rank's
        write (up to write_s), then as long as any collective. torch's default for a gloo group is 30 min."""
        return timedelta(seconds=self.write_s + self.collective_s)


# hands a Replaced on to whoever records it (the CheckpointManager's event log)
ReplacementReport = Callable[[Replaced], None]


def _plain(state: dict[str, Any]) -> dict[str, Any]:
    """Stateful objects replaced by their state dicts (what the async writers stage)."""
    return {k: v.state_dict() if isinstance(v, Stateful) else v for k, v in state.items()}


def _cpu_snapshot(state: dict[str, Any]) -> dict[str, Any]:
    """`state` with its CPU tensors cloned: a writer that reads them later still writes this step.

    NVRx's persistent worker reads the planned tensors when it preloads and writes them. CUDA
    tensors are copied to the host in its preload, which `schedule_async_request` waits for. CPU
    tensors: 0.7.0's FileSystemWriterAsync.prepare_write_data clones them while planning (or copies
    them into shared-memory snapshots with use_cpu_shm_for_gpu_tensors); 0.4.1 clones only views and
    hands the live tensor to the worker. AdamW's `step` tensors live on the CPU and the next
    optimizer step increments them in place: such a save records a later step count than its
    weights. This copy makes the save hold its step whatever NVRx does; the CPU part of a CUDA
    state is small (optimizer steps, RNG states)."""
    return tree_map_only(torch.Tensor, lambda t: t.clone() if t.device.type == "cpu" else t, state)


class _HookedFileSystemWriter(dcp.FileSystemWriter):
    """FileSystemWriter whose shard writing runs through a WriteHook (fault injection)."""

    def __init__(self, path: Path, step: int, hook: WriteHook) -> None:
        super().__init__(path)
        self._step, self._hook = step, hook

    def write_data(self, plan, planner):  # noqa: ANN001, ANN201 (DCP's signature)
        return self._hook(self._step, functools.partial(self._write, plan, planner))

    def _write(self, plan, planner):  # noqa: ANN001, ANN202
        return super().write_data(plan, planner)


def with_emulated_delay(hook: WriteHook) -> WriteHook:
    """`hook`, each write first held back for $TRAINING_EMULATED_SAVE_DELAY_S seconds when set (training.local
    --save-delay; training.contract.launcher.SAVE_DELAY_ENV)."""
    delay = float(os.environ.get(SAVE_DELAY_ENV) or 0)
    if delay <= 0:
        return hook

    def delayed(step: int, write: Callable[[], T]) -> T:
        time.sleep(delay)
        return hook(step, write)
    return delayed


def file_writer(path: Path, step: int, hook: WriteHook | None) -> dcp.FileSystemWriter:
    """DCP's writer for the save of `step` into `path`, its shard writing run through `hook` if any."""
    return dcp.FileSystemWriter(path) if hook is None else _HookedFileSystemWriter(path, step, hook)


def _unhooked(step: int, write: Callable[[], T]) -> T:
    return write()


class _HandOffWriter(_HookedFileSystemWriter):
    """FileSystemWriter that plans here and hands this rank's shard write to the writer process: the
    items' data (views of the shared-memory staging buffers, or small pickled objects) go as they are."""

    def __init__(self, path: Path, step: int, hook: WriteHook | None, process: WriterProcess,
                 deadline_s: float) -> None:
        super().__init__(path, step, hook or _unhooked)
        self._process, self._deadline_s = process, deadline_s

    def _write(self, plan, planner):  # noqa: ANN001, ANN202
        request = WriteRequest(self.path, plan, {item.index: planner.resolve_data(item) for item in plan.items})
        written: Future[list[WriteResult]] = Future()
        written.set_result(self._process.write(request, self._deadline_s))
        return written


class AsyncWriter(Protocol):
    @property
    def writer_pid(self) -> int | None:
        """The process that writes this rank's shards, where it is known (its CPU time is not the rank's)."""
    def prepare(self, state: dict[str, Any]) -> None:
        """Start allocating what a save of `state` will stage into, in the background (returns at once)."""
    def wait_ready(self) -> None:
        """Block until the writer can take a save at once (its process has started, a preparation ended)."""
    def start(self, state: dict[str, Any], path: Path, step: int) -> None: ...
    def staged(self) -> bool:
        """Whether the in-flight save's staging copy is made (the state may change); True with none in flight."""
    def wait_staged(self) -> None:
        """Block until `staged()` (a failed copy fails the save, which `done` reports)."""
    def done(self, blocking: bool) -> bool:
        """True once the in-flight save is durable on every rank; raises if it failed."""
    def close(self, abort: bool) -> None:
        """Release the writer. abort: the run is dying and peers may be gone, so stop any
        in-flight save without collectives; otherwise no save is in flight any more."""


class _TorchAsyncWriter:
    """dcp.async_save, async mode on CPU: staging into shared memory in the stager's thread, the write in the
    writer process. `process_group` is a gloo group of its own (the CheckpointManager's), so its collectives
    never interleave with the training group's. The copy is made in a staging thread while the training
    thread runs on until it changes the state (`staging`), the save's background thread plans and
    coordinates, and each rank's shard write runs in a writer process (`writer_process`); the WriteHook wraps
    its hand-off, in the background thread.

    The stager is kept for the writer's life: it reuses its staging buffers from one save to the
    next (a stager per save, dcp's default, allocates and page-faults the whole state every time),
    and `prepare` allocates them ahead, off the training thread (`staging`). Reuse is safe because
    at most one save is in flight. The buffers are shared memory, so the writer process reads them
    where they are; pinned memory is for CUDA copies, not used here."""

    def __init__(self, process_group: dist.ProcessGroup | None, write_hook: WriteHook | None,
                 deadlines: WriterDeadlines, report: ReplacementReport) -> None:
        self._pg = process_group
        self._hook = write_hook
        self._deadlines, self._report = deadlines, report
        self._future: futures.Future[Any] | None = None  # the save: durable on every rank once done
        self._staged: futures.Future[None] | None = None  # its staging copy
        self._stager = SharedStaging()
        self._process = shared_writer_process(deadlines.write_s, report)

    @property
    def writer_pid(self) -> int | None:
        return self._process.pid

    def prepare(self, state: dict[str, Any]) -> None:
        self._stager.warm_up(_plain(state))

    def wait_ready(self) -> None:
        self._process.wait_ready(self._deadlines.write_s)
        self._stager.wait()

    def start(self, state: dict[str, Any], path: Path, step: int) -> None:
        # after a writer process died, timed out or was aborted: a new one
        self._process = shared_writer_process(self._deadlines.write_s, self._report)
        writer = _HandOffWriter(path, step, self._hook, self._process, self._deadlines.write_s)
        response = dcp.async_save(_plain(state), storage_writer=writer, process_group=self._pg,
                                  async_stager=self._stager)
        # a stager that returns a Future gets both: the copy's completion and the save's (torch 2.13)
        assert isinstance(response, AsyncSaveResponse), type(response)
        self._staged, self._future = response.staging_completion, response.upload_completion

    def staged(self) -> bool:
        return self._staged is None or self._staged.done()

    def wait_staged(self) -> None:
        if self._staged is not None:
            futures.wait([self._staged])

    def done(self, blocking: bool) -> bool:
        assert self._future is not None
        if blocking:
            self._future.result()
        elif not self._future.done():
            return False
        self._future.result()  # re-raises a failed save's exception
        return True

    def close(self, abort: bool) -> None:
        # abort: the writer process is killed at once (its save thread then fails); a thread cannot be
        # stopped, but it only waits for the process and for collectives on groups being torn down.
        # Otherwise the process stays for this process's next manager (shared_writer_process).
        # Closing the stager frees its staging copy of the state now (on abort, once a copy under way
        # ends), not when a cyclic GC finds it (every in-process restart builds a new writer).
        if abort:
            self._process.abort()
        self._stager.close(wait=not abort)


class _NvrxAsyncWriter:
    """NVRx async checkpointing (CUDA only: it stages with CUDA copies), async mode on CUDA with NVRx installed:
    FileSystemWriterAsync + AsyncCallsQueue, which stage synchronously. Planning is collective and
    synchronous; the write runs in NVRx's persistent worker process, which no WriteHook reaches;
    finalization (gather of write results, .metadata on the coordinator) runs on every rank in `done`, which
    NVRx makes a collective: every rank must call `poll()`/`wait()` at the same steps, as the train loop does.

    NVRx's queue never checks that its worker lives: a worker killed mid-write (the OOM killer) leaves its
    call unfinished for ever, so a poll says "not done" at every step and a blocking wait loops without end
    (PersistentAsyncCaller.is_current_async_call_done in NVRx 0.7.0's async_ckpt/core.py). Here each poll
    checks the worker: a dead one's call is marked finished, so NVRx's own finalization fails it on every
    rank (the write results it gathers lack this rank's) or, where the worker had written them, commits it;
    the queue is then rebuilt, and the next save starts a new worker. A blocking wait polls the same way."""

    _POLL_S = 0.1  # NVRx's own interval while a blocking wait waits for its worker

    def __init__(self, process_group: dist.ProcessGroup | None, report: ReplacementReport) -> None:
        from nvidia_resiliency_ext.checkpointing.async_ckpt.core import AsyncCallsQueue

        self._pg = process_group
        self._report = report
        self._new_queue = functools.partial(AsyncCallsQueue, persistent=True)
        self._queue = self._new_queue()

    writer_pid = None  # NVRx's persistent worker is the queue's own

    def prepare(self, state: dict[str, Any]) -> None:
        """Nothing: NVRx's writer stages the state in its own preload, at each save."""

    def wait_ready(self) -> None:
        """NVRx starts its persistent worker at the first save."""

    def staged(self) -> bool:
        return True  # NVRx stages in `start` (its preload)

    def wait_staged(self) -> None:
        """Nothing: `staged` is always True."""

    def start(self, state: dict[str, Any], path: Path, step: int) -> None:
        from functools import partial

        from nvidia_resiliency_ext.checkpointing.async_ckpt.core import AsyncRequest
        from nvidia_resiliency_ext.checkpointing.async_ckpt.filesystem_async import FileSystemWriterAsync
        from nvidia_resiliency_ext.checkpointing.async_ckpt.state_dict_saver import (
            save_state_dict_async_finalize, save_state_dict_async_plan)

        if self._dead_worker() is not None:  # died between saves: NVRx would wait for its preload for ever
            self._rebuild("between saves")
        path.mkdir(parents=True, exist_ok=True)
        writer, metadata, dist_wrapper = save_state_dict_async_plan(
            _cpu_snapshot(_plain(state)), FileSystemWriterAsync(path), process_group=self._pg)
        save_fn, preload_fn, save_args = writer.get_save_function_and_args()
        finalize = partial(save_state_dict_async_finalize, writer, metadata, dist_wrapper)
        self._queue.schedule_async_request(AsyncRequest(save_fn, save_args, [finalize], preload_fn=preload_fn))

    def done(self, blocking: bool) -> bool:
        while not self._poll():
            if not blocking:
                return False
            time.sleep(self._POLL_S)
        return True

    def _poll(self) -> bool:
        """One collective check of the save in flight, finalized (or failed: raises) where every rank is done."""
        dead = self._dead_worker()
        if dead is not None and self._queue.get_num_unfinalized_calls():
            caller = self._queue.persistent_caller
            if caller.cur_item is None:  # NVRx's mark of a call its worker reported finished
                caller.cur_item = self._queue.async_calls[0].idx
        try:
            self._queue.maybe_finalize_async_calls(blocking=False)
        finally:
            if dead is not None and not self._queue.get_num_unfinalized_calls():  # its call is settled
                self._rebuild("with a save in flight")
        return not self._queue.get_num_unfinalized_calls()

    def _dead_worker(self) -> Any:
        """NVRx's persistent worker process if it has ended (None while it runs, or before the first save)."""
        caller = self._queue.persistent_caller
        process = caller.process if caller is not None else None
        return process if process is not None and not process.is_alive() else None

    def _rebuild(self, when: str) -> None:
        dead = self._dead_worker()
        log.error("NVRx's checkpoint worker process %d died %s (exit code %s): a save it had not written fails; "
                  "a new worker starts at the next save", dead.pid, when, dead.exitcode)
        self._queue.close(abort=True)  # NVRx 0.7.0: terminate and join, at once for a process that has ended
        self._queue = self._new_queue()
        self._report(Replaced("nvrx_worker", dead.pid, None, f"died {when} (exit code {dead.exitcode})"))

    def close(self, abort: bool) -> None:
        # NVRx 0.7.0: abort terminates the persistent worker (SIGTERM, then SIGKILL) and skips the
        # finalization. Left to garbage collection, the queue's __del__ runs a plain close, whose
        # blocking finalization waits for the worker and then all-reduces over a torn-down group.
        # A plain close of a dead worker would wait for its answer to 'DONE' for ever.
        self._queue.close(abort=abort or self._dead_worker() is not None)


def make_async_writer(device: torch.device, process_group: dist.ProcessGroup | None, write_hook: WriteHook | None,
                      deadlines: WriterDeadlines, report: ReplacementReport) -> AsyncWriter:
    """Async mode's writer: NVRx's on CUDA where it is importable (not hooked: fault injection does not reach
    it), else dcp.async_save's."""
    if device.type == "cuda":
        try:
            writer = _NvrxAsyncWriter(process_group, report)
            if write_hook is not None:
                log.warning("checkpoint fault injection (ckpt-crash, disk-full) does not reach NVRx's async "
                            "writer: use checkpoint.mode=sync to inject them on CUDA")
            return writer
        except ImportError:
            log.info("nvidia_resiliency_ext async checkpointing not importable; using dcp.async_save")
    return _TorchAsyncWriter(process_group, write_hook, deadlines, report)
