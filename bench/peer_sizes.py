"""Peer state at more than one size (training.train.peer_state): what one rank's copy costs as its state grows,
measured, not scaled from the tiny model.

Two processes, one per emulated node (`measure_peer_size`), hold a preset's optimizer-ready state sharded over
both (`_ShardState`), save it PEER_SAVES times with PeerState, then lose node 1 and restore on a spare
(`_worker`). `PeerSize` holds what one rank's copy, send, restore and CRC-32 took; the CRC-32's rate is the
capacity model's CRC32_GBS (training.contract.capacity).
"""
from __future__ import annotations

import math
import os
import shutil
import statistics
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from training.contract.config import PeerStateConfig
from training.contract.launcher import free_port
from training.contract.shapes import PEER_STATE_SLOTS, STATE_BYTES_PER_PARAMETER, parameter_count

PEER_SAVES = PEER_STATE_SLOTS + 3  # every slot laid out once, then three measured saves
CHECKSUM_RUNS = 3
EVERY_STEP = PeerStateConfig(enabled=True, interval=1)  # every save copied and sent, to one partner
NODES = 2


@dataclass(frozen=True)
class PeerSize:
    """One preset's figures, in seconds:

      copy_s      PeerState.save on the training thread: the state into node memory (medians over the saves after
                  each slot's first, which lays it out; each save after the previous copy reached the partner)
      send_s      the replication thread, beside training: CRC-32, commit, the exchange with the partner node and
                  its acknowledgement (medians over the same saves)
      restore_s   PeerState.restore on the spare: its shard fetched from node 0's memory, checked and loaded
      checksum_s  the CRC-32 of one rank's copy alone (peer_state.checksum, zlib; the send and the restore each
                  take one): its rate (`checksum_gbs`) is the capacity model's CRC32_GBS (training.contract.capacity)
    """
    preset: str
    bytes_per_rank: int  # one rank's copy: its shard of the parameters and both AdamW moments, fp32
    copy_s: float
    send_s: float
    restore_s: float
    checksum_s: float  # CRC-32 of one rank's copy (median of CHECKSUM_RUNS)

    @property
    def checksum_gbs(self) -> float:
        return self.bytes_per_rank / self.checksum_s / 1e9


def state_bytes_per_rank(preset: str) -> int:
    return STATE_BYTES_PER_PARAMETER * parameter_count(preset) // NODES


class _ShardState:
    """A rank's share of the preset's optimizer-ready state, as a Stateful: for each of the model's parameters
    an fp32 shard and AdamW's two fp32 moments, shaped like the preset's."""

    def __init__(self, preset: str, rank: int) -> None:
        import torch

        from training.models.llama import build_model

        self.tensors = [torch.full((math.ceil(p.numel() / NODES),), float(rank + kind), dtype=torch.float32)
                        for p in build_model(preset).parameters() for kind in range(3)]

    def state_dict(self) -> dict[str, Any]:
        return {"tensors": self.tensors}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for mine, loaded in zip(self.tensors, state["tensors"]):
            mine.copy_(loaded)


def _worker(rank: int, port: int, preset: str, roots: list[str], results: dict) -> None:
    """One emulated node: one rank, gloo over loopback, node memory under `roots[rank]`. Saves PEER_SAVES times
    with PeerState; then node 1 is lost and a spare with empty memory restores in its place."""
    import torch.distributed as dist

    from training.train.peer_state import OWN, NodeMemory, PeerState, checksum

    os.environ.update(LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", OMP_NUM_THREADS="1")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=NODES)
    state = {"model": _ShardState(preset, rank)}
    peer = PeerState(EVERY_STEP, Path(roots[rank]), preset, timeout_s=600)
    copies = []
    for step in range(1, PEER_SAVES + 1):
        peer.settle()  # the copy alone: not the wait for the previous send
        copies.append(peer.save(step, state, step_time_s=1.0))
    peer.settle()
    sends = list(peer.send_times)[PEER_STATE_SLOTS:]
    peer.close()
    memory = NodeMemory(Path(roots[rank]))
    [newest] = [c for c in memory.copies() if c.kind == OWN and c.step == PEER_SAVES]
    data, meta = memory.read(newest)
    checksums = []
    for _ in range(CHECKSUM_RUNS):
        started = time.perf_counter()
        checksum(data, meta)
        checksums.append(time.perf_counter() - started)
    spare = PeerState(EVERY_STEP, Path(roots[NODES if rank == 1 else rank]), preset, timeout_s=600)
    dist.barrier()
    started = time.perf_counter()
    restored = spare.restore(state, not_older_than=0)
    restore_s = time.perf_counter() - started
    spare.close()
    dist.destroy_process_group()
    if restored != PEER_SAVES:
        raise RuntimeError(f"peer state restored step {restored}, not {PEER_SAVES}")
    results[rank] = (statistics.median(copies[PEER_STATE_SLOTS:]), statistics.median(sends), restore_s,
                     statistics.median(checksums))


def measure_peer_size(preset: str) -> PeerSize:
    """Two processes, one per emulated node, with node memory in /dev/shm as a pod's."""
    import torch.multiprocessing as mp

    shm = Path("/dev/shm")
    base = Path(tempfile.mkdtemp(prefix=f"bench-peer-{uuid.uuid4().hex[:8]}-",
                                 dir=shm if shm.is_dir() else None))  # memory-backed, as a pod's /dev/shm
    try:
        roots = [str(base / f"node{i}") for i in range(NODES)] + [str(base / "spare")]
        results = mp.Manager().dict()
        mp.spawn(_worker, args=(free_port(), preset, roots, results), nprocs=NODES)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    copy_s, send_s, _, checksum_s = results[0]
    return PeerSize(preset, state_bytes_per_rank(preset), copy_s, send_s, restore_s=results[1][2],  # the spare's
                    checksum_s=checksum_s)


def measure_peer_sizes(presets: tuple[str, ...]) -> tuple[PeerSize, ...]:
    return tuple(measure_peer_size(preset) for preset in presets)
