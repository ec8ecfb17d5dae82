"""Entry point of every rank: `python -m training.train --config FILE [section.key=value …]`,
started by ft_launcher in the pods and by training.local here.

`run(cfg)` builds a `Trainer` (its components, resumed from the first recovery tier that holds the
state: training.train.recovery), trains and closes it; it is re-entrant (everything it builds it
also tears down), so it can be wrapped by nvidia_resiliency_ext.inprocess.Wrapper for in-process
restarts. One optimizer step is training.train.optimizer_step's, apart from all of that.
"""
from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import sys
import time
import traceback
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

import numpy as np
import torch
from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_optimizer_state_dict,
                                                     set_model_state_dict, set_optimizer_state_dict)
from torch.distributed.checkpoint.stateful import Stateful

from training.contract.capacity import gradient_reduce
from training.contract.config import (ConfigArgumentParser, TrainConfig, TrainConfigError, config_or_exit,
                                      load_train_config)
from training.contract.events import EventLog, next_attempt, record_attempt
from training.contract.exit_codes import CONFIG_ERROR, TERMINATED
from training.contract.faults import FaultSpecError, check_chaos_switch, parse_faults, with_env_faults
from training.contract.flops import flops_per_token
from training.contract.job_failure import JobMustFail, request_job_failure
from training.contract.model_source import ModelSourceError, check_model_source
from training.contract.replica_groups import Share, check_torchft, replica_group
from training.data.stream import Batch, TokenStream
from training.data.token_file import DataError, check_token_file
from training.models.spec import ModelSpec, model_spec
from training.train.checkpoint.layout import committed_checkpoints
from training.train.checkpoint.manager import CheckpointManager, CheckpointMismatch, FreshStartRefused
from training.train.checkpoint.writers import WriterDeadlines, with_emulated_delay
from training.train.checkpoint.writer_process import start_zygote as start_writer_zygote
from training.train.distributed import DistInfo, device_memory_bytes, init_distributed, teardown
from training.train.drain import Drain, DrainSignal, Drained
from training.train.faults import FaultInjector
from training.train.metrics import TrainingMetrics
from training.train.monitor import RankMonitor
from training.train.optimizer_step import OptimizerStep, StepDiscarded
from training.train.parallelize import parallelize
from training.train.peer_state import PeerState, memory_root
from training.train.progress import Progress
from training.train.recovery import (DiskTier, InProcessTier, LiveGroupTier, PeerTier, RecoveryTier, Restored,
                                     restore_first)

if TYPE_CHECKING:
    from training.train.inprocess import Iteration
    from training.train.replica_groups import ReplicaGroups

log = logging.getLogger("training.train")


class ModelState(Stateful):
    """Also a training.train.rollback.InPlaceState: its state dict is the parameters' shards (and persistent
    buffers), which the optimizer updates in place."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model

    def state_dict(self) -> dict[str, Any]:
        return get_model_state_dict(self.model)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        set_model_state_dict(self.model, state)

    def live_tensors(self) -> list[torch.Tensor]:
        return [*self.model.parameters(), *self.model.buffers()]

    def refresh(self, saved: dict[str, Any]) -> None:
        """Nothing to do: every leaf of a model's state dict is a tensor."""


