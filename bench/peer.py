"""Peer state (training.train.peer_state): what keeping every rank's state in node memory, on its own node
and the next, costs, from the peer-state mechanism's fault run.

  cost per step   rank 0's `peer_s` (PeerState.save on the training thread: the copy into node memory;
                  sending it to the partner runs beside training) against its `step_time_s`, medians
                  over the steps that saved.
  memory          node memory per rank (the `peer_state` event): two slots of its own copy and of each
                  partner's it holds.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from bench.rollback import cost_per_step
from training.contract.events import read_events


@dataclass(frozen=True)
class PeerResult:
    save_s: float  # median peer_s (rank 0)
    step_s: float  # median step_time_s over the same steps
    cost_ratio: float  # save_s / step_s
    steps: int  # steps that saved a copy
    interval: int  # the most steps a lost node costs, as settled (the last attempt's)
    replicas: int
    bytes_per_rank: int


def measure_peer(run_dir: Path) -> PeerResult:
    save_s, step_s, steps = cost_per_step(run_dir, "peer_s")
    settled = [e for e in read_events(run_dir) if e["event"] == "peer_state"]
    if not settled:
        raise ValueError(f"{run_dir}: no peer_state event")
    last = settled[-1]
    return PeerResult(save_s=save_s, step_s=step_s, cost_ratio=save_s / step_s, steps=steps,
                      interval=last["interval"], replicas=last["replicas"], bytes_per_rank=last["bytes_per_rank"])
