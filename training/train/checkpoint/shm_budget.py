"""What the staging buffers of async saves cost the process in shared memory and file descriptors, and the
checks that turn a shortage into one clear error instead of a dead rank or saves that fail forever.

Each buffer is a file in /dev/shm (tmpfs) held by an open descriptor. A full /dev/shm fails the buffer's
allocation with a line that says which file system is full, by how much, and what to change
(`new_shared_buffer`). A state with more buffers than the descriptor limit allows is refused before any is
made (`check_fd_budget`). Small tensors take no buffer (staging.BY_VALUE_BYTES): they travel inside the request.
"""
from __future__ import annotations

import os
import resource

import torch

SHM_DIR = "/dev/shm"  # where glibc's shm_open, and so torch's own shared memory, puts its files
# Descriptors per staging buffer that a writer process holds at its peak (the rank holds one)
WRITER_FDS_PER_BUFFER = 2
# Descriptors a process needs besides the buffers (sockets, pidfds, logs, the event log, torch's own)
FD_RESERVE = 128


class StagingBudgetError(RuntimeError):
    """The staging buffers cannot be had: the save (or the run's preparation) fails with this one line."""


def raise_fd_limit() -> int:
    """Lift this process's RLIMIT_NOFILE soft limit (often 1024) to its hard limit (setrlimit(2): an
    unprivileged process may); children forked after it inherit it. Returns the limit now in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return hard


def check_fd_budget(buffers: int) -> None:
    """Refuse, in one line, a state whose `buffers` staging buffers the writer process cannot receive, before
    any is made. A save hands the writer process one descriptor per buffer
    (training.train.checkpoint.shm_channel), and the writer holds up to two per buffer while it receives one
    (the previous save's mapping and the new one); the soft limit is first lifted (`raise_fd_limit`)."""
    limit = raise_fd_limit()
    needed = WRITER_FDS_PER_BUFFER * buffers + FD_RESERVE
    if needed > limit:
        raise StagingBudgetError(
            f"async checkpoint staging needs {needed} file descriptors ({buffers} staged tensors, "
            f"{WRITER_FDS_PER_BUFFER} each in the writer process, plus {FD_RESERVE}) but RLIMIT_NOFILE's hard limit "
            f"is {limit}: raise the container's nofile limit, or use checkpoint.mode=sync")


def new_shared_buffer(nbytes: int, directory: str = SHM_DIR) -> torch.UntypedStorage:
    """A shared-memory storage of `nbytes`, its pages reserved, or StagingBudgetError naming the file system
    that is full, by how much, and what to change. A tmpfs page first written through a mapping while the file
    system is full raises SIGBUS in the rank; torch's shared-memory allocator reserves the pages first
    (posix_fallocate in ATen's MapAllocator, torch 2.13: "unable to allocate shared memory(shm) ... No space
    left on device"), so a full /dev/shm fails the allocation here instead."""
    try:
        return torch.UntypedStorage._new_shared(nbytes, device="cpu")
    except RuntimeError as err:
        if "No space left on device" not in str(err):
            raise
        free = os.statvfs(directory)
        raise StagingBudgetError(
            f"async checkpoint staging: a {nbytes / 2**20:.1f} MiB buffer does not fit in {directory} "
            f"({free.f_bavail * free.f_frsize / 2**20:.1f} MiB free of {free.f_blocks * free.f_frsize / 2**20:.1f} "
            f"MiB): the save fails; give the pod's /dev/shm room for a copy of its state (the chart's "
            f"shm_fraction) or use checkpoint.mode=sync") from err
