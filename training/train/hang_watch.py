"""Under restart=both, a hang is detected as soon as under injob: the rank monitor's calculated section
timeouts, applied in-process.

Why: under restart=both the launcher's calculated timeouts are raised above the Wrapper's hard timeout
(section_timeout_floor), and the Wrapper's soft timeout is one fixed figure from the config, so a hung rank's
peers would learn of it only from gloo's timeout. This watch compares the open section with its calculated
timeout and, past it, reports once per iteration; the report (training.train.inprocess) records a soft-timeout
interruption in the Wrapper's store, and every rank restarts in-process. Cost: one thread per rank that wakes
every WATCH_INTERVAL_S. The timeouts are those injob's launcher would apply: learned from observed timings
(training.train.monitor.RankMonitor), kept in checkpoints and the rollback, merged with each iteration's timings.
"""
from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator

WATCH_INTERVAL_S = 0.1  # adds at most this to the calculated timeout

HangReport = Callable[[str, float, float], None]  # (section, seconds open, its calculated timeout)


class HangWatch:
    """The open rank monitor section and the calculated timeouts, kept across the Wrapper's iterations."""

    def __init__(self, interval_s: float = WATCH_INTERVAL_S) -> None:
        self._interval_s = interval_s
        self._timeouts: dict[str, float] = {}
        self._open: tuple[str, float] | None = None  # (section, time.monotonic() it opened)
        self._paused = 0

    def learned(self, timeouts: dict[str, float | None]) -> None:
        """The rank monitor's learned timeouts, before any floor: loaded with a checkpoint or the in-memory
        rollback, then merged by NVRx with each iteration's new calculation, as injob's launcher holds them."""
        self._timeouts.update({name: timeout for name, timeout in timeouts.items() if timeout is not None})

    def opened(self, section: str) -> None:
        self._open = (section, time.monotonic())

    def closed(self) -> None:
        self._open = None

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """No report while a drain waits through whole saves (the Wrapper's timeouts are off too)."""
        self._paused += 1
        try:
            yield
        finally:
            self._paused -= 1

    def overdue(self) -> tuple[str, float, float] | None:
        """(section, seconds open, timeout) of the open section when it is past its calculated timeout."""
        open_section = self._open
        if open_section is None or self._paused:
            return None
        name, since = open_section
        timeout = self._timeouts.get(name)
        open_s = time.monotonic() - since
        return (name, open_s, timeout) if timeout is not None and open_s > timeout else None

    @contextlib.contextmanager
    def watching(self, report: HangReport) -> Iterator[None]:
        """One iteration: a thread calls `report` the first time a section is overdue."""
        stop = threading.Event()
        thread = threading.Thread(target=self._watch, args=(stop, report), name="hang-watch", daemon=True)
        self._open = None  # a section of the iteration before, cut short by its failure
        thread.start()
        try:
            yield
        finally:
            stop.set()  # first: an interrupt landing in this block must still end the thread

    def _watch(self, stop: threading.Event, report: HangReport) -> None:
        while not stop.wait(self._interval_s):
            if (late := self.overdue()) is not None:
                report(*late)
                return
