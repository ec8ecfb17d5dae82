"""Checkpoints in torch.distributed.checkpoint (DCP) format: sharded, loadable without NVRx.

Layout under the checkpoint directory:

  step_00000040/          complete: every rank's shards, DCP .metadata, and COMMITTED (a JSON marker)
  .tmp-step_00000060.g7/  a save in progress by generation 7, or abandoned: never loaded, removed
  corrupt-step_00000020-<time>/  a committed checkpoint found damaged, set aside (never deleted)
  GENERATION              the newest generation of workers (a number; see Fencing)

Atomic commit: every rank writes its shards (fsynced) into `.tmp-step_N`; DCP's coordinator (rank 0)
writes `.metadata` only after gathering every rank's write result, so when rank 0's save returns,
all data is durable. Rank 0 then writes COMMITTED, renames the directory to `step_N` (one atomic
rename) and fsyncs the parent. A crash at any point before the rename leaves only a `.tmp-` dir.

Fencing: every CheckpointManager (one per worker group: an attempt, a rendezvous round, an in-process
restart) takes the next generation number from GENERATION as it starts, and writes only into
`.tmp-step_N.g<its generation>`. A worker of an older generation that is still running (a node cut off
from its peers but not from the file system, a paused process) therefore writes where no newer save
looks, and its rank 0 commits only while GENERATION still holds its own number, checked just before the
rename: a late save is never committed with, nor over, a newer generation's checkpoint (ckpt_failed
says it was fenced). Its leftovers are removed when a newer generation starts or commits.

Loading takes the newest complete checkpoint and reshards it to the current world size (DCP). Only
evidence of damage (`inspect_checkpoint`: a marker or `.metadata` that does not parse, a shard file
missing or shorter than the metadata says) sets a checkpoint aside as `corrupt-step_N-<time>/` and
falls back to the previous one; any other load error fails the attempt and leaves it in place. When
checkpoints exist but none loads, training refuses to start at step 0 unless told to.

Async mode: the state is staged (copied) synchronously, then written in the background while
training goes on; `poll()` (called every step on every rank) commits a finished save. At most one
save is in flight: the next waits for it (the wait is emitted as ckpt_blocked) or, with
when_busy=skip, is skipped with a log line. Ranks can see a save finish at different polls (the
torch writer's check is local), so a save stays in flight until the next `save` or `wait`, where
all ranks decide together. On CPU the background writer is torch's `dcp.async_save` (thread
executor, own gloo group, so its collectives never interleave with the training group's); on CUDA
with NVRx installed, NVRx's FileSystemWriterAsync + AsyncCallsQueue.

A failing save (e.g. OSError: disk full) emits ckpt_failed, removes its `.tmp-` dir, and training
goes on.

Fault injection (training/train/faults.py) reaches a save through `write_hook(step, write)`: it wraps each
rank's write of its shards inside DCP (in async mode, in the background thread), so an injected
error fails the save on every rank as a real one would. NVRx's CUDA async writer writes in its own
worker process and is not hooked.
"""
from __future__ import annotations

import functools
import json
import logging
import os
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Protocol, TypeVar

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import CheckpointException
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.stateful import Stateful
from torch.utils._pytree import tree_map_only

from training.contract.events import EventLog
from training.contract.launcher import resume_step_file

log = logging.getLogger(__name__)

COMMIT_MARKER = "COMMITTED"
GENERATION_FILE = "GENERATION"
T = TypeVar("T")
# hook(step, write) -> write(): called on each rank as it writes its shards of the save of `step`
WriteHook = Callable[[int, Callable[[], T]], T]
_STEP_DIR = re.compile(r"^step_(\d{8})$")
_TMP_DIR = re.compile(r"^\.tmp-step_\d{8}(\.g(?P<generation>\d+))?$")  # no generation: written before fencing


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


def committed_checkpoints(directory: str | os.PathLike) -> list[tuple[int, Path]]:
    """Complete checkpoints as (step, path), newest first."""
    root = Path(directory)
    if not root.is_dir():
        return []
    found = []
    for child in root.iterdir():
        m = _STEP_DIR.match(child.name)
        if m and (child / COMMIT_MARKER).is_file():
            found.append((int(m.group(1)), child))
    return sorted(found, reverse=True)


