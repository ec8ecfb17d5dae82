"""In-memory rollback (training.train.rollback): what keeping every completed step in host memory costs.

  cost per step   from the in-process mechanism's fault run: rank 0's `rollback_s` (MemoryRollback.save
                  after each step) against its `step_time_s`, medians over the steps (the first save into
                  each set of buffers also allocates it and makes its plan, once per process).
  copy bandwidth  MemoryRollback.save of a synthetic shard of the profile's `rollback_copy_bytes` on its
                  device (CPU: host to host; CUDA: device to pinned host), bytes / median seconds per save
                  once both sets of buffers exist. The fault run's model is too small for that: its save
                  is per-tensor overhead.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from bench.stall import synthetic_state
from training.contract.events import read_events
from training.train.rollback import KEEP, MemoryRollback

COPY_SAVES = KEEP + 3  # the first KEEP allocate the buffers


@dataclass(frozen=True)
class RollbackResult:
    save_s: float  # median rollback_s over the in-process run's steps (rank 0)
    step_s: float  # median step_time_s over the same steps
    cost_ratio: float  # save_s / step_s
    steps: int
    copy_bytes: int  # the synthetic shard
    copy_s: float  # median seconds per save of it
    copy_gbps: float  # copy_bytes / copy_s, in GB/s (10^9 bytes)


class _Held:
    """A Stateful around a plain state dict."""

    def __init__(self, state: dict[str, Any]) -> None:
        self.state = state

    def state_dict(self) -> dict[str, Any]:
        return self.state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.state = state


def cost_per_step(run_dir: Path, key: str = "rollback_s") -> tuple[float, float, int]:
    """(median `key`, median step_time_s, steps) over a run's step events that have `key`: rollback_s
    (an in-process run), peer_s (a run with peer state)."""
    steps = [e for e in read_events(run_dir) if e["event"] == "step" and key in e]
    if not steps:
        raise ValueError(f"{run_dir}: no step event has {key}")
    return (statistics.median(e[key] for e in steps), statistics.median(e["step_time_s"] for e in steps),
            len(steps))


def copy_seconds(nbytes: int, device: str) -> float:
    """Median seconds per MemoryRollback.save of a synthetic `nbytes` shard on `device`, buffers allocated."""
    state = {"shard": _Held(synthetic_state(nbytes, 0, torch.device(device)))}
    rollback, seconds = MemoryRollback(), []
    for step in range(COPY_SAVES):
        started = time.perf_counter()
        rollback.save(step, state)
        seconds.append(time.perf_counter() - started)
    return statistics.median(seconds[KEEP:])


def measure_rollback(inprocess_run: Path, copy_bytes: int, device: str) -> RollbackResult:
    save_s, step_s, steps = cost_per_step(inprocess_run)
    copy_s = copy_seconds(copy_bytes, device)
    return RollbackResult(save_s=save_s, step_s=step_s, cost_ratio=save_s / step_s, steps=steps,
                          copy_bytes=copy_bytes, copy_s=copy_s, copy_gbps=copy_bytes / copy_s / 1e9)
