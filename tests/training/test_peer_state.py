"""Peer state (training/train/peer_state.py) on two gloo ranks, one per "node" directory: what a node keeps,
what its partner gets, what a new world restores; a torn copy is never used."""
from __future__ import annotations

import os
import shutil
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from training.contract.config import PeerStateConfig
from training.contract.events import read_events
from training.contract.launcher import free_port
from training.train.peer_state import OWN, REPLICA, Copy, NodeMemory, checksum, flatten, layout, unflatten, views
from training_helpers import rank_results

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


@dataclass(frozen=True)
class Phase:
    """What each rank does: save `steps` at peer_state.interval `interval` (each send held back `send_delay_s`
    first, as a slow network would), rank 0 copying its node's memory to `snapshot` as soon as its last save
    returned (the node's memory at that instant, while sends are in flight); or restore, each rank with its own
    view of the newest checkpoint (`not_older_than`), the tier after peer state one that loads or raises
    (`disk`), then save the steps `then` (rank 0's node memory copied to `snapshot` first)."""
    steps: tuple[int, ...] = ()
    send_delay_s: float = 0.0
    snapshot: str | None = None
    not_older_than: tuple[int, ...] = (0, 0)
    disk: str | None = None  # None: no tier after peer state; "loads": a checkpoint at not_older_than; "fails"
    events_dir: str | None = None
    interval: int = 1
    then: tuple[int, ...] = ()


class _FakeDisk:
    name = "disk"

    def __init__(self, outcome: str, step: int) -> None:
        self.outcome, self.step = outcome, step

    def restore(self, state, *, not_older_than):
        from training.train.recovery import Restored

        if self.outcome == "fails":
            raise OSError("the checkpoint cannot be read")
        return Restored(self.step, "disk")

    def superseded(self, restored):
        pass


def _join(rank: int, world: int) -> None:
    """This forked rank in the world of `rank_results` (MASTER_PORT), one rank per node."""
    os.environ.update(LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{os.environ['MASTER_PORT']}", rank=rank,
                            world_size=world)


def _worker(rank: int, roots: list[str], phase: Phase, replicas: int) -> object:
    _join(rank, len(roots))
    from training.contract.events import EventLog
    from training.train.peer_state import PeerState
    from training.train.recovery import PeerTier, restore_first

    if phase.send_delay_s:
        replicate = PeerState._replicate

        def slow(self, *args):
            time.sleep(phase.send_delay_s)
            replicate(self, *args)
        PeerState._replicate = slow
    events = EventLog(phase.events_dir, f"rank{rank}") if phase.events_dir else None
    peer = PeerState(PeerStateConfig(enabled=True, interval=phase.interval, replicas=replicas), Path(roots[rank]),
                     FINGERPRINT, timeout_s=30, events=events)
    weights = Weights(torch.zeros(1000))
    state = {"model": weights}
    if phase.steps:
        for step in phase.steps:
            weights.value.copy_(_values(rank, step))
            weights.count = step
            peer.save(step, state, step_time_s=1.0)
        if rank == 0 and phase.snapshot:
            shutil.copytree(roots[0], phase.snapshot)
        peer.settle()
        result = None
    else:
        tiers = [PeerTier(peer)] + ([_FakeDisk(phase.disk, phase.not_older_than[rank])] if phase.disk else [])
        try:
            restored = restore_first(tiers, state, not_older_than=phase.not_older_than[rank])
            result = (restored and (restored.step, restored.source_kind), weights.value.clone(), weights.count)
            if rank == 0 and phase.snapshot:
                shutil.copytree(roots[0], phase.snapshot)
            for step in phase.then:
                peer.save(step, state, step_time_s=1.0)
            peer.settle()
        except OSError as err:
            result = str(err)
    peer.close()
    dist.destroy_process_group()
    return result


def _run(roots: list[Path], phase: Phase, replicas: int = 1) -> dict:
    """One process per node directory in `roots` (one rank per node, forked from this one): rank -> its result."""
    logs = Path(tempfile.mkdtemp(prefix="ranks-", dir=roots[0].parent))
    paths = [str(r) for r in roots]
    return dict(enumerate(rank_results(lambda rank: _worker(rank, paths, phase, replicas), logs, world=len(roots))))


def _restore(roots: list[Path], newest_checkpoint: int = 0, replicas: int = 1, **kwargs) -> dict:
    return _run(roots, Phase(not_older_than=(newest_checkpoint,) * len(roots), **kwargs), replicas)


