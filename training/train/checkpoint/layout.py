"""The checkpoint directory: its names and every file operation of the commit protocol.

A checkpoint is complete or invisible, and only the newest generation of workers commits one. Atomic
commit (`commit`): every rank writes into `.tmp-step_N.g<generation>`; once every rank's shards are
durable, rank 0 writes the COMMITTED marker and renames the directory to `step_N`, one atomic rename.
Pruning (`prune`, `clean_up`): a checkpoint replaced or pruned is renamed out of sight before it is
deleted, and the next `clean_up` finishes what a crash interrupted. Fencing (`start_generation`): each
worker group takes the next number from GENERATION and commits only while it is still the newest, so a
late worker of an older group never commits with, nor over, a newer group's checkpoint. A full file
system is told apart from other failures (`out_of_space`). Cost: a few fsyncs and renames per commit,
and a replaced checkpoint's space until its replacement is in. For a user: docs/training.md, Checkpoints.
"""
from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import re
import shutil
import threading
import time
from pathlib import Path

from training.contract.launcher import resume_step_file

log = logging.getLogger(__name__)

COMMIT_MARKER = "COMMITTED"
GENERATION_FILE = "GENERATION"
REPLACED_PREFIX, PRUNED_PREFIX = ".replaced-", ".pruned-"
NO_SPACE = frozenset({errno.ENOSPC, errno.EDQUOT})
_STEP_DIR = re.compile(r"^step_(\d{8})$")
_TMP_DIR = re.compile(r"^\.tmp-step_\d{8}(\.g(?P<generation>\d+))?$")  # no generation: written before fencing


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


def save_dir_name(step: int, generation: int) -> str:
    """Where generation `generation` writes its save of `step` until the commit renames it."""
    return f".tmp-{step_dir_name(step)}.g{generation}"


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


def start_generation(directory: Path, found: int | None = None) -> int:
    """Rank 0 of a new worker group: the next generation, made durable before any rank writes. `found`: what
    GENERATION held when the group started, for a group whose first try failed (a full file system) and
    tries again later: SaveFenced if a newer group started meanwhile, which then owns the directory.

    Fencing: every CheckpointManager (one per worker group: an attempt, a rendezvous round, an in-process
    restart) takes the next generation number as it starts (where that write fails, at a later save, unless
    a newer group has started meanwhile; until then it saves nothing), and writes only into
    `save_dir_name(step, its generation)`. A worker of an older generation that is still running (a node cut
    off from its peers but not from the file system, a paused process) therefore writes where no newer save
    looks, and its rank 0 commits only while GENERATION still holds its own number, checked just before the
    rename (`commit`): a late save is never committed with, nor over, a newer generation's checkpoint
    (ckpt_failed says it was fenced). Its leftovers are removed when a newer generation starts or commits
    (`remove_older_saves`)."""
    newest = current_generation(directory)
    if found is not None and newest != found:
        raise SaveFenced(f"fenced: generation {newest} of the workers started after this worker group found "
                         f"{found}; a newer worker group's checkpoints win")
    _replace_text(directory / GENERATION_FILE, f"{newest + 1}\n", durable=True)
    return newest + 1


class SaveFenced(RuntimeError):
    """A newer generation of workers started while this save was in flight: it must not commit."""


