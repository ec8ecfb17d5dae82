"""Aborting torch.distributed for an in-process restart, gloo included.

gloo has no abort: destroy_process_group() and ProcessGroupGloo.abort() return at once, but a
collective blocked in another thread keeps waiting until the gloo timeout. Shutting down the TCP
sockets of gloo's pairs makes it fail within about a second, on this rank and on its peers
("Connection closed by peer"). The TCPStore connections (the launcher's store, the Wrapper's and the
application's) are left alone: they must survive the restart. Cost: each restart leaks one gloo
context (its threads and descriptors stay until the process exits).
"""
from __future__ import annotations

import os
import socket
from collections.abc import Collection

import torch.distributed as dist
from nvidia_resiliency_ext.inprocess.abort import Abort, AbortTorchDistributed
from nvidia_resiliency_ext.inprocess.state import FrozenState

from training.train.distributed import PROCESS_GROUP_LOCK


def shutdown_gloo_sockets(keep_ports: Collection[int]) -> int:
    """shutdown(2) every connected TCP socket of this process whose local or peer port is not in
    `keep_ports`; returns how many. Only duplicates of the descriptors are closed."""
    count = 0
    for name in os.listdir("/proc/self/fd"):
        try:
            if not os.readlink(f"/proc/self/fd/{name}").startswith("socket:"):
                continue
            sock = socket.socket(fileno=os.dup(int(name)))
        except OSError:  # closed meanwhile
            continue
        with sock:
            try:
                if sock.type != socket.SOCK_STREAM or sock.family not in (socket.AF_INET, socket.AF_INET6):
                    continue
                ports = {sock.getsockname()[1], sock.getpeername()[1]}
                if ports.isdisjoint(keep_ports):
                    sock.shutdown(socket.SHUT_RDWR)
                    count += 1
            except OSError:  # listening or unconnected socket
                continue
    return count


class ProcessGroupAbort(Abort):
    """The Wrapper's `abort` (run by its monitor thread): unblock gloo collectives, then abort the
    NCCL communicators (NVRx's AbortTorchDistributed, on CUDA) or destroy the groups (CPU).
    NVRx's own abort asks every group for a CUDA backend, which fails on CPU."""

    def __init__(self, keep_ports: Collection[int], on_cuda: bool) -> None:
        self.keep_ports = frozenset(keep_ports)
        self._nccl = AbortTorchDistributed() if on_cuda else None

    def __call__(self, state: FrozenState) -> FrozenState:
        with PROCESS_GROUP_LOCK:  # the training thread, woken by the shut sockets, tears down too
            if dist.is_available() and dist.is_initialized():
                shutdown_gloo_sockets(self.keep_ports)  # on CUDA too: the cpu:gloo backend and checkpoint group
                if self._nccl is not None:
                    self._nccl(state)
                else:
                    dist.destroy_process_group()
        return state
