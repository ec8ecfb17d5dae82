"""The floor of this machine: start fresh Pythons, import torch and join one gloo process group.

No recovery that restarts processes can beat it. Measured as the wall time from spawning
`world` processes (the recovery runs' world size, same environment as the ranks) until the last
of them has passed a barrier in the new group.

    python -m bench.floor RANK WORLD PORT     # one such process (what `measure_floor` spawns)
"""
from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from training.contract.launcher import free_port

REPO_ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class FloorResult:
    median_s: float
    samples_s: tuple[float, ...]
    world_size: int


def rank_env() -> dict[str, str]:
    """The environment the local cluster gives its ranks (training.local.cluster)."""
    path = os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": path, "PYTHONUNBUFFERED": "1",
            "PYTHONWARNINGS": "ignore::FutureWarning"}  # torch's pynvml deprecation notice, once per process


def measure_once(world: int) -> float:
    port = str(free_port())
    start = time.time()
    procs = [subprocess.Popen([sys.executable, "-m", "bench.floor", str(r), str(world), port], cwd=REPO_ROOT,
                              env=rank_env(), stdout=subprocess.PIPE, text=True) for r in range(world)]
    joined = []
    for p in procs:
        out, _ = p.communicate(timeout=120)
        if p.returncode != 0:
            raise RuntimeError(f"floor process exited with {p.returncode}")
        joined.append(float(out.split()[-1]))
    return max(joined) - start


def measure_floor(world: int, repeats: int) -> FloorResult:
    samples = tuple(measure_once(world) for _ in range(repeats))
    return FloorResult(statistics.median(samples), samples, world)


def _join(rank: int, world: int, port: int) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    dist.barrier()
    print(time.time(), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    _join(*(int(a) for a in sys.argv[1:4]))
