"""Synthetic event logs, written through the real EventLog on a clock the test moves."""
from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from training.contract import events
from training.contract.events import EventLog

T0 = 1_767_000_000.0
STEP_S = 1.0
LOAD_S = 2.0  # checkpoint load before training resumes


class FakeRun:
    """Writes one run's event log, one file per source, as training, controller and injector would."""

    def __init__(self, run_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        self.run_dir = run_dir
        self.now = T0
        self._logs: dict[str, EventLog] = {}
        monkeypatch.setattr(events, "time", SimpleNamespace(time=lambda: self.now))

    @property
    def elapsed(self) -> float:
        return self.now - T0

    def wait(self, seconds: float) -> None:
        self.now += seconds

    def emit(self, event: str, source: str = "rank0", **fields) -> None:
        if source not in self._logs:
            self._logs[source] = EventLog(self.run_dir, source)
        self._logs[source].emit(event, **fields)

    def attempt(self, number: int, kind: str, resume: int, source_kind: str, load_s: float = LOAD_S) -> None:
        self.emit("run_start", world_size=16, nodes=2, config={})
        self.emit("attempt_start", attempt=number, restart_kind=kind)
        if number:  # as training.train does
            self.emit("restart", attempt=number, restart_kind=kind)
        self.wait(load_s)
        self.emit("resume", step=resume, source_kind=source_kind, path=None)

    def steps(self, first: int, last: int, save_every: int = 10, blocking_s: float = 0.5,
              failed_saves: tuple[int, ...] = ()) -> None:
        for step in range(first, last + 1):
            self.wait(STEP_S)
            self.emit("step", step=step, loss=10.0 / step, step_time_s=STEP_S, tokens=4096)
            if step % save_every == 0:
                self.emit("ckpt_start", step=step)
                self.wait(blocking_s)
                self.emit("ckpt_blocked", step=step, seconds=blocking_s)
                if step in failed_saves:
                    self.emit("ckpt_failed", step=step, error="OSError: disk full")
                else:
                    self.emit("ckpt_committed", step=step, path=f"ckpt/step_{step}", seconds=blocking_s + 1.0)

    def fault(self, kind: str, rank: int, step: int) -> None:
        self.emit("fault_injected", source=f"rank{rank}", kind=kind, rank=rank, step=step)

    def end(self, step: int, status: str = "completed") -> None:
        self.emit("run_end", step=step, status=status)
        for log in self._logs.values():
            log.close()
