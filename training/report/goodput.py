"""Goodput report of a run, from its event log (the contract in training.contract.events).

    python -m training.report RUN_DIR [--plot [PNG]]

It says what a run's faults cost. Training goodput is the share of wall time in steps whose result survived;
infra goodput, in any step. Each fault gets its detection and recovery time and the steps and time it lost.
The report is printed and written to RUN_DIR/report.json; --plot draws the timeline (RUN_DIR/timeline.png
unless a path is given). Only the event log and its own timestamps are read, so a laptop run and an EKS run
whose run directory is on FSx report alike.
Reference: docs/observability.md.
"""
from __future__ import annotations

import json
import statistics
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Sequence

from training.contract.events import events_dir, read_events
from training.report.tally import UsefulSteps

Event = dict[str, Any]
RESTARTS = ("restart", "attempt_start")
OUTLIVED = ("disk-full", "fs-eio", "lighthouse-loss")  # injected fault kinds that training outlives without a restart


class ReportError(Exception):
    """The run directory or its event log cannot give a report; the message says what was expected."""


@dataclass(frozen=True)
class StepRun:
    """One execution of an optimizer step (seconds since start)."""
    step: int
    start_s: float
    end_s: float
    attempt: int
    useful: bool


@dataclass(frozen=True)
class Span:
    start_s: float
    end_s: float


@dataclass(frozen=True)
class Attempt:
    number: int
    restart_kind: str


@dataclass(frozen=True)
class Fault:
    kind: str
    rank: int | None
    step: int | None  # the step field of fault_injected
    at_s: float  # since start
    detection_s: float | None
    detected_by: str | None  # the event that marked detection
    restart_kind: str | None
    recovery_s: float | None
    resumed_from: int | None
    steps_lost: int | None
    time_lost_s: float | None
    drain_path: str | None = None  # a drain: how the step reached was kept (the `drained` event's path)
    checkpoint_steps_lost: int | None = None  # what a resume from the newest checkpoint at the fault would lose


@dataclass(frozen=True)
class Timeline:
    """What happened, in seconds since start: the parsed event log, before any figures."""
    wall_s: float
    status: str
    runs: tuple[StepRun, ...]
    saves: tuple[Span, ...]  # blocking span of each save
    attempts: tuple[Attempt, ...]
    faults: tuple[Fault, ...]
    counts: dict[str, int]  # events by name
    events_dropped: int  # events the log lacks: their writers could not write them (events_dropped records)
    first_loss: float
    final_loss: float


@dataclass(frozen=True)
class CheckpointStats:
    started: int
    committed: int
    failed: int
    blocking_saves: int
    blocking_total_s: float
    blocking_mean_s: float | None
    blocking_max_s: float | None


@dataclass(frozen=True)
class GoodputReport:
    status: str
    wall_s: float
    attempts: int
    final_step: int
    useful_steps: int
    step_executions: int
    lost_executions: int
    productive_step_s: float
    executed_step_s: float
    lost_step_s: float
    training_goodput: float
    infra_goodput: float
    faults: tuple[Fault, ...]
    checkpoints: CheckpointStats
    events_dropped: int  # events the log lacks (a full or failing file system): the figures leave them out
    first_loss: float
    final_loss: float  # loss of the last step in the trajectory that produced the final model

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)


def build_report(events: Sequence[Event]) -> GoodputReport:
    return summarize(build_timeline(events))


def build_timeline(events: Sequence[Event]) -> Timeline:
    if not events:
        raise ReportError("no events (expected JSON lines written through training.contract.events.EventLog)")
    events = _healed_resumes(sorted(events, key=lambda r: r["t"]))
    steps = [r for r in events if r["event"] == "step"]
    if not steps:
        raise ReportError(
            f"{len(events)} events but no 'step' event (expected rank 0 to log "
            "{step, loss, step_time_s, tokens} after each optimizer step)")
    step_times = [_number(r, "step_time_s") for r in steps]
    t0 = min(events[0]["t"], min(r["t"] - s for r, s in zip(steps, step_times)))
    ends = [r for r in events if r["event"] == "run_end"]
    return Timeline(
        wall_s=events[-1]["t"] - t0,
        status=str(ends[-1].get("status", "unknown")) if ends else "incomplete (no run_end event)",
        runs=_step_runs(events, t0),
        saves=tuple(Span(r["t"] - t0 - _number(r, "seconds"), r["t"] - t0)
                    for r in events if r["event"] == "ckpt_blocked"),
        attempts=tuple(Attempt(int(_number(r, "attempt")), str(r.get("restart_kind", "?")))
                       for r in events if r["event"] == "attempt_start"),
        faults=_faults(events, t0, typical_step_s=statistics.median(step_times)),
        counts=dict(Counter(r["event"] for r in events)),
        events_dropped=sum(int(_number(r, "count")) for r in events if r["event"] == "events_dropped"),
        first_loss=_number(steps[0], "loss"),
        final_loss=_number(steps[-1], "loss"),
    )