def current_generation(directory: str | os.PathLike) -> int:
    """The newest generation of workers that started on this checkpoint directory (0: none yet)."""
    try:
        return int((Path(directory) / GENERATION_FILE).read_text())
    except FileNotFoundError:
        return 0


def _start_generation(directory: Path) -> int:
    """Rank 0 of a new worker group: the next generation, made durable before any rank writes."""
    generation = current_generation(directory) + 1
    _replace_text(directory / GENERATION_FILE, f"{generation}\n", durable=True)
    return generation


class SaveFenced(RuntimeError):
    """A newer generation of workers started while this save was in flight: it must not commit."""


def _write_resume_step(directory: Path, step: int) -> None:
    """The step a restart resumes at, for NVRx's progress tracker (training.contract.launcher)."""
    _replace_text(resume_step_file(directory), f"{step}\n")


def _replace_text(path: Path, text: str, durable: bool = False) -> None:
    """A reader of `path` sees the old text or the new one, never a torn write. `durable`: on disk, name
    included, when this returns (the resume step need not be: the commit it follows already is)."""
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w") as f:
        f.write(text)
        if durable:
            f.flush()
            os.fsync(f.fileno())
    os.replace(tmp, path)
    if durable:
        _fsync_dir(path.parent)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# CheckpointException derives from BaseException; DCP raises it on every rank when any rank failed.
_SAVE_ERRORS = (Exception, CheckpointException)


def _describe(err: BaseException) -> str:
    """One line: the first failing rank's error, not DCP's multi-rank traceback dump."""
    if isinstance(err, CheckpointException) and err.failures:
        rank, cause = next(iter(sorted(err.failures.items())))
        if isinstance(cause, tuple):  # DCP wraps each rank's failure as (exception, traceback)
            cause = cause[0]
        err = cause if isinstance(cause, BaseException) else RuntimeError(str(cause))
        return f"rank {rank}: {type(err).__name__}: {err}"[:500]
    return f"{type(err).__name__}: {err}"[:500]


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
        return self._hook(self._step, functools.partial(super().write_data, plan, planner))


def _file_writer(path: Path, step: int, hook: WriteHook | None) -> dcp.FileSystemWriter:
    return dcp.FileSystemWriter(path) if hook is None else _HookedFileSystemWriter(path, step, hook)


class _AsyncWriter(Protocol):
    def start(self, state: dict[str, Any], path: Path, step: int) -> None: ...
    def done(self, blocking: bool) -> bool:
        """True once the in-flight save is durable on every rank; raises if it failed."""
    def close(self, abort: bool) -> None:
        """Release the writer. abort: the run is dying and peers may be gone, so stop any
        in-flight save without collectives; otherwise no save is in flight any more."""


class _TorchAsyncWriter:
    """dcp.async_save: synchronous staging into CPU copies, background write in a thread.

    The stager is kept for the writer's life: it reuses its staging buffers from one save to the
    next (a stager per save, dcp's default, allocates and page-faults the whole state every time,
    which is most of the blocking on CPU). Reuse is safe because at most one save is in flight.
    Pinned and shared memory are for CUDA copies and a process executor; neither is used here."""

    def __init__(self, process_group: dist.ProcessGroup | None, write_hook: WriteHook | None) -> None:
        self._pg = process_group
        self._hook = write_hook
        self._future = None
        self._stager = DefaultStager(StagingOptions(use_pinned_memory=False, use_shared_memory=False,
                                                    use_async_staging=False, use_non_blocking_copy=False))

    def start(self, state: dict[str, Any], path: Path, step: int) -> None:
        self._future = dcp.async_save(_plain(state), storage_writer=_file_writer(path, step, self._hook),
                                      process_group=self._pg, async_stager=self._stager)

    def done(self, blocking: bool) -> bool:
        assert self._future is not None
        if blocking:
            self._future.result()
        elif not self._future.done():
            return False
        self._future.result()  # re-raises a failed save's exception
        return True

    def close(self, abort: bool) -> None:
        # A thread cannot be stopped: an aborted save fails once the process groups are torn down.
        # Closing the stager frees its staging copy of the state now, not when a cyclic GC finds it
        # (every in-process restart builds a new writer).
        self._stager.close()


