"""Goodput figures, faults and checkpoint statistics from synthetic event logs."""
from __future__ import annotations

import dataclasses

import pytest

from training.contract.events import read_events
from training.report.goodput import Fault, ReportError, build_report, build_timeline, format_report

from synthetic_log import STEP_S, FakeRun


def test_goodput_counts_each_step_once_and_lost_executions_only_for_infra(faulty_run: FakeRun) -> None:
    report = build_report(read_events(faulty_run.run_dir))
    wall = faulty_run.elapsed
    assert report.status == "completed"
    assert report.wall_s == pytest.approx(wall) == pytest.approx(195.7)
    assert (report.final_step, report.useful_steps, report.attempts) == (120, 120, 4)
    # Steps 41-47 and 71-75 ran twice; their first runs were rolled back.
    assert (report.step_executions, report.lost_executions) == (132, 12)
    assert report.productive_step_s == pytest.approx(120 * STEP_S)
    assert report.lost_step_s == pytest.approx(12 * STEP_S)
    assert report.training_goodput == pytest.approx(120 * STEP_S / wall)
    assert report.infra_goodput == pytest.approx(132 * STEP_S / wall)


def test_faults_detection_recovery_and_steps_lost(faulty_run: FakeRun) -> None:
    faults = build_report(read_events(faulty_run.run_dir)).faults
    approx = pytest.approx
    assert faults == (
        # detected by the launcher; restart 0.5 s later, 6 s to start, 2 s to load, 1 s step
        # time lost: step 48 done 11 s + 7 recomputed steps after the fault, less the 1 s it takes anyway
        Fault("exception", 1, 48, approx(52.0), approx(1.5), "fault_detected", "injob", approx(11.0), 40, 7,
              approx(17.0), checkpoint_steps_lost=7),
        # no fault_detected: detection ends at the controller's restart
        Fault("node_failure", 12, 76, approx(98.5), approx(30.0), "restart", "injob", approx(43.0), 70, 5,
              approx(47.0), checkpoint_steps_lost=5),  # the save at step 60 failed
        # in-process restart, rolled back in memory to the step in flight: the first step back is step 91
        Fault("gpu_error", 2, 91, approx(163.5), approx(0.4), "fault_detected", "inprocess", approx(1.7), 90, 0,
              approx(0.7), checkpoint_steps_lost=0),
    )


def test_checkpoint_blocking_statistics(faulty_run: FakeRun) -> None:
    ck = build_report(read_events(faulty_run.run_dir)).checkpoints
    assert (ck.started, ck.committed, ck.failed, ck.blocking_saves) == (12, 11, 1, 12)
    assert ck.blocking_total_s == pytest.approx(10 * 0.5 + 2 * 1.5)
    assert ck.blocking_mean_s == pytest.approx(8.0 / 12)
    assert ck.blocking_max_s == pytest.approx(1.5)


def test_timeline_marks_rolled_back_executions_and_attempts(faulty_run: FakeRun) -> None:
    tl = build_timeline(read_events(faulty_run.run_dir))
    lost = [(r.step, r.attempt) for r in tl.runs if not r.useful]
    assert lost == [(s, 0) for s in range(41, 48)] + [(s, 1) for s in range(71, 76)]
    assert [(a.number, a.restart_kind) for a in tl.attempts] == [
        (0, "fresh"), (1, "injob"), (2, "injob"), (3, "inprocess")]
    assert all(s.end_s - s.start_s in (0.5, 1.5) for s in tl.saves)


def test_clean_run(fake_run: FakeRun) -> None:
    fake_run.attempt(0, "fresh", resume=0, source_kind="none")
    fake_run.steps(1, 30, save_every=100)
    fake_run.end(30)
    report = build_report(read_events(fake_run.run_dir))
    assert (report.faults, report.lost_executions, report.attempts) == ((), 0, 1)
    assert report.training_goodput == report.infra_goodput == pytest.approx(30 / (30 + 2.0))
    assert report.checkpoints.blocking_mean_s is None
    assert (report.first_loss, report.final_loss) == (10.0, pytest.approx(10.0 / 30))
    assert "blocking not logged" in format_report(report)
    assert "loss 10.0000 -> 0.3333" in format_report(report)


def test_rollback_without_resume_event_counts_the_last_execution(fake_run: FakeRun) -> None:
    fake_run.steps(1, 12, save_every=100)
    fake_run.fault("sigkill", rank=0, step=13)
    fake_run.wait(5.0)
    fake_run.emit("restart", source="controller", attempt=1, restart_kind="injob")
    fake_run.steps(9, 20, save_every=100)  # the new attempt logs no resume: it restarted after step 8
    report = build_report(read_events(fake_run.run_dir))
    assert (report.useful_steps, report.lost_executions) == (20, 4)
    assert report.status == "incomplete (no run_end event)"
    (fault,) = report.faults
    assert (fault.detected_by, fault.resumed_from, fault.steps_lost) == ("restart", 8, 4)
    assert fault.recovery_s == pytest.approx(6.0)


