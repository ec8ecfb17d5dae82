"""The run's append-only event log: the contract between training and the goodput report.

Each writer (a rank, the local controller, the fault injector) appends JSON lines to a file of its own,
`<run_dir>/events/<source>.jsonl`, so writers never interleave within a line, on Lustre too. Every record
has `t`, `event` (one of EVENTS) and `source`; the fields of each event are in docs/observability.md
("Event schema"), which a test checks against EVENTS.
"""
from __future__ import annotations

import errno
import json
import logging
import os
import time
from collections import Counter
from pathlib import Path
from typing import Any, Iterable, Iterator

log = logging.getLogger(__name__)

EVENTS = frozenset({
    "job_start", "run_start", "attempt_start", "resume", "step", "ckpt_start", "ckpt_blocked", "ckpt_committed",
    "ckpt_failed", "ckpt_no_space", "ckpt_fallback", "ckpt_writer_replaced", "state_derived", "fault_injected", "fault_detected", "restart", "node_replaced", "drained",
    "peer_state", "peer_copy_rejected", "events_dropped", "quorum", "step_discarded",
    "run_end",
})


ATTEMPTS_SOURCE = "attempts"  # the source of every attempt_start: a file of one line per attempt


def events_dir(run_dir: str | os.PathLike) -> Path:
    return Path(run_dir) / "events"


class EventLog:
    """Appends events for one source; each record is one write() of one line, flushed at once.

    `emit` never raises an I/O error into its caller: a full file system (ENOSPC), an FSx hiccup (EIO,
    ESTALE) or a log that cannot be opened drops the event instead, counted by kind (`dropped`) and logged
    at most once every DROP_LOG_S. The first event written after drops is preceded by an `events_dropped`
    record of them, so the report and the metrics count what the log lacks. Costs: nothing while writes
    succeed; a dropped event costs its failed write (and an open of the file while it cannot be opened)."""

    DROP_LOG_S = 60.0

    def __init__(self, run_dir: str | os.PathLike, source: str) -> None:
        self.source = source
        self._path = events_dir(run_dir) / f"{source}.jsonl"
        self._fd: int | None = None
        self.dropped: Counter[str] = Counter()  # events lost so far, by kind: a count for the whole process
        self._unreported: Counter[str] = Counter()  # of those, the ones no events_dropped record names yet
        self._first_error = ""  # the first error of the unreported drops
        self._logged_at = -float("inf")
        self._torn = False  # a write ended mid-line: the next record starts on a line of its own
        self._open()

    def emit(self, event: str, **fields: Any) -> None:
        if event not in EVENTS:
            raise ValueError(f"unknown event {event!r}; known: {sorted(EVENTS)}")
        if self._unreported and not self._report_drops():
            self._drop(event, None)
            return
        self._append({"t": time.time(), "event": event, "source": self.source, **fields})

    @property
    def unwritten(self) -> int:
        """Events dropped that no events_dropped record counts yet: non-zero while the log cannot be written."""
        return sum(self._unreported.values())

    def count_dropped(self, event: str) -> None:
        """Count an event that another log of this process (`record_attempt`'s) could not write."""
        self._drop(event, None)

    def _report_drops(self) -> bool:
        unreported = dict(self._unreported)
        record = {"t": time.time(), "event": "events_dropped", "source": self.source,
                  "count": sum(unreported.values()), "events": unreported, "error": self._first_error}
        if not self._append(record, count_as=None):
            return False
        self._unreported.clear()
        self._first_error = ""
        log.warning("event log %s writable again: %d event(s) had been dropped (%s)", self._path,
                    record["count"], ", ".join(f"{n} {kind}" for kind, n in sorted(unreported.items())))
        return True

    def _append(self, record: dict[str, Any], count_as: str | None = "") -> bool:
        """Write `record` as one line; False (the event counted as dropped, unless `count_as` is None) on an
        I/O error. A write cut short (a full file system) leaves a torn line, which readers skip."""
        line = (json.dumps(record, separators=(",", ":")) + "\n").encode()
        try:
            if self._fd is None:
                self._open(raising=True)
            data = b"\n" + line if self._torn else line
            written = os.write(self._fd, data)
            self._torn = written < len(data)
            if self._torn:
                # a regular file's write cut short: its file system (or quota) has no room for the rest
                raise OSError(errno.ENOSPC, f"{os.strerror(errno.ENOSPC)} ({len(data) - written} of {len(data)} "
                                            "bytes not written)")
        except OSError as err:
            if count_as is not None:
                self._drop(record["event"], err)
            return False
        return True

    def _drop(self, event: str, err: OSError | None) -> None:
        self.dropped[event] += 1
        self._unreported[event] += 1
        if err is not None and not self._first_error:
            self._first_error = f"{type(err).__name__}: {err}"[:300]
        now = time.monotonic()
        if now - self._logged_at >= self.DROP_LOG_S:
            self._logged_at = now
            log.error("event log %s cannot be written (%s): %d event(s) dropped so far; training goes on",
                      self._path, err or self._first_error or f"{event} dropped by another log of this process",
                      sum(self.dropped.values()))

    def _open(self, raising: bool = False) -> None:
        try:
            self._path.parent.mkdir(parents=True, exist_ok=True)
            self._fd = os.open(self._path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644)
        except OSError as err:
            if raising:
                raise
            self._first_error = self._first_error or f"{type(err).__name__}: {err}"[:300]
            log.error("event log %s cannot be opened (%s); its events are dropped until it can", self._path, err)
            return
        # A line that an earlier writer of this source left torn (killed mid-write, a full file system) is ended
        # before this writer's first record, which would otherwise be lost with it. Unknown: an empty line more.
        try:
            size = os.fstat(self._fd).st_size
            self._torn = size > 0 and os.pread(self._fd, 1, size - 1) != b"\n"
        except OSError:
            self._torn = True

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def read_events(run_dir: str | os.PathLike) -> list[dict[str, Any]]:
    """All events of a run, ordered by time. A torn last line (a writer killed mid-write) is skipped."""
    tail = EventTail(run_dir)
    records = tail.read_new()
    if tail.unreadable:
        raise OSError(f"{events_dir(run_dir)}: cannot read {'; '.join(tail.unreadable.values())}")
    return records


