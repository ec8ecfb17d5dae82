"""One optimizer step over a rank's micro-batches: gradient accumulation, the replica groups' sum, clipping,
the update, and the step's one all-reduce (the mean loss and whether any rank must drain).

Why a component: the loop calls `run` once per step and the step calls what it needs itself, the
checkpointer's wait for an async save's staging copy before the update and the replica groups' sum and commit.
Tests drive it on one rank without a Trainer. Cost: nothing beyond the step's own work.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import torch
import torch.nn.functional as F

from training.data.stream import Batch
from training.train.agreement import total
from training.train.distributed import DistInfo

if TYPE_CHECKING:
    from training.train.replica_groups import ReplicaGroups


class StepDiscarded(RuntimeError):
    """Replica groups: the step did not commit in this group (torchft's should_commit said no, the same on
    every rank of the group): parameters, optimizer and data position are as before it; run it again."""


@dataclass(frozen=True)
class StepResult:
    loss: float  # averaged over the global batch
    drain: bool  # some rank was told to drain
    waited_s: float  # blocked before the update on an async save's staging copy: not training time


class OptimizerStep:
    """One rank's optimizer step, the same on every rank of the world.

    Each micro-batch's loss is scaled by 1/len(micro_batches), and FSDP averages over the ranks: the
    gradient is the mean over the global batch, whatever its split into ranks and micro-batches. FSDP2
    reduce-scatters after the last backward only, unless `reduce_every_micro_batch` (FSDP2's documented
    gradient accumulation without communication, `set_requires_gradient_sync`,
    https://docs.pytorch.org/docs/stable/distributed.fsdp.fully_shard.html): until then each rank holds its
    unsharded gradients in the reduce dtype (fp32), 4 bytes per parameter of the whole model
    (training.gradient_reduce).

    Args:
        model: the FSDP2-sharded model.
        optimizer: its optimizer; `run` sets every group's learning rate.
        info: this rank's place in the world.
        grad_clip: the gradient norm clipped to; 0: no clipping.
        reduce_every_micro_batch: reduce-scatter after every micro-batch's backward.
        before_update: called before the optimizer changes the parameters and its state in place (an async
            save's staging copy may still read them); returns the seconds it blocked.
        replicas: with parallel.replica_groups >= 2, the micro-batches are this rank's part of its group's
            share; gradients and loss are summed over the groups, weighted by their shares, before clipping,
            and a step that does not commit raises StepDiscarded with nothing changed.
    """

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, info: DistInfo, grad_clip: float,
                 *, reduce_every_micro_batch: bool = False, before_update: Callable[[], float] = lambda: 0.0,
                 replicas: ReplicaGroups | None = None) -> None:
        self.model, self.optimizer, self.info, self.grad_clip = model, optimizer, info, grad_clip
        self.reduce_every_micro_batch = reduce_every_micro_batch
        self.before_update = before_update
        self.replicas = replicas

    def run(self, micro_batches: list[Batch], lr: float, drain_flag: float = 0.0) -> StepResult:
        """The step at learning rate `lr`; `drain_flag` > 0 says this rank was told to drain."""
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        loss = self._accumulate(micro_batches)
        replicas = self.replicas
        with replicas.across_groups() if replicas is not None else contextlib.nullcontext():
            if replicas is not None:
                loss = replicas.reduce(self.model, loss)
            if self.grad_clip > 0:
                torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.grad_clip)
            waited_s = self.before_update()
            committed = replicas is None or replicas.commit()
        if not committed:
            self.optimizer.zero_grad(set_to_none=True)
            raise StepDiscarded("the step did not commit in this replica group")
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        total_loss, drain = total(torch.cat([loss.reshape(1), loss.new_tensor([drain_flag])]))
        return StepResult(total_loss / self.info.world_size, drain > 0, waited_s)

    def _accumulate(self, micro_batches: list[Batch]) -> torch.Tensor:
        """Forward and backward of each micro-batch; the rank's loss, detached."""
        device = self.info.device
        loss = torch.zeros((), device=device)
        for i, batch in enumerate(micro_batches):
            self.model.set_requires_gradient_sync(self.reduce_every_micro_batch or i == len(micro_batches) - 1)
            logits = self.model(batch.inputs.to(device))
            micro_loss = F.cross_entropy(logits.flatten(0, 1), batch.targets.to(device).flatten()) / len(micro_batches)
            micro_loss.backward()
            loss += micro_loss.detach()
        return loss
