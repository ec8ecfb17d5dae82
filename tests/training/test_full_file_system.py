"""A run directory on a file system that is really full (a small tmpfs, filled and freed again) or fails
for a few seconds (EIO, the fs-eio fault's outage): the event log, the attempt record, the checkpoint
directory's GENERATION and a commit's bookkeeping meet the error, and none of them may end training; once
the file system takes writes again, checkpoints commit again."""
from __future__ import annotations

import logging
import time

import pytest
import torch

from training.contract.events import EventLog, next_attempt, read_events, record_attempt
from training.contract.launcher import free_port
from training.report.goodput import build_report, format_report
from training.train.checkpoint.layout import committed_checkpoints, current_generation
from training.train.metrics import RunCollector
from training.train.outage import begin_outage
from training_helpers import (COMMON, TWO_NODES, SmallFileSystem, StartedRun, assert_bitwise_equal, checkpoint_manager,
                              completed, events_named, load_final_state, run_forked, scrape_when, start_local)

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


def _metrics(run_dir) -> dict[str, float]:
    return {s.name: s.value for family in RunCollector(run_dir, 0.0).collect() for s in family.samples}


def test_events_on_a_full_file_system_are_dropped_counted_and_reported_once_space_is_back(small_fs, caplog):
    run_dir = small_fs.path
    events = EventLog(run_dir, "rank0")
    events.emit("step", step=1, loss=1.0, step_time_s=1.0, tokens=8)
    small_fs.fill()
    caplog.set_level(logging.ERROR)
    for step in range(2, 201):  # rank 0's every step, beyond the page the log's file has begun: none may raise
        events.emit("step", step=step, loss=1.0, step_time_s=1.0, tokens=8)
    assert not record_attempt(run_dir, 1, "injob")  # an attempt that starts on the full file system goes on
    events.count_dropped("attempt_start")
    assert events.dropped["step"] > 0 and events.dropped["attempt_start"] == 1
    assert events.unwritten == sum(events.dropped.values())  # what rank 0's metrics show meanwhile
    assert sum("cannot be written" in r.getMessage() for r in caplog.records if "rank0" in r.getMessage()) == 1
    small_fs.free()
    events.emit("step", step=201, loss=1.0, step_time_s=1.0, tokens=8)
    events.emit("run_end", step=201, status="completed")
    assert events.unwritten == 0
    records = read_events(run_dir)
    steps = [r["step"] for r in records if r["event"] == "step"]
    assert steps == list(range(1, len(steps))) + [201]  # whole lines only: a line cut short is skipped
    assert len(steps) + events.dropped["step"] == 201
    [dropped] = [r for r in records if r["event"] == "events_dropped"]
    assert dropped["count"] == events.dropped["step"] + 1 and dropped["events"] == dict(events.dropped)
    assert "No space left on device" in dropped["error"]
    assert [r["event"] for r in records[-3:]] == ["events_dropped", "step", "run_end"]
    assert next_attempt(run_dir) == 0  # the dropped attempt_start: its number is taken again
    report = build_report(records)
    assert report.events_dropped == dropped["count"] and f"Events dropped: {dropped['count']}" in format_report(report)
    assert _metrics(run_dir)["training_events_dropped"] == dropped["count"]


def test_a_restarted_writer_does_not_lose_its_first_event_to_the_line_its_predecessor_left_torn(tmp_path):
    EventLog(tmp_path, "rank0").emit("step", step=1, loss=1.0, step_time_s=1.0, tokens=8)
    with open(tmp_path / "events" / "rank0.jsonl", "ab") as log_file:  # killed mid-write, or cut short: no space
        log_file.write(b'{"t":1.0,"event":"step","sou')
    EventLog(tmp_path, "rank0").emit("run_start", world_size=2, nodes=2, config={})  # the next rank 0
    assert [e["event"] for e in read_events(tmp_path)] == ["step", "run_start"]


def _state(value: float) -> dict[str, torch.Tensor]:
    return {"w": torch.full((4096,), value)}


