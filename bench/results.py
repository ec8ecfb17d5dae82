"""The bench result: one JSON document per run, bench/results/<date>.json.

`python -m training.plan --from-bench` reads `checkpoint.async_blocking_s`, `checkpoint.sync_blocking_s` and
`recovery.<mechanism>.median_recovery_s`: only measured mechanisms appear under "recovery"; those
that could not be measured are under "unavailable" with the reason.
"""
from __future__ import annotations

import json
import os
import platform
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from bench.checks import Check
from bench.floor import FloorResult
from bench.mechanisms import MechanismResult
from bench.peer import PeerResult
from bench.peer_sizes import PeerSize
from bench.profile import Profile
from bench.projection import Projection
from bench.rollback import RollbackResult
from bench.stall import StallResult
from training.contract.k8s_delays import EKS, KubernetesDelays

SCHEMA = "bench-result/1"
SPARE_CPU = "checkpoint_spare_cpu"  # the stall's second CPU pass, with one CPU left to the writer
ROLLBACK = "rollback"  # the in-memory rollback's cost (bench.rollback)
PEER = "peer"  # peer state's cost and memory (bench.peer)
PEER_SIZES = "peer_sizes"  # peer state's copy, send and restore at more than one size (bench.peer_sizes)


@dataclass(frozen=True)
class Machine:
    cpus: int
    load_avg_1m: float  # at the end of the run: other work on the machine makes timings noisy
    python: str
    torch: str
    nvrx: str
    device: str

    @staticmethod
    def here(device: str) -> "Machine":
        import torch
        from importlib.metadata import PackageNotFoundError, version

        try:
            nvrx = version("nvidia-resiliency-ext")
        except PackageNotFoundError:
            nvrx = "not installed"
        name = torch.cuda.get_device_name() if device == "cuda" else platform.processor() or platform.machine()
        return Machine(os.cpu_count() or 0, os.getloadavg()[0], platform.python_version(), torch.__version__,
                       nvrx, name)


@dataclass(frozen=True)
class BenchResult:
    date: str
    profile: Profile
    machine: Machine
    elapsed_s: float
    checkpoint: StallResult | None
    checkpoint_spare_cpu: StallResult | None  # SPARE_CPU; None where not run or not measured
    floor: FloorResult | None
    recovery: dict[str, MechanismResult]
    rollback: RollbackResult | None  # ROLLBACK; None where not measured
    peer: PeerResult | None  # PEER; None where not measured
    unavailable: dict[str, str]  # mechanism or part -> why it was not measured
    checks: tuple[Check, ...]
    # A lost p5 node on EKS, projected from `recovery` and `delays` (bench.projection): not measured.
    projections: tuple[Projection, ...] = ()
    delays: KubernetesDelays = EKS
    peer_sizes: tuple[PeerSize, ...] = ()  # PEER_SIZES, smallest state first; () where not measured
    schema: str = field(default=SCHEMA)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def write_json(result: BenchResult, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result.to_dict(), indent=2) + "\n")
    return path
