"""Replica groups, torch-free: where a rank learns its group and the Lighthouse, and how one step's global
batch is split over the groups that are live at that step.

A step's global batch is `rows` rows of micro-batches, a row being one micro-batch for each rank of a group
(so `rows` = global_batch_size / (group world size x batch_size)). The live groups take contiguous runs of
rows in the global sample order, as evenly as whole rows allow; a group's gradient is weighted by its rows'
share of the step's samples. So whichever groups are live, every step trains the same samples with the same
weight each, and a group that is out costs the others its rows, not the step. What it costs: with a number
of live groups that does not divide `rows`, some groups take one row more, and the step lasts as long as
theirs. Read by training.train.replica_groups (the ranks) and, before any rank starts, by training.train's
entry point (`check_torchft`) and the config's validation (`split_problem`).
"""
from __future__ import annotations

import importlib.metadata
import os
from dataclasses import dataclass
from pathlib import Path

# The group index of a rank's process (0 … R-1), set per group by whoever starts it (the group's Job, the
# local cluster, a test).
REPLICA_GROUP_ENV = "TRAINING_REPLICA_GROUP"
# The Lighthouse's address (http://host:port): the variable torchft's Manager reads on a group's rank 0
# (torchft 0.2.0 manager.py: `os.environ["TORCHFT_LIGHTHOUSE"]`).
LIGHTHOUSE_ENV = "TORCHFT_LIGHTHOUSE"
LIGHTHOUSE_PORT = 29510  # torchft_lighthouse's default --bind port (its --help)
TORCHFT_VERSION = "0.2.0"  # requirements.txt and training/requirements-image.txt pin it


def replica_group() -> int:
    """This process's replica group (0 without replica groups)."""
    return int(os.environ.get(REPLICA_GROUP_ENV, 0))


def group_run_dir(run_dir: str | Path, group: int) -> Path:
    """Replica group `group`'s own run directory (events, logs, report, checkpoints) in the run's."""
    return Path(run_dir) / f"group{group}"


def lighthouse_command(options: dict[str, int], port: int, bin_dir: str = "", host: str = "[::]") -> list[str]:
    """torchft's own Lighthouse server (its `torchft_lighthouse` console script, from PATH unless `bin_dir`
    names its directory) on `host` (default: every address) at `port`, with `options`
    (ParallelConfig.lighthouse_options) as its flags."""
    return [os.path.join(bin_dir, "torchft_lighthouse"), f"--bind={host}:{port}",
            *(f"--{key}={value}" for key, value in options.items())]


@dataclass(frozen=True)
class Share:
    """The rows of one step that a live group trains: `rows` of the step's `total_rows`, from `first_row` on."""
    first_row: int
    rows: int
    total_rows: int

    @property
    def weight(self) -> float:
        """The group's part of the step's samples: the factor of its gradient (and loss) in the cross-group sum."""
        return self.rows / self.total_rows


def share_of(total_rows: int, live_groups: int, index: int) -> Share:
    """The share of the live group with participating index `index` (0 … live_groups-1): the first
    total_rows % live_groups groups take one row more than the others."""
    base, extra = divmod(total_rows, live_groups)
    return Share(first_row=index * base + min(index, extra), rows=base + (index < extra), total_rows=total_rows)


def split_problem(micro_batches: int, groups: int, group_world_size: int | None = None) -> str | None:
    """Why `groups` replica groups cannot share a step of `micro_batches` micro-batches (None: they can):
    every rank of a group takes the same number of micro-batches (its FSDP2 collectives are one group's), and
    every group takes at least one row when all are live. Without `group_world_size` (at config time) only
    the second. The message names the shapes that can."""
    if micro_batches < groups:
        return (f"{micro_batches} micro-batch(es) per step cannot give each of {groups} replica groups one: a global "
                f"batch of at least {groups} micro-batches (training.global_batch_size >= {groups} x "
                f"training.batch_size), or at most {micro_batches} groups")
    if group_world_size is None:
        return None
    if micro_batches % group_world_size or micro_batches // group_world_size < groups:
        allowed = [w for w in range(1, micro_batches // groups + 1) if micro_batches % w == 0]
        return (f"{micro_batches} micro-batches per step cannot be split into rows of {group_world_size} (one per "
                f"rank of a group) with one row or more for each of {groups} groups; allowed ranks per group: "
                f"{allowed}")
    return None


def check_torchft() -> str | None:
    """Why replica groups cannot run in this environment (None: they can): torchft missing, or not the
    version the image pins. Reads package metadata only, imports nothing."""
    try:
        version = importlib.metadata.version("torchft")
    except importlib.metadata.PackageNotFoundError:
        return (f"parallel.replica_groups >= 2 needs torchft {TORCHFT_VERSION}, which is not installed here "
                f"(pip install --no-deps torchft=={TORCHFT_VERSION}; requirements.txt pins it)")
    if version != TORCHFT_VERSION:
        return f"parallel.replica_groups >= 2 needs torchft {TORCHFT_VERSION}; this environment has {version}"
    return None