def test_a_worker_group_that_cannot_write_generation_trains_without_checkpoints_until_space_is_back(
        small_fs, tmp_path, caplog):
    run_dir = tmp_path / "run"  # the events elsewhere: what the test reads must not be lost to the full fs
    events = EventLog(run_dir, "rank0")
    ckpt_dir = small_fs.path / "ckpt"
    checkpoint_manager(ckpt_dir, mode="sync", keep=3, events=events).save(5, _state(5.0))  # generation 1
    small_fs.fill()
    caplog.set_level(logging.ERROR)
    manager = checkpoint_manager(ckpt_dir, mode="sync", keep=3, events=events)  # a restart on the full fs
    for step in (10, 15):
        manager.save(step, _state(float(step)))
    assert [e["step"] for e in events_named(run_dir, "ckpt_failed")] == [10, 15]
    assert all("GENERATION could not be written" in e["error"] for e in events_named(run_dir, "ckpt_failed"))
    assert [e["step"] for e in events_named(run_dir, "ckpt_no_space")] == [10, 15]
    assert sum("NO CHECKPOINT at step" in r.getMessage() for r in caplog.records) == 2  # at every save
    assert [step for step, _ in committed_checkpoints(ckpt_dir)] == [5]
    small_fs.free()
    manager.save(20, _state(20.0))
    assert manager.saved_step == 20 and current_generation(ckpt_dir) == 2
    assert [step for step, _ in committed_checkpoints(ckpt_dir)] == [20, 5]
    assert [e["step"] for e in events_named(run_dir, "ckpt_committed")] == [5, 20]


def test_a_newer_worker_group_fences_a_group_that_took_no_generation(small_fs, tmp_path):
    events = EventLog(tmp_path / "run", "rank0")
    ckpt_dir = small_fs.path / "ckpt"
    small_fs.fill()
    late = checkpoint_manager(ckpt_dir, mode="sync", keep=3, events=events)  # found no GENERATION: 0
    small_fs.free()
    checkpoint_manager(ckpt_dir, mode="sync", keep=3).save(5, _state(5.0))  # a newer group: generation 1
    late.save(10, _state(10.0))  # a cut-off group of the past must not take generation 2 over it
    assert current_generation(ckpt_dir) == 1 and [s for s, _ in committed_checkpoints(ckpt_dir)] == [5]
    [failed] = events_named(tmp_path / "run", "ckpt_failed")
    assert failed["step"] == 10 and "fenced" in failed["error"]


