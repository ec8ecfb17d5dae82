"""CheckpointManager: saves, commits, prunes and loads checkpoints, on every rank at the same points of
the program (`layout` has the directory and the commit protocol, `writers` the DCP writers).

Why: nothing a fault, a drain or a resize does may discard training. A failing save (a full file system
included) is an event and a log line, and training goes on; only evidence of damage sets a checkpoint
aside, and a checkpoint that cannot match the state (CheckpointMismatch) fails the Job instead of being
retried. Cost: at most one async save in flight, and a `poll()` on every rank every step that commits a
finished one. What each failure does, and how loading falls back: docs/training.md, "Checkpoints" and
"Async saves".
"""
from __future__ import annotations

import contextlib
import logging
import os
import shutil
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import CheckpointException

from training.contract.config import CheckpointConfig, TrainConfig
from training.contract.events import EventLog
from training.contract.launcher import resume_step_file
from training.train.agreement import every, first_found, from_rank0
from training.train.checkpoint.fit import misfit
from training.train.checkpoint.inspection import Damaged, Held, inspect_checkpoint
from training.train.checkpoint.layout import (GENERATION_FILE, BackgroundDeletion, SaveFenced, clean_up, commit,
                                              committed_checkpoints, current_generation, free_bytes, out_of_space,
                                              prune, remove_older_saves, save_dir_name, set_aside, set_aside_names,
                                              start_generation, write_resume_step)
from training.train.checkpoint.writer_process import Replaced
from training.train.drain import agree_on_save, checkpoint_cost
from training.train.checkpoint.writers import AsyncWriter, WriteHook, WriterDeadlines, file_writer, make_async_writer

log = logging.getLogger(__name__)


# CheckpointException derives from BaseException; DCP raises it on every rank when any rank failed.
_SAVE_ERRORS = (Exception, CheckpointException)
# A group's search for the newest checkpoint of any group, sent back by pruning while it read one (`load`).
PRUNED_RESCANS = 5


def _describe(err: BaseException) -> str:
    """One line: the first failing rank's error, not DCP's multi-rank traceback dump."""
    if isinstance(err, CheckpointException) and err.failures:
        rank, cause = next(iter(sorted(err.failures.items())))
        if isinstance(cause, tuple):  # DCP wraps each rank's failure as (exception, traceback)
            cause = cause[0]
        err = cause if isinstance(cause, BaseException) else RuntimeError(str(cause))
        return f"rank {rank}: {type(err).__name__}: {err}"[:500]
    return f"{type(err).__name__}: {err}"[:500]


class NoGeneration(RuntimeError):
    """This worker group has no generation (`layout`, Fencing), so it saves nothing: GENERATION could not be
    written (a full file system, an I/O error; tried again at every save) or, `fenced`, a newer group started."""

    def __init__(self, message: str, fenced: bool = False) -> None:
        super().__init__(message)
        self.fenced = fenced


class CheckpointLoadError(RuntimeError):
    """An intact checkpoint could not be loaded (an I/O error, a timeout): the attempt fails, the checkpoint
    stays where it is, and a retry may load it."""


class _PrunedWhileRead(Exception):
    """Another group's checkpoint vanished while this group read it: its writer pruned it."""

    def __init__(self, path: Path) -> None:
        super().__init__(str(path))
        self.path = path


class CheckpointMismatch(RuntimeError):
    """An intact checkpoint cannot be loaded into this run's state (a key it lacks, a tensor of another
    size): every attempt would fail the same way."""


class FreshStartRefused(RuntimeError):
    """Committed checkpoints exist but none can be loaded: a start at step 0 would discard them."""


@dataclass(frozen=True)
class Loaded:
    step: int
    path: Path
    world_size: int | None  # the world size that wrote it (from its COMMITTED marker)
    missing: tuple[str, ...]  # optional keys the checkpoint does not hold


class SharedState(Protocol):
    """Replica groups that hold the same state (training.train.replica_groups.ReplicaGroups): one writes."""
    writes_checkpoints: bool  # this rank's group writes the periodic checkpoints of the current quorum


@dataclass
class _InFlight:
    step: int
    tmp: Path
    started: float
    blocked_s: float  # how long the training thread waited for this save so far
    staged: bool = False  # its staging copy is made and its ckpt_blocked emitted
    settled: bool = False  # this rank saw it end; rank 0 has committed it or reported its failure
    committed: bool = False  # rank 0: the commit succeeded (other ranks learn it in `wait`)