class EventTail:
    """A run's event log, read incrementally: each `read_new` returns the records appended since the
    previous one (every source, ordered by time), reading only the new bytes of each file. A last line
    without its newline yet waits for it; one that never gets it (a writer killed mid-write) is skipped,
    as is the line a later writer then appends to it. A file that cannot be read (an I/O error) is left
    out and read from where it was next time; `unreadable` says which, and why. `limit` bounds the bytes
    read from each file by one call (and so its memory): `behind` says whether more is waiting."""

    def __init__(self, run_dir: str | os.PathLike) -> None:
        self.run_dir = run_dir
        self._offsets: dict[str, int] = {}  # file name -> bytes read (the log is append-only)
        self._pending: dict[str, bytes] = {}  # file name -> a last line still without its newline
        self.unreadable: dict[str, str] = {}  # file name -> the error of the last read
        self.behind = False
        self._mid_line: dict[str, int] = {}  # file name -> the start of a line begun before `from_now`, skipped

    @classmethod
    def from_offsets(cls, run_dir: str | os.PathLike, offsets: dict[str, int]) -> EventTail:
        """A tail that reads each file from its offset in `offsets` (a line's end), one not named from its start."""
        tail = cls(run_dir)
        tail._offsets.update(offsets)
        return tail

    @classmethod
    def from_now(cls, run_dir: str | os.PathLike) -> EventTail:
        """A tail whose first `read_new` returns only the records appended after this call. A line being written
        at this instant began before it: it is skipped, and the tail starts at the next whole line."""
        directory = events_dir(run_dir)
        tail = cls(run_dir)
        for path in directory.glob("*.jsonl") if directory.is_dir() else ():
            size = path.stat().st_size
            tail._offsets[path.name] = size
            if (start := _line_start(path, size)) < size:
                tail._mid_line[path.name] = start
        return tail

    def offsets(self) -> dict[str, int]:
        """How far each file has been read, to the end of its last complete line (`from_offsets` goes on there)."""
        return {name: self._mid_line.get(name, offset - len(self._pending.get(name, b"")))
                for name, offset in self._offsets.items()}

    def read_new(self, limit: int = -1) -> list[dict[str, Any]]:
        directory = events_dir(self.run_dir)
        if not directory.is_dir():
            raise FileNotFoundError(f"{self.run_dir}: no event log (expected {directory}/*.jsonl)")
        self.unreadable, self.behind = {}, False
        records = []
        for path in sorted(directory.glob("*.jsonl")):
            try:
                records += self._read_new_lines(path, limit)
            except OSError as err:
                self.unreadable[path.name] = f"{path.name}: {err}"
        return sorted(records, key=lambda r: r["t"])

    def _read_new_lines(self, path: Path, limit: int) -> list[dict[str, Any]]:
        with path.open("rb") as f:
            f.seek(self._offsets.get(path.name, 0))
            new = f.read(limit)
            self._offsets[path.name] = f.tell()
        self.behind |= 0 < limit <= len(new)
        data = self._pending.get(path.name, b"") + new
        if path.name in self._mid_line:  # the rest of a line begun before from_now: up to its newline
            _, newline, data = data.partition(b"\n")
            if not newline:
                return []
            del self._mid_line[path.name]
        complete, _, pending = data.rpartition(b"\n")
        self._pending[path.name] = pending
        return list(_parse(complete.decode(errors="replace").split("\n")))  # str: json.loads needs no detection