def test_a_renamed_checkpoint_is_committed_though_its_bookkeeping_after_the_rename_fails(small_fs, tmp_path):
    run_dir = tmp_path / "run"
    ckpt_dir = small_fs.path / "ckpt"
    leave_pages: list[int] = []  # once set: the file system fills up as soon as the shards are written

    def write_then_fill(step, write):
        written = write()
        if leave_pages:
            small_fs.fill(leave_pages=leave_pages[0])
        return written

    manager = checkpoint_manager(ckpt_dir, mode="sync", keep=3, events=EventLog(run_dir, "rank0"),
                                 write_hook=write_then_fill)
    manager.save(5, _state(5.0))
    _, first = committed_checkpoints(ckpt_dir)[0]
    # what a commit writes up to its rename, DCP's .metadata and the COMMITTED marker, fits; nothing after it
    leave_pages.append(sum(-(-(first / name).stat().st_size // small_fs.PAGE) for name in (".metadata", "COMMITTED")))
    manager.save(10, _state(10.0))
    small_fs.free()
    assert manager.saved_step == 10
    assert [e["step"] for e in events_named(run_dir, "ckpt_committed")] == [5, 10]
    assert events_named(run_dir, "ckpt_failed") == []
    restored = _state(0.0)
    assert checkpoint_manager(ckpt_dir, mode="sync", keep=3).load(restored).step == 10
    assert torch.equal(restored["w"], _state(10.0)["w"])


def test_a_run_directory_that_fails_with_eio_for_a_while_ends_no_write_and_checkpoints_resume(tmp_path):
    run_dir = tmp_path / "run"
    events = EventLog(run_dir, "rank0")
    events.emit("step", step=1, loss=1.0, step_time_s=1.0, tokens=8)
    outage = begin_outage([run_dir], 2.0)
    events.emit("step", step=2, loss=1.0, step_time_s=1.0, tokens=8)  # on the log's open descriptor
    assert not record_attempt(run_dir, 1, "injob")
    manager = checkpoint_manager(run_dir / "checkpoints", mode="sync", keep=3, events=events)  # a restart's setup
    manager.save(5, _state(5.0))
    outage.join()
    manager.save(10, _state(10.0))
    assert manager.saved_step == 10 and [s for s, _ in committed_checkpoints(run_dir / "checkpoints")] == [10]
    records = read_events(run_dir)
    [dropped] = [r for r in records if r["event"] == "events_dropped"]
    assert dropped["events"] == {"step": 1, "ckpt_start": 1, "ckpt_blocked": 1, "ckpt_failed": 1}
    assert "Input/output error" in dropped["error"]
    assert [(r["event"], r.get("step")) for r in records if r["event"] != "events_dropped"] == [
        ("step", 1), ("ckpt_start", 10), ("ckpt_blocked", 10), ("ckpt_committed", 10)]


# The fault runs' shape, ten times as long: room for both outages, however fast the steps.
STEPS, KILL_STEP, OUTAGE_S = 200, 150, 3
SHAPE = ("--steps", str(STEPS), *COMMON[2:])
# An FSx hiccup on both ranks from step 3 for OUTAGE_S; later, once the file system is full, rank 1 fails (an
# in-job restart): the new worker group starts on the full file system.
FAULTS = (f"fs-eio@3:rank=0:duration={OUTAGE_S},fs-eio@3:rank=1:duration={OUTAGE_S},"
          f"exception@{KILL_STEP}:rank=1")


def _wait_for(run_dir, proc: StartedRun, found, what: str, timeout: float = 120) -> dict:
    """The first event of the run for which `found(event)` holds (the run failing or `timeout` fails the test)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.communicate()[0][-3000:]
        try:
            event = next((e for e in read_events(run_dir) if found(e)), None)
        except OSError:  # no log yet
            event = None
        if event is not None:
            return event
        time.sleep(0.05)
    proc.kill()
    pytest.fail(f"no {what} within {timeout} s: {proc.communicate()[0][-3000:]}")


@pytest.mark.slow
def test_a_two_node_run_survives_an_fsx_outage_and_a_file_system_that_fills_and_is_freed(tmp_path, scratch):
    reference = completed(run_forked(tmp_path / "reference", 2, *SHAPE))  # uninterrupted: no launcher needed
    fs = SmallFileSystem(tmp_path / "fs", 32 << 20)  # the run directory, checkpoints and logs included
    try:
        run_dir, port = fs.path / "run", free_port()
        proc = start_local(run_dir, *TWO_NODES.argv(), "--faults", FAULTS, *SHAPE, f"metrics.port={port}")
        try:
            outage = _wait_for(run_dir, proc, lambda e: e["event"] == "fault_injected" and e["kind"] == "fs-eio",
                               "outage")
            committed = _wait_for(run_dir, proc, lambda e: e["event"] == "ckpt_committed"
                                  and e["t"] > outage["t"] + OUTAGE_S, "checkpoint after the outage")
            fs.keep_full()
            assert committed["step"] < KILL_STEP
            # the restarted group has passed its first save (skipped: no GENERATION) when its rank 0 is past KILL_STEP
            full = scrape_when(port, lambda m: m.get(("training_step", ()), 0) > KILL_STEP, timeout=180)
            fs.free()
            freed_at = time.time()
            output, _ = proc.communicate(timeout=300)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
        assert proc.returncode == 0, output[-4000:]
        assert full[("training_events_unwritten", ())] > 0  # the metrics said so while the log could not
        events = read_events(run_dir)
        named = lambda name: [e for e in events if e["event"] == name]  # noqa: E731
        assert [e["status"] for e in named("run_end")] == ["completed"]
        # during the outage, rank 0's steps and failed saves were dropped, and counted once it was over
        [dropped] = [e for e in named("events_dropped") if "Input/output error" in e["error"]]
        assert dropped["source"] == "rank0" and dropped["events"].get("step") and dropped["events"].get("ckpt_failed")
        # the restarted group's rank 0 started on the full file system: its first events were dropped, and counted
        assert any(e["source"] == "rank0" and "No space left on device" in e["error"]
                   and {"run_start", "resume", "ckpt_no_space"} <= set(e["events"]) for e in named("events_dropped"))
        after = [e["step"] for e in named("ckpt_start") if e["t"] > freed_at]
        assert len(after) >= 3 and after[-1] == STEPS
        assert [e["step"] for e in named("ckpt_committed") if e["t"] > freed_at] == after  # every one commits
        # ... by the restarted group, whose GENERATION waited for the space
        assert {e["generation"] for e in named("ckpt_committed") if e["t"] > freed_at} == {2}
        assert_bitwise_equal(load_final_state(run_dir, scratch), load_final_state(reference.run_dir, scratch))
    finally:
        fs.unmount()
