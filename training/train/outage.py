"""An injected file-system outage in this rank (the `fs-eio` fault): for a few seconds, every file operation
of this process on the run and checkpoint directories fails with EIO, as an FSx client eviction or failover
makes Lustre's calls fail until the client reconnects.

No file system here can fail on demand (no device-mapper, no FUSE library), so the outage is played at the
boundary of CPython's file calls (`begin_outage`): an audit hook refuses them, and the descriptors already
open there fail until it ends. Other processes see no outage. Cost: a Python call per audited event of the
process once the first outage began (a comparison of the clock, once it is over).
"""
from __future__ import annotations

import errno
import logging
import os
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

# CPython's audit events (the "Audit events table" of the Python docs) that name a path as their first argument
# and stand for one system call. Not shutil.rmtree's: it is raised outside the error handling of the calls it
# makes (which raise their own), so refusing it would fail even a deletion told to ignore errors.
_PATH_EVENTS = frozenset({"open", "os.rename", "os.remove", "os.rmdir", "os.mkdir", "os.scandir", "os.listdir",
                          "os.truncate", "os.chmod", "os.utime", "os.link", "os.symlink"})


@dataclass(frozen=True)
class _Outage:
    roots: tuple[str, ...]  # absolute directories, without a trailing separator
    until: float  # time.monotonic()

    def covers(self, path: Any) -> bool:
        if isinstance(path, int) or path is None:  # a descriptor: its open was refused, or it was swapped
            return False
        name = os.path.abspath(os.fsdecode(os.fspath(path)))
        return any(name == root or name.startswith(root + os.sep) for root in self.roots)


_outage: _Outage | None = None
_hook_added = False


def _audit(event: str, args: tuple[Any, ...]) -> None:
    """The audit hook (PEP 578: `open`, `os.rename`, `os.remove`, `os.mkdir`, `os.scandir` … raise it before
    their system call, and an exception it raises aborts the call): refuses every one on a path under the
    outage's roots. Calls without an audit event (`os.stat`, so `Path.exists`) and relative paths under a
    `dir_fd` are not reached."""
    outage = _outage
    if outage is None or event not in _PATH_EVENTS or not args or time.monotonic() >= outage.until:
        return
    try:
        covered = outage.covers(args[0])
    except (TypeError, ValueError):  # not a path
        return
    if covered:
        raise OSError(errno.EIO, f"{os.strerror(errno.EIO)} (injected file-system outage)", os.fspath(args[0]))


def in_outage() -> bool:
    """Whether an injected outage is under way in this process."""
    return _outage is not None and time.monotonic() < _outage.until


def begin_outage(roots: list[Path], seconds: float) -> threading.Timer:
    """Every file call of this process on `roots` fails with EIO for `seconds`; returns at once, with the
    timer that ends the outage (joined once the swapped descriptors are back). Calls are refused by `_audit`,
    descriptors already open are swapped (`_swap_open_files`). Other processes are not reached: the checkpoint
    writer's save fails in the rank's hand-off instead (FaultInjector.around_write); PID 1 and the controller
    see no outage."""
    global _outage, _hook_added
    if not _hook_added:
        sys.addaudithook(_audit)  # for the rest of the process: an audit hook cannot be removed
        _hook_added = True
    outage = _Outage(tuple(os.path.abspath(r) for r in roots), time.monotonic() + seconds)
    swapped = _swap_open_files(outage)
    _outage = outage
    log.warning("injected file-system outage: every file call on %s fails with EIO for %.0f s (%d open file(s))",
                ", ".join(outage.roots), seconds, len(swapped))
    timer = threading.Timer(seconds, _end_outage, args=(outage, swapped))
    timer.daemon = True
    timer.start()
    return timer


@dataclass(frozen=True)
class _Swapped:
    fd: int
    path: str
    flags: int
    position: int
    dead: str  # what the descriptor points at during the outage


def _swap_open_files(outage: _Outage) -> list[_Swapped]:
    """Point each descriptor open on a regular file under `outage`'s roots (the event log's) at a hung-up
    terminal, whose writes fail with EIO, for the outage; `_end_outage` reopens them where they were. Not
    standard output and error: the local cluster writes them to the run directory, a pod's go to its container
    runtime."""
    master, terminal = os.openpty()
    os.close(master)  # hung up: a write to `terminal` fails with EIO
    dead = os.readlink(f"/proc/self/fd/{terminal}")
    swapped = []
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        try:
            path = os.readlink(f"/proc/self/fd/{fd}")
            if fd in (terminal, 0, 1, 2) or not outage.covers(path) or not os.path.isfile(path):
                continue
            info = dict(line.split(":", 1) for line in Path(f"/proc/self/fdinfo/{fd}").read_text().splitlines())
            flags, position = int(info["flags"], 8), int(info["pos"])
            os.dup2(terminal, fd)
        except (OSError, ValueError, KeyError):  # closed meanwhile
            continue
        swapped.append(_Swapped(fd, path, flags, position, dead))
    os.close(terminal)
    return swapped


def _end_outage(outage: _Outage, swapped: list[_Swapped]) -> None:
    """Reopen each swapped descriptor where it was, unless its owner closed it (its number may be another's)."""
    global _outage
    if _outage is outage:
        _outage = None
    for s in swapped:
        try:
            if os.readlink(f"/proc/self/fd/{s.fd}") != s.dead:
                continue
            reopened = os.open(s.path, s.flags & (os.O_ACCMODE | os.O_APPEND))
            if not s.flags & os.O_APPEND:
                os.lseek(reopened, s.position, os.SEEK_SET)
            os.dup2(reopened, s.fd)
            os.close(reopened)
        except OSError as err:
            log.warning("injected file-system outage: %s could not be reopened (%s)", s.path, err)
    log.warning("injected file-system outage over")