def summarize(tl: Timeline) -> GoodputReport:
    useful = [r for r in tl.runs if r.useful]
    productive = sum(r.end_s - r.start_s for r in useful)
    executed = sum(r.end_s - r.start_s for r in tl.runs)
    blocking = [s.end_s - s.start_s for s in tl.saves]
    return GoodputReport(
        status=tl.status,
        wall_s=tl.wall_s,
        attempts=max(len(tl.attempts), 1),
        final_step=max((r.step for r in useful), default=0),
        useful_steps=len(useful),
        step_executions=len(tl.runs),
        lost_executions=len(tl.runs) - len(useful),
        productive_step_s=productive,
        executed_step_s=executed,
        lost_step_s=executed - productive,
        training_goodput=_ratio(productive, tl.wall_s),
        infra_goodput=_ratio(executed, tl.wall_s),
        faults=tl.faults,
        events_dropped=tl.events_dropped,
        first_loss=tl.first_loss,
        final_loss=tl.final_loss,
        checkpoints=CheckpointStats(
            started=tl.counts.get("ckpt_start", 0),
            committed=tl.counts.get("ckpt_committed", 0),
            failed=tl.counts.get("ckpt_failed", 0),
            blocking_saves=len(blocking),
            blocking_total_s=sum(blocking),
            blocking_mean_s=sum(blocking) / len(blocking) if blocking else None,
            blocking_max_s=max(blocking, default=None),
        ),
    )


def _healed_resumes(events: list[Event]) -> list[Event]:
    """The events, each resume that a heal follows before the next step moved to the step healed to: a
    replica group that restarted behind the live ones received their state (training.train.replica_groups),
    in which its earlier steps live on, so they are not lost."""
    out, pending = list(events), None  # pending: the index of a resume with no step after it yet
    for i, r in enumerate(out):
        if r["event"] == "resume":
            pending = i
        elif r["event"] == "step":
            pending = None
        elif r["event"] == "quorum" and r.get("healed_from_step") is not None and pending is not None:
            out[pending], pending = {**out[pending], "step": r["step"]}, None
    return out


def _step_runs(events: list[Event], t0: float) -> tuple[StepRun, ...]:
    """Every step execution, in log order (timestamps may tie), and whether it counts (UsefulSteps)."""
    attempt, useful, lost, runs = 0, UsefulSteps(), set(), []
    for r in events:
        if r["event"] == "attempt_start":
            attempt = int(_number(r, "attempt"))
        elif r["event"] == "resume":
            lost.update(useful.resumed(int(_number(r, "step"))))
        elif r["event"] == "step":
            step, seconds = int(_number(r, "step")), _number(r, "step_time_s")
            lost.update(useful.executed(step, seconds, len(runs)))
            runs.append((step, r["t"] - t0 - seconds, r["t"] - t0, attempt))
    return tuple(StepRun(step, start, end, attempt, useful=i not in lost)
                 for i, (step, start, end, attempt) in enumerate(runs))


