"""Process-group setup and teardown; device and backend chosen from the config and the machine."""
from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from datetime import timedelta

import psutil
import torch
import torch.distributed as dist

from training.contract.launcher import FIRST_ATTEMPT_NCCL_DEBUG_ENV, free_port


def first_attempt_nccl_debug() -> None:
    level = os.environ.get(FIRST_ATTEMPT_NCCL_DEBUG_ENV)
    if level and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":
        os.environ["NCCL_DEBUG"] = level  # NCCL reads it at its first communicator in this process


@dataclass(frozen=True)
class DistInfo:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str  # nccl on CUDA, gloo on CPU


def choose_device(requested: str) -> torch.device:
    if requested == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("training.device=cuda but no CUDA device is visible")
    if requested == "cuda" or (requested == "auto" and torch.cuda.is_available()):
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device("cpu")


def init_distributed(requested_device: str, timeout_s: float, store: dist.Store | None = None) -> DistInfo:
    """Join the job's process group from the launcher's env (RANK, WORLD_SIZE, MASTER_ADDR …);
    without a launcher, a single-process group on a free local port. `store`: rendezvous there
    instead (an in-process restart joins each new group under a fresh store prefix)."""
    device = choose_device(requested_device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
        first_attempt_nccl_debug()
    default_launcher_env()
    # cpu:gloo alongside NCCL: DCP async saves and small CPU collectives need a CPU backend
    backend = "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"
    placement = {} if store is None else {"store": store, "rank": int(os.environ["RANK"]),
                                          "world_size": int(os.environ["WORLD_SIZE"])}
    dist.init_process_group(backend=backend, timeout=timedelta(seconds=timeout_s),
                            device_id=device if device.type == "cuda" else None, **placement)
    return DistInfo(rank=dist.get_rank(), world_size=dist.get_world_size(),
                    local_rank=int(os.environ["LOCAL_RANK"]), device=device,
                    backend="nccl" if device.type == "cuda" else "gloo")


def default_launcher_env() -> None:
    """Without a launcher: the env of a one-process job (rank 0 of 1, a free local port)."""
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    if "MASTER_PORT" not in os.environ:
        os.environ["MASTER_PORT"] = str(free_port())


# The in-process Wrapper's abort (in its monitor thread) and the training thread's teardown can
# destroy the process group at the same moment; destroy_process_group is not thread-safe.
PROCESS_GROUP_LOCK = threading.Lock()


def device_memory_bytes(device: torch.device) -> int:
    """The memory of the device the rank trains on: its GPU's, or the host's for a CPU rank."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    return psutil.virtual_memory().total


def teardown() -> None:
    with PROCESS_GROUP_LOCK:
        if dist.is_initialized():
            dist.destroy_process_group()