class CheckpointManager:
    """Saves, commits, prunes and loads checkpoints. Every method is called on every rank at the
    same point of the program (they run collectives); only rank 0 renames, deletes and emits. The training
    loop calls `step_done` after every step: the manager decides which steps it saves.

    Args:
        config: the checkpoint section: directory, interval, mode, keep, when_busy, the final export and the
            other groups' directories a resume also reads.
        run_dir: the run's directory: the checkpoints are in <run_dir>/checkpoints unless checkpoint.dir names
            another, the final state in <run_dir>/final.
        events: where the saves are told (rank 0's log; None on other ranks is allowed).
        device: the training device (the async writer stages from it).
        write_hook: wraps each shard write (fault injection, an emulated slow file system).
        deadlines: how long an async save waits on its writer (WriterDeadlines.of the run's config); None: those
            of the default config.
        around_save: the context of the periodic saves and of `close` (the rank monitor's checkpoint section:
            NVRx learns how long saves take, apart from the steps).
    """

    def __init__(self, config: CheckpointConfig, run_dir: str | os.PathLike, *, events: EventLog | None = None,
                 device: torch.device = torch.device("cpu"), write_hook: WriteHook | None = None,
                 deadlines: WriterDeadlines | None = None,
                 around_save: Callable[[], AbstractContextManager[object]] = contextlib.nullcontext) -> None:
        self.dir = Path(config.directory(run_dir))
        self.interval = config.interval
        self.final_dir = Path(run_dir) / "final" if config.save_final else None
        self._around_save = around_save
        self._shared: SharedState | None = None
        self.also_resume_from = tuple(Path(d) for d in config.also_resume_from)  # read only: another group's
        self.mode, self.keep, self.when_busy = config.mode, config.keep, config.when_busy
        self.events = events
        self._write_hook = write_hook
        self.distributed = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank() if self.distributed else 0
        self._inflight: _InFlight | None = None
        self._writer: AsyncWriter | None = None
        self._prepared = False
        self._deletion = BackgroundDeletion()  # rank 0's deletion of pruned checkpoints
        # The newest step this manager committed: every rank learns rank 0's outcome in `wait` (async) or
        # `save` (sync), so it never counts a save that was fenced or failed to commit.
        self.saved_step: int | None = None
        self.last_save_s: float | None = None  # how long the last save that was written took, start to durable
        # See `layout`, Fencing; every rank learns rank 0's number below. 0: none (NoGeneration, rank 0's
        # `_no_generation`): the group trains without checkpoints, and rank 0 tries again at every save.
        self.generation = 0
        self._found_generation: int | None = None  # rank 0: what GENERATION held as this group started
        self._no_generation: NoGeneration | None = None
        if self.rank == 0:
            self.generation = self._start_generation()
        if self.mode == "async":
            deadlines = deadlines or WriterDeadlines.of(TrainConfig())
            # A separate group: background-save collectives must not interleave with the training group's.
            group = dist.new_group(backend="gloo", timeout=deadlines.group_timeout) if self.distributed else None
            self._writer = make_async_writer(device, group, write_hook, deadlines, self._writer_replaced)
        self.generation = from_rank0(lambda: self.generation)  # also: no rank writes before the stale dirs are gone

    def _start_generation(self) -> int:
        """Rank 0: this worker group's generation, its directory rid of older groups' debris; 0 where it has
        none (`_no_generation` says why: GENERATION could not be written, or a newer group started since)."""
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            if self._found_generation is None:  # an I/O error here too: the retry compares with what it finds
                self._found_generation = current_generation(self.dir)
            generation = start_generation(self.dir, self._found_generation)
        except SaveFenced as err:
            self._no_generation = NoGeneration(f"{err}: this worker group saves no checkpoint", fenced=True)
            return 0
        except OSError as err:
            self._no_generation = NoGeneration(
                f"{GENERATION_FILE} could not be written ({type(err).__name__}: {err}): this worker group saves no "
                "checkpoint until it can")
            self._no_generation.__cause__ = err  # out_of_space looks there
            return 0
        self._no_generation = None
        try:
            remove_older_saves(self.dir, generation)  # abandoned by a crash mid-save, or an older generation's
            clean_up(self.dir)  # an interrupted replacement or deletion
            if not resume_step_file(self.dir).exists():
                newest = committed_checkpoints(self.dir)[:1]
                write_resume_step(self.dir, newest[0][0] + 1 if newest else 1)
        except OSError as err:  # each commit clears up again
            log.warning("checkpoint directory %s: clearing up as generation %d starts failed (%s); the next commit "
                        "tries again", self.dir, generation, err)
        return generation

    def _retry_generation(self, step: int) -> bool:
        """Every rank, at a save of a group without a generation: rank 0 tries to take one again (space may have
        been freed). Where it cannot, the save is skipped with an error line and ckpt_failed (ckpt_no_space)."""
        t0 = time.monotonic()
        if self.rank == 0 and not (self._no_generation is not None and self._no_generation.fenced):
            self.generation = self._start_generation()
        self.generation = from_rank0(lambda: self.generation)
        if self.generation:
            self._log(f"checkpoints resume at step {step}: this worker group is generation {self.generation} now")
            return True
        if self.rank == 0:
            assert self._no_generation is not None
            log.error("NO CHECKPOINT at step %d, training goes on without: %s (tried again at every save)", step,
                      self._no_generation)
            self._emit("ckpt_start", step=step)
            self._emit("ckpt_blocked", step=step, seconds=round(time.monotonic() - t0, 4))
            self._failed(step, None, self._no_generation)
        return False

    def shared_by(self, groups: SharedState) -> None:
        """The state is held by every live replica group alike: a periodic save is written by the group
        `groups` elects, and the others' rank 0 only advances ft_launcher's progress file, as the step is held
        by a live group and in the writer's directory, from which they also resume."""
        self._shared = groups

    @property
    def writer_pid(self) -> int | None:
        """The process that writes this rank's shards of an async save, where there is one (bench.stall
        charges its CPU time to the writer, not to the rank)."""
        return self._writer.writer_pid if self._writer is not None else None

    def prepare(self, state: dict[str, Any]) -> None:
        """Async mode: start allocating the buffers a save of `state` stages into, in the background (on CPU,
        `staging`; once: later calls do nothing). Call it once `state` holds every tensor a save will hold
        (AdamW's moments exist after the first optimizer step): the first save then only copies."""
        if self._writer is not None and not self._prepared:
            self._prepared = True
            self._writer.prepare(state)

    def wait_for_writer(self) -> None:
        """Async mode: block until the background writer can take a save (on CPU, at once where the rank's
        zygote forked it; seconds where a new interpreter had to import torch) and, where `prepare` came
        first (as bench.stall._interleaved does), its buffers are allocated. Called at the end of the rank's setup,
        so that the first saves do not wait for the writer."""
        if self._writer is not None:
            self._writer.wait_ready()

    # ---- saving ----------------------------------------------------------------------------
    def step_done(self, step: int, state: dict[str, Any]) -> None:
        """Once per completed step, on every rank: the staging buffers start after the first (`prepare`), an
        async save this rank sees finished commits (`poll`), and every `interval` steps a periodic save
        starts, inside `around_save` (with replica groups, by the elected group alone: `shared_by`)."""
        self.prepare(state)
        self.poll()
        if step % self.interval:
            return
        with self._around_save():
            if self._shared is None or self._shared.writes_checkpoints:
                self.save(step, state)
            elif self.rank == 0:
                try:
                    write_resume_step(self.dir, step + 1)
                except OSError as err:  # an FSx error must not stop training; the next interval writes it
                    log.warning("step %d: ft_launcher's progress file could not be written (%s)", step, err)

    def save(self, step: int, state: dict[str, Any]) -> None:
        if self.mode == "off" or (self.generation == 0 and not self._retry_generation(step)):
            return
        t0 = time.monotonic()
        if self._inflight is not None:
            if self.when_busy == "skip" and not self._all_done():
                self._log(f"checkpoint at step {step} skipped: the save of step {self._inflight.step} is still in flight")
                return
            self.wait()
        tmp = self.dir / save_dir_name(step, self.generation)
        self._emit("ckpt_start", step=step)
        try:
            if self.mode == "sync":
                dcp.save(state, storage_writer=file_writer(tmp, step, self._write_hook))
            else:
                assert self._writer is not None
                self._writer.start(state, tmp, step)
                self._inflight = _InFlight(step, tmp, t0, blocked_s=time.monotonic() - t0)
        except _SAVE_ERRORS as err:  # any failed save is survivable: training goes on
            self._inflight = None
            self._emit("ckpt_blocked", step=step, seconds=round(time.monotonic() - t0, 4))
            self._failed(step, tmp, err)
            return
        if self.mode == "async":
            assert self._writer is not None and self._inflight is not None
            if self._writer.staged():  # NVRx stages in `start`
                self._staging_done(self._inflight)
            return
        self._emit("ckpt_blocked", step=step, seconds=round(time.monotonic() - t0, 4))
        if self.mode == "sync":
            self.last_save_s = time.monotonic() - t0
            self._agree_on_commit(step, self._commit(step, tmp, t0))

    # ---- a drain's way (training.train.drain.Drain) ---------------------------------------------
    def drain_cost(self, step: int) -> float:
        """Seconds until `step` is committed, as last measured (training.train.drain.checkpoint_cost)."""
        return checkpoint_cost(step, enabled=self.mode != "off", saved_step=self.saved_step,
                               in_flight=self.in_flight(), last_save_s=self.last_save_s)

    def committed(self, step: int) -> bool:
        """Whether `step` is committed and no save is in flight."""
        return self.saved_step == step and self.in_flight() is None

    def drain(self, step: int, state: dict[str, Any], time_left: Callable[[], float]) -> bool:
        """Let the in-flight save commit; then save `step` if it was not that one and every rank's
        `time_left()` still covers a save. Whether `step` is committed (every rank knows rank 0's outcome)."""
        self.wait()
        if self.saved_step != step and agree_on_save(time_left(), self.last_save_s):
            self.save(step, state)
            self.wait()
        return self.saved_step == step

    def settle(self, step: int) -> bool:
        """The in-flight save's outcome; whether `step` is committed."""
        self.wait()
        return self.saved_step == step

    def wait_staged(self) -> float:
        """Block until the in-flight async save's staging copy is made: call it before the state changes
        (the optimizer's step). The save's ckpt_blocked is emitted then. Returns the seconds waited (a
        step that waited holds them: not training time). Not collective."""
        inflight = self._inflight
        if inflight is None or inflight.staged:
            return 0.0
        assert self._writer is not None
        t0 = time.monotonic()
        self._writer.wait_staged()
        waited = time.monotonic() - t0
        inflight.blocked_s += waited
        self._staging_done(inflight)
        return waited

    def _staging_done(self, inflight: _InFlight) -> None:
        inflight.staged = True
        self._emit("ckpt_blocked", step=inflight.step, seconds=round(inflight.blocked_s, 4))

    def poll(self) -> None:
        """Commit the in-flight async save if this rank sees it finished (non-blocking). It still
        counts as in flight until `save` or `wait`: a peer may not have seen it finish yet."""
        if self._inflight is not None and not self._inflight.settled:
            self._settle(blocking=False)

    def wait(self) -> None:
        """Block until the in-flight async save is committed or has failed, and every rank knows which
        (collective: every rank calls it at the same point, as it calls `save`)."""
        if self._inflight is not None:
            inflight = self._inflight
            if not inflight.settled:
                self._settle(blocking=True)
            self._inflight = None
            self._agree_on_commit(inflight.step, inflight.committed)

    def in_flight(self) -> tuple[int, float] | None:
        """The in-flight async save's step and the seconds since it started (None: none in flight)."""
        if self._inflight is None:
            return None
        return self._inflight.step, time.monotonic() - self._inflight.started

    def _all_done(self) -> bool:
        assert self._writer is not None and self._inflight is not None
        try:
            done = self._inflight.settled or self._writer.done(blocking=False)
        except _SAVE_ERRORS:  # failed counts as done; `wait` reports it
            done = True
        return every(done)  # every rank must take the same skip/wait decision

    def _settle(self, blocking: bool) -> None:
        assert self._writer is not None and self._inflight is not None
        inflight = self._inflight
        if blocking:
            self.wait_staged()  # its copy ends before its write: counted as blocking, as ever
        try:
            if not self._writer.done(blocking):
                return
            error = None
        except _SAVE_ERRORS as err:
            error = err
        self.wait_staged()  # at once: the copy was made (or failed) before the write ended
        inflight.settled = True
        if error is not None:
            self._failed(inflight.step, inflight.tmp, error)
            return
        self.last_save_s = time.monotonic() - inflight.started
        # Rank 0's save returns only after every rank's write result reached it and .metadata is
        # written: the save is durable whatever the other ranks have seen.
        inflight.committed = self._commit(inflight.step, inflight.tmp, inflight.started)

    def _agree_on_commit(self, step: int, committed: bool) -> None:
        """Every rank learns whether rank 0 committed `step` (a broadcast): no rank goes on (a drain: leaves
        the process) while rank 0 may still be renaming, writing resume_step or pruning (the renames: the
        deletions run on in their thread), and `saved_step` names only a committed step."""
        if from_rank0(lambda: step if committed else -1) == step:
            self.saved_step = step

    def _commit(self, step: int, tmp: Path, started: float) -> bool:
        """Rank 0: make the save of `step` a checkpoint; whether it did (other ranks: False, see
        `_agree_on_commit`)."""
        if self.rank != 0:
            return False
        try:
            final = commit(self.dir, tmp, step, generation=self.generation,
                           world_size=dist.get_world_size() if self.distributed else 1)
        except (SaveFenced, OSError) as err:
            self._failed(step, tmp, err)
            return False
        self._emit("ckpt_committed", step=step, path=str(final), seconds=round(time.monotonic() - started, 4),
                   generation=self.generation)
        self._deletion.wait()  # the last commit's, long done as a rule: clean_up must not race it
        try:
            remove_older_saves(self.dir, self.generation)
            clean_up(self.dir)
            self._deletion.start(prune(self.dir, self.keep))
        except OSError as err:  # committed all the same; what is left, the next commit clears up
            log.warning("checkpoint %s committed; clearing up and pruning after it failed (%s): the next commit "
                        "tries again", final, err)
        return True

    def _failed(self, step: int, tmp: Path | None, err: BaseException) -> None:
        if self.rank != 0:
            return
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        error = _describe(err)
        self._log(f"checkpoint at step {step} failed, nothing made visible, training goes on: {error}")
        self._emit("ckpt_failed", step=step, error=error)
        if out_of_space(err):
            free = free_bytes(self.dir)
            log.error("checkpoint directory %s: its file system is full (%s bytes free): no checkpoint can be saved "
                      "until space is freed there (old runs, set-aside corrupt-* checkpoints; on EKS a larger "
                      "fsxStorageGib); training goes on without", self.dir, "?" if free is None else free)
            self._emit("ckpt_no_space", step=step, path=str(self.dir), free_bytes=free, error=error)

    # ---- loading ---------------------------------------------------------------------------
    def load(self, state: dict[str, Any], *, optional: frozenset[str] = frozenset(),
             allow_fresh_start: bool = False) -> Loaded | None:
        """Load the newest complete checkpoint of the directory and `also_resume_from` into `state`. Returns
        what was loaded, or None when the directories never held a committed checkpoint.

        A checkpoint is set aside (`corrupt-…`, ckpt_fallback) and the previous one tried only on
        evidence of damage (`inspect_checkpoint`); one in `also_resume_from` is skipped, left to its owner.
        One there that its group pruned while this one read it (a newer save replaced it) sends the search
        back to the newest, up to PRUNED_RESCANS times. Any other failure raises CheckpointLoadError and
        leaves the checkpoint in place. `optional` names keys of `state` that a checkpoint written at another
        world size may lack (per-rank state): they are left as they are and reported in `missing`.
        If committed checkpoints exist (or were set aside) and none loads, FreshStartRefused, unless
        `allow_fresh_start`."""
        for _ in range(PRUNED_RESCANS):
            try:
                return self._load_newest(state, optional, allow_fresh_start)
            except _PrunedWhileRead as pruned:
                self._log(f"checkpoint {pruned.path} was pruned by its group while this one read it (a newer save "
                          "replaced it); looking for the newest again")
        raise CheckpointLoadError(f"the other groups' checkpoints were pruned {PRUNED_RESCANS} times while being "
                                  "read: their saves come faster than this group loads one; raise checkpoint.keep")

    def _load_newest(self, state: dict[str, Any], optional: frozenset[str],
                     allow_fresh_start: bool) -> Loaded | None:
        committed, damaged = from_rank0(lambda: (self._resumable(), set_aside_names(self.dir)))
        for i, (step, path) in enumerate(committed):
            found = from_rank0(lambda: inspect_checkpoint(path))
            if not isinstance(found, Held):
                self._unless_pruned(path)
            if isinstance(found, Damaged):
                older = f"falling back to {committed[i + 1][1].name}" if i + 1 < len(committed) else "no older checkpoint"
                own = path.parent == self.dir
                self._log(f"checkpoint {path} is damaged ({found.evidence}); {'set aside' if own else 'skipped'}, "
                          f"{older}")
                self._emit("ckpt_fallback", path=str(path), error=found.evidence)
                if self.rank == 0 and own:
                    damaged.append(set_aside(path))
                if self.distributed:
                    dist.barrier()
                continue
            if isinstance(found, str):
                raise CheckpointLoadError(f"checkpoint {path} could not be inspected ({found}); it was left in place")
            missing = tuple(sorted(k for k in optional if k in state and k not in found.keys))
            loadable = {k: v for k, v in state.items() if k not in missing}
            mismatch = first_found(lambda: misfit(loadable, path))
            if mismatch is not None:
                self._unless_pruned(path)
                raise CheckpointMismatch(
                    f"checkpoint {path} is intact but cannot be loaded into this run's model and optimizer "
                    f"({mismatch}); it was left in place. Restore the config it was written with (model.preset, "
                    "the optimizer), or train with another checkpoint directory")
            try:
                dcp.load(loadable, checkpoint_id=path)
            except _SAVE_ERRORS as err:  # DCP raises on every rank when any rank fails
                self._unless_pruned(path)
                raise CheckpointLoadError(
                    f"checkpoint {path} is intact but could not be loaded ({_describe(err)}); it was left in "
                    "place: an I/O error or timeout may pass on the next attempt") from None
            return Loaded(step, path, found.world_size, missing)
        if committed or damaged:
            none = f"no checkpoint in {self.dir} can be loaded (set aside as damaged: {', '.join(damaged)})"
            if not allow_fresh_start:
                raise FreshStartRefused(
                    f"{none}; refusing to start at step 0, which would discard their training. Restore a "
                    "checkpoint into that directory, or set checkpoint.allow_fresh_start=true to train from scratch")
            self._log(f"{none}; starting at step 0 as checkpoint.allow_fresh_start=true says")
        return None

    def _unless_pruned(self, path: Path) -> None:
        """After a failed read of `path`: _PrunedWhileRead if it is another group's and is gone (its group's
        pruning renames it out of sight at once), on every rank alike."""
        if path.parent != self.dir and from_rank0(lambda: not path.exists()):
            raise _PrunedWhileRead(path)

    # ---- helpers ---------------------------------------------------------------------------
    def _resumable(self) -> list[tuple[int, Path]]:
        """Committed checkpoints of the directory and `also_resume_from`, newest first; the own first of a step."""
        found = [(step, i, path) for i, directory in enumerate((self.dir, *self.also_resume_from))
                 for step, path in committed_checkpoints(directory)]
        return [(step, path) for step, _, path in sorted(found, key=lambda f: (-f[0], f[1]))]

    def close(self, final: dict[str, Any] | None = None) -> None:
        """End of the run, on every rank, inside `around_save`: commit the in-flight save, release the writer,
        then write `final` (a synchronous DCP save) to `final_dir`, where the config asks for it."""
        with self._around_save():
            self.wait()
            if self._writer is not None:
                self._writer.close(abort=False)
            self._deletion.wait()
            if final is not None and self.final_dir is not None:
                dcp.save(final, checkpoint_id=self.final_dir)

    def abort(self) -> None:
        """The run dies (an exception, an in-process restart): stop the in-flight save without a
        collective; it stays an uncommitted .tmp- dir, removed by the next manager. Pruned checkpoints
        still being deleted are left to their thread (and to the next manager's clean_up)."""
        if self._inflight is not None and not self._inflight.staged:
            self._staging_done(self._inflight)  # the save's blocking so far: every started save has one
        self._inflight = None
        if self._writer is not None:
            self._writer.close(abort=True)
            self._writer = None  # closed once: a drain that abandoned its save aborts before the run's end does

    def _writer_replaced(self, replaced: Replaced) -> None:
        """This rank's writer was found dead or stuck and replaced: an event of this rank's own (not rank 0's)."""
        if self.events is not None:
            self.events.emit("ckpt_writer_replaced", rank=self.rank, process=replaced.process, pid=replaced.pid,
                             new_pid=replaced.new_pid, reason=replaced.reason)

    def _emit(self, event: str, **fields: Any) -> None:
        if self.rank == 0 and self.events is not None:
            self.events.emit(event, **fields)

    def _log(self, message: str) -> None:
        if self.rank == 0:
            log.warning(message)
