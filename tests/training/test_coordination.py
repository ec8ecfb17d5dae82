"""Where the in-process Wrapper coordinates (training/train/coordination.py): in the rendezvous store, off the
nodes, under a prefix of the launcher cycle; rank 0's process hosts it only without a launcher store."""
from __future__ import annotations

import threading
from datetime import timedelta

import pytest
import torch.distributed as dist

from training.contract.launcher import STORE_ENDPOINT_ENV, free_port
from training.train.coordination import HOSTED_PORT_OFFSET, Coordination, WrapperStore

RANK_ENV = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500", "TORCHELASTIC_RUN_ID": "job-1",
            "TORCHELASTIC_RESTART_COUNT": "4"}


def test_the_stores_live_in_the_rendezvous_store_under_the_cycles_prefix():
    c = Coordination.from_env({**RANK_ENV, STORE_ENDPOINT_ENV: "job-store.training:29400"})
    assert (c.host, c.port, c.host_rank) == ("job-store.training", 29400, None)  # no rank's process serves it
    assert c.serve(0) is None
    assert c.prefix == "training/job-1/cycle4-127.0.0.1:29500"
    assert Coordination.from_env({**RANK_ENV, STORE_ENDPOINT_ENV: "[fd00::1]:29400"}).host == "fd00::1"


def test_an_endpoint_without_a_port_takes_the_launchers_default_and_a_bad_one_is_named():
    # ft_launcher, as torchrun, takes --rdzv-endpoint=HOST with the c10d backend's port 29400
    assert Coordination.from_env({**RANK_ENV, STORE_ENDPOINT_ENV: "job-store"}).port == 29400
    with pytest.raises(ValueError, match=r"TRAINING_STORE_ENDPOINT='job-store:x' is not a rendezvous endpoint"):
        Coordination.from_env({**RANK_ENV, STORE_ENDPOINT_ENV: "job-store:x"})


def test_without_a_launcher_store_rank_0_hosts_it_and_is_the_wrappers_critical_rank():
    c = Coordination.from_env(RANK_ENV)
    assert (c.host, c.port, c.host_rank) == ("127.0.0.1", 29500 + HOSTED_PORT_OFFSET, 0)
    assert c.wrapper_store()["store_kwargs"]["host_rank"] == 0


def test_ranks_coordinate_through_a_store_no_rank_hosts(monkeypatch):
    """Two ranks' Wrapper stores meet in a store served elsewhere (here, this test, as nvrx-control does on the
    cluster); a later cycle's keys start empty; neither rank is critical to it."""
    port = free_port()
    server = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    env = {**RANK_ENV, STORE_ENDPOINT_ENV: f"127.0.0.1:{port}"}
    first, later = Coordination.from_env(env), Coordination.from_env({**env, "TORCHELASTIC_RESTART_COUNT": "5"})
    stores = [WrapperStore(**first.wrapper_store()["store_kwargs"]) for _ in range(2)]
    assert all(s.critical_ranks == () for s in stores)
    arrived = []

    def barrier(rank):
        stores[rank].initial_barrier(ranks=[rank], rendezvous_count=2, timeout=timedelta(seconds=20))
        arrived.append(rank)

    threads = [threading.Thread(target=barrier, args=(rank,)) for rank in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert sorted(arrived) == [0, 1]
    stores[0].send_heartbeat(0)
    assert stores[1].get_heartbeat(0) > 0
    fresh = WrapperStore(**later.wrapper_store()["store_kwargs"])
    assert not fresh.check([WrapperStore.HEARTBEAT.format(rank=0)])  # the next cycle's Wrapper starts empty
    first.app_store().set("faults/0", "x")
    assert not later.app_store().check(["faults/0"]) and server.num_keys() > 0
