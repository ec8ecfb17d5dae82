"""The run-so-far figures, folded event by event: what rank 0's metrics endpoint shows between reads of
the event log, at the cost of the events appended since the last read, not of the whole log.

The definitions are the report's (training.report.goodput); `UsefulSteps` is its rule for which step
executions count, which the report's timeline uses too. Events are folded in the order they are read,
each read's batch in time order: a late event of another source (read after a newer one was folded)
changes sums and extremes as if it had come in order; the steps and resumes that decide which
executions count are all rank 0's, written, and therefore read, in order.
"""
from __future__ import annotations

from array import array
from bisect import bisect_left, bisect_right
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Iterable

Event = dict[str, Any]


class BelowFloor(Exception):
    """A resume, or a step's execution, reached the steps a saved tally folded into its floor."""


class UsefulSteps:
    """Step executions whose result still counts, in step order: a `resume` to step S throws away every
    execution of a later step; a new execution of a step replaces its earlier one. 24 bytes per step
    held (a two-week run at a step a second: about 30 MB), and the productive time kept as a running
    sum, so neither a step nor a resume costs more than the executions it throws away (an execution out
    of step order, which no resume preceded, costs the executions after it once).

    `folded(step)` is a copy with the executions up to `step` folded into a floor (their count and time):
    what a saved tally keeps. Going back below the floor then raises BelowFloor."""

    def __init__(self) -> None:
        self._steps = array("q")
        self._ids = array("q")  # the caller's id of each execution
        self._sums = array("d")  # productive seconds up to and including each execution
        self.floor_step, self.floor_count, self.floor_seconds = -1, 0, 0.0  # folded: executions up to floor_step

    def __len__(self) -> int:
        return self.floor_count + len(self._steps)

    @property
    def seconds(self) -> float:
        """Productive step time: the useful executions' step times summed."""
        return self._sums[-1] if self._sums else self.floor_seconds

    def folded(self, step: int) -> UsefulSteps:
        at = bisect_right(self._steps, step)
        copy = UsefulSteps()
        copy._steps, copy._ids, copy._sums = self._steps[at:], self._ids[at:], self._sums[at:]
        if at:
            copy.floor_step, copy.floor_count, copy.floor_seconds = self._steps[at - 1], self.floor_count + at, \
                self._sums[at - 1]
        else:
            copy.floor_step, copy.floor_count, copy.floor_seconds = self.floor_step, self.floor_count, self.floor_seconds
        return copy

    def arrays(self) -> tuple[array, array, array]:
        return self._steps, self._ids, self._sums

    def restore(self, arrays: tuple[array, array, array], floor_step: int, floor_count: int,
                floor_seconds: float) -> None:
        self._steps, self._ids, self._sums = arrays
        self.floor_step, self.floor_count, self.floor_seconds = floor_step, floor_count, floor_seconds

    def executed(self, step: int, seconds: float, run_id: int) -> list[int]:
        """Execution `run_id` of `step` took `seconds`; returns the ids it throws away."""
        if step <= self.floor_step:
            raise BelowFloor(f"step {step} executed again, at or below the floor {self.floor_step}")
        if not self._steps or step > self._steps[-1]:
            self._steps.append(step)
            self._ids.append(run_id)
            self._sums.append(self.seconds + seconds)
            return []
        at = bisect_left(self._steps, step)
        lost = []
        if self._steps[at] == step:
            lost.append(self._ids[at])
            self._ids[at] = run_id
        else:
            self._steps.insert(at, step)
            self._ids.insert(at, run_id)
            self._sums.insert(at, self._sums[at - 1] if at else self.floor_seconds)
        self._set(at, seconds)
        return lost

    def resumed(self, step: int) -> list[int]:
        """Training went back to `step`; returns the ids of the executions of later steps."""
        if step < self.floor_step:
            raise BelowFloor(f"resumed at step {step}, below the floor {self.floor_step}")
        at = bisect_right(self._steps, step)
        lost = self._ids[at:].tolist()
        del self._steps[at:], self._ids[at:], self._sums[at:]
        return lost

    def _set(self, at: int, seconds: float) -> None:
        """Execution `at` (new with no time yet, or replacing another) takes `seconds`: the sums from it on."""
        change = (self._sums[at - 1] if at else self.floor_seconds) + seconds - self._sums[at]
        for i in range(at, len(self._sums)):
            self._sums[i] += change


@dataclass
class RunTally:
    """The figures of `build_report` that the metrics endpoint shows, kept up to date by `add`."""
    first_t: float = float("inf")  # the report's start: the first event, or the first step's start if earlier
    last_t: float = float("-inf")
    steps: int = 0  # step executions, lost ones too
    executed_s: float = 0.0
    useful: UsefulSteps = field(default_factory=UsefulSteps)
    restarts: Counter[str] = field(default_factory=Counter)  # restart events by restart_kind
    ckpt_started: int = 0
    ckpt_committed: int = 0
    ckpt_failed: int = 0
    ckpt_no_space: int = 0  # of those failed: the checkpoint file system was full
    ckpt_writer_replaced: int = 0  # a rank's async checkpoint writer found dead or stuck and replaced
    events_dropped: int = 0  # events the log lacks: their writer could not write them (events_dropped)
    blocking_total_s: float = 0.0
    blocking_max_s: float = 0.0
    committed_at: float | None = None  # time of the newest ckpt_committed
    committed_step: int = -1  # the newest committed checkpoint's step
    malformed: int = 0  # events without the fields their kind needs: skipped (the report refuses the log)

    def add(self, events: Iterable[Event]) -> None:
        """Fold `events` in; raises BelowFloor when they go back below a saved tally's floor."""
        for r in events:
            try:
                self._add(r)
            except (KeyError, TypeError, ValueError):
                self.malformed += 1

    def _add(self, r: Event) -> None:
        name, t = r["event"], float(r["t"])
        start = t
        if name == "step":
            step, seconds = int(r["step"]), float(r["step_time_s"])
            self.useful.executed(step, seconds, self.steps)
            self.steps += 1
            self.executed_s += seconds
            start = t - seconds
        elif name == "resume":
            self.useful.resumed(int(r["step"]))
        elif name == "restart":
            self.restarts[str(r.get("restart_kind"))] += 1
        elif name == "ckpt_start":
            self.ckpt_started += 1
        elif name == "ckpt_committed":
            self.ckpt_committed += 1
            self.committed_at = t if self.committed_at is None else max(self.committed_at, t)
            self.committed_step = max(self.committed_step, int(r["step"]))
        elif name == "ckpt_failed":
            self.ckpt_failed += 1
        elif name == "ckpt_no_space":
            self.ckpt_no_space += 1
        elif name == "ckpt_writer_replaced":
            self.ckpt_writer_replaced += 1
        elif name == "events_dropped":
            self.events_dropped += int(r["count"])
        elif name == "ckpt_blocked":
            seconds = float(r["seconds"])
            self.blocking_total_s += seconds
            self.blocking_max_s = max(self.blocking_max_s, seconds)
        self.first_t, self.last_t = min(self.first_t, start), max(self.last_t, t)

    @property
    def wall_s(self) -> float:
        return self.last_t - self.first_t if self.steps else 0.0

    @property
    def training_goodput(self) -> float:
        return self.useful.seconds / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def infra_goodput(self) -> float:
        return self.executed_s / self.wall_s if self.wall_s > 0 else 0.0
