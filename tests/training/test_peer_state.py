"""Peer state (training/train/peer_state.py) on two gloo ranks, one per "node" directory: what a node keeps,
what its partner gets, what a new world restores; a torn copy is never used."""
from __future__ import annotations

import shutil
import threading
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from training.contract.launcher import free_port
from training.train.peer_state import OWN, REPLICA, Copy, NodeMemory, flatten, layout, unflatten, views

WORLD = 2
FINGERPRINT = "test"


class Weights:
    """A Stateful holding one tensor and a counter, as the training state's parts do."""

    def __init__(self, value: torch.Tensor, count: int = 0) -> None:
        self.value, self.count = value, count

    def state_dict(self):
        return {"w": self.value, "meta": {"count": self.count, "lr": [0.5]}}

    def load_state_dict(self, state):
        self.value.copy_(state["w"])
        self.count = state["meta"]["count"]


def _values(rank: int, step: int) -> torch.Tensor:
    return torch.arange(1000, dtype=torch.float32) * (rank + 1) + step


def _worker(rank: int, port: int, roots: list[str], phase: str, results: dict, replicas: int) -> None:
    import os

    os.environ.update(LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=len(roots))
    from training.train.peer_state import PeerState

    peer = PeerState(Path(roots[rank]), FINGERPRINT, interval=1, replicas=replicas, timeout_s=30)
    weights = Weights(torch.zeros(1000))
    state = {"model": weights}
    if phase == "save":
        for step in (3, 4):
            weights.value.copy_(_values(rank, step))
            weights.count = step
            peer.save(step, state, step_time_s=1.0)
        peer.settle()
        results[rank] = None
    else:
        step = peer.restore(state, not_older_than=int(phase))
        results[rank] = (step, weights.value.clone(), weights.count)
    peer.close()
    dist.destroy_process_group()


