"""Where the ranks coordinate in-process restarts (fault_tolerance.restart = both): the Wrapper's store (its
barriers, heartbeats, interruption records) and the application's (each iteration's process-group rendezvous,
the fault log).

Both live in the rendezvous store off the GPU nodes, whose endpoint training.pod.launch hands the ranks
(STORE_ENDPOINT_ENV), under a prefix of the launcher cycle so that each cycle's keys start empty. Why: hosted
in global rank 0's process (NVRx's default) they died with rank 0's node and nothing escalated; off the
nodes, losing any node leaves the survivors' Wrapper standing to hand over to the in-job restart. Cost: every
rank's Wrapper polls a remote store. Without the endpoint, rank 0 hosts one store at MASTER_PORT+1. Details:
docs/recovery.md, "How `both` works".
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist
from nvidia_resiliency_ext.inprocess.store import StoreMixin
from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import DEFAULT_PORT as C10D_DEFAULT_PORT
from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint

from training.contract.launcher import STORE_ENDPOINT_ENV

HOSTED_PORT_OFFSET = 1  # without an endpoint: rank 0's store, at MASTER_PORT + this
STORE_TIMEOUT = timedelta(minutes=5)  # one store request (a wait's own timeout is shorter)


class WrapperStore(dist.PrefixStore, StoreMixin):
    """The Wrapper's store (its store_factory): a client of the coordination store, under a prefix.
    `host_rank`: the rank whose process serves it (None: off the nodes), which the Wrapper keeps until
    every rank has left."""

    def __init__(self, host: str, port: int, prefix: str, host_rank: int | None = None) -> None:
        super().__init__(prefix, dist.TCPStore(host, port, is_master=False, timeout=STORE_TIMEOUT,
                                               wait_for_workers=False))
        self._critical_ranks = () if host_rank is None else (host_rank,)

    @property
    def critical_ranks(self) -> tuple[int, ...]:
        return self._critical_ranks


@dataclass(frozen=True)
class Coordination:
    """The store this launcher cycle's ranks coordinate in, and their prefix in it."""
    host: str
    port: int
    prefix: str
    host_rank: int | None  # the rank whose process serves it; None: the rendezvous store, off the nodes

    @classmethod
    def from_env(cls, environ: dict[str, str] | os._Environ) -> Coordination:
        cycle = f"cycle{environ.get('TORCHELASTIC_RESTART_COUNT', '0')}-{environ['MASTER_ADDR']}:{environ['MASTER_PORT']}"
        prefix = f"training/{environ.get('TORCHELASTIC_RUN_ID', 'none')}/{cycle}"
        endpoint = environ.get(STORE_ENDPOINT_ENV)
        if endpoint:
            try:  # parsed as ft_launcher parses --rdzv-endpoint: the c10d backend's port unless one is given
                host, port = parse_rendezvous_endpoint(endpoint, default_port=C10D_DEFAULT_PORT)
            except ValueError as e:
                raise ValueError(f"{STORE_ENDPOINT_ENV}={endpoint!r} is not a rendezvous endpoint "
                                 f"(HOST, HOST:PORT or [IPv6]:PORT): {e}") from None
            return cls(host, port, prefix, None)
        return cls(environ["MASTER_ADDR"], int(environ["MASTER_PORT"]) + HOSTED_PORT_OFFSET, prefix, 0)

    def serve(self, rank: int) -> dist.TCPStore | None:
        """The store's server, when this rank's process hosts it (kept for the life of the process)."""
        if rank != self.host_rank:
            return None
        return dist.TCPStore(self.host, self.port, is_master=True, timeout=STORE_TIMEOUT, wait_for_workers=False)

    def app_store(self) -> dist.Store:
        """The application's store: a client, under the cycle's prefix."""
        return self.client("app")

    def client(self, name: str, timeout: timedelta = STORE_TIMEOUT) -> dist.Store:
        """A client of the store under the cycle's prefix and `name`, each request ending after `timeout`."""
        client = dist.TCPStore(self.host, self.port, is_master=False, timeout=timeout, wait_for_workers=False)
        return dist.PrefixStore(f"{self.prefix}/{name}", client)

    def wrapper_store(self) -> dict:
        """The Wrapper's store_factory and store_kwargs."""
        return dict(store_factory=WrapperStore, store_kwargs=dict(host=self.host, port=self.port,
                                                                  prefix=f"{self.prefix}/wrapper",
                                                                  host_rank=self.host_rank))
