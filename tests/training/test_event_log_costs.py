"""Reading the event log costs rank 0 what was appended since its last read, not the log's length: a
metrics refresh and an attempt start on synthetic logs of different lengths (bench/event_log.py measures
millions of events)."""
from __future__ import annotations

import pytest

from bench.event_log import STEPS_PER_CHECKPOINT, SyntheticRun, announce_attempt, measure, measured
from training.contract.events import EventLog, EventTail, events_dir, next_attempt, read_events
from training.report import saved_tally
from training.report.goodput import build_report
from training.train import metrics as train_metrics
from training.train.metrics import RunCollector

SIZES = (4_000, 40_000)


def _metrics(collector: RunCollector) -> dict[str, float]:
    return {s.name: s.value for family in collector.collect() for s in family.samples}


def test_a_new_rank_0_catches_up_from_the_saved_tally_reading_only_the_tail(tmp_path):
    """Each attempt's rank 0 starts a new endpoint: it reads the tally the previous one saved and the events
    since, not the whole log."""
    small, large = (measure(tmp_path / str(n), n) for n in SIZES)
    assert large.log_bytes > 9 * small.log_bytes and large.catch_up.bytes_read > 0.99 * large.log_bytes
    for c in (small, large):
        assert c.resumed.bytes_read < 32_768, c
    # the saved tally keeps the steps after the newest checkpoint: at most a checkpoint interval's, 24 bytes each
    assert abs(large.resumed.bytes_read - small.resumed.bytes_read) < 24 * STEPS_PER_CHECKPOINT + 1_024


def test_a_refresh_and_an_attempt_start_read_only_what_is_new(tmp_path):
    costs = [measure(tmp_path / str(n), n) for n in SIZES]
    small, large = costs
    assert large.log_bytes > 9 * small.log_bytes  # the log grew tenfold ...
    assert large.catch_up.bytes_read > 0.99 * large.log_bytes  # (a new process reads it once) ...
    for c in costs:  # ... and neither the refresh nor the attempt start read it again
        assert c.refresh.bytes_read < 16_384, c
        assert c.attempt_start.bytes_read < 4_096, c
    assert abs(large.refresh.bytes_read - small.refresh.bytes_read) < 1_024
    assert abs(large.attempt_start.bytes_read - small.attempt_start.bytes_read) < 1_024
    assert next_attempt(tmp_path / str(SIZES[1])) == 2  # attempts 0 (fresh) and 1 (announce_attempt)


def test_incremental_figures_are_the_reports(tmp_path, monkeypatch):
    monkeypatch.setattr(train_metrics, "READ_CHUNK_BYTES", 1_000)  # lines split across reads, several per refresh
    run = SyntheticRun(tmp_path)
    collector = RunCollector(tmp_path, refresh_s=0.0)
    try:
        for chunk in (250, 1, 3_000, 40):
            run.append(chunk)
            _metrics(collector)
        with (events_dir(tmp_path) / "rank0.jsonl").open("a") as f:  # a line still being written: not yet
            f.write('{"t":1767999999.0,"event":"ckpt_failed","source":"rank0","step":1,')
        metrics = _metrics(collector)
        assert metrics["training_checkpoints_failed"] == 0
        with (events_dir(tmp_path) / "rank0.jsonl").open("a") as f:
            f.write('"error":"OSError: disk full"}\n')
        run.append(10)
        metrics = _metrics(collector)
    finally:
        run.close()
    report = build_report(read_events(tmp_path))
    assert metrics["training_checkpoints_failed"] == report.checkpoints.failed == 1
    assert metrics["training_goodput_ratio"] == pytest.approx(report.training_goodput, rel=1e-9)
    assert metrics["training_infra_goodput_ratio"] == pytest.approx(report.infra_goodput, rel=1e-9)
    assert metrics["training_wall_seconds"] == pytest.approx(report.wall_s, rel=1e-9)
    assert metrics["training_checkpoints_committed"] == report.checkpoints.committed > 0
    assert metrics["training_checkpoint_blocking_seconds_total"] == pytest.approx(report.checkpoints.blocking_total_s)


def test_an_attempt_start_needs_no_scan_of_the_log(tmp_path):
    """A fresh run is attempt 0; each announced attempt counts; a log from before the attempts file
    (attempt_start among rank 0's events) is counted from the log once."""
    assert next_attempt(tmp_path / "new") == 0
    run = SyntheticRun(tmp_path / "run")
    run.close()
    cost = measured(lambda: announce_attempt(tmp_path / "run"))
    assert cost.bytes_read < 4_096 and next_attempt(tmp_path / "run") == 2
    legacy = events_dir(tmp_path / "legacy")
    legacy.mkdir(parents=True)
    (legacy / "rank0.jsonl").write_text("".join(
        f'{{"t":{i}.0,"event":"attempt_start","source":"rank0","attempt":{i},"restart_kind":"injob"}}\n'
        for i in range(3)))
    assert next_attempt(tmp_path / "legacy") == 3
    announce_attempt(tmp_path / "legacy")
    assert next_attempt(tmp_path / "legacy") == 4
    assert [e["attempt"] for e in read_events(tmp_path / "legacy") if e["event"] == "attempt_start"] == [0, 1, 2, 3]


