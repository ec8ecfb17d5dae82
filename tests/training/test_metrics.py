"""Rank 0's Prometheus endpoint, scraped during a real local-cluster run, against the run's event log."""
from __future__ import annotations

import signal
import time
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from training.contract.events import read_events
from training.contract.launcher import free_port
from training.report.goodput import build_report
from training_helpers import start_local, wait_for_step

pytestmark = pytest.mark.slow


def _scrape(port: int) -> dict[tuple[str, tuple], float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        text = response.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def _scrape_when(port: int, ready, timeout: float = 60) -> dict[tuple[str, tuple], float]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            metrics = _scrape(port)
            if ready(metrics):
                return metrics
        except OSError:  # not bound yet, or between the old rank 0 and the new
            pass
        time.sleep(0.3)
    pytest.fail(f"no scrape of port {port} met the condition within {timeout} s")


def test_rank0_metrics_match_the_event_log(tmp_path: Path):
    run_dir, port = tmp_path / "run", free_port()
    # rank 1 fails at step 15: ft_launcher restarts the whole group, and the new rank 0 binds the port again
    proc = start_local(run_dir, "--nodes", "2", "--nproc-per-node", "1", "--steps", "100000",
                       "--faults", "exception@15:rank=1", f"metrics.port={port}", "metrics.event_log_refresh_s=0",
                       "checkpoint.interval=10", "fault_tolerance.timeout_safety_factor=50")
    try:
        wait_for_step(run_dir, 25, proc)
        metrics = _scrape_when(port, lambda m: m.get(("training_step", ()), 0) >= 25)
    finally:
        proc.send_signal(signal.SIGINT)
        proc.communicate(timeout=60)

    events = read_events(run_dir)
    value = lambda name, **labels: metrics[(name, tuple(sorted(labels.items())))]  # noqa: E731
    step = int(value("training_step"))
    step_event = [e for e in events if e["event"] == "step" and e["step"] == step][-1]
    assert value("training_loss") == pytest.approx(step_event["loss"], abs=1e-6)
    assert value("training_step_time_seconds") == pytest.approx(step_event["step_time_s"], abs=1e-5)
    assert value("training_tokens_per_second") == pytest.approx(step_event["tokens"] / step_event["step_time_s"],
                                                                rel=1e-3)
    assert not any(name == "training_mfu_ratio" for name, _ in metrics)  # a CPU run: no MFU

    # the run so far: the report's own figures over the events the scrape had seen
    as_of = value("training_report_as_of_timestamp_seconds")
    seen = [e for e in events if e["t"] <= as_of]
    report = build_report(seen)
    assert value("training_goodput_ratio") == pytest.approx(report.training_goodput, rel=1e-9)
    assert value("training_infra_goodput_ratio") == pytest.approx(report.infra_goodput, rel=1e-9)
    assert 0 < report.training_goodput < report.infra_goodput < 1  # a restart lost time and steps
    assert value("training_restarts_total", kind="injob") == sum(
        1 for e in seen if e["event"] == "restart" and e["restart_kind"] == "injob") == 1
    assert value("training_checkpoints_committed") == report.checkpoints.committed >= 2
    assert value("training_checkpoint_blocking_seconds_total") == pytest.approx(report.checkpoints.blocking_total_s)
    newest_commit = max(e["t"] for e in seen if e["event"] == "ckpt_committed")
    assert 0 <= value("training_checkpoint_commit_age_seconds") <= time.time() - newest_commit
