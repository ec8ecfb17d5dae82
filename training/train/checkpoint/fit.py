"""Whether an intact checkpoint can be loaded into this run's state at all, decided before any shard is
read: a changed model preset or optimizer cannot load it on any attempt, while an I/O error or a timeout
during the load may pass on the next one (`manager` retries only those)."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.stateful import Stateful


def misfit(state: dict[str, Any], path: Path) -> str | None:
    """Why `state` cannot load the checkpoint at `path` (a key it lacks, a tensor of another size), or None
    when it can, or when its metadata cannot be read (an I/O error proves nothing: the load reports it)."""
    try:
        metadata = FileSystemReader(path).read_metadata()
    except OSError:
        return None
    return plan_misfit(state, metadata)


def plan_misfit(state: dict[str, Any], metadata: Metadata) -> str | None:
    """Why `state` cannot load a checkpoint with this `.metadata`, or None. It asks DCP's own load planner
    for this rank's plan, as `dcp.load` does before it reads: the plan depends on the state and the
    metadata only, so what fails here fails on every attempt."""
    planner = DefaultLoadPlanner()
    # as dcp.load sees the state: a Stateful's state_dict (FSDP's DTensors keep their global sizes)
    plain = {key: value.state_dict() if isinstance(value, Stateful) else value for key, value in state.items()}
    try:
        planner.set_up_planner(plain, metadata, is_coordinator=False)
        planner.create_local_plan()
    except Exception as err:  # noqa: BLE001 (no I/O and no collective here: any error is the mismatch's)
        return f"{type(err).__name__}: {err}"[:500]
    return None