SAVE = Phase(steps=(3, 4))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Two nodes' memory after steps 3 and 4: each holds its own shard and its partner's."""
    base = tmp_path_factory.mktemp("peer")
    roots = [base / "node0", base / "node1"]
    _run(roots, SAVE)
    return roots


def _copy_nodes(saved: list[Path], tmp_path: Path) -> list[Path]:
    roots = [tmp_path / p.name for p in saved]
    for src, dst in zip(saved, roots):
        shutil.copytree(src, dst)
    return roots


def _assert_restored_from_peers(results: dict, step: int) -> None:
    for rank in range(WORLD):
        restored, value, count = results[rank]
        assert (restored, count) == ((step, "peer"), step)
        assert torch.equal(value, _values(rank, step))


def test_each_node_holds_its_shard_and_its_partners(saved):
    for rank, root in enumerate(saved):
        copies = NodeMemory(root).copies()
        assert {(c.kind, c.shard, c.step) for c in copies} == {
            (OWN, rank, 3), (OWN, rank, 4), (REPLICA, 1 - rank, 3), (REPLICA, 1 - rank, 4)}


def test_a_lost_node_is_restored_from_its_partner_bitwise(saved, tmp_path):
    node0, _ = _copy_nodes(saved, tmp_path)
    spare = tmp_path / "spare"  # node 1 is lost; the spare's memory is empty
    _assert_restored_from_peers(_restore([node0, spare]), 4)


def test_a_node_lost_while_its_newest_copy_is_still_being_sent_resumes_from_peers(tmp_path):
    """Replication slower than the interval (each send held back 1 s, a save every step): node 1 is lost
    the moment step 5 is saved, while step 4's copy may still be on its way. Node 0's memory at that
    instant still holds a step with every shard, at most one interval old; no trip to the checkpoint."""
    snapshot = tmp_path / "node0-at-loss"
    _run([tmp_path / "node0", tmp_path / "node1"], Phase(steps=(3, 4, 5), send_delay_s=1.0, snapshot=str(snapshot)))
    _assert_restored_from_peers(_restore([snapshot, tmp_path / "spare"]), 4)


def test_replication_slower_than_the_interval_still_loses_at_most_the_interval_to_a_node(tmp_path):
    """peer_state.interval=2 (at most 2 steps lost) with every send held back 1 s, far slower than the steps (they
    take no time). Node 1 is lost the moment step 5 counts as reached (rank 0's save of step 5 returned, the step
    event comes next): node 0's memory at that instant resumes the spare at step 3 or later, from node memory.
    A copy every 2 steps that nothing waits for would leave step 4's copy in flight and step 2 the newest with
    every shard: 3 steps lost."""
    snapshot = tmp_path / "node0-at-loss"
    _run([tmp_path / "node0", tmp_path / "node1"],
         Phase(steps=(1, 2, 3, 4, 5), send_delay_s=1.0, snapshot=str(snapshot), interval=2))
    results = _restore([snapshot, tmp_path / "spare"])
    [(step, source)] = {r[0] for r in results.values()}
    assert source == "peer" and 5 - step <= 2


def test_a_restart_that_gives_the_nodes_other_ranks_keeps_their_copies(saved, tmp_path):
    """As after a partition, when the survivors come back with other ranks: node 1 now runs rank 0 and node 0
    rank 1. Each node's copies are the same data in other roles: lose a node right after this restart (before
    a save), and the other still holds every shard."""
    node0, node1 = _copy_nodes(saved, tmp_path)
    _assert_restored_from_peers(_restore([node1, node0]), 4)
    _assert_restored_from_peers(_restore([node1, tmp_path / "spare"]), 4)


def test_two_partners_lost_together_fall_back(saved, tmp_path):
    results = _restore([tmp_path / "a", tmp_path / "b"])  # both nodes new: no copy anywhere
    assert {r[0] for r in results.values()} == {None}


def test_a_torn_copy_is_never_used(saved, tmp_path):
    """Node 1 lost while node 0 was receiving its step-4 copy: that copy is torn (no .ok), step 3 is used."""
    node0, _ = _copy_nodes(saved, tmp_path)
    memory = NodeMemory(node0)
    [torn] = [c for c in memory.copies() if (c.kind, c.step) == (REPLICA, 4)]
    memory.begin(torn.shard, torn.slot, torn.data_nbytes)[:10] = 7  # a write that never completed
    _assert_restored_from_peers(_restore([node0, tmp_path / "spare"]), 3)
    # the run goes back to step 3: node 0's own copy of step 4 is gone, so it can never be mixed in later
    assert {c.step for c in NodeMemory(node0).copies()} == {3}


def test_a_copy_that_fails_its_checksum_is_not_used_and_the_next_source_is(saved, tmp_path):
    """Node 0's own copy of shard 0 at step 4 is damaged in memory (https://github.com/NVIDIA/Megatron-LM/issues/5281:
    a replica-retrieved local checkpoint gave NaNs, 44 restarts): its CRC-32 fails, rank 0 takes node 1's copy
    of the same step, and says so."""
    roots = _copy_nodes(saved, tmp_path)
    [own] = [c for c in NodeMemory(roots[0]).copies() if (c.kind, c.step) == (OWN, 4)]
    damaged = NodeMemory(roots[0]).read(own)[0].clone()
    damaged[:4] = torch.tensor([0, 0, 192, 127], dtype=torch.uint8)  # the first weight becomes NaN
    (roots[0] / f"shard{own.shard:05d}-slot{own.slot}.bin").write_bytes(damaged.numpy().tobytes())
    _assert_restored_from_peers(_restore(roots, events_dir=str(tmp_path / "run")), 4)
    [rejected] = [e for e in read_events(tmp_path / "run") if e["event"] == "peer_copy_rejected"]
    assert (rejected["shard"], rejected["step"], rejected["node"].endswith(str(roots[0]))) == (0, 4, True)


def test_a_newer_checkpoint_wins(saved, tmp_path):
    roots = _copy_nodes(saved, tmp_path)
    results = _restore(roots, 5, disk="loads")
    assert {r[0] for r in results.values()} == {(5, "disk")}
    assert not NodeMemory(roots[0]).copies()  # older than where the run goes on from: dropped once it loaded


def test_a_checkpoint_that_fails_to_load_costs_no_copy_and_every_rank_asks_for_it(saved, tmp_path):
    """Rank 1's listing shows a checkpoint of step 5 that rank 0's does not (yet): both go to it, agreed. Its
    load fails: the copies in node memory are all still there for the next attempt."""
    roots = _copy_nodes(saved, tmp_path)
    before = [NodeMemory(root).copies() for root in roots]
    results = _run(roots, Phase(not_older_than=(0, 5), disk="fails"))
    assert results == {0: "the checkpoint cannot be read", 1: "the checkpoint cannot be read"}
    assert [NodeMemory(root).copies() for root in roots] == before


def test_two_replicas_survive_two_lost_nodes(tmp_path):
    """Three nodes, each rank copied to the next two: lose two nodes, the third holds every shard."""
    roots = [tmp_path / f"node{i}" for i in range(3)]
    _run(roots, SAVE, replicas=2)
    assert {(c.kind, c.shard) for c in NodeMemory(roots[2]).copies()} == {
        (OWN, 2), (REPLICA, 0), (REPLICA, 1)}
    results = _restore([roots[2], tmp_path / "spare1", tmp_path / "spare2"], replicas=2)
    for rank in range(3):
        restored, value, _ = results[rank]
        assert restored == (4, "peer") and torch.equal(value, _values(rank, 4))


def _commit(memory: NodeMemory, kind: str, shard: int, slot: int, step: int) -> None:
    data = memory.begin(shard, slot, 64)
    data[:] = step
    memory.commit(Copy(kind, shard, slot, step, 3, FINGERPRINT, 64, 1, checksum(data, b"m")), b"m")


def test_a_restore_keeps_copies_outside_the_nodes_new_roles_until_a_newer_step_is_complete(tmp_path):
    """Three nodes, one rank each, each rank copied to the next node: node A ran rank 0 and holds shards 0 (its
    own) and 2 (its source's) at steps 3 and 4. After a restart A runs rank 1, whose roles are shards 1 and 0.
    Shard 2's copy of step 4, the step the run resumed at, may be the only one left (its old partner node may
    be the one lost): it stays until the new roles hold a newer step (`release`); its older copy goes at once."""
    memory = NodeMemory(tmp_path)
    for shard, kind in ((0, OWN), (2, REPLICA)):
        for slot, step in ((0, 3), (1, 4)):
            _commit(memory, kind, shard, slot, step)
    memory.prune(keep={1, 0}, newest=4)
    assert {(c.shard, c.step) for c in memory.copies()} == {(0, 3), (0, 4), (2, 4)}
    memory.release(keep={1, 0})
    assert {(c.shard, c.step) for c in memory.copies()} == {(0, 3), (0, 4)}
    assert not list(tmp_path.glob("shard00002-*"))


def test_copies_held_over_a_restore_go_once_a_newer_step_is_on_every_partner(tmp_path):
    """The same on three processes: node 1 lost, node 2 runs rank 0 and node 0 rank 1, the spare rank 2. Right
    after the restore each surviving node still holds its old shards' copies of step 4; two saves later every
    node holds its new roles' shards only."""
    roots = [tmp_path / f"node{i}" for i in range(3)]
    _run(roots, SAVE)
    new = [roots[2], roots[0], tmp_path / "spare"]
    results = _run(new, Phase(not_older_than=(0, 0, 0), then=(5, 6), snapshot=str(tmp_path / "after-restore")))
    assert {r[0] for r in results.values()} == {(4, "peer")}
    # node 2, now rank 0 (roles: shards 0 and 2), after the restore: shard 1's copy of step 4 is still there
    assert {(c.shard, c.step) for c in NodeMemory(tmp_path / "after-restore").copies()} >= {(1, 4), (2, 4)}
    for rank, root in enumerate(new):
        assert {c.shard for c in NodeMemory(root).copies()} == {rank, (rank - 1) % 3}
        assert {c.step for c in NodeMemory(root).copies()} == {5, 6}


