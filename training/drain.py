"""Drains: SIGTERM commits, it does not discard.

Kubernetes sends SIGTERM to a pod on a node drain, an eviction, the end of a spot instance or a
capacity block, and `kubectl delete pod`; ft_launcher forwards it to its ranks and waits
`fault_tolerance.drain_timeout_s` (its --term-timeout) before it SIGKILLs them. Each rank notes the
signal here instead of dying. The train loop carries the note in the all-reduce it already does for
the loss (no extra collective), so every rank learns of a drain at the same step, from whichever
node got the signal. Then all ranks together: let the in-flight async save commit, save the step
reached if the time left covers a save (as long as the last one took, twice over), and leave with
DRAINED, an exit code that ft_launcher and the Job retry (ft_launcher exits 0 when every rank exits
cleanly after a signal, which the Job would take for a completed index).
"""
from __future__ import annotations

import logging
import signal
import time
from types import FrameType

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

DRAINED = 143  # 128 + SIGTERM, what a process killed by it reports
SAVE_TIME_MARGIN = 2.0  # a save of the step reached needs this many times the last save's duration


class Drained(BaseException):
    """Leave the training loop and the process: a BaseException, so the in-process Wrapper (which
    restarts on Exception) lets it through."""


class DrainSignal:
    """SIGTERM handler of one training run: installed by `start`, the previous one restored by `stop`."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self.received_at: float | None = None  # monotonic time of the first SIGTERM
        self._previous: signal.Handlers | None = None

    def start(self) -> None:
        self._previous = signal.signal(signal.SIGTERM, self._note)

    def stop(self) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)
            self._previous = None

    def _note(self, signum: int, frame: FrameType | None) -> None:
        if self.received_at is None:
            self.received_at = time.monotonic()

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