@dataclass
class _OpenFault:
    """A fault being followed through the log; the first event of each kind after it is kept."""
    onset: Event  # fault_injected, or fault_detected of a fault nobody injected
    position: int  # step reached when it fired
    checkpoint: int  # the newest checkpoint committed when it fired (0: none)
    detected: Event | None = None
    restarted: Event | None = None  # first restart, attempt_start or resume
    resumed: Event | None = None
    recovered: Event | None = None  # first step after the restart, or started after the fault
    regained: Event | None = None  # first step past the one reached at the fault
    drain_path: str | None = None

    @property
    def outlived(self) -> bool:
        """Whether training may go on past this fault without a restart: a failed save injected, or
        any fault nobody injected (the log is all there is to go by)."""
        return self.onset["event"] != "fault_injected" or self.onset.get("kind") in OUTLIVED

    def close(self, t0: float, typical_step_s: float) -> Fault:
        injected = self.onset["event"] == "fault_injected"
        kinds = [r.get("restart_kind") for r in (self.detected, self.restarted) if r and r["event"] in RESTARTS]
        if self.resumed is not None:
            resumed_from = int(_number(self.resumed, "step"))
        elif self.recovered is not None:
            resumed_from = int(_number(self.recovered, "step")) - 1
        else:
            resumed_from = None
        return Fault(
            kind=str(self.onset.get("kind", "unknown")),
            rank=self.onset.get("rank"),
            step=self.onset.get("step"),
            at_s=self.onset["t"] - t0,
            detection_s=self.detected["t"] - self.onset["t"] if injected and self.detected else None,
            detected_by=self.detected["event"] if self.detected else None,
            restart_kind=next((str(k) for k in kinds if k), None),
            recovery_s=self.recovered["t"] - self.onset["t"] if self.recovered else None,
            resumed_from=resumed_from,
            steps_lost=max(self.position - resumed_from, 0) if resumed_from is not None else None,
            time_lost_s=(max(self.regained["t"] - self.onset["t"] - typical_step_s, 0.0)
                         if self.regained else None),
            drain_path=self.drain_path,
            checkpoint_steps_lost=max(self.position - self.checkpoint, 0),
        )


def _faults(events: list[Event], t0: float, typical_step_s: float) -> tuple[Fault, ...]:
    closed: list[_OpenFault] = []
    fault: _OpenFault | None = None
    position = committed = 0
    for r in events:
        name = r["event"]
        if name == "ckpt_committed":
            committed = max(committed, int(_number(r, "step")))
        elif name == "resume":  # back below a checkpoint (one found unreadable): it is gone
            committed = min(committed, int(_number(r, "step")))
        if name == "fault_injected" or (name == "fault_detected" and fault is None):
            if fault is not None:
                closed.append(fault)
            # An injected fault fires before its step: the faulty rank had finished step - 1, even
            # when rank 0's event for that step reaches the log after the fault's.
            reached = max(position, int(r["step"]) - 1) if isinstance(r.get("step"), int) else position
            fault = _OpenFault(r, reached, committed, detected=r if name == "fault_detected" else None)
        elif fault is not None:
            if name == "fault_detected" or name in RESTARTS:
                fault.detected = fault.detected or r
            if name in RESTARTS or name == "resume":
                fault.restarted = fault.restarted or r
            if name == "resume":
                fault.resumed = fault.resumed or r
            if name == "drained" and fault.restarted is None:  # the step the drain committed and left at
                fault.position = int(_number(r, "step"))
                fault.drain_path = r.get("path")
            # A step completed after the restart recovers the fault, and so does one that started
            # after the fault without a restart (training went on: a step needs every rank) if the
            # fault is one training can outlive. An injected crash, drain or hang may let a few more
            # steps through before it bites (a dying background save, a signal on its way): those
            # prove nothing, nor does a step that was in flight when the fault fired.
            if name == "step" and (fault.restarted or (fault.outlived and
                                                       r["t"] - _number(r, "step_time_s") >= fault.onset["t"])):
                fault.recovered = r
                closed.append(fault)
                fault = None
        if name == "step":  # only recovered faults wait for this: a step in flight at the fault is no regain
            for waiting in closed:
                if waiting.regained is None and _number(r, "step") > waiting.position:
                    waiting.regained = r
        if name in ("step", "resume"):
            position = int(_number(r, "step"))
    if fault is not None:
        closed.append(fault)
    return tuple(f.close(t0, typical_step_s) for f in closed)


def _number(record: Event, key: str) -> float:
    value = record.get(key)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ReportError(f"{record['event']} event from {record.get('source', '?')} at t={record['t']} "
                          f"has {key}={value!r}; expected a number")
    return value


def _ratio(part: float, whole: float) -> float:
    return part / whole if whole > 0 else 0.0