class _NvrxAsyncWriter:
    """NVRx async checkpointing (CUDA only: it stages with CUDA copies). Planning is collective
    and synchronous; the write runs in NVRx's persistent worker process; finalization (gather of
    write results, .metadata on the coordinator) runs on every rank in `done`, which NVRx makes a
    collective: every rank must call `poll()`/`wait()` at the same steps, as the train loop does."""

    def __init__(self, process_group: dist.ProcessGroup | None) -> None:
        from nvidia_resiliency_ext.checkpointing.async_ckpt.core import AsyncCallsQueue

        self._pg = process_group
        self._queue = AsyncCallsQueue(persistent=True)

    def start(self, state: dict[str, Any], path: Path, step: int) -> None:
        from functools import partial

        from nvidia_resiliency_ext.checkpointing.async_ckpt.core import AsyncRequest
        from nvidia_resiliency_ext.checkpointing.async_ckpt.filesystem_async import FileSystemWriterAsync
        from nvidia_resiliency_ext.checkpointing.async_ckpt.state_dict_saver import (
            save_state_dict_async_finalize, save_state_dict_async_plan)

        path.mkdir(parents=True, exist_ok=True)
        writer, metadata, dist_wrapper = save_state_dict_async_plan(
            _cpu_snapshot(_plain(state)), FileSystemWriterAsync(path), process_group=self._pg)
        save_fn, preload_fn, save_args = writer.get_save_function_and_args()
        finalize = partial(save_state_dict_async_finalize, writer, metadata, dist_wrapper)
        self._queue.schedule_async_request(AsyncRequest(save_fn, save_args, [finalize], preload_fn=preload_fn))

    def done(self, blocking: bool) -> bool:
        self._queue.maybe_finalize_async_calls(blocking=blocking)
        return self._queue.get_num_unfinalized_calls() == 0

    def close(self, abort: bool) -> None:
        # NVRx 0.7.0: abort terminates the persistent worker (SIGTERM, then SIGKILL) and skips the
        # finalization. Left to garbage collection, the queue's __del__ runs a plain close, whose
        # blocking finalization waits for the worker and then all-reduces over a torn-down group.
        self._queue.close(abort=abort)


def _make_async_writer(device: torch.device, process_group: dist.ProcessGroup | None,
                       write_hook: WriteHook | None) -> _AsyncWriter:
    if device.type == "cuda":
        try:
            writer = _NvrxAsyncWriter(process_group)
            if write_hook is not None:
                log.warning("checkpoint fault injection (ckpt-crash, disk-full) does not reach NVRx's async "
                            "writer: use checkpoint.mode=sync to inject them on CUDA")
            return writer
        except ImportError:
            log.info("nvidia_resiliency_ext async checkpointing not importable; using dcp.async_save")
    return _TorchAsyncWriter(process_group, write_hook)


class CheckpointLoadError(RuntimeError):
    """An intact checkpoint could not be loaded (an I/O error, a timeout, a key the config no longer
    has): the attempt fails, the checkpoint stays where it is."""


class FreshStartRefused(RuntimeError):
    """Committed checkpoints exist but none can be loaded: a start at step 0 would discard them."""


@dataclass(frozen=True)
class Loaded:
    step: int
    path: Path
    world_size: int | None  # the world size that wrote it (from its COMMITTED marker)
    missing: tuple[str, ...]  # optional keys the checkpoint does not hold


@dataclass(frozen=True)
class Held:
    keys: frozenset[str]  # top-level keys of the saved state
    world_size: int | None


@dataclass(frozen=True)
class Damaged:
    evidence: str