def commit(directory: Path, tmp: Path, step: int, *, generation: int, world_size: int) -> Path:
    """Rank 0, once every rank's shards of `tmp` are durable: make the save of `step` the checkpoint
    `step_N`, or raise SaveFenced (a newer generation started) or OSError, leaving `tmp` uncommitted.

    Atomic commit: every rank writes its shards (fsynced) into `tmp`; DCP's coordinator (rank 0) writes
    `.metadata` only after gathering every rank's write result, so when rank 0's save returns, all data is
    durable. Here rank 0 writes COMMITTED (a JSON marker), renames the directory to `step_N` (one atomic
    rename) and fsyncs the parent. A crash at any point before the rename leaves only a `.tmp-` directory,
    never loaded. A save of a step that already has a checkpoint (the same step trained again after a resume
    from an older one) first renames the old one to `.replaced-step_N`, then renames the new one in, then
    deletes the old: a crash between the two renames leaves no `step_N`, and the next worker group puts the
    old one back (`clean_up`), so one of the two is always there."""
    final = directory / step_dir_name(step)
    with open(tmp / COMMIT_MARKER, "w") as f:
        json.dump({"step": step, "world_size": world_size, "generation": generation, "time": time.time()}, f)
        f.flush()
        os.fsync(f.fileno())
    _fsync_dir(tmp)
    newest = current_generation(directory)
    if newest != generation:  # as late as it can be: between this check and the rename, microseconds
        raise SaveFenced(f"fenced: written by generation {generation}, and generation {newest} of the workers has "
                         "started since; a newer worker group's checkpoints win")
    replaced = directory / f"{REPLACED_PREFIX}{final.name}"
    if final.exists():  # same step saved again after a resume from an older checkpoint
        _delete(replaced)  # a leftover of an earlier replacement whose deletion failed
        os.rename(final, replaced)  # not deleted yet: a crash before the next rename puts it back (clean_up)
    os.rename(tmp, final)
    # Committed from here on: the renamed directory is complete (its marker is durable). What follows is
    # bookkeeping, whose failure (a full file system, an FSx hiccup) must not report the save as failed.
    try:
        _fsync_dir(directory)
    except OSError as err:
        log.warning("checkpoint %s committed, but its directory could not be synced (%s): a crash of the file "
                    "server may still undo the rename", final, err)
    _delete(replaced)
    try:
        write_resume_step(directory, step + 1)
    except OSError as err:
        log.warning("checkpoint %s committed, but %s could not be written (%s); the next commit writes it",
                    final, resume_step_file(directory).name, err)
    return final


def remove_older_saves(directory: Path, generation: int) -> None:
    """Rank 0: the `.tmp-` dirs of generations older than `generation` (a crash's debris, a late writer's
    files). The caller's own in-flight save, if any, is the one that just committed."""
    for stale in directory.glob(".tmp-step_*"):
        m = _TMP_DIR.match(stale.name)
        if m and int(m.group("generation") or 0) < generation:
            shutil.rmtree(stale, ignore_errors=True)


def prune(directory: Path, keep: int) -> list[Path]:
    """Rank 0, after a commit: the committed checkpoints older than the newest `keep` renamed out of sight
    (`.pruned-…`); returns those, for a BackgroundDeletion to delete.

    Pruning: the rename is atomic, so a pruned checkpoint stops being one at once; the deletion follows in a
    background thread. What an interrupted deletion leaves is deleted by the next `clean_up` (at every worker
    group's start, and after every commit)."""
    hidden = (_hide(old) for _, old in committed_checkpoints(directory)[keep:])
    return [path for path in hidden if path is not None]