class OptimizerState(Stateful):
    """Also a training.train.rollback.InPlaceState: AdamW's per-parameter state is tensors updated in place
    (moments and step counts, foreach); its other leaves are the param groups' plain hyperparameters,
    of which OptimizerStep.run changes the learning rate."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.model, self.optimizer = model, optimizer

    def state_dict(self) -> dict[str, Any]:
        return get_optimizer_state_dict(self.model, self.optimizer)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        set_optimizer_state_dict(self.model, self.optimizer, state)

    def live_tensors(self) -> list[torch.Tensor]:
        # .get: optimizer.state is a defaultdict, and an entry made here would hide from torch's helper
        # that the state is not created yet
        return [t for group in self.optimizer.param_groups for p in group["params"]
                for t in self.optimizer.state.get(p, {}).values()]

    def refresh(self, saved: dict[str, Any]) -> None:
        for group, saved_group in zip(self.optimizer.param_groups, saved["param_groups"], strict=True):
            saved_group.update((k, v) for k, v in group.items() if k != "params")  # params: FQNs there


class TrainState(Stateful):
    """Step, data position and NVRx timeouts: the same on every rank."""

    def __init__(self, stream: TokenStream, monitor: RankMonitor) -> None:
        self.step = 0
        self.stream, self.monitor = stream, monitor

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "data": self.stream.state_dict(), "ft": self.monitor.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step = int(state["step"])
        self.stream.load_state_dict(state["data"])
        self.monitor.load_state_dict(state["ft"])


def rng_key(rank: int) -> str:
    """The checkpoint key of a rank's RNG streams: per rank, so a checkpoint written at another world
    size may lack it."""
    return f"rng_rank{rank}"


class RngState(Stateful):
    """This rank's RNG streams (a per-rank checkpoint key: ranks differ)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def derive(self, seed: int, step: int, rank: int) -> None:
        """Streams for a rank the checkpoint has none for (it was written at a smaller world size):
        a pure function of (seed, step, rank), so every resume derives the same."""
        derived = int(np.random.SeedSequence([seed, step, rank]).generate_state(1)[0])
        torch.manual_seed(derived)
        if self.device.type == "cuda":
            torch.cuda.manual_seed(derived)

    def state_dict(self) -> dict[str, torch.Tensor]:
        state = {"cpu": torch.get_rng_state()}
        if self.device.type == "cuda":
            state["cuda"] = torch.cuda.get_rng_state(self.device)
        return state

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        torch.set_rng_state(state["cpu"])
        if "cuda" in state:
            torch.cuda.set_rng_state(state["cuda"], self.device)


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warm-up, then cosine decay to a tenth of the peak at the schedule's last step (lr_decay_steps,
    else the run's last), a tenth after it."""
    t = cfg.training
    if step <= t.warmup_steps:
        return t.lr * step / max(t.warmup_steps, 1)
    decay_end = t.lr_decay_steps if t.lr_decay_steps is not None else t.steps
    progress = (step - t.warmup_steps) / max(decay_end - t.warmup_steps, 1)
    return t.lr * (0.1 + 0.45 * (1 + math.cos(math.pi * min(progress, 1.0))))


def build(cfg: TrainConfig, spec: ModelSpec, info: DistInfo) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    on_cuda = info.device.type == "cuda"
    # CPU: materialise whole, init, then shard. CUDA: shard on meta, materialise only the shards.
    model = spec.build("meta" if on_cuda else "cpu")
    if not on_cuda:
        spec.init_weights(model, cfg.training.seed)
    model = parallelize(model, spec.shard_units(model), info)
    if on_cuda:
        model.to_empty(device=info.device)
        spec.init_weights(model, cfg.training.seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.training.lr, weight_decay=cfg.training.weight_decay,
                                  foreach=True)
    return model, optimizer


def _peer_state(cfg: TrainConfig, spec: ModelSpec, info: DistInfo, events: EventLog) -> PeerState | None:
    if not cfg.peer_state.enabled:
        return None
    t = cfg.training
    # copies made for another world size, model layout or data layout cannot be loaded here
    fingerprint = f"{spec.fingerprint}:{info.world_size}:{t.batch_size}:{t.global_batch(info.world_size)}:{t.seq_len}:{t.seed}"
    return PeerState(cfg.peer_state, memory_root(cfg.peer_state.memory_dir, cfg.run_dir), fingerprint,
                     timeout_s=t.collective_timeout_s, events=events)