def test_steps_lost_count_from_the_faulty_rank_even_when_rank_0_logs_later(fake_run: FakeRun) -> None:
    """Rank 1 fires before step 20, after finishing step 19; rank 0's step-19 event lands after it."""
    fake_run.attempt(0, "fresh", resume=0, source_kind="none")
    fake_run.steps(1, 18, save_every=10)
    fake_run.fault("exception", rank=1, step=20)
    fake_run.wait(0.2)  # rank 0's step 19 was in flight when the fault fired
    fake_run.emit("step", step=19, loss=0.5, step_time_s=1.0, tokens=4096)
    fake_run.wait(3.0)
    fake_run.attempt(1, "injob", resume=10, source_kind="disk")
    fake_run.steps(11, 25, save_every=100)
    fake_run.end(25)
    (fault,) = build_report(read_events(fake_run.run_dir)).faults
    assert (fault.resumed_from, fault.steps_lost) == (10, 9)


def test_fault_seen_only_by_its_detectors_is_one_fault(fake_run: FakeRun) -> None:
    """A real fault on EKS: nobody injected it, two detectors report it."""
    fake_run.attempt(0, "fresh", resume=0, source_kind="none")
    fake_run.steps(1, 10, save_every=5)
    fake_run.emit("fault_detected", source="launcher1", kind="rank_died", rank=5, detail="exit -9")
    fake_run.wait(0.2)
    fake_run.emit("fault_detected", source="launcher0", kind="rank_died", rank=5, detail="peer gone")
    fake_run.wait(4.0)
    fake_run.attempt(1, "injob", resume=10, source_kind="disk")
    fake_run.steps(11, 12)
    fake_run.end(12)
    (fault,) = build_report(read_events(fake_run.run_dir)).faults
    assert (fault.kind, fault.rank, fault.detection_s, fault.restart_kind) == ("rank_died", 5, None, "injob")
    assert (fault.resumed_from, fault.steps_lost) == (10, 0)
    assert fault.recovery_s == pytest.approx(0.2 + 4.0 + 2.0 + 1.0)


def test_fault_in_a_failed_run_is_not_recovered(fake_run: FakeRun) -> None:
    fake_run.attempt(0, "fresh", resume=0, source_kind="none")
    fake_run.steps(1, 5)
    fake_run.fault("hang", rank=3, step=6)
    fake_run.wait(60.0)
    fake_run.emit("run_end", source="controller", step=5, status="failed")
    report = build_report(read_events(fake_run.run_dir))
    (fault,) = report.faults
    assert (fault.detection_s, fault.recovery_s, fault.steps_lost) == (None, None, None)
    assert report.status == "failed"
    [row] = [line for line in format_report(report).splitlines() if "not recovered" in line]
    assert row.count("not recovered") == 2 and "recoverednot" not in row  # recovery and time lost, apart
    assert format_report(report).splitlines()[-1] == \
        "Lost: 0 completed step(s) to 0 recovered fault(s); 1 never recovered"


def test_the_fault_table_keeps_its_columns_for_a_drains_way(fake_run: FakeRun) -> None:
    fake_run.attempt(0, "fresh", resume=0, source_kind="none")
    fake_run.steps(1, 5)
    fake_run.fault("hang", rank=3, step=6)
    fake_run.emit("run_end", source="controller", step=5, status="failed")
    report = build_report(read_events(fake_run.run_dir))
    drain = dataclasses.replace(report.faults[0], kind="drain", drain_path="checkpoint")
    lines = format_report(dataclasses.replace(report, faults=(drain,))).splitlines()
    [header] = [line for line in lines if "detected after" in line]
    [row] = [line for line in lines if "drain (checkpoint)" in line]
    at = f"{drain.at_s:.1f}"
    assert row.index(at) + len(at) == header.index("at s") + len("at s")  # right-aligned under its heading


def test_format_report_lists_the_figures(faulty_run: FakeRun) -> None:
    text = format_report(build_report(read_events(faulty_run.run_dir)))
    assert "Training goodput  61.3%" in text and "Infra goodput     67.5%" in text
    assert "12 started, 11 committed, 1 failed" in text
    assert "node_failure" in text and "7 (back to 40)" in text
    # the last lines: no recovery did better than its newest checkpoint, so there is nothing to set beside it
    assert text.splitlines()[-2:] == [
        "Lost: 12 completed step(s) to 3 fault(s)",
        "Recovered in 11.0 s (exception), 43.0 s (node_failure), 1.7 s (gpu_error), each from the fault to the next "
        "completed step"]


