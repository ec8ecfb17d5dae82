"""Drains: SIGTERM commits, it does not discard.

Kubernetes sends SIGTERM to a pod on a node drain, an eviction, the end of a spot instance or a
capacity block, and `kubectl delete pod`; ft_launcher forwards it to its ranks and waits
`fault_tolerance.drain_timeout_s` (its --term-timeout) before it SIGKILLs them. But ft_launcher also
sends SIGTERM to stop the survivors of a failed rank before an in-job restart, and there the rank
must go at once, as SIGTERM's default would: it may be blocked in a collective with the dead rank.
A drain is told apart by a marker file (DRAIN_MARKER_ENV) that whoever drains writes before the
signal: the pod's preStop hook, which the kubelet runs before it sends SIGTERM, or training.local's
controller.

A rank is never left in a collective by a Python signal handler that cannot run: the handler only
makes the interpreter write the signal number to a pipe (`signal.set_wakeup_fd`, done in C, from
whichever thread the signal lands in), and a watcher thread reads it. Without the marker the watcher
ends the process (TERMINATED). With it, it notes the drain; the train loop carries the note in the
all-reduce it already does for the loss (no extra collective), so every rank learns of the drain at
the same step, from whichever node got the signal. Then all ranks together let the in-flight async
save commit, save the step reached if the time left covers a save (twice the last one's duration),
and leave with TERMINATED, an exit code that ft_launcher and the Job retry (ft_launcher exits 0
when every rank exits cleanly after a signal, which the Job would take for a completed index).
"""
from __future__ import annotations

import logging
import os
import signal
import threading
import time
from types import FrameType

import torch
import torch.distributed as dist

from training.contract.exit_codes import TERMINATED
from training.contract.launcher import DRAIN_MARKER_ENV

log = logging.getLogger(__name__)

SAVE_TIME_MARGIN = 2.0  # a save of the step reached needs this many times the last save's duration
_STOP = 0  # not a signal number: tells the watcher to end


class Drained(BaseException):
    """Leave the training loop and the process: a BaseException, so the in-process Wrapper (which
    restarts on Exception) lets it through."""


def _noted(signum: int, frame: FrameType | None) -> None:
    """The Python-level handler: nothing to do, the watcher thread acts (module doc)."""


class DrainSignal:
    """SIGTERM for one training run: `start` installs the watcher, `stop` restores what was there."""

    def __init__(self, timeout_s: float, marker: str | None = None) -> None:
        self.timeout_s = timeout_s
        self.marker = marker if marker is not None else os.environ.get(DRAIN_MARKER_ENV)
        self.received_at: float | None = None  # monotonic time of the first SIGTERM of a drain
        self._pipe: tuple[int, int] | None = None
        self._restore: tuple[object, int] | None = None
        self._watcher: threading.Thread | None = None

    def start(self) -> None:
        read_fd, write_fd = os.pipe()
        os.set_blocking(write_fd, False)  # the interpreter's C handler must never block
        self._pipe = (read_fd, write_fd)
        self._watcher = threading.Thread(target=self._watch, name="drain-watcher", daemon=True)
        self._watcher.start()
        self._restore = (signal.signal(signal.SIGTERM, _noted),
                         signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False))

    def stop(self) -> None:
        if self._pipe is None or self._restore is None or self._watcher is None:
            return
        handler, wakeup_fd = self._restore
        signal.set_wakeup_fd(wakeup_fd)
        signal.signal(signal.SIGTERM, handler)  # type: ignore[arg-type]
        os.write(self._pipe[1], bytes([_STOP]))
        self._watcher.join()
        for fd in self._pipe:
            os.close(fd)
        self._pipe = self._restore = self._watcher = None

    def _watch(self) -> None:
        assert self._pipe is not None
        while True:
            numbers = os.read(self._pipe[0], 64)
            if not numbers or _STOP in numbers:
                return
            if signal.SIGTERM not in numbers:
                continue  # another signal with a Python handler (SIGINT)
            if self.marker is None or not os.path.exists(self.marker):
                os._exit(TERMINATED)  # a stop, not a drain: go now, as SIGTERM's default would
            if self.received_at is None:
                self.received_at = time.monotonic()
                log.warning("SIGTERM with the drain marker %s: draining at the end of this step", self.marker)

    @property
    def flag(self) -> float:
        """What this rank adds to the step's all-reduce: above 0 on any rank means drain now."""
        return 0.0 if self.received_at is None else 1.0

    def time_left(self) -> float:
        """Seconds until the launcher's SIGKILL, as this rank sees it (a rank that got no signal
        counts from now: its launcher signals it at the latest when the drained node's ranks leave)."""
        start = self.received_at if self.received_at is not None else time.monotonic()
        return start + self.timeout_s - time.monotonic()


def agree_on_save(time_left: float, save_seconds: float | None, distributed: bool) -> bool:
    """Whether every rank has time for one more save: one decision for all (a collective)."""
    need = -1.0 if save_seconds is None else save_seconds * SAVE_TIME_MARGIN  # never measured: try
    values = torch.tensor([time_left, -need], dtype=torch.float64)
    if distributed:
        dist.all_reduce(values, op=dist.ReduceOp.MIN)  # the least time left, the longest save
    return float(values[0]) > -float(values[1])
