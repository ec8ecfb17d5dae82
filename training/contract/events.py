"""The run's append-only event log: the contract between training and the goodput report.

Each writer (a rank, the local controller, the fault injector) appends JSON lines to its own file
`<run_dir>/events/<source>.jsonl`, so concurrent writers never interleave within a line, also on
Lustre where O_APPEND across clients is not atomic. `read_events` merges all files by time.

Every record has `t` (unix seconds, float), `event` (one of EVENTS) and `source`; the other fields
depend on the event:

  job_start       nodes, nproc_per_node, spares    the local controller, before any launcher starts, so
                                                   the report's wall time includes start-up
  run_start       world_size, nodes, config        rank 0, once per process group start (attempt)
  attempt_start   attempt, restart_kind            rank 0; restart_kind: fresh | injob | inprocess
  resume          step, source_kind, path,         rank 0; source_kind: disk | memory (in-process) | peer
                                                   (node memory, training/train/peer_state.py) | none;
                  saved_world_size                 saved_world_size: the world size that wrote the checkpoint
  state_derived   step, saved_world_size,          rank 0: the checkpoint was resharded to another world
                  world_size, keys                 size; `keys`: per-rank state it lacked, derived
                                                   deterministically instead
  step            step, loss, step_time_s, tokens  rank 0, after each completed optimizer step; with
                  [rollback_s] [peer_s]            in-process restarts, rollback_s: seconds spent keeping
                                                   the step in memory after it (training/train/rollback.py);
                                                   with peer state, peer_s: the same for node memory
  ckpt_start      step                             rank 0
  ckpt_blocked    step, seconds                    rank 0: time training was blocked by this save
  ckpt_committed  step, path, seconds,             rank 0: save visible; seconds from start to commit;
                  generation                       generation: the worker group's (training/train/checkpoint/layout.py)
  ckpt_failed     step, error                      rank 0: the save is invisible, training goes on (error
                                                   starts with "fenced:" for a late save of an older generation)
  ckpt_fallback   path, error                      rank 0: a checkpoint could not be loaded, an older one is used
  fault_injected  kind, rank, step, spec           the faulty rank, just before the fault fires; spec:
                                                   the fault spec as written (training/train/faults.py)
  fault_detected  kind, rank, detail, by           whoever detects it; by: the detecting party
                                                   (controller, nvrx rank monitor, Wrapper …)
  restart         attempt, restart_kind            controller or rank 0; restart_kind: injob (ft_launcher
                                                   restarted the worker group), inprocess (Wrapper),
                                                   node (a node's pod replaced)
  peer_state      interval, replicas,              rank 0, once per attempt when peer state settled its interval
                  bytes_per_rank                   (training/train/peer_state.py): node memory per rank
  node_replaced   node, attempt                    the local controller
  drained         step, saved_step                 rank 0: every rank left at `step` after a SIGTERM;
                                                   saved_step: the newest step saved, where the restart resumes
  run_end         step, status                     rank 0 (status: completed) or controller (failed)
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any, Iterable, Iterator

EVENTS = frozenset({
    "job_start", "run_start", "attempt_start", "resume", "step", "ckpt_start", "ckpt_blocked", "ckpt_committed",
    "ckpt_failed", "ckpt_fallback", "state_derived", "fault_injected", "fault_detected", "restart", "node_replaced", "drained",
    "peer_state",
    "run_end",
})


def events_dir(run_dir: str | os.PathLike) -> Path:
    return Path(run_dir) / "events"


class EventLog:
    """Appends events for one source; each record is one write() of one line, flushed at once."""

    def __init__(self, run_dir: str | os.PathLike, source: str) -> None:
        self.source = source
        directory = events_dir(run_dir)
        directory.mkdir(parents=True, exist_ok=True)
        self._fd = os.open(directory / f"{source}.jsonl", os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def emit(self, event: str, **fields: Any) -> None:
        if event not in EVENTS:
            raise ValueError(f"unknown event {event!r}; known: {sorted(EVENTS)}")
        record = {"t": time.time(), "event": event, "source": self.source, **fields}
        os.write(self._fd, (json.dumps(record, separators=(",", ":")) + "\n").encode())

    def close(self) -> None:
        os.close(self._fd)


def read_events(run_dir: str | os.PathLike) -> list[dict[str, Any]]:
    """All events of a run, ordered by time. A torn last line (a writer killed mid-write) is skipped."""
    directory = events_dir(run_dir)
    if not directory.is_dir():
        raise FileNotFoundError(f"{run_dir}: no event log (expected {directory}/*.jsonl)")
    records = [r for path in sorted(directory.glob("*.jsonl")) for r in _read_lines(path)]
    return sorted(records, key=lambda r: r["t"])


def run_completed(run_dir: str | os.PathLike, steps: int) -> bool:
    """Whether rank 0 recorded the run's completion: a completed run_end at `steps` or beyond (a run
    directory may hold an earlier, shorter run that a longer one resumed from)."""
    directory = events_dir(run_dir)
    for path in sorted(directory.glob("*.jsonl")) if directory.is_dir() else ():
        with path.open() as f:  # a two-week log is large: parse only the run_end lines
            for r in _parse(line for line in f if '"run_end"' in line):
                if r["event"] == "run_end" and r.get("status") == "completed" and r.get("step", 0) >= steps:
                    return True
    return False


def _read_lines(path: Path) -> Iterator[dict[str, Any]]:
    with path.open() as f:
        yield from _parse(f)


def _parse(lines: Iterable[str]) -> Iterator[dict[str, Any]]:
    for line in lines:
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict) and "t" in record and "event" in record:
            yield record
