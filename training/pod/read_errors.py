"""Reads of the run directory that fail for a while, in a watching process's log: the first failure at once,
then one line a minute while they last, and one when the reads succeed again.

The run directory is on FSx, and a Lustre server can evict a client (wiki.lustre.org, "Lustre Client Eviction
Guide"): until it reconnects its I/O fails, with EIO, or ESTALE where a server no longer holds its lock
(Linux commit 4c43c27ddc46, "staging: lustre: ptlrpc: skip lock if export failed"). The processes that only
watch that directory (the store's stall watch, a pod's PID 1) must outlive it: each logs the failure here and
tries again at its next poll. One object per kind of read, so that one kind that reads while another fails
does not turn the rate limit into a line per poll.
"""
from __future__ import annotations

import logging
import time
from typing import Callable, TypeVar

T = TypeVar("T")

LOG_EVERY_S = 60.0  # while the reads fail: a line this often, not every poll


class ReadErrors:
    """The failures of one kind of read: `what` is read (e.g. "the event log in /fsx/run"); `meanwhile` says
    what the process does while it cannot (e.g. "the store keeps running"). Times: time.monotonic()."""

    def __init__(self, what: str, meanwhile: str, log: logging.Logger) -> None:
        self.what, self.meanwhile, self.log = what, meanwhile, log
        self.since: float | None = None  # when the reads started failing
        self.failed = 0
        self._logged_at = 0.0

    def read(self, read: Callable[[], T], failed: T) -> T:
        """`read()`; `failed` where it raised OSError, which is logged."""
        try:
            value = read()
        except OSError as err:
            self.failure(err, time.monotonic())
            return failed
        self.success(time.monotonic())
        return value

    def failure(self, err: OSError, now: float) -> None:
        self.failed += 1
        if self.since is None:
            self.since = now
        elif now - self._logged_at < LOG_EVERY_S:
            return
        self._logged_at = now
        self.log.warning("cannot read %s (%s: %s; failing for %.0f s, %d read(s)): %s", self.what,
                         type(err).__name__, err, now - self.since, self.failed, self.meanwhile)

    def success(self, now: float) -> None:
        if self.since is not None:
            self.log.warning("%s can be read again, after %.0f s and %d failed read(s)", self.what,
                             now - self.since, self.failed)
        self.since, self.failed = None, 0