def inspect_checkpoint(path: Path) -> Held | Damaged | str:
    """What a committed checkpoint holds, or the evidence that it is damaged: a `.metadata` or
    COMMITTED marker that does not parse, a shard file that is missing or shorter than its metadata
    says. A string when it cannot be checked (an I/O error is no evidence of damage)."""
    try:
        marker = json.loads((path / COMMIT_MARKER).read_text())
        metadata = dcp.FileSystemReader(path).read_metadata()
    except FileNotFoundError as err:
        return Damaged(f"{err.filename or err} is missing")
    except OSError as err:
        return f"{type(err).__name__}: {err}"[:300]
    except Exception as err:  # noqa: BLE001 (JSON or pickle that does not parse: any error the bytes cause)
        return Damaged(f"unreadable marker or .metadata: {type(err).__name__}: {err}"[:300])
    needed: dict[str, int] = {}
    for info in metadata.storage_data.values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    for name, size in sorted(needed.items()):
        try:
            actual = (path / name).stat().st_size
        except FileNotFoundError:
            return Damaged(f"shard file {name} is missing")
        except OSError as err:
            return f"{type(err).__name__}: {err}"[:300]
        if actual < size:
            return Damaged(f"shard file {name} is truncated: {actual} bytes, its metadata needs {size}")
    keys = frozenset(fqn.split(".", 1)[0] for fqn in metadata.state_dict_metadata)
    return Held(keys, marker.get("world_size") if isinstance(marker, dict) else None)


@dataclass
class _InFlight:
    step: int
    tmp: Path
    started: float
    settled: bool = False  # this rank saw it end; rank 0 has committed it or reported its failure