def report_run(run_dir: Path) -> tuple[Timeline, GoodputReport]:
    directory = events_dir(run_dir)
    if not run_dir.is_dir():
        raise ReportError(f"{run_dir}: no such run directory (expected one holding events/*.jsonl)")
    if not directory.is_dir():
        raise ReportError(f"{directory}: missing (expected the run's event log, events/*.jsonl)")
    try:
        timeline = build_timeline(read_events(run_dir))
    except ReportError as err:
        raise ReportError(f"{directory}: {err}") from None
    return timeline, summarize(timeline)


def format_report(report: GoodputReport) -> str:
    ck = report.checkpoints
    lines = [
        f"Run: {report.status}, final step {report.final_step}, {report.attempts} attempt(s), "
        f"wall {report.wall_s:.1f} s, loss {report.first_loss:.4f} -> {report.final_loss:.4f}",
        f"Training goodput {report.training_goodput:6.1%}  productive step time "
        f"{report.productive_step_s:.1f} s ({report.useful_steps} steps, each once) / wall",
        f"Infra goodput    {report.infra_goodput:6.1%}  time inside steps {report.executed_step_s:.1f} s "
        f"({report.step_executions} executions; {report.lost_executions} lost to rollback, "
        f"{report.lost_step_s:.1f} s) / wall",
        f"Checkpoints: {ck.started} started, {ck.committed} committed, {ck.failed} failed; blocking "
        + (f"per save mean {ck.blocking_mean_s:.2f} s, max {ck.blocking_max_s:.2f} s, "
           f"total {ck.blocking_total_s:.1f} s ({ck.blocking_saves} saves)"
           if ck.blocking_saves else "not logged"),
        f"Faults: {len(report.faults)}",
    ]
    if report.events_dropped:
        lines.insert(-1, f"Events dropped: {report.events_dropped} (their writers could not write the log: a full or "
                         "failing file system); the figures above leave them out")
    # drain (peers): how a drain kept the step reached
    kinds = [f"{f.kind} ({f.drain_path})" if f.drain_path else f.kind for f in report.faults]
    width = max([16, *(len(k) + 1 for k in kinds)])
    if report.faults:
        lines.append(f"  {'#':>2}  {'kind':<{width}}{'rank':>5}{'at s':>9}  {'detected after':<26}"
                     f"{'restart':<11}{'recovery s':>14}{'time lost s':>14}  steps lost")
    for i, (f, kind) in enumerate(zip(report.faults, kinds), 1):
        detected = f"{_s(f.detection_s)} s ({f.detected_by})" if f.detection_s is not None else "-"
        lost = f"{f.steps_lost} (back to {f.resumed_from})" if f.steps_lost is not None else "-"
        lines.append(f"  {i:>2}  {kind:<{width}}{_or_dash(f.rank):>5}{f.at_s:>9.1f}  {detected:<26}"
                     f"{_or_dash(f.restart_kind):<11}{_s(f.recovery_s):>14}{_s(f.time_lost_s):>14}  {lost}")
    if report.faults:
        lines.extend(_fault_summary(report.faults))
    return "\n".join(lines)


def _fault_summary(faults: Sequence[Fault]) -> list[str]:
    """The report's last lines: what the faults cost in all, beside what the newest checkpoint alone would
    have cost where a recovery did better, and how fast each one recovered."""
    lost = [f.steps_lost for f in faults if f.steps_lost is not None]
    never = len(faults) - len(lost)
    line = (f"Lost: {sum(lost)} completed step(s) to {len(lost)} recovered fault(s); {never} never recovered" if never
            else f"Lost: {sum(lost)} completed step(s) to {len(faults)} fault(s)")
    if any(f.steps_lost is not None and f.checkpoint_steps_lost is not None and f.steps_lost < f.checkpoint_steps_lost
           for f in faults):
        baseline = " + ".join(_or_dash(f.checkpoint_steps_lost) for f in faults)
        line += f"; a resume from the newest checkpoint would have lost {baseline}"
    recovered = [f"{f.recovery_s:.1f} s ({f.kind})" for f in faults if f.recovery_s is not None]
    if not recovered:
        return [line]
    return [line, f"Recovered in {', '.join(recovered)}, each from the fault to the next completed step"]


def _s(seconds: float | None) -> str:  # at most 13 characters: the columns are 14 wide
    return "not recovered" if seconds is None else f"{seconds:.1f}"


def _or_dash(value: Any) -> str:
    return "-" if value is None else str(value)