def _run(roots: list[Path], phase: str, replicas: int = 1) -> dict:
    """One process per node directory in `roots` (one rank per node)."""
    results = mp.Manager().dict()
    mp.spawn(_worker, args=(free_port(), [str(r) for r in roots], phase, results, replicas), nprocs=len(roots))
    return dict(results)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Two nodes' memory after steps 3 and 4: each holds its own shard and its partner's."""
    base = tmp_path_factory.mktemp("peer")
    roots = [base / "node0", base / "node1"]
    _run(roots, "save")
    return roots


def _copy_nodes(saved: list[Path], tmp_path: Path) -> list[Path]:
    roots = [tmp_path / p.name for p in saved]
    for src, dst in zip(saved, roots):
        shutil.copytree(src, dst)
    return roots


def test_each_node_holds_its_shard_and_its_partners(saved):
    for rank, root in enumerate(saved):
        copies = NodeMemory(root).copies()
        assert {(c.kind, c.shard, c.step) for c in copies} == {
            (OWN, rank, 3), (OWN, rank, 4), (REPLICA, 1 - rank, 3), (REPLICA, 1 - rank, 4)}


def test_a_lost_node_is_restored_from_its_partner_bitwise(saved, tmp_path):
    node0, _ = _copy_nodes(saved, tmp_path)
    spare = tmp_path / "spare"  # node 1 is lost; the spare's memory is empty
    results = _run([node0, spare], "0")
    for rank in range(WORLD):
        step, value, count = results[rank]
        assert (step, count) == (4, 4)
        assert torch.equal(value, _values(rank, 4))


def test_two_partners_lost_together_fall_back(saved, tmp_path, caplog):
    results = _run([tmp_path / "a", tmp_path / "b"], "0")  # both nodes new: no copy anywhere
    assert {r[0] for r in results.values()} == {None}


def test_a_torn_copy_is_never_used(saved, tmp_path):
    """Node 1 lost while node 0 was receiving its step-4 copy: that copy is torn (no .ok), step 3 is used."""
    node0, _ = _copy_nodes(saved, tmp_path)
    memory = NodeMemory(node0)
    [torn] = [c for c in memory.copies() if (c.kind, c.step) == (REPLICA, 4)]
    memory.begin(REPLICA, torn.shard, torn.slot, torn.data_nbytes)[:10] = 7  # a write that never completed
    results = _run([node0, tmp_path / "spare"], "0")
    for rank in range(WORLD):
        step, value, _ = results[rank]
        assert step == 3 and torch.equal(value, _values(rank, 3))
    # the run goes back to step 3: node 0's own copy of step 4 is gone, so it can never be mixed in later
    assert {c.step for c in NodeMemory(node0).copies()} == {3}


def test_a_newer_checkpoint_wins(saved, tmp_path):
    roots = _copy_nodes(saved, tmp_path)
    results = _run(roots, "5")
    assert {r[0] for r in results.values()} == {None}
    assert not NodeMemory(roots[0]).copies()  # older than where the run goes on from: dropped


def test_two_replicas_survive_two_lost_nodes(tmp_path):
    """Three nodes, each rank copied to the next two: lose two nodes, the third holds every shard."""
    roots = [tmp_path / f"node{i}" for i in range(3)]
    _run(roots, "save", replicas=2)
    assert {(c.kind, c.shard) for c in NodeMemory(roots[2]).copies()} == {
        (OWN, 2), (REPLICA, 0), (REPLICA, 1)}
    results = _run([roots[2], tmp_path / "spare1", tmp_path / "spare2"], "0", replicas=2)
    for rank in range(3):
        step, value, _ = results[rank]
        assert step == 4 and torch.equal(value, _values(rank, 4))


def test_copies_without_a_commit_record_do_not_count(tmp_path):
    memory = NodeMemory(tmp_path)
    data = memory.begin(OWN, 0, 0, 64)
    data[:] = 1
    assert memory.copies() == []
    copy = Copy(OWN, 0, 0, 9, 1, FINGERPRINT, 64, 3)
    memory.commit(copy, b"abc")
    assert memory.copies() == [copy]
    memory.begin(OWN, 0, 0, 64)  # rewriting the slot: it stops counting first
    assert memory.copies() == []


def test_flat_layout_round_trips_every_tensor_and_leaf():
    state = {"a": torch.arange(5, dtype=torch.int64), "b": [torch.ones(2, 3, dtype=torch.bfloat16), 0.1],
             "c": {"step": 7, "t": torch.tensor(True)}}
    tensors: list[torch.Tensor] = []
    skeleton = flatten(state, tensors)
    specs, nbytes = layout(tensors)
    data = torch.zeros(nbytes, dtype=torch.uint8)
    for view, t in zip(views(data, specs), tensors):
        view.copy_(t)
    back = unflatten(skeleton, views(data, specs))
    assert torch.equal(back["a"], state["a"]) and torch.equal(back["b"][0], state["b"][0])
    assert back["b"][1] == 0.1 and back["c"]["step"] == 7 and back["c"]["t"].item() is True


def test_an_iteration_that_dies_leaves_no_replication_thread_behind(tmp_path, monkeypatch):
    """Under in-process restarts a process runs one iteration after another: each iteration's peer-state
    thread must end with it."""
    from training.contract.config import load_train_config
    from training.train.faults import FaultInjected
    from training.train.trainer import run

    for name, value in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
                        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}.items():
        monkeypatch.setenv(name, value)
    cfg = load_train_config(None, [f"run_dir={tmp_path}", "training.device=cpu", "training.steps=6",
                                   "peer_state.enabled=true", "peer_state.interval=1",
                                   f"peer_state.memory_dir={tmp_path / 'memory'}", "faults=[exception@3,exception@5]"])
    for _ in range(2):  # two iterations: the first dies at step 3, the second (resumed from node memory) at 5
        with pytest.raises(FaultInjected):
            run(cfg)
    assert [t for t in threading.enumerate() if t.name == "peer-state" and t.is_alive()] == []