class CheckpointManager:
    """Saves, commits, prunes and loads checkpoints. Every method is called on every rank at the
    same point of the program (they run collectives); only rank 0 renames, deletes and emits."""

    def __init__(self, directory: str | os.PathLike, *, mode: str, keep: int, when_busy: str = "wait",
                 events: EventLog | None = None, device: torch.device = torch.device("cpu"),
                 write_hook: WriteHook | None = None) -> None:
        self.dir = Path(directory)
        self.mode, self.keep, self.when_busy = mode, keep, when_busy
        self.events = events
        self._write_hook = write_hook
        self.distributed = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank() if self.distributed else 0
        self._inflight: _InFlight | None = None
        self._writer: _AsyncWriter | None = None
        self.saved_step: int | None = None  # the newest step this manager saved (every rank knows it)
        self.last_save_s: float | None = None  # how long that save took, start to durable
        self.generation = 0  # see Fencing; every rank learns rank 0's number below
        if self.rank == 0:
            self.dir.mkdir(parents=True, exist_ok=True)
            self.generation = _start_generation(self.dir)
            self._remove_older_saves()  # abandoned by a crash mid-save, or an older generation's
            if not resume_step_file(self.dir).exists():
                newest = committed_checkpoints(self.dir)[:1]
                _write_resume_step(self.dir, newest[0][0] + 1 if newest else 1)
        if mode == "async":
            # A separate group: background-save collectives must not interleave with the training group's.
            group = dist.new_group(backend="gloo") if self.distributed else None
            self._writer = _make_async_writer(device, group, write_hook)
        self.generation = self._broadcast(lambda: self.generation)  # also: no rank writes before the stale dirs are gone

    # ---- saving ----------------------------------------------------------------------------
    def save(self, step: int, state: dict[str, Any]) -> None:
        if self.mode == "off":
            return
        t0 = time.monotonic()
        if self._inflight is not None:
            if self.when_busy == "skip" and not self._all_done():
                self._log(f"checkpoint at step {step} skipped: the save of step {self._inflight.step} is still in flight")
                return
            self.wait()
        tmp = self.dir / f".tmp-{step_dir_name(step)}.g{self.generation}"
        self._emit("ckpt_start", step=step)
        try:
            if self.mode == "sync":
                dcp.save(state, storage_writer=_file_writer(tmp, step, self._write_hook))
            else:
                assert self._writer is not None
                self._writer.start(state, tmp, step)
                self._inflight = _InFlight(step, tmp, t0)
        except _SAVE_ERRORS as err:  # any failed save is survivable: training goes on
            self._inflight = None
            self._emit("ckpt_blocked", step=step, seconds=round(time.monotonic() - t0, 4))
            self._failed(step, tmp, err)
            return
        self._emit("ckpt_blocked", step=step, seconds=round(time.monotonic() - t0, 4))
        if self.mode == "sync":
            self._saved(step, t0)
            self._commit(step, tmp, t0)

    def poll(self) -> None:
        """Commit the in-flight async save if this rank sees it finished (non-blocking). It still
        counts as in flight until `save` or `wait`: a peer may not have seen it finish yet."""
        if self._inflight is not None and not self._inflight.settled:
            self._settle(blocking=False)

    def wait(self) -> None:
        """Block until the in-flight async save is committed or has failed."""
        if self._inflight is not None:
            if not self._inflight.settled:
                self._settle(blocking=True)
            self._inflight = None

    def _all_done(self) -> bool:
        assert self._writer is not None and self._inflight is not None
        try:
            done = self._inflight.settled or self._writer.done(blocking=False)
        except _SAVE_ERRORS:  # failed counts as done; `wait` reports it
            done = True
        if not self.distributed:
            return done
        flag = torch.tensor([0 if done else 1])
        dist.all_reduce(flag)  # every rank must take the same skip/wait decision
        return int(flag.item()) == 0

    def _settle(self, blocking: bool) -> None:
        assert self._writer is not None and self._inflight is not None
        inflight = self._inflight
        try:
            if not self._writer.done(blocking):
                return
        except _SAVE_ERRORS as err:
            inflight.settled = True
            self._failed(inflight.step, inflight.tmp, err)
            return
        inflight.settled = True
        self._saved(inflight.step, inflight.started)
        # Rank 0's save returns only after every rank's write result reached it and .metadata is
        # written: the save is durable whatever the other ranks have seen.
        self._commit(inflight.step, inflight.tmp, inflight.started)

    def _saved(self, step: int, started: float) -> None:
        self.saved_step, self.last_save_s = step, time.monotonic() - started

    def _commit(self, step: int, tmp: Path, started: float) -> None:
        if self.rank != 0:
            return
        final = self.dir / step_dir_name(step)
        try:
            marker = tmp / COMMIT_MARKER
            with open(marker, "w") as f:
                json.dump({"step": step, "world_size": dist.get_world_size() if self.distributed else 1,
                           "generation": self.generation, "time": time.time()}, f)
                f.flush()
                os.fsync(f.fileno())
            _fsync_dir(tmp)
            newest = current_generation(self.dir)
            if newest != self.generation:  # as late as it can be: between this check and the rename, microseconds
                self._failed(step, tmp, SaveFenced(
                    f"fenced: written by generation {self.generation}, and generation {newest} of the workers has "
                    "started since; a newer worker group's checkpoints win"))
                return
            if final.exists():  # same step saved again after a resume from an older checkpoint
                shutil.rmtree(final)
            os.rename(tmp, final)
            _fsync_dir(self.dir)
            _write_resume_step(self.dir, step + 1)
        except OSError as err:
            self._failed(step, tmp, err)
            return
        self._emit("ckpt_committed", step=step, path=str(final), seconds=round(time.monotonic() - started, 4),
                   generation=self.generation)
        for _, old in committed_checkpoints(self.dir)[self.keep:]:
            shutil.rmtree(old, ignore_errors=True)
        self._remove_older_saves()

    def _remove_older_saves(self) -> None:
        """Rank 0: the `.tmp-` dirs of older generations (a crash's debris, a late writer's files). This
        generation's own in-flight save, if any, is the one that just committed."""
        for stale in self.dir.glob(".tmp-step_*"):
            m = _TMP_DIR.match(stale.name)
            if m and int(m.group("generation") or 0) < self.generation:
                shutil.rmtree(stale, ignore_errors=True)

    def _failed(self, step: int, tmp: Path, err: BaseException) -> None:
        if self.rank != 0:
            return
        shutil.rmtree(tmp, ignore_errors=True)
        error = _describe(err)
        self._log(f"checkpoint at step {step} failed, nothing made visible, training goes on: {error}")
        self._emit("ckpt_failed", step=step, error=error)

    # ---- loading ---------------------------------------------------------------------------
    def load(self, state: dict[str, Any], *, optional: frozenset[str] = frozenset(),
             allow_fresh_start: bool = False) -> Loaded | None:
        """Load the newest complete checkpoint into `state`. Returns what was loaded, or None when
        the directory never held a committed checkpoint.

        A checkpoint is set aside (`corrupt-…`, ckpt_fallback) and the previous one tried only on
        evidence of damage (`inspect_checkpoint`). Any other failure raises CheckpointLoadError and leaves the
        checkpoint in place. `optional` names keys of `state` that a checkpoint written at another
        world size may lack (per-rank state): they are left as they are and reported in `missing`.
        If committed checkpoints exist (or were set aside) and none loads, FreshStartRefused, unless
        `allow_fresh_start`."""
        candidates = self._broadcast(
            lambda: (committed_checkpoints(self.dir), sorted(p.name for p in self.dir.glob("corrupt-step_*"))))
        committed, set_aside = candidates
        for i, (step, path) in enumerate(committed):
            found = self._broadcast(lambda: inspect_checkpoint(path))
            if isinstance(found, Damaged):
                older = f"falling back to {committed[i + 1][1].name}" if i + 1 < len(committed) else "no older checkpoint"
                self._log(f"checkpoint {path} is damaged ({found.evidence}); set aside, {older}")
                self._emit("ckpt_fallback", path=str(path), error=found.evidence)
                if self.rank == 0:  # set aside, so no later restart tries it again
                    aside = path.with_name(f"corrupt-{path.name}-{int(time.time())}")
                    os.rename(path, aside)
                    set_aside.append(aside.name)
                if self.distributed:
                    dist.barrier()
                continue
            if isinstance(found, str):
                raise CheckpointLoadError(f"checkpoint {path} could not be inspected ({found}); it was left in place")
            missing = tuple(sorted(k for k in optional if k in state and k not in found.keys))
            try:
                dcp.load({k: v for k, v in state.items() if k not in missing}, checkpoint_id=path)
            except _SAVE_ERRORS as err:  # DCP raises on every rank when any rank fails
                raise CheckpointLoadError(
                    f"checkpoint {path} is intact but could not be loaded ({_describe(err)}); it was left in "
                    "place. An I/O error or timeout may pass on the next attempt; a changed model or optimizer "
                    "config cannot load it: restore the config it was written with") from None
            return Loaded(step, path, found.world_size, missing)
        if committed or set_aside:
            none = f"no checkpoint in {self.dir} can be loaded (set aside as damaged: {', '.join(set_aside)})"
            if not allow_fresh_start:
                raise FreshStartRefused(
                    f"{none}; refusing to start at step 0, which would discard their training. Restore a "
                    "checkpoint into that directory, or set checkpoint.allow_fresh_start=true to train from scratch")
            self._log(f"{none}; starting at step 0 as checkpoint.allow_fresh_start=true says")
        return None

    def _broadcast(self, compute: Callable[[], T]) -> T:
        """`compute()` on rank 0, its result on every rank (file-system checks are rank 0's)."""
        box = [compute() if self.rank == 0 else None]
        if self.distributed:
            dist.broadcast_object_list(box, src=0)
        return box[0]  # type: ignore[return-value]

    # ---- helpers ---------------------------------------------------------------------------
    def close(self) -> None:
        """End of the run, on every rank: commit the in-flight save, then release the writer."""
        self.wait()
        if self._writer is not None:
            self._writer.close(abort=False)

    def abort(self) -> None:
        """The run dies (an exception, an in-process restart): stop the in-flight save without a
        collective; it stays an uncommitted .tmp- dir, removed by the next manager."""
        self._inflight = None
        if self._writer is not None:
            self._writer.close(abort=True)

    def _emit(self, event: str, **fields: Any) -> None:
        if self.rank == 0 and self.events is not None:
            self.events.emit(event, **fields)

    def _log(self, message: str) -> None:
        if self.rank == 0:
            log.warning(message)
