"""Rank 0's Prometheus endpoint, scraped during a real local-cluster run, against the run's event log."""
from __future__ import annotations

import time

import pytest

from training.contract.events import read_events
from training.report.goodput import build_report

pytestmark = pytest.mark.slow


@pytest.mark.xdist_group("ctrl-c")  # one worker makes the run for both (conftest's stopped_by_ctrl_c)
def test_rank0_metrics_match_the_event_log(stopped_by_ctrl_c):
    """The run: training_helpers.run_stopped_by_ctrl_c (rank 1 fails at step 15, scraped at step 25)."""
    run_dir, metrics = stopped_by_ctrl_c.run_dir, stopped_by_ctrl_c.metrics
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