def _interval_worker(rank: int, roots: list[str]) -> list[tuple[int, int]]:
    """interval=None with steps of 0.1 s: sends slowed to 0.3 s until the interval is first settled, then
    at full speed; every (step, interval) at which the interval was settled or changed."""
    _join(rank, len(roots))
    from training.train.peer_state import PeerState

    delay = [0.3 if rank == 1 else 0.0]  # rank 1's network is slow; the exchange makes rank 0 wait for it too
    replicate = PeerState._replicate

    def slow(self, *args):
        time.sleep(delay[0])
        replicate(self, *args)
    PeerState._replicate = slow
    peer = PeerState(PeerStateConfig(enabled=True), Path(roots[rank]), FINGERPRINT, timeout_s=30)
    state = {"model": Weights(torch.zeros(1000))}
    settled = []
    for step in range(1, 400):
        peer.save(step, state, step_time_s=0.1)
        if peer.chosen_at == step:
            settled.append((step, peer.interval))
            delay[0] = 0.0
            if len(settled) == 2:
                break
    peer.settle()
    peer.close()
    dist.destroy_process_group()
    return settled


def test_the_interval_follows_the_send_as_well_as_the_copy_and_every_rank_agrees(tmp_path):
    """A copy into node memory costs nothing next to a 0.1 s step, but a send takes 0.3 s: saving every step,
    each save would wait for the one before. The interval covers the send, the same on every rank; once the
    network is fast again, a new measurement brings it back down."""
    roots = [str(tmp_path / "node0"), str(tmp_path / "node1")]
    results = rank_results(lambda rank: _interval_worker(rank, roots), tmp_path / "ranks")
    assert results[0] == results[1]
    (_, slow), (_, fast) = results[0]
    assert slow >= 3 and fast < slow  # 0.3 s of send over 0.1 s steps, with headroom; then back down