class BackgroundDeletion:
    """Deletes pruned checkpoints in a thread of their own: unlinking a shard file of hundreds of MiB waits
    for the file system with hardly any CPU, a wait the training thread should not make. One deletion at a
    time; what a crash or an error leaves, the next clean_up deletes."""

    def __init__(self) -> None:
        self._thread: threading.Thread | None = None

    def start(self, paths: list[Path]) -> None:
        def delete() -> None:
            for path in paths:
                _delete(path)

        self.wait()
        if paths:  # a daemon: a dying process leaves the rest to clean_up
            self._thread = threading.Thread(target=delete, name="ckpt-deletion", daemon=True)
            self._thread.start()

    def wait(self) -> None:
        """Block until the deletion in progress, if any, has ended."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None


def clean_up(directory: Path) -> None:
    """Rank 0, as a worker group starts and after each commit: finish what a crash or an I/O error
    interrupted. A replaced checkpoint whose replacement was never renamed in goes back; deletions
    (Pruning) are finished. Errors are logged, and left for the next time."""
    for path in sorted(directory.glob(f"{REPLACED_PREFIX}step_*")):
        final = directory / path.name.removeprefix(REPLACED_PREFIX)
        if final.exists():
            _delete(path)
            continue
        try:
            os.rename(path, final)
        except OSError as err:
            log.warning("cannot put %s back as %s (%s); trying again later", path, final, err)
            continue
        log.warning("checkpoint %s: its replacement by a new save was interrupted; the checkpoint is back", final)
    for path in sorted(directory.glob(f"{PRUNED_PREFIX}step_*")):
        _delete(path)
    # A commit renames only complete directories, so a `step_N` without its marker is what a deletion in place
    # (before pruning renamed first) left half done.
    for path in sorted(directory.glob("step_*")):
        if _STEP_DIR.match(path.name) and not _has_marker(path):
            log.warning("checkpoint directory %s has no %s marker: what an interrupted deletion left; deleting it",
                        path, COMMIT_MARKER)
            _discard(path)


def out_of_space(err: BaseException) -> bool:
    """Whether a failed save failed because its file system is full: ENOSPC, or EDQUOT (a quota), on any
    rank (DCP's CheckpointException holds each rank's failure in `failures`, as (exception, traceback))."""
    pending, seen = [err], set()
    while pending:
        e = pending.pop()
        if not isinstance(e, BaseException) or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in NO_SPACE:
            return True
        failures = getattr(e, "failures", None)
        if isinstance(failures, dict):
            pending += [f[0] if isinstance(f, tuple) else f for f in failures.values()]
        pending += [e.__cause__, e.__context__]
    return False


def free_bytes(directory: Path) -> int | None:
    """Bytes free to this process on the file system of `directory` (None when it cannot say)."""
    try:
        return shutil.disk_usage(directory).free
    except OSError:
        return None


def _has_marker(path: Path) -> bool:
    """Whether `path` holds the COMMITTED marker; an error other than its absence (an I/O error) counts
    as having it: nothing is deleted on what could not be checked."""
    try:
        (path / COMMIT_MARKER).stat()
    except FileNotFoundError:
        return False
    except OSError:
        return True
    return True


def _discard(path: Path) -> None:
    """Delete a checkpoint directory, invisible from the first moment: renamed to `.pruned-…`, then deleted."""
    pruned = _hide(path)
    if pruned is not None:
        _delete(pruned)


def _hide(path: Path) -> Path | None:
    """A checkpoint directory renamed to `.pruned-…` (no checkpoint any more), or None where the rename failed."""
    pruned = path.with_name(f"{PRUNED_PREFIX}{path.name}")
    _delete(pruned)  # a leftover of an earlier deletion of the same step
    try:
        os.rename(path, pruned)
    except OSError as err:
        log.warning("cannot delete %s (%s); trying again after the next commit", path, err)
        return None
    return pruned


def _delete(path: Path) -> None:
    """Delete a directory that is no checkpoint (any more); an error is logged, and what is left is
    deleted by the next clean_up."""
    try:
        shutil.rmtree(path)
    except FileNotFoundError:
        pass
    except OSError as err:
        log.warning("cannot delete %s (%s); trying again after the next commit", path, err)


def set_aside(path: Path) -> str:
    """Rank 0: rename a damaged checkpoint to `corrupt-step_N-<time>`, so no later restart tries it
    again (it is kept, never deleted); returns the new name."""
    aside = path.with_name(f"corrupt-{path.name}-{int(time.time())}")
    os.rename(path, aside)
    return aside.name


def set_aside_names(directory: Path) -> list[str]:
    """The checkpoints set aside as damaged, by name."""
    return sorted(p.name for p in directory.glob("corrupt-step_*"))


def write_resume_step(directory: Path, step: int) -> None:
    """The step a restart resumes at, for NVRx's progress tracker (training.contract.launcher)."""
    _replace_text(resume_step_file(directory), f"{step}\n")


def _replace_text(path: Path, text: str, durable: bool = False) -> None:
    """A reader of `path` sees the old text or the new one, never a torn write. `durable`: on disk, name
    included, when this returns (the resume step need not be: the commit it follows already is)."""
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        with open(tmp, "w") as f:
            f.write(text)
            if durable:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError:
        with contextlib.suppress(OSError):  # no debris of a write that failed (a full file system)
            tmp.unlink()
        raise
    if durable:
        _fsync_dir(path.parent)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
