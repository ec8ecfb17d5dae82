"""HSDP across replica groups on torchft 0.2.0: FSDP2 shards the model within a group (its own process group,
rendezvous and store); torchft's Manager sums the groups' gradients every step through a Lighthouse. A group
that fails leaves the quorum; the others discard at most the step in flight and train on with its rows of the
batch; a group that comes back heals from a live group's state over torchft's HTTP transport. Why one flat
all-reduce after backward, not FSDP2's all-reduce hook: every quorum member must join the same collectives,
whatever its rows. Cost: the cross-group sum does not overlap backward, and one copy of the gradient shards
per step. A step's phases (quorum, share, reduce, commit) and what a hung rank 0 does: docs/replica-groups.md,
"How a step runs".
"""
from __future__ import annotations

import contextlib
import logging
import math
import os
from collections.abc import Callable
from contextlib import AbstractContextManager
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import ReduceOp
from torch.distributed.checkpoint.stateful import Stateful
from torchft import Manager, ProcessGroupGloo, ProcessGroupNCCL
from torchft.coordination import LighthouseServer
from torchft.process_group import create_store_client

from training.contract.config import ParallelConfig
from training.contract.events import EventLog
from training.contract.replica_groups import LIGHTHOUSE_ENV, Share, share_of
from training.train.distributed import DistInfo
from training.train.group_pulse import GroupPulse
from training.train.rollback import copy_into, load_into, local_shard

log = logging.getLogger(__name__)

# How often a group's ManagerServer asks again for a quorum while the Lighthouse cannot be reached. torchft
# 0.2.0's ManagerServer (src/manager.rs, `_quorum_with_retries`) sleeps quorum_timeout / (quorum_retries + 1)
# after a failed request, connects anew and asks again; the rank's own request still ends after quorum_timeout.
LIGHTHOUSE_POLL_S = 1.0


class _FreshPrefix:
    """A torchft process group whose every configure gets a store prefix of its own. torchft names the prefix by
    the quorum id (manager.py `_async_quorum`: "<store>/torchft/<quorum_id>/<group rank>") and requires it unique
    (ProcessGroup.configure), but a restarted Lighthouse counts quorum ids from 1 again: the ranks then read the
    rank addresses of an earlier process group under that prefix, and gloo waits out its connect timeout on them.
    Each member counts its arrival under the prefix: all of one configure land in the same block of world_size
    arrivals, a sub-prefix no earlier configure used. Where an earlier configure under it lacked members, the
    blocks split; that configure fails, the step does not commit, and the Lighthouse moves the id on."""

    _timeout: timedelta

    def configure(self, store_addr: str, replica_id: str, rank: int, world_size: int, *args: Any) -> None:
        arrival = create_store_client(store_addr, timeout=self._timeout).add("arrivals", 1)
        block = (arrival - 1) // world_size
        super().configure(f"{store_addr}/{block}", replica_id, rank, world_size, *args)  # type: ignore[misc]


class _Gloo(_FreshPrefix, ProcessGroupGloo):
    pass


class _NCCL(_FreshPrefix, ProcessGroupNCCL):
    pass


def start_lighthouse(cfg: ParallelConfig, bind: str = "[::]:0") -> LighthouseServer:
    """The Lighthouse in this process (tests; the cluster runs torchft_lighthouse: lighthouse_command)."""
    return LighthouseServer(bind=bind, **cfg.lighthouse_options())