def _line_start(path: Path, size: int, chunk: int = 1 << 16) -> int:
    """The offset just after the last newline in the first `size` bytes of `path` (0: none)."""
    with path.open("rb") as f:
        end = size
        while end > 0:
            begin = max(0, end - chunk)
            f.seek(begin)
            newline = f.read(end - begin).rfind(b"\n")
            if newline >= 0:
                return begin + newline + 1
            end = begin
    return 0


def record_attempt(run_dir: str | os.PathLike, attempt: int, restart_kind: str) -> bool:
    """Rank 0 at the start of an attempt: its attempt_start, in the attempts file (`next_attempt`). Whether it
    was written: one that could not be (an I/O error) is logged and dropped, and the next attempt then takes
    this attempt's number again (the report counts restarts from their own events)."""
    attempts = EventLog(run_dir, ATTEMPTS_SOURCE)
    try:
        attempts.emit("attempt_start", attempt=attempt, restart_kind=restart_kind)
    finally:
        attempts.close()
    return not attempts.dropped


def next_attempt(run_dir: str | os.PathLike) -> int:
    """The number of the attempt starting now (0: the first): one after the newest attempt_start. Reads
    the attempts file only, a line per attempt; a log from before that file (attempt_start among rank 0's
    events) is read whole, once: the attempt then recorded there says the number from then on."""
    attempts = events_dir(run_dir) / f"{ATTEMPTS_SOURCE}.jsonl"
    recorded = [r for r in _read_lines(attempts) if r["event"] == "attempt_start"] if attempts.exists() else []
    if recorded:
        return int(recorded[-1]["attempt"]) + 1
    if not events_dir(run_dir).is_dir():
        return 0
    return sum(1 for r in read_events(run_dir) if r["event"] == "attempt_start")


def run_completed(run_dir: str | os.PathLike, steps: int) -> bool:
    """Whether rank 0 recorded the run's completion: a completed run_end at `steps` or beyond (a run
    directory may hold an earlier, shorter run that a longer one resumed from)."""
    directory = events_dir(run_dir)
    for path in sorted(directory.glob("*.jsonl")) if directory.is_dir() else ():
        with path.open("rb") as f:  # a two-week log is large: parse only the run_end lines
            if any(completes(r, steps) for r in _parse(line for line in f if b'"run_end"' in line)):
                return True
    return False


def completes(record: dict[str, Any], steps: int) -> bool:
    """Whether `record` is a run's completion at `steps` or beyond."""
    return record["event"] == "run_end" and record.get("status") == "completed" and record.get("step", 0) >= steps


def _read_lines(path: Path) -> Iterator[dict[str, Any]]:
    with path.open("rb") as f:
        yield from _parse(f)


def _parse(lines: Iterable[str | bytes]) -> Iterator[dict[str, Any]]:
    for line in lines:
        try:
            record = json.loads(line)
        except ValueError:  # not JSON, or not UTF-8: a torn line
            continue
        if isinstance(record, dict) and "t" in record and "event" in record:
            yield record
