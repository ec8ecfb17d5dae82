"""The checkpoint directory: its names and every file operation of the commit protocol.

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
"""
from __future__ import annotations

import json
import os
import re
import shutil
import time
from pathlib import Path

from training.contract.launcher import resume_step_file

COMMIT_MARKER = "COMMITTED"
GENERATION_FILE = "GENERATION"
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


def start_generation(directory: Path) -> int:
    """Rank 0 of a new worker group: the next generation, made durable before any rank writes."""
    generation = current_generation(directory) + 1
    _replace_text(directory / GENERATION_FILE, f"{generation}\n", durable=True)
    return generation


class SaveFenced(RuntimeError):
    """A newer generation of workers started while this save was in flight: it must not commit."""


def commit(directory: Path, tmp: Path, step: int, *, generation: int, world_size: int) -> Path:
    """Rank 0, once every rank's shards of `tmp` are durable: make the save of `step` the checkpoint
    `step_N`, or raise SaveFenced (a newer generation started) or OSError, leaving `tmp` uncommitted."""
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
    if final.exists():  # same step saved again after a resume from an older checkpoint
        shutil.rmtree(final)
    os.rename(tmp, final)
    _fsync_dir(directory)
    write_resume_step(directory, step + 1)
    return final


def remove_older_saves(directory: Path, generation: int) -> None:
    """Rank 0: the `.tmp-` dirs of generations older than `generation` (a crash's debris, a late writer's
    files). The caller's own in-flight save, if any, is the one that just committed."""
    for stale in directory.glob(".tmp-step_*"):
        m = _TMP_DIR.match(stale.name)
        if m and int(m.group("generation") or 0) < generation:
            shutil.rmtree(stale, ignore_errors=True)


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