def run(cfg: TrainConfig, restart: Iteration | None = None) -> None:
    """One training run; under the in-process Wrapper, one iteration of it (`restart`). Checkpoints that
    no restart can load, and a world size that cannot reach training.global_batch_size, ask for the Job to
    fail (training.contract.job_failure) and raise JobMustFail."""
    try:
        trainer = Trainer(cfg, restart)
        try:
            trainer.train()
        finally:
            trainer.close()
    except (FreshStartRefused, CheckpointMismatch, TrainConfigError) as err:
        raise request_job_failure(cfg.run_dir, f"rank{os.environ.get('RANK', 0)}", str(err)) from err


class Trainer:
    """One attempt of the run on this rank (under the in-process Wrapper, one iteration of it): its
    components, built once in the order each needs the ones before it; `train()` loads the state, then
    trains. Everything it opens `close()` closes, so a process can run the next iteration."""

    # setup: the config, NVRx's rank monitor, the SIGTERM watch, the place in the world, the event log
    cfg: TrainConfig
    restart: Iteration | None  # the Wrapper's iteration; None without in-process restarts
    monitor: RankMonitor
    drain_signal: DrainSignal
    info: DistInfo
    events: EventLog
    lead: bool  # rank 0: writes the run's events and log lines
    # model and optimizer state: what the checkpoints and the other recovery tiers hold
    spec: ModelSpec  # what the model is: built, sharded, initialised or loaded through it
    pretrained: bool  # step 0 started from the model's pretrained weights
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    train_state: TrainState
    rng: RngState
    state: dict[str, Stateful]
    # data
    stream: TokenStream
    # fault injection (drains: drain_signal, watching from the start)
    injector: FaultInjector
    # checkpointing and the recovery tiers besides it
    ckpt: CheckpointManager
    peer: PeerState | None  # peer_state.enabled
    # metrics and progress: opened once resumed, so that the first rate counts steps only
    tokens_per_step: int
    progress: Progress
    metrics: TrainingMetrics | None  # rank 0 with a metrics port
    samples: TextIO | None  # logging.sample_log

    def __init__(self, cfg: TrainConfig, restart: Iteration | None = None) -> None:
        t = cfg.training
        self.cfg, self.restart = cfg, restart
        # first: the setup section covers process start-up
        self.monitor = RankMonitor(cfg.fault_tolerance, cfg.checkpoint.mode,
                                   watch=restart.hang_watch if restart is not None else None)
        if restart is not None:  # the process's, watching between the Wrapper's iterations too
            self.drain_signal = restart.drain_signal
        else:
            self.drain_signal = DrainSignal(cfg.fault_tolerance.drain_timeout_s)
            self.drain_signal.start()
        self.info = init_distributed(t.device, t.collective_timeout_s,
                                     store=restart.store if restart is not None else None)
        self.events = EventLog(cfg.run_dir, f"rank{self.info.rank}")
        self.lead = self.info.rank == 0
        self.peer = None  # before anything can fail: closing the setup stops its thread
        self.metrics, self.samples = None, None  # opened by `load`; `close` closes them
        self.replicas: ReplicaGroups | None = None  # parallel.replica_groups >= 2, made last
        try:  # the setup is open: a failure from here on closes it, so that another iteration can start
            self.rows = cfg.rows_per_step(self.info.world_size)  # before anything trains
            if self.lead:
                self._announce_attempt()
            torch.manual_seed(t.seed)
            self.spec = model_spec(cfg.model)
            self.model, self.optimizer = build(cfg, self.spec, self.info)
            self.gradient_reduce = gradient_reduce(t.gradient_reduce, self.spec.shape.parameters,
                                                   device_memory_bytes(self.info.device))
            self.stream = TokenStream(t, cfg.data, rank=self.info.rank, world_size=self.info.world_size,
                                      vocab_size=self.spec.shape.vocab_size, rows=self.rows)
            self.train_state = TrainState(self.stream, self.monitor)
            self.rng = RngState(self.info.device)
            self.state = {"model": ModelState(self.model), "optimizer": OptimizerState(self.model, self.optimizer),
                          "train": self.train_state, rng_key(self.info.rank): self.rng}
            self.injector = FaultInjector(parse_faults(cfg.faults), cfg.run_dir, self.info.rank, self.events,
                                          cfg.checkpoint_dir)
            self.ckpt = CheckpointManager(cfg.checkpoint, cfg.run_dir, events=self.events, device=self.info.device,
                                          write_hook=with_emulated_delay(self.injector.around_write),
                                          deadlines=WriterDeadlines.of(cfg),
                                          around_save=lambda: self.monitor.section("checkpoint"))
            self.peer = _peer_state(cfg, self.spec, self.info, self.events)
            self.drain = Drain(self.drain_signal, self.ckpt, self.peer, cfg.checkpoint_dir,
                               self.events if self.lead else None, self.info.world_size)
        except BaseException:
            self._close_setup()
            raise

    def load(self) -> None:
        """The state, from the first recovery tier that holds it; then what reports on training, so that the
        first rate counts steps only. With replica groups, the group's manager (made by the live tier, or
        here where an earlier tier restored). In NVRx's setup section."""
        self.ckpt.wait_for_writer()  # in the setup section, not in the first saves'
        self.resume()
        self._open_reporting()
        if self.cfg.parallel.replica_groups > 1 and self.replicas is None:
            self._join_replica_groups(self.train_state.step)

    def _join_replica_groups(self, step: int) -> ReplicaGroups:
        """This rank's manager of its replica group at `step`, once everything else is built and just before
        its first quorum: from its creation group rank 0 heartbeats to the Lighthouse, and a group that
        heartbeats without asking for a quorum holds the others' back (training.train.replica_groups)."""
        from training.train.replica_groups import ReplicaGroups  # torchft, only with replica groups

        self.replicas = ReplicaGroups(self.cfg.parallel, replica_group(), self.info, self.state, self.rows, step,
                                      self.events if self.lead else None,
                                      outside_step=lambda: self.monitor.outside("step"))
        self.ckpt.shared_by(self.replicas)
        return self.replicas

    def _announce_attempt(self) -> None:
        """Rank 0's events for the start of a run (attempt): run_start, attempt_start and, after a fault, restart."""
        attempt = next_attempt(self.cfg.run_dir)  # one line per attempt, not the whole log
        world_size = self.info.world_size
        nodes = world_size // int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
        self.events.emit("run_start", world_size=world_size, nodes=nodes, config=self.cfg.to_dict())
        kind = "fresh" if attempt == 0 else "inprocess" if self.restart is not None and self.restart.number else "injob"
        if not record_attempt(self.cfg.run_dir, attempt, kind):  # the next attempt takes this number again
            self.events.count_dropped("attempt_start")
        if attempt:
            self.events.emit("restart", attempt=attempt, restart_kind=kind)

    def _open_reporting(self) -> None:
        cfg, info = self.cfg, self.info
        self.tokens_per_step = self.stream.global_batch_size * cfg.training.seq_len  # every rank's micro-batches
        per_token = flops_per_token(self.spec.shape, cfg.training.seq_len)
        gpu_peak = cfg.metrics.gpu_peak_tflops if info.device.type == "cuda" else None  # MFU on GPUs only
        self.progress = Progress(cfg.training, cfg.logging, enabled=self.lead, flops_per_token=per_token,
                                 gpus=info.world_size, gpu_peak_tflops=gpu_peak)
        self.metrics = (TrainingMetrics(cfg.metrics, cfg.run_dir, world_size=info.world_size,
                                        flops_per_token=per_token, gpu_peak_tflops=gpu_peak)
                        if self.lead and cfg.metrics.port else None)  # port 0: off
        self.samples = _sample_log(cfg, info.rank)

    # ---- resume --------------------------------------------------------------------------------
    def resume(self) -> None:
        """Load the state from the first recovery tier that holds it (training.train.recovery);
        per-rank state the checkpoint lacks (it was written by fewer ranks) is derived, and said so."""
        tiers: list[RecoveryTier] = [InProcessTier(self.restart)] if self.restart is not None else []
        if self.peer is not None:
            tiers.append(PeerTier(self.peer))
        if self.cfg.parallel.replica_groups > 1:
            tiers.append(LiveGroupTier(self._join_replica_groups))
        tiers.append(DiskTier(self.ckpt, optional=frozenset({rng_key(self.info.rank)}),
                              allow_fresh_start=self.cfg.checkpoint.allow_fresh_start))
        restored = restore_first(tiers, self.state, not_older_than=self._newest_checkpoint_step())
        if restored is not None and restored.missing:
            self.rng.derive(self.cfg.training.seed, restored.step, self.info.rank)
        # step 0 only: every resume loads the run's own state, never the pretrained weights again
        self.pretrained = restored is None and self.spec.load_pretrained(self.model)
        if self.lead:
            self._announce_resume(restored)

    def _newest_checkpoint_step(self) -> int:
        """The step peer state must not be older than (0: none); only peer state asks, so only it reads it."""
        if self.peer is None:
            return 0
        newest = committed_checkpoints(self.cfg.checkpoint_dir)
        return newest[0][0] if newest else 0

    def _announce_resume(self, restored: Restored | None) -> None:
        """Rank 0's resume event and line; after a resharded checkpoint, the warning and state_derived."""
        info, step = self.info, self.train_state.step
        self.events.emit("resume", step=step, source_kind=restored.source_kind if restored else "none",
                         path=str(restored.path) if restored and restored.path else None,
                         saved_world_size=restored.saved_world_size if restored else None)
        reduce = "" if self.stream.accumulation_steps == 1 else (
            ", gradients reduce-scattered after every micro-batch" if self.gradient_reduce == "micro_batch" else
            ", gradients reduce-scattered once per step")
        groups = self.cfg.parallel.replica_groups
        split = (f"{self.stream.accumulation_steps} micro-batch(es) of {self.stream.batch_size} per rank" if groups == 1
                 else f"{self.rows} rows of {info.world_size} micro-batches of {self.stream.batch_size}, shared by "
                      f"the live ones of {groups} replica groups")
        log.info("world size %d, %s, model %s, global batch %d (%s%s); %s",
                 info.world_size, info.backend, self.spec.shape.name, self.stream.global_batch_size, split, reduce,
                 f"resumed from {restored.origin} at step {step}" if restored else
                 f"starting at step 0 from {'its pretrained weights' if self.pretrained else 'seeded weights'}")
        if restored is None or restored.saved_world_size in (None, info.world_size):
            return
        saved = restored.saved_world_size
        derived = [r for r in range(info.world_size) if r >= saved]
        t, stream = self.cfg.training, self.stream
        if t.global_batch_size is None:
            batch = f"global batch {t.batch_size * saved} -> {stream.global_batch_size} samples per step"
        else:
            batch = (f"global batch kept at {stream.global_batch_size} samples per step (training.global_batch_size): "
                     f"{stream.accumulation_steps} micro-batch(es) of {t.batch_size} per rank")
        log.warning("checkpoint written by %d ranks, resharded to %d: %s, data position kept (no sample skipped or "
                    "repeated)%s", saved, info.world_size, batch,
                    f"; RNG of ranks {derived} derived from (seed, step, rank)" if derived else "")
        self.events.emit("state_derived", step=restored.step, saved_world_size=saved, world_size=info.world_size,
                         keys=[rng_key(r) for r in derived])

    # ---- the loop ------------------------------------------------------------------------------
    def train(self) -> None:
        """Load the state, then steps until the last one, checkpointing and draining on the way; then the
        final save."""
        self.load()
        t, monitor, ckpt = self.cfg.training, self.monitor, self.ckpt
        optimizer_step = OptimizerStep(self.model, self.optimizer, self.info, t.grad_clip,
                                       reduce_every_micro_batch=self.gradient_reduce == "micro_batch",
                                       before_update=ckpt.wait_staged, replicas=self.replicas)
        monitor.end_setup()
        try:
            while self.train_state.step < t.steps:
                # with replica groups: the step's quorum first (a heal moves train_state to the live groups'
                # step), so that a fault injected at this step lands in a group the others count on
                share = self.replicas.begin_step() if self.replicas is not None else Share(0, self.rows, self.rows)
                if self.train_state.step >= t.steps:
                    break
                step = self.train_state.step + 1
                self.injector.maybe_fire(step)
                with monitor.section("step"):
                    t0 = time.perf_counter()
                    micro_batches = self.stream.share(share.first_row, share.rows)
                    try:
                        result = optimizer_step.run(micro_batches, lr_at(step, self.cfg), self.drain_signal.flag)
                    except StepDiscarded:
                        self._discarded(step, time.perf_counter() - t0)
                        continue
                    # a wait for a staging copy is counted in the save's ckpt_blocked, not as training
                    step_time = time.perf_counter() - t0 - result.waited_s
                self.stream.advance()
                self.train_state.step = step
                self.after_step(step, micro_batches, result.loss, step_time)
                if result.drain:
                    with monitor.section("checkpoint"), (self.restart.unwatched() if self.restart is not None
                                                         else contextlib.nullcontext()):
                        self.drain(step, step_time, self.state)
                ckpt.step_done(step, self.state)
            ckpt.close(final={"model": self.state["model"], "optimizer": self.state["optimizer"]})
        except BaseException:
            ckpt.abort()  # no checkpoint work of a dead iteration may run on into the next one
            raise
        if self.peer is not None:
            self.peer.close()  # not after a failure: its thread may be stuck with a dead peer (_close_setup aborts it)
        if self.lead:
            self.events.emit("run_end", step=self.train_state.step, status="completed")
            log.info("done: %d steps", self.train_state.step)

    def after_step(self, step: int, micro_batches: list[Batch], mean_loss: float, step_time: float) -> None:
        """What follows every completed step, in this order: the NVRx heartbeat, the in-memory copy for
        in-process restarts, the copy in node memory for the partner nodes, rank 0's step event, the
        sample log, metrics and progress line."""
        self.monitor.step_done()
        costs = {} if self.restart is None else {"rollback_s": round(self.restart.step_done(step, self.state), 5)}
        peer_s = self.peer.save(step, self.state, step_time) if self.peer is not None else None
        if peer_s is not None:
            costs["peer_s"] = round(peer_s, 5)
        if self.lead:
            group = {} if self.replicas is None else {"group": self.replicas.group}
            self.events.emit("step", step=step, loss=round(mean_loss, 6), step_time_s=round(step_time, 5),
                             tokens=self.tokens_per_step, **group, **costs)
            if self.peer is not None and self.peer.chosen_at == step:
                self.events.emit("peer_state", interval=self.peer.interval, every=self.peer.every,
                                 replicas=self.peer.replicas, bytes_per_rank=self.peer.bytes_per_rank)
        if self.samples is not None:
            indices = [i for batch in micro_batches for i in batch.indices]
            self.samples.write(json.dumps({"step": step, "indices": indices}) + "\n")
            self.samples.flush()
        if self.metrics is not None:
            self.metrics.update(step, mean_loss, step_time, self.tokens_per_step, self.events.unwritten)
        self.progress.update(step, mean_loss, step_time, self.tokens_per_step)

    def _discarded(self, step: int, seconds: float) -> None:
        """A step that did not commit (a replica group failed in it): said once by rank 0, then run again."""
        if self.lead:
            self.events.emit("step_discarded", step=step, seconds=round(seconds, 3))
            log.warning("step %d did not commit across the replica groups (%.2f s lost): running it again with "
                        "the groups of the next quorum", step, seconds)

    # ---- teardown ------------------------------------------------------------------------------
    def close(self) -> None:
        """Close what the attempt opened, after a failure too."""
        try:
            if self.samples is not None:
                self.samples.close()
            if self.metrics is not None:
                self.metrics.close()
        finally:
            self._close_setup()

    def _close_setup(self) -> None:
        if self.replicas is not None:
            self.replicas.close()
        if self.peer is not None:  # after a failure its thread is still running; the next iteration starts its own
            self.peer.abort()
        if self.restart is None:
            self.drain_signal.stop()
        self.monitor.shutdown()
        teardown()
        self.events.close()


