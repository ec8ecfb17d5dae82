"""The run-so-far figures folded event by event (training/report/tally.py) are the report's."""
from __future__ import annotations

import math
import random
from collections import Counter

import pytest

from training.contract.events import read_events
from training.report.goodput import build_report
from training.report.tally import RunTally, UsefulSteps


def _useful_by_definition(log: list[tuple[str, int, float]]) -> set[int]:
    """The report's definition, read backwards: an execution counts unless a later resume went back
    before its step or a later execution of the same step replaced it."""
    floor, seen, useful = math.inf, set(), set()
    for i in reversed(range(len(log))):
        kind, step, _ = log[i]
        if kind == "resume":
            floor = min(floor, step)
        elif kind == "step":
            if step <= floor and step not in seen:
                useful.add(i)
            seen.add(step)
    return useful


@pytest.mark.parametrize("seed", range(40))
def test_useful_steps_follow_the_definition_in_any_order(seed):
    rng = random.Random(seed)
    log, step = [], 0
    for _ in range(rng.randrange(1, 200)):
        roll = rng.random()
        if roll < 0.08:
            step = rng.randrange(0, step + 1)
            log.append(("resume", step, 0.0))
        else:  # mostly the next step; sometimes a step again, or out of order, without a resume
            step = step + 1 if roll < 0.9 else max(1, step + rng.randrange(-5, 3))
            log.append(("step", step, rng.choice([0.5, 1.0, 1.25])))
    useful, lost = UsefulSteps(), set()
    for i, (kind, step, seconds) in enumerate(log):
        lost.update(useful.resumed(step) if kind == "resume" else useful.executed(step, seconds, i))
    expected = _useful_by_definition(log)
    assert {i for i, (kind, _, _) in enumerate(log) if kind == "step"} - lost == expected
    assert len(useful) == len(expected)
    assert useful.seconds == pytest.approx(sum(log[i][2] for i in expected), abs=1e-9)


def test_the_tally_of_a_log_read_in_pieces_is_the_report(faulty_run):
    events = read_events(faulty_run.run_dir)
    report = build_report(events)
    tally = RunTally()
    for start in range(0, len(events), 37):  # as a metrics endpoint reads it: a piece per refresh
        tally.add(events[start:start + 37])
    assert tally.training_goodput == pytest.approx(report.training_goodput, rel=1e-12)
    assert tally.infra_goodput == pytest.approx(report.infra_goodput, rel=1e-12)
    assert tally.wall_s == pytest.approx(report.wall_s, rel=1e-12)
    assert (tally.steps, len(tally.useful)) == (report.step_executions, report.useful_steps)
    ck = report.checkpoints
    assert (tally.ckpt_started, tally.ckpt_committed, tally.ckpt_failed) == (ck.started, ck.committed, ck.failed)
    assert tally.blocking_total_s == pytest.approx(ck.blocking_total_s)
    assert tally.blocking_max_s == pytest.approx(ck.blocking_max_s)
    assert tally.restarts == Counter(e["restart_kind"] for e in events if e["event"] == "restart")
    assert tally.malformed == 0


def test_an_event_without_its_fields_is_skipped_not_fatal():
    tally = RunTally()
    tally.add([{"t": 1.0, "event": "step", "step": 1}, {"t": 2.0, "event": "step", "step": 2, "step_time_s": 1.0}])
    assert (tally.malformed, tally.steps, tally.wall_s) == (1, 1, 1.0)
