"""What reading the event log costs rank 0 as a run grows: a refresh of the metrics endpoint and the start
of an attempt, on synthetic logs of up to millions of events.

    python -m bench.event_log [--events N …]

Why: a two-week run writes over a million step events, and neither a scrape nor an attempt's start may cost
more as the log grows. Each size's log is written as training.contract.events writes it, and only two entry
points are measured (RunCollector.collect, Trainer._announce_attempt), so the same script measures an older
checkout. The rows and what each measures: docs/benchmarks.md.
"""
from __future__ import annotations

import argparse
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Callable

from training.contract.events import ATTEMPTS_SOURCE, EventLog, events_dir
from training.train.metrics import RunCollector
from training.train.trainer import Trainer

REFRESH_EVENTS = 30
STEPS_PER_CHECKPOINT = 100
STEPS_PER_ATTEMPT = 100_000
T0 = 1_767_000_000.0


@dataclass(frozen=True)
class Cost:
    seconds: float
    bytes_read: int


@dataclass(frozen=True)
class LogCosts:
    events: int
    log_bytes: int
    catch_up: Cost
    refresh: Cost
    resumed: Cost
    attempt_start: Cost


def bytes_read() -> int:
    """This process's bytes read so far, page cache included (Linux: /proc/self/io rchar)."""
    with open("/proc/self/io") as f:
        return int(next(line for line in f if line.startswith("rchar:")).split()[1])


def measured(action: Callable[[], object]) -> Cost:
    before, started = bytes_read(), time.perf_counter()
    action()
    return Cost(time.perf_counter() - started, bytes_read() - before)


class SyntheticRun:
    """rank 0's log of a long run, appended line by line as EventLog would write it (but formatted from a
    template: millions of json.dumps would take minutes); attempt_start in the attempts file."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir, self.step, self.t, self.events = run_dir, 0, T0, 0
        directory = events_dir(run_dir)
        directory.mkdir(parents=True, exist_ok=True)
        self._file = open(directory / "rank0.jsonl", "a")
        self._attempts = open(directory / f"{ATTEMPTS_SOURCE}.jsonl", "a")
        self._attempts.write(f'{{"t":{T0:.6f},"event":"attempt_start","source":"attempts","attempt":0,'
                             '"restart_kind":"fresh"}\n')
        self.events += 1

    def append(self, events: int) -> None:
        """At least `events` more events: steps, with their saves and restarts."""
        lines = []
        while len(lines) < events:
            self.step += 1
            self.t += 1.0
            lines.append(f'{{"t":{self.t:.6f},"event":"step","source":"rank0","step":{self.step},"loss":2.5,'
                         f'"step_time_s":0.98,"tokens":4096}}\n')
            if self.step % STEPS_PER_CHECKPOINT == 0:
                lines += [f'{{"t":{self.t:.6f},"event":"ckpt_start","source":"rank0","step":{self.step}}}\n',
                          f'{{"t":{self.t + 0.01:.6f},"event":"ckpt_blocked","source":"rank0","step":{self.step},'
                          '"seconds":0.01}\n',
                          f'{{"t":{self.t + 0.5:.6f},"event":"ckpt_committed","source":"rank0","step":{self.step},'
                          f'"path":"ckpt/step_{self.step:08d}","seconds":0.5,"generation":1}}\n']
            if self.step % STEPS_PER_ATTEMPT == 0:
                fields = f'"attempt":{self.step // STEPS_PER_ATTEMPT},"restart_kind":"injob"}}\n'
                self._attempts.write(f'{{"t":{self.t + 0.6:.6f},"event":"attempt_start","source":"attempts",{fields}')
                lines.append(f'{{"t":{self.t + 0.6:.6f},"event":"restart","source":"rank0",{fields}')
                self.events += 1
        self._file.writelines(lines)
        self._file.flush()
        self._attempts.flush()
        self.events += len(lines)

    def close(self) -> None:
        self._file.close()
        self._attempts.close()


def announce_attempt(run_dir: Path) -> None:
    """Rank 0's start of an attempt, as the Trainer does it, without building a model."""
    events = EventLog(run_dir, "rank0")
    stub = SimpleNamespace(cfg=SimpleNamespace(run_dir=str(run_dir), to_dict=dict), info=SimpleNamespace(world_size=1),
                           restart=None, events=events)
    try:
        Trainer._announce_attempt(stub)  # type: ignore[arg-type]
    finally:
        events.close()


def measure(run_dir: Path, events: int) -> LogCosts:
    run = SyntheticRun(run_dir)
    try:
        run.append(events)
        collector = RunCollector(run_dir, refresh_s=0.0)
        catch_up = measured(lambda: list(collector.collect()))
        run.append(REFRESH_EVENTS)
        refresh = measured(lambda: list(collector.collect()))
        resumed = measured(lambda: list(RunCollector(run_dir, refresh_s=0.0).collect()))
        attempt = measured(lambda: announce_attempt(run_dir))
    finally:
        run.close()
    size = sum(p.stat().st_size for p in events_dir(run_dir).glob("*.jsonl"))
    return LogCosts(run.events, size, catch_up, refresh, resumed, attempt)


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m bench.event_log", description=__doc__.split("\n\n")[0])
    p.add_argument("--events", type=int, nargs="+", default=[100_000, 1_000_000, 3_000_000])
    args = p.parse_args()
    print(f"{'events':>10} {'log MB':>8} {'catch-up s':>11} {'refresh s':>10} {'refresh KB':>11} "
          f"{'resumed s':>10} {'resumed KB':>11} {'attempt s':>10} {'attempt KB':>11}")
    for n in args.events:
        with tempfile.TemporaryDirectory() as tmp:
            c = measure(Path(tmp), n)
        print(f"{c.events:>10} {c.log_bytes / 1e6:>8.1f} {c.catch_up.seconds:>11.3f} {c.refresh.seconds:>10.4f} "
              f"{c.refresh.bytes_read / 1e3:>11.1f} {c.resumed.seconds:>10.4f} {c.resumed.bytes_read / 1e3:>11.1f} "
              f"{c.attempt_start.seconds:>10.4f} {c.attempt_start.bytes_read / 1e3:>11.1f}", flush=True)


if __name__ == "__main__":
    main()