def test_the_last_lines_set_what_the_newest_checkpoint_would_have_lost_beside_what_was(fake_run: FakeRun) -> None:
    """Resumed from peer state at the step reached, 5 steps past the newest checkpoint; then back to a
    checkpoint that is gone after a resume below it (step 30, unreadable): the one before it is the baseline."""
    fake_run.attempt(0, "fresh", resume=0, source_kind="none")
    fake_run.steps(1, 25)
    fake_run.fault("exception", rank=1, step=26)
    fake_run.wait(2.0)
    fake_run.attempt(1, "injob", resume=25, source_kind="peer")
    fake_run.steps(26, 33)
    fake_run.fault("sigkill", rank=3, step=34)
    fake_run.wait(2.0)
    fake_run.attempt(2, "injob", resume=20, source_kind="disk")  # step 30's checkpoint was unreadable
    fake_run.steps(21, 25)
    fake_run.fault("exception", rank=1, step=26)
    fake_run.wait(2.0)
    fake_run.attempt(3, "injob", resume=25, source_kind="peer")
    fake_run.steps(26, 27)
    fake_run.end(27)
    report = build_report(read_events(fake_run.run_dir))
    assert [(f.steps_lost, f.checkpoint_steps_lost) for f in report.faults] == [(0, 5), (13, 3), (0, 5)]
    assert format_report(report).splitlines()[-2] == (
        "Lost: 13 completed step(s) to 3 fault(s); a resume from the newest checkpoint would have lost 5 + 3 + 5")


@pytest.mark.parametrize("events, expected", [
    ([], "no events"),
    ([{"t": 1.0, "event": "run_start", "source": "rank0"}], "no 'step' event"),
    ([{"t": 1.0, "event": "step", "source": "rank0", "step": 1}], "step_time_s=None; expected a number"),
])
def test_unusable_events_raise_report_error(events: list, expected: str) -> None:
    with pytest.raises(ReportError, match=expected):
        build_report(events)


def test_run_rolled_back_to_scratch_has_no_productive_time(fake_run: FakeRun) -> None:
    fake_run.steps(1, 3, save_every=100)
    fake_run.emit("resume", step=0, source_kind="none", path=None)
    report = build_report(read_events(fake_run.run_dir))
    assert (report.final_step, report.useful_steps, report.productive_step_s) == (0, 0, 0.0)
    assert report.infra_goodput == pytest.approx(1.0)


def test_fault_training_survives_recovers_at_the_next_step(fake_run: FakeRun) -> None:
    """A full disk fails a save; training goes on. A later real fault is still a fault of its own."""
    fake_run.attempt(0, "fresh", resume=0, source_kind="none")
    fake_run.steps(1, 20)
    fake_run.fault("disk-full", rank=0, step=21)
    fake_run.steps(21, 30, failed_saves=(30,))
    fake_run.emit("fault_detected", source="controller", kind="node", rank=None, detail="launcher exited")
    fake_run.wait(3.0)
    fake_run.attempt(1, "injob", resume=20, source_kind="disk")
    fake_run.steps(21, 22)
    fake_run.end(22)
    disk, node = build_report(read_events(fake_run.run_dir)).faults
    assert (disk.kind, disk.detection_s, disk.detected_by, disk.restart_kind) == ("disk-full", None, None, None)
    assert (disk.recovery_s, disk.steps_lost) == (pytest.approx(STEP_S), 0)
    assert (node.kind, node.rank, node.steps_lost) == ("node", None, 10)
    assert node.recovery_s == pytest.approx(3.0 + 2.0 + STEP_S)


def test_a_replica_group_that_healed_from_a_live_group_lost_no_step(fake_run: FakeRun) -> None:
    """A group restarts from nothing (resume 0) and heals to the live group's step 35: its 20 steps live on."""
    fake_run.attempt(0, "fresh", resume=0, source_kind="none")
    fake_run.steps(1, 20, save_every=100)
    fake_run.fault("node-loss", rank=1, step=21)
    fake_run.wait(3.0)
    fake_run.attempt(1, "injob", resume=0, source_kind="none")
    fake_run.emit("quorum", step=35, group=1, live_groups=2, rows=1, healed_from_step=0)
    fake_run.steps(36, 40, save_every=100)
    fake_run.end(40)
    report = build_report(read_events(fake_run.run_dir))
    (fault,) = report.faults
    assert (fault.resumed_from, fault.steps_lost) == (35, 0)
    assert report.final_step == 40