def _sample_log(cfg: TrainConfig, rank: int) -> TextIO | None:
    if not cfg.logging.sample_log:
        return None
    directory = Path(cfg.run_dir) / "samples"
    directory.mkdir(parents=True, exist_ok=True)
    return open(directory / f"rank{rank}.jsonl", "a")


def checked_config(path: str | None, overrides: list[str]) -> TrainConfig:
    """The rank's config, refused before anything starts: destructive faults without their switch, a token
    file the model cannot read, replica groups without torchft, a Hugging Face model without its weights."""
    cfg = with_env_faults(load_train_config(path, overrides))
    check_chaos_switch(parse_faults(cfg.faults, int(os.environ.get("WORLD_SIZE", 1)),
                                    groups=cfg.parallel.replica_groups), cfg.allow_destructive_faults)
    check_token_file(cfg.data.path, cfg.data.dtype, check_model_source(cfg.model).vocab_size)
    if cfg.parallel.replica_groups > 1 and (missing := check_torchft()):
        raise TrainConfigError(missing)
    if cfg.model.source == "huggingface":
        from training.models.huggingface import HuggingFaceSpec

        HuggingFaceSpec(cfg.model.path).check_weights()
    return cfg


def main(argv: list[str] | None = None) -> int:
    parser = ConfigArgumentParser(prog="python -m training.train", description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", help="training config file (YAML or JSON); default: built-in defaults")
    parser.add_argument("overrides", nargs="*", metavar="section.key=value", help="config overrides")
    args = parser.parse_args(argv)
    rank = int(os.environ.get("RANK", 0))
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING, stream=sys.stdout,
                        format=f"[%(asctime)s] [rank{rank}] %(message)s", datefmt="%H:%M:%S")
    cfg = config_or_exit("training.train", lambda: checked_config(args.config, args.overrides),
                         FaultSpecError, DataError, ModelSourceError)
    if cfg.checkpoint.mode == "async":
        # Here, before the run's first thread: a fork is safe. On CUDA with NVRx its writer is used instead
        # and the zygote stays idle (a forked process, its memory shared with the rank's until either writes).
        start_writer_zygote()
    try:
        if cfg.fault_tolerance.restart == "injob":
            run(cfg)
        else:
            from training.train.inprocess import run_inprocess  # NVRx's Wrapper, only when asked for

            run_inprocess(cfg, run)
    except JobMustFail as err:  # no restart can help: the checkpoints need a person
        log.error("%s", err)
        _flush_output()
        os._exit(CONFIG_ERROR)
    except Drained:
        _flush_output()
        os._exit(TERMINATED)
    except BaseException:  # noqa: BLE001
        # Exit at once, as a crash would: interpreter shutdown would join a background checkpoint
        # thread that may be stuck in a collective with a dead peer.
        with contextlib.suppress(OSError):
            traceback.print_exc()
        _flush_output()
        os._exit(1)
    return 0


def _flush_output() -> None:
    """Flush standard output and error before os._exit; a failing flush (the local cluster writes them to the
    run directory, which may be full) must not keep the process from its exit code."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError):
            stream.flush()