class ReplicaGroups:
    """This rank's side of the replica groups: its group's Manager (a ManagerServer on group rank 0), the
    cross-group process group of the ranks with its group rank, and the step's share of the batch.

    Args:
        cfg: the parallel section (timeouts; the group count is the quorum's business, not this object's)
        group: this rank's replica group (training.contract.replica_groups.REPLICA_GROUP_ENV)
        info: the group's own process group (its rank and world size are the group rank and size)
        state: the Stateful dict that checkpoints hold; a heal sends and loads all of it
        rows: rows of micro-batches in every step's global batch
        step: the step this group reports to the quorum: the one it resumed at, or 0 where nothing is loaded
            yet (recovery.LiveGroupTier); a lower one than the others' heals
        events: rank 0's `quorum` events (None on the other ranks)
        outside_step: a context in which the rank monitor's step section is closed (RankMonitor.outside):
            the waits for the other groups, which torchft's timeouts end, are not this rank's work
    """

    def __init__(self, cfg: ParallelConfig, group: int, info: DistInfo, state: dict[str, Stateful], rows: int,
                 step: int, events: EventLog | None,
                 outside_step: Callable[[], AbstractContextManager[None]] = contextlib.nullcontext) -> None:
        self.group, self.rows, self.events = group, rows, events
        self._outside_step = outside_step
        self.share: Share | None = None
        self.writes_checkpoints = False  # the quorum's first group writes the periodic checkpoints
        self._live = 0  # live groups of the last quorum: a `quorum` event when they change
        self._formed = False  # `heal` healed this group: the quorum it formed is the next step's
        timeout = timedelta(seconds=cfg.step_timeout_s)
        # torchft's reconfigurable process groups: each quorum re-forms it over the live groups' ranks with
        # this group rank (manager.py `_async_quorum`: pg.configure on "<store>/torchft/<quorum_id>/<rank>")
        pg = _NCCL(timeout=timeout) if info.device.type == "cuda" else _Gloo(timeout=timeout)
        for name in ("torchft.manager", "torchft_quorums", "torchft_commits"):  # each logs every step at INFO
            logging.getLogger(name).setLevel(logging.WARNING)
        self.manager = Manager(
            pg=pg, min_replica_size=1,
            # a heal: the sender's host copy of every Stateful (DTensors as their local shards, `rollback`),
            # loaded by the receiver into its own, identically sharded state
            state_dict=lambda: _host_copy(state), load_state_dict=lambda saved: load_into(state, saved),
            use_async_quorum=False, timeout=timeout, quorum_timeout=timedelta(seconds=cfg.quorum_timeout_s),
            # a restarted Lighthouse (its Deployment's pod) back within quorum_timeout_s costs no restart
            quorum_retries=math.ceil(cfg.quorum_timeout_s / LIGHTHOUSE_POLL_S),
            connect_timeout=timeout, rank=info.rank, world_size=info.world_size,
            store_addr=os.environ["MASTER_ADDR"], store_port=int(os.environ["MASTER_PORT"]),
            lighthouse_addr=os.environ.get(LIGHTHOUSE_ENV), replica_id=f"group{group}",
            # every group starts from the same seeded (or pretrained) weights: no transfer at step 0
            init_sync=False)
        self.manager.load_state_dict({"step": step, "batches_committed": 0})
        # every node's beat, so that a silent node anywhere takes this group out of the quorum, not only rank 0's
        self.pulse = GroupPulse.from_env(info.rank, info.world_size, cfg.node_pulse_timeout_s)
        if self.pulse is not None:
            self.pulse.start()

    def heal(self) -> int | None:
        """A quorum asked before the disk tier: a group behind a live one loads the live state into
        `state` (the heal), and the step healed to is returned; the next `begin_step` trains that quorum's step
        with the live groups. None where no group is ahead of this one (every group lost, or a fresh start):
        then every member is as far as this one, loads on its own and asks again in its `begin_step`."""
        self._formed = self._quorum()
        return self.manager.current_step() if self._formed else None

    def resumed_at(self, step: int) -> None:
        """A tier after this one loaded `step` (a fresh start: 0): the step this group reports to the quorum."""
        self.manager.load_state_dict({"step": step, "batches_committed": 0})

    def begin_step(self) -> Share:
        """The quorum of the next step (a heal, if this group is behind, loads the live state into `state`
        before it returns) and this group's share of the step's rows; no rows when it takes no part."""
        if self._formed:  # `heal` asked for this step's quorum
            self._formed = False
        else:
            self._quorum()
        assert self.share is not None
        return self.share

    def _quorum(self) -> bool:
        """Ask for a quorum, take this group's share of it; whether it healed this group."""
        behind = self.manager.current_step()
        self.manager.start_quorum()
        live, index = self.manager.num_participants(), self.manager.participating_rank()
        self.share = Share(0, 0, self.rows) if index is None else share_of(self.rows, live, index)
        self.writes_checkpoints = index == 0
        healed = self.manager.current_step() != behind
        if self.events is not None and (healed or live != self._live):
            self.events.emit("quorum", step=self.manager.current_step(), group=self.group, live_groups=live,
                             rows=self.share.rows, healed_from_step=behind if healed else None)
            log.info("replica group %d: %d live group(s), this one takes %d of %d rows%s", self.group, live,
                     self.share.rows, self.rows, f"; healed from step {behind} to {self.manager.current_step()}"
                     if healed else "")
        self._live = live
        if dist.is_initialized():  # the group's ranks start the step together, whatever each one's heal took
            dist.barrier()
        return healed

    def across_groups(self) -> AbstractContextManager[None]:
        """Around the part of a step that waits for the other groups (`reduce` to `commit`): outside the
        rank monitor's step section, whose timeout is learned from this rank's own work. A rank that hangs
        in its own work is then found at that timeout; torchft's (parallel.step_timeout_s) ends the waits."""
        return self._outside_step()

    def reduce(self, model: torch.nn.Module, loss: torch.Tensor) -> torch.Tensor:
        """Sum every group's gradient shards and loss, each weighted by its share of the step's samples, into
        this rank's: one flat all-reduce over the groups. A group with no rows (or no backward) adds zeros."""
        assert self.share is not None, "begin_step first"
        params = [p for p in model.parameters() if p.requires_grad]
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        grads = [local_shard(p.grad) for p in params]
        flat = torch.cat([*(g.reshape(-1) for g in grads), loss.reshape(1)]).mul_(self.share.weight)
        # SUM, not torchft's default AVG (a division by the live groups): the weights already make the mean
        self.manager.allreduce(flat, reduce_op=ReduceOp.SUM).wait()
        torch._foreach_copy_(grads, [chunk.view_as(g) for chunk, g in zip(flat[:-1].split([g.numel() for g in grads]),
                                                                           grads)])
        return flat[-1]

    def commit(self) -> bool:
        """Whether this step commits in this group (the same answer on all of its ranks); False after any
        error of the step's collectives or quorum (torchft manager.py `should_commit`)."""
        return self.manager.should_commit()

    def close(self) -> None:
        """Stop the nodes' pulse, the manager (its server and heartbeats on group rank 0) and the checkpoint
        server."""
        if self.pulse is not None:
            self.pulse.stop()
        self.manager.shutdown(wait=False)


def _host_copy(state: dict[str, Stateful]) -> dict[str, Any]:
    copied = {key: copy_into(obj.state_dict(), None) for key, obj in state.items()}
    if torch.cuda.is_initialized():
        torch.cuda.current_stream().synchronize()  # copy_into's device-to-host copies are asynchronous
    return copied