def test_copies_without_a_commit_record_do_not_count(tmp_path):
    memory = NodeMemory(tmp_path)
    data = memory.begin(0, 0, 64)
    data[:] = 1
    assert memory.copies() == []
    copy = Copy(OWN, 0, 0, 9, 1, FINGERPRINT, 64, 3, checksum(data, b"abc"))
    memory.commit(copy, b"abc")
    assert memory.copies() == [copy]
    memory.begin(0, 0, 64)  # rewriting the slot: it stops counting first
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


@pytest.fixture
def one_rank(monkeypatch):
    """torch.distributed in this process, a world of one rank on one node."""
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_a_long_run_keeps_only_the_send_times_its_measurement_reads(tmp_path, one_rank):
    """interval=None measures sends over windows of RECHECK_SAVES saves: a run of many saves keeps no more than
    that (one float per save for the life of the process was ~40 MB per rank over two weeks at interval 1)."""
    from training.train.peer_state import RECHECK_SAVES, PeerState

    peer = PeerState(PeerStateConfig(enabled=True), tmp_path, FINGERPRINT, timeout_s=30)
    state = {"model": Weights(torch.zeros(10))}
    for step in range(1, 3 * RECHECK_SAVES + 1):
        peer.save(step, state, step_time_s=10.0)  # copy and send: far below 5% of a step, so one every step
    peer.settle()
    assert peer.chosen_at is not None and peer._saves == 3 * RECHECK_SAVES  # measured, every step copied
    assert 0 < len(peer.send_times) <= RECHECK_SAVES
    peer.close()


def test_pruning_removes_an_older_formats_files_and_keeps_the_newest_complete_step(tmp_path):
    """Files named as an earlier version named copies (kind first: `own-shard…`, `replica-shard…`) are read by
    nothing and used to outlive every prune, in a pod's /dev/shm; a prune drops them with the rest, and the copies
    of the step the run goes on from stay."""
    memory = NodeMemory(tmp_path)
    for kind in ("own", "replica"):
        for suffix in ("bin", "meta", "ok"):
            (tmp_path / f"{kind}-shard00000-slot0.{suffix}").write_bytes(b"old")
    data = memory.begin(0, 1, 64)
    newest = Copy(OWN, 0, 1, 7, 1, FINGERPRINT, 64, 3, checksum(data, b"abc"))
    memory.commit(newest, b"abc")
    assert memory.copies() == [newest]  # an older format's record is no copy
    memory.prune(keep={0}, newest=7)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["shard00000-slot1.bin", "shard00000-slot1.meta",
                                                          "shard00000-slot1.ok"]
    assert memory.copies() == [newest]