def test_a_file_that_cannot_be_read_is_read_later_not_lost(tmp_path):
    log = EventLog(tmp_path, "rank0")
    log.emit("step", step=1, loss=1.0, step_time_s=1.0, tokens=1)
    broken = events_dir(tmp_path) / "rank1.jsonl"
    broken.mkdir()  # reading it fails with an OSError, as an evicted Lustre client's read does
    tail = EventTail(tmp_path)
    assert [r["step"] for r in tail.read_new()] == [1]
    assert list(tail.unreadable) == ["rank1.jsonl"]
    with pytest.raises(OSError, match="cannot read rank1.jsonl"):
        read_events(tmp_path)
    broken.rmdir()
    EventLog(tmp_path, "rank1").emit("fault_detected", kind="exception", rank=1, detail="x", by="test")
    log.emit("step", step=2, loss=1.0, step_time_s=1.0, tokens=1)
    assert [r["event"] for r in tail.read_new()] == ["fault_detected", "step"] and not tail.unreadable


def test_a_tail_from_now_begins_at_the_next_whole_line(tmp_path):
    """A tail started while a line is half written (a writer's line in flight, or a torn one a later writer
    appends to) skips that line and returns the whole lines after it; its offsets are lines' ends all along, so a
    tail resumed from them (from_offsets) never starts inside a line either."""
    log = EventLog(tmp_path, "rank0")
    log.emit("step", step=1, loss=1.0, step_time_s=1.0, tokens=1)
    path = events_dir(tmp_path) / "rank0.jsonl"
    whole = path.stat().st_size
    with path.open("ab") as f:
        f.write(b'{"t": 1.5, "event": "step", "st')  # half of a line, begun before the tail
    tail = EventTail.from_now(tmp_path)
    assert tail.offsets() == {"rank0.jsonl": whole}
    assert tail.read_new() == [] and tail.offsets() == {"rank0.jsonl": whole}
    with path.open("ab") as f:
        f.write(b'ep": 2, "loss": 1.0}\n')
    log.emit("step", step=3, loss=1.0, step_time_s=1.0, tokens=1)
    assert [r["step"] for r in tail.read_new()] == [3]
    assert tail.offsets() == {"rank0.jsonl": path.stat().st_size}
    log.close()


def _figures_match_the_report(metrics: dict[str, float], run_dir) -> None:
    report = build_report(read_events(run_dir))
    assert metrics["training_goodput_ratio"] == pytest.approx(report.training_goodput, rel=1e-9)
    assert metrics["training_infra_goodput_ratio"] == pytest.approx(report.infra_goodput, rel=1e-9)
    assert metrics["training_checkpoints_committed"] == report.checkpoints.committed


def test_a_saved_tally_is_trusted_only_while_the_log_it_read_is_unchanged(tmp_path):
    run = SyntheticRun(tmp_path)
    try:
        run.append(3_000)
        _metrics(RunCollector(tmp_path, refresh_s=0.0))  # the first read saves the tally
        assert saved_tally.load(tmp_path) is not None
        run.append(500)
        _figures_match_the_report(_metrics(RunCollector(tmp_path, refresh_s=0.0)), tmp_path)  # from the tally
    finally:
        run.close()
    log_file = events_dir(tmp_path) / "rank0.jsonl"
    log_file.write_bytes(log_file.read_bytes().replace(b'"loss":2.5', b'"loss":2.6', 1))  # rewritten in place
    assert saved_tally.load(tmp_path) is None
    saved_tally.tally_path(tmp_path).write_bytes(b"not a tally")
    assert saved_tally.load(tmp_path) is None
    _figures_match_the_report(_metrics(RunCollector(tmp_path, refresh_s=0.0)), tmp_path)  # the whole log


def test_a_resume_below_the_saved_floor_reads_the_log_whole(tmp_path):
    """The saved tally folds the steps up to the newest checkpoint; going back before it (the newer
    checkpoints damaged) needs them: the whole log is read again, and the figures stay the report's."""
    run = SyntheticRun(tmp_path)
    try:
        run.append(3_000)
        _metrics(RunCollector(tmp_path, refresh_s=0.0))
        with (events_dir(tmp_path) / "rank0.jsonl").open("a") as f:
            f.write(f'{{"t":{run.t + 0.5:.6f},"event":"resume","source":"rank0","step":100,"source_kind":"disk",'
                    '"path":"ckpt/step_00000100","saved_world_size":1}\n')
        run.t += 1.0
        run.append(50)
        collector = RunCollector(tmp_path, refresh_s=0.0)
        cost = measured(lambda: _metrics(collector))
        metrics = _metrics(collector)
    finally:
        run.close()
    assert cost.bytes_read > sum(p.stat().st_size for p in events_dir(tmp_path).glob("*.jsonl"))  # read whole
    _figures_match_the_report(metrics, tmp_path)
    assert metrics["training_goodput_ratio"] < 0.1  # steps 101-3000 thrown away
