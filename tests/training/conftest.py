"""Fixtures shared by the training tests."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from training.train.distributed import DistInfo
from training_helpers import (COMMON, ONE_NODE, SmallFileSystem, StoppedRun, completed, once_per_session, run_local,
                              run_stopped_by_ctrl_c)


@pytest.fixture(scope="session")
def scratch(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("scratch")


@pytest.fixture(scope="session")
def reference(tmp_path_factory: pytest.TempPathFactory):
    """The uninterrupted run that every fault run of the COMMON shape must end equal to, bit for bit."""
    return once_per_session(tmp_path_factory, "reference", lambda run_dir: completed(
        run_local(run_dir, *ONE_NODE.argv(), *COMMON, "checkpoint.mode=sync")))


@pytest.fixture(scope="session")
def stopped_by_ctrl_c(tmp_path_factory) -> StoppedRun:
    """One run for the metrics endpoint (test_metrics.py) and Ctrl-C (test_local_cluster.py)."""
    return run_stopped_by_ctrl_c(tmp_path_factory.mktemp("ctrl-c") / "run")


@pytest.fixture()
def one_rank_group():
    """A one-rank gloo process group in this process, for FSDP2 and DCP without the local cluster."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield DistInfo(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), backend="gloo")
    dist.destroy_process_group()


@pytest.fixture()
def small_fs(tmp_path: Path):
    """An 8 MiB tmpfs under tmp_path, to fill and free (SmallFileSystem); unmounted after the test."""
    fs = SmallFileSystem(tmp_path / "fs", 8 << 20)
    yield fs
    fs.unmount()
