"""Fixtures: synthetic runs (tests/report/synthetic_log.py)."""
from __future__ import annotations

from pathlib import Path

import pytest
from synthetic_log import FakeRun


@pytest.fixture
def fake_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> FakeRun:
    return FakeRun(tmp_path / "run", monkeypatch)


@pytest.fixture
def faulty_run(fake_run: FakeRun) -> FakeRun:
    """120 steps, three faults, four attempts:
    1. exception on rank 1 at step 48: detected 1.5 s later, in-job restart, back to checkpoint 40;
    2. node failure at step 76: no detection event, node replaced, in-job restart, back to 70;
    3. GPU error at step 91: in-process restart, rolled back in memory to step 90.
    Saves every 10 steps block 0.5 s (1.5 s in attempt 2); the save at step 60 fails."""
    r = fake_run
    r.attempt(0, "fresh", resume=0, source_kind="none", load_s=3.0)
    r.steps(1, 47)
    r.fault("exception", rank=1, step=48)
    r.wait(1.5)
    r.emit("fault_detected", source="launcher0", kind="exception", rank=1, detail="worker exited 1")
    r.wait(0.5)
    r.emit("restart", source="controller", attempt=1, restart_kind="injob")
    r.wait(6.0)
    r.attempt(1, "injob", resume=40, source_kind="disk")
    r.steps(41, 75, failed_saves=(60,))
    r.fault("node_failure", rank=12, step=76)
    r.wait(30.0)
    r.emit("restart", source="controller", attempt=2, restart_kind="injob")
    r.emit("node_replaced", source="controller", node=1, attempt=2)
    r.wait(10.0)
    r.attempt(2, "injob", resume=70, source_kind="disk")
    r.steps(71, 90, blocking_s=1.5)
    r.fault("gpu_error", rank=2, step=91)
    r.wait(0.4)
    r.emit("fault_detected", kind="gpu_error", rank=2, detail="Wrapper: rank 2 raised")
    r.wait(0.3)
    r.attempt(3, "inprocess", resume=90, source_kind="memory", load_s=0.0)
    r.steps(91, 120)
    r.end(120)
    return r
