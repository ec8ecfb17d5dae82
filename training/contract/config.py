"""`TrainConfig`: the typed training config, from a YAML/JSON file plus `--section.key value` overrides.

Sections follow torchtitan's job config: model, training, data, checkpoint, fault_tolerance, logging,
plus metrics (rank 0's Prometheus endpoint, MFU), peer_state and parallel (replica groups).
Unknown sections or keys and out-of-range values fail with a message naming the key, the value
and what is allowed. A closed set of values is a `Literal` type, checked from the type itself; each
key's documentation lives in its field (`doc`), from where `--help` lists it (`config_keys_help`).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import sys
import textwrap
import typing
from dataclasses import asdict, dataclass, field, fields, is_dataclass, replace
from pathlib import Path
from typing import Any, Callable, Literal, Sequence, TypeVar

import yaml

from training.contract.exit_codes import CONFIG_ERROR
from training.contract.replica_groups import group_run_dir, split_problem
from training.contract.shapes import PRESETS

ModelPreset = Literal[tuple(PRESETS)]  # type: ignore[valid-type]  # the shapes table is the one list
ModelSource = Literal["preset", "huggingface"]
CheckpointMode = Literal["sync", "async", "off"]
RestartMode = Literal["injob", "both"]
Device = Literal["auto", "cpu", "cuda"]
DataDtype = Literal["uint16", "uint32"]
WhenBusy = Literal["wait", "skip"]
GradientReduce = Literal["auto", "micro_batch", "step"]

MODEL_PRESETS: tuple[str, ...] = typing.get_args(ModelPreset)
RESTART_MODES: tuple[str, ...] = typing.get_args(RestartMode)


class TrainConfigError(ValueError):
    """A training config value is not allowed; the message names the key, the value and what is allowed."""


class ConfigArgumentParser(argparse.ArgumentParser):
    """argparse for the training CLIs: a bad flag is a config error (exit CONFIG_ERROR, not 2), so
    the Job fails at once instead of retrying a command line that cannot work. `--help` ends with every
    config key the command's config file and overrides may set."""

    def error(self, message: str) -> typing.NoReturn:
        self.print_usage(sys.stderr)
        print(f"{self.prog}: error: {message}", file=sys.stderr)
        sys.exit(CONFIG_ERROR)

    def format_help(self) -> str:
        # the width argparse wraps its own help to
        return f"{super().format_help()}\n{config_keys_help(shutil.get_terminal_size().columns - 2)}"


Loaded = TypeVar("Loaded")


def config_or_exit(command: str, load: Callable[[], Loaded], *refusals: type[Exception]) -> Loaded:
    """What `load()` returns, or the end of `command`: a config it cannot read, or one that it or the
    command's checks refuse (TrainConfigError, OSError and `refusals`), prints one line naming why and exits
    CONFIG_ERROR, on which the Job fails at once (training.contract.job_rules), as on a bad flag."""
    try:
        return load()
    except (TrainConfigError, OSError, *refusals) as err:
        print(f"{command}: invalid training config: {err}", file=sys.stderr)
        sys.exit(CONFIG_ERROR)


def _doc(default: Any, text: str) -> Any:
    """A config key's field: its default and the documentation `--help` shows for it."""
    return field(default=default, metadata={"doc": text})


def _refuse(key: str, value: Any, allowed: str) -> typing.NoReturn:
    """A refused value, in one line: the key, its value and what is allowed."""
    raise TrainConfigError(f"{key}={value!r} is not allowed: {allowed}")


class _Section:
    """A config section: it checks itself when built (its keys' choices, then its own rules), so a section
    made in code is held to the same rules as one loaded from a file."""
    SECTION: typing.ClassVar[str]  # its name in the config file

    def __post_init__(self) -> None:
        for key in _keys(self, f"{self.SECTION}."):
            allowed = _choices(key.hint)
            if allowed and key.value not in allowed:
                _refuse(key.name, key.value, f"one of {[v for v in allowed if v is not None]}")
        self.validate()

    def validate(self) -> None:
        """The section's rules beyond its keys' types and choices; a TrainConfigError names the first broken."""


@dataclass(frozen=True)
class ModelConfig(_Section):
    SECTION = "model"
    source: ModelSource = _doc("preset", "preset: a built-in Llama-style model (model.preset); huggingface: a causal "
                                         "LM from the local directory model.path, built with transformers from its "
                                         "config.json (never downloaded), trained from its *.safetensors if any")
    preset: ModelPreset = _doc("tiny", "the model's shape (training.contract.shapes.PRESETS): tiny runs on a CPU "
                                       "core; 1b and 8b are the Llama-3.2-1B and Llama-3.1-8B shapes")
    path: str | None = _doc(None, "source=huggingface: the model's directory, e.g. /fsx/models/<name>: config.json, "
                                  "optional *.safetensors (pretrained weights, loaded at step 0) and tokenizer files")

    def validate(self) -> None:
        if self.source == "huggingface" and not self.path:
            _refuse("model.path", self.path, "the Hugging Face model's directory (config.json, optional "
                    "*.safetensors) with model.source=huggingface")
        if self.source == "preset" and self.path is not None:
            _refuse("model.path", self.path, "null with model.source=preset (a path is read with source=huggingface)")


@dataclass(frozen=True)
class TrainingConfig(_Section):
    SECTION = "training"
    steps: int = _doc(200, "optimizer steps of the whole run")
    batch_size: int = _doc(4, "sequences per data-parallel rank per forward and backward pass (a micro-batch)")
    global_batch_size: int | None = _doc(None, "Sequences per optimizer step, kept at any world size that can reach "
                                               "it: each rank accumulates gradients over global_batch_size / (world "
                                               "size x batch_size) micro-batches, so a resume on fewer or more ranks "
                                               "keeps the training dynamics and the data order. A multiple of "
                                               "batch_size; a world size that cannot reach it is refused before any "
                                               "rank trains. null: world size x batch_size, one micro-batch per step "
                                               "(the global batch then changes with the world size).")
    gradient_reduce: GradientReduce = _doc(
        "auto", "With more than one micro-batch per step, when FSDP2 reduce-scatters the gradients: micro_batch: "
                "after each micro-batch's backward, so only sharded gradients accumulate (a reduce-scatter per "
                "micro-batch, as torchtitan always does); step: after the last one only (one reduce-scatter per "
                "step, but every rank holds the whole model's unsharded fp32 gradients until then, 4 bytes per "
                "parameter: 32 GB at 8b). auto: step while those gradients take at most a tenth of the device's "
                "memory (the capacity model's rule, training.contract.capacity.gradient_reduce), else micro_batch. "
                "Both give the same step to float tolerance.")
    seq_len: int = _doc(64, "tokens per sequence")
    lr: float = _doc(3e-3, "peak learning rate: linear warmup, then cosine decay to a tenth at the schedule's "
                           "last step (lr_decay_steps)")
    warmup_steps: int = _doc(10, "steps of linear learning-rate warmup")
    lr_decay_steps: int | None = _doc(None, "The step at which the cosine decay reaches its floor (a tenth of lr), "
                                            "where the learning rate then stays: the schedule's length, apart from "
                                            "how long the run trains (torchtitan's lr_scheduler.total_steps). null: "
                                            "training.steps. To extend a run by resuming it with a larger "
                                            "training.steps, set this to the steps its schedule had (null: the old "
                                            "training.steps): without it the steps ahead follow the longer schedule "
                                            "and the learning rate jumps at the resume step.")
    weight_decay: float = _doc(0.01, "AdamW weight decay")
    grad_clip: float = _doc(1.0, "gradient norm clipping; 0: off")
    seed: int = _doc(1234, "seed of the initial weights, the synthetic tokens and the RNG streams")
    device: Device = _doc("auto", "auto: cuda when available (NCCL), else cpu (gloo)")
    collective_timeout_s: float = _doc(60.0, "Off the GPU, a gloo collective cannot be aborted: a short timeout "
                                             "bounds how long peers of a failed rank wait. On CUDA the NCCL timeout "
                                             "is the watchdog's.")

    def accumulation_steps(self, world_size: int) -> int:
        """Micro-batches per rank per optimizer step at `world_size` (1 without global_batch_size); a world
        size that cannot reach global_batch_size is a TrainConfigError naming the sizes that can."""
        if self.global_batch_size is None:
            return 1
        per_micro_batch = world_size * self.batch_size
        if self.global_batch_size % per_micro_batch:
            raise TrainConfigError(
                f"training.global_batch_size={self.global_batch_size} cannot be reached by world size {world_size}: "
                f"the global batch is world size x batch_size ({self.batch_size}) x micro-batches per rank, so the "
                f"world size must divide {self.global_batch_size // self.batch_size}; allowed world sizes: "
                f"{self.reachable_world_sizes()}")
        return self.global_batch_size // per_micro_batch

    def reachable_world_sizes(self) -> list[int]:
        """Every world size at which global_batch_size is a whole number of micro-batches per rank."""
        assert self.global_batch_size is not None
        micro_batches = self.global_batch_size // self.batch_size
        return [w for w in range(1, micro_batches + 1) if micro_batches % w == 0]

    def global_batch(self, world_size: int) -> int:
        """Sequences per optimizer step at `world_size`."""
        return world_size * self.batch_size * self.accumulation_steps(world_size)

    def validate(self) -> None:
        for key in ("steps", "batch_size", "seq_len"):
            if getattr(self, key) < 1:
                _refuse(f"training.{key}", getattr(self, key), "at least 1")
        if self.global_batch_size is not None and (self.global_batch_size < 1
                                                   or self.global_batch_size % self.batch_size):
            below = self.batch_size * max(self.global_batch_size // self.batch_size, 1)
            _refuse("training.global_batch_size", self.global_batch_size,
                    f"a positive multiple of training.batch_size ({self.batch_size}), which each rank's micro-batches "
                    f"fill, e.g. {below} or {below + self.batch_size}; or null (world size x batch_size)")
        if not self.lr > 0:
            _refuse("training.lr", self.lr, "greater than 0")
        if self.warmup_steps < 0:
            _refuse("training.warmup_steps", self.warmup_steps, "0 or more")
        if self.lr_decay_steps is not None and self.lr_decay_steps <= self.warmup_steps:
            _refuse("training.lr_decay_steps", self.lr_decay_steps, f"more than training.warmup_steps "
                    f"({self.warmup_steps}): the decay follows the warmup; or null (training.steps)")
        if self.weight_decay < 0:
            _refuse("training.weight_decay", self.weight_decay, "0 or more")
        if self.grad_clip < 0:
            _refuse("training.grad_clip", self.grad_clip, "0 (off) or more")
        if not self.collective_timeout_s > 0:
            _refuse("training.collective_timeout_s", self.collective_timeout_s, "greater than 0")


@dataclass(frozen=True)
class DataConfig(_Section):
    SECTION = "data"
    path: str | None = _doc(None, "pre-tokenized uint16/uint32 .bin file (`python -m training.data prepare`); "
                                  "null: synthetic tokens")
    dtype: DataDtype | None = _doc(None, "token width of the file at `path`; null: its sidecar's, else uint16")


@dataclass(frozen=True)
class CheckpointConfig(_Section):
    SECTION = "checkpoint"
    dir: str | None = _doc(None, "null: <run_dir>/checkpoints")
    interval: int = _doc(20, "steps between saves")
    mode: CheckpointMode = _doc("async", "how a checkpoint is written: sync blocks the step, async saves in the "
                                         "background, off saves none")
    keep: int = _doc(3, "complete checkpoints kept on disk")
    when_busy: WhenBusy = _doc("wait", "An async save still in flight when the next is due: wait for it (the wait "
                                       "is recorded as ckpt_blocked) or skip the new one. Never two in flight.")
    save_final: bool = _doc(False, "Write the full training state to <run_dir>/final (DCP, sync) after the last "
                                   "step: the artefact that exact-resume comparisons read.")
    allow_fresh_start: bool = _doc(False, "When checkpoints exist but none can be loaded, training refuses to start "
                                          "at step 0 (that would discard them); true trains from scratch instead.")
    also_resume_from: tuple[str, ...] = _doc((), "Other checkpoint directories a resume loads from when they hold "
                                                 "a newer complete checkpoint than `dir`, read only: the other "
                                                 "replica groups' (TrainConfig.for_group sets them), since one "
                                                 "group writes each checkpoint.")

    def directory(self, run_dir: str | os.PathLike) -> str:
        """Where the checkpoints of the run in `run_dir` are: `dir`, else <run_dir>/checkpoints."""
        return self.dir or str(Path(run_dir) / "checkpoints")

    def validate(self) -> None:
        if self.interval < 1:
            _refuse("checkpoint.interval", self.interval, "at least 1 step")
        if self.keep < 1:
            _refuse("checkpoint.keep", self.keep, "at least 1 (the newest complete checkpoint is never deleted)")


# Shared by the docs of a group of keys.
_RANK_MONITOR = ("An NVRx rank monitor timeout in seconds, generous until observed timings exist: after "
                 "calculate_timeouts_after steps they are recomputed and saved in checkpoints.")
_INPROCESS = ("In-process restart (restart=both; training.train.inprocess); both timeouts must cover the "
              "longest blocking operation (a sync checkpoint save) and stay below the launcher's rank monitor "
              "timeouts, which remain the backstop")


@dataclass(frozen=True)
class FaultToleranceConfig(_Section):
    SECTION = "fault_tolerance"
    restart: RestartMode = _doc("injob", "who restarts after a fault: injob (the default: ft_launcher restarts the "
                                         "worker group) or both (the Wrapper restarts the ranks in their processes "
                                         "first; what it cannot handle, ft_launcher); NVRx 0.7.0's release notes call "
                                         "in-process restart deprecated: new deployments should use in-job restart")
    max_restarts: int = _doc(3, "ft_launcher's in-job restarts in a row without progress (NVRx 0.7.0's no-progress "
                                "cycles): a restart after which a newer checkpoint was committed starts the count "
                                "again, so a long run with many faults keeps its budget and a persistent fault still "
                                "ends the job. 0: no in-job restart.")
    max_restarts_total: int = _doc(1000, "Every in-job restart of the launcher's life, with progress or not: only a "
                                         "backstop (ten times the Llama 3 failure rate gives about 140 faults in two "
                                         "weeks on 256 p5 nodes).")
    prefork_workers: bool = _doc(True, "ft_launcher's workers are forked from a per-node process that imported torch, "
                                       "DCP and NVRx once (training.pod.prefork), so an in-job restart skips "
                                       "Python start-up and imports.")
    initial_rank_heartbeat_timeout: float = _doc(600.0, f"The first heartbeat, after setup. {_RANK_MONITOR}")
    rank_heartbeat_timeout: float = _doc(300.0, f"Between heartbeats. {_RANK_MONITOR}")
    setup_section_timeout: float = _doc(600.0, f"The setup section. {_RANK_MONITOR}")
    step_section_timeout: float = _doc(180.0, f"One step. {_RANK_MONITOR}")
    checkpoint_section_timeout: float = _doc(600.0, f"One checkpoint save. {_RANK_MONITOR}")
    out_of_section_timeout: float = _doc(600.0, f"Outside any section. {_RANK_MONITOR}")
    rank_check_interval_s: float = _doc(1.0, "How often each rank monitor checks its rank's heartbeats and sections "
                                             "(NVRx's workload_check_interval, 5 s by default): a hang is found "
                                             "up to this long after its timeout, and another replica group waits "
                                             "that long for the hung group to leave its quorum.")
    calculate_timeouts_after: int = _doc(5, "steps after which the rank monitor timeouts are recomputed from "
                                            "observed timings and saved in checkpoints")
    timeout_safety_factor: float = _doc(5.0, "the longest observed timings times this make the recomputed timeouts "
                                             "(ft_launcher --ft-safety-factor)")
    drain_timeout_s: float = _doc(120.0, "SIGTERM (a drain, an eviction, a capacity block's end): the ranks have this "
                                         "long to keep the step reached, by a checkpoint or in the partners' memory "
                                         "(peer state), whichever is cheaper and fits, before ft_launcher (--term-timeout) and then Kubernetes (the pod's grace "
                                         "period, this plus a margin) kill them (training.train.drain).")
    rendezvous_join_timeout_s: float = _doc(1800.0, "How long a rendezvous round may gather its nodes (NVRx's join "
                                                    "timeout, launchers and store alike). Without a hot spare the "
                                                    "survivors of a lost node wait here for its replacement, which on "
                                                    "EKS is a new p5 that boots, joins and pulls the image "
                                                    "(bench.projection: about 11 min); a first start pulls the "
                                                    "image on every node. Past it a launcher gives up and its pod is "
                                                    "retried.")
    rendezvous_last_call_s: int | None = _doc(
        None, "After a fault, how long the store holds a restart round open for the previous round's nodes before "
              "hot spares take their places (NVRx's last_call_timeout, 1 s by default). A survivor is still stopping "
              "its ranks meanwhile (ft_launcher's --workers-stop-timeout; under restart=both the Wrapper gives up "
              "first); one left out stands by while a spare, or an early replacement, trains in its place, and the "
              "peer-state copies in its memory are lost to the run (the resume falls back to the checkpoint). NVRx "
              "cannot tell a lost node from a late survivor, so each node loss with a spare waits this long. null: "
              "where the round could fill without a survivor (two spares or more, or a lost node's replacement "
              "sooner than a survivor is back), the launchers' worker-stop timeout plus NVRx's rejoin polls (18 s "
              "on the cluster, 8 s on the local one); else NVRx's 1 s (training.contract.launcher."
              "rendezvous_last_call_s).")
    inprocess_max_restarts: int = _doc(3, "per process: the Wrapper's restarts in a row without progress")
    inprocess_soft_timeout: float = _doc(60.0, f"{_INPROCESS}. A rank making no progress for this long makes "
                                               "every rank restart in-process.")
    inprocess_hard_timeout: float = _doc(90.0, f"{_INPROCESS}. A rank that cannot be interrupted is killed by "
                                               "the Wrapper's monitor process after this long.")

    @property
    def launcher_max_restarts(self) -> int:
        """ft_launcher's --max-restarts: none with max_restarts=0, else the lifetime backstop
        max_restarts_total (the budget that matters, restarts without progress, is counted by NVRx's
        progress tracker)."""
        return 0 if self.max_restarts == 0 else self.max_restarts_total

    def __post_init__(self) -> None:
        if self.restart == "inprocess":  # retired: say what replaced it, not only what is allowed
            _refuse("fault_tolerance.restart", "inprocess", "one of ['injob', 'both'] (both: the Wrapper restarts "
                    "the ranks in their processes first, then ft_launcher restarts the worker group)")
        super().__post_init__()

    def validate(self) -> None:
        self._validate_budgets()
        self._validate_rank_monitor()
        if not self.drain_timeout_s > 0:
            _refuse("fault_tolerance.drain_timeout_s", self.drain_timeout_s, "greater than 0 seconds")
        if not self.rendezvous_join_timeout_s >= 60:
            _refuse("fault_tolerance.rendezvous_join_timeout_s", self.rendezvous_join_timeout_s,
                    "at least 60 seconds (a round must outlast a node's restart)")
        if self.rendezvous_last_call_s is not None and self.rendezvous_last_call_s < 0:
            _refuse("fault_tolerance.rendezvous_last_call_s", self.rendezvous_last_call_s, "0 or more whole seconds "
                    "(0: spares are taken at once), or null (derived from the worker-stop timeout)")
        self._validate_inprocess()

    def _validate_budgets(self) -> None:
        if self.max_restarts < 0:
            _refuse("fault_tolerance.max_restarts", self.max_restarts, "0 or more")
        if self.max_restarts_total < self.max_restarts:
            _refuse("fault_tolerance.max_restarts_total", self.max_restarts_total,
                    f"at least max_restarts ({self.max_restarts}): it caps every restart, with progress or not")
        if self.inprocess_max_restarts < 0:
            _refuse("fault_tolerance.inprocess_max_restarts", self.inprocess_max_restarts, "0 or more")

    def _validate_rank_monitor(self) -> None:
        for key in ("initial_rank_heartbeat_timeout", "rank_heartbeat_timeout", "setup_section_timeout",
                    "step_section_timeout", "checkpoint_section_timeout", "out_of_section_timeout"):
            if not getattr(self, key) > 0:
                _refuse(f"fault_tolerance.{key}", getattr(self, key), "greater than 0 seconds")
        if not self.rank_check_interval_s > 0:
            _refuse("fault_tolerance.rank_check_interval_s", self.rank_check_interval_s, "greater than 0 seconds")
        if self.initial_rank_heartbeat_timeout < self.rank_heartbeat_timeout:
            raise TrainConfigError(
                f"fault_tolerance.initial_rank_heartbeat_timeout ({self.initial_rank_heartbeat_timeout}) must be at "
                f"least rank_heartbeat_timeout ({self.rank_heartbeat_timeout}): the first heartbeat comes after "
                "setup, which is slower than a step")
        if self.checkpoint_section_timeout < self.step_section_timeout:
            raise TrainConfigError(
                f"fault_tolerance.checkpoint_section_timeout ({self.checkpoint_section_timeout}) must be at least "
                f"step_section_timeout ({self.step_section_timeout}): a save never takes less than a step")
        if self.calculate_timeouts_after < 1:
            _refuse("fault_tolerance.calculate_timeouts_after", self.calculate_timeouts_after, "at least 1 step")
        if self.timeout_safety_factor < 1:
            _refuse("fault_tolerance.timeout_safety_factor", self.timeout_safety_factor, "1 or more")

    def _validate_inprocess(self) -> None:
        if not 0 < self.inprocess_soft_timeout < self.inprocess_hard_timeout:
            raise TrainConfigError(
                f"fault_tolerance.inprocess_soft_timeout ({self.inprocess_soft_timeout}) must be greater than 0 and "
                f"less than inprocess_hard_timeout ({self.inprocess_hard_timeout}): the Wrapper first tries to "
                "interrupt a hung rank, then kills it")
        if self.restart == "injob":
            return
        for key in ("step_section_timeout", "out_of_section_timeout", "rank_heartbeat_timeout"):
            if not self.inprocess_hard_timeout < getattr(self, key):
                raise TrainConfigError(
                    f"fault_tolerance.inprocess_hard_timeout ({self.inprocess_hard_timeout}) must be less than "
                    f"{key} ({getattr(self, key)}) with restart={self.restart}: otherwise the launcher's rank "
                    "monitor kills a hung rank before the Wrapper can restart it in-process")


@dataclass(frozen=True)
class PeerStateConfig(_Section):
    """Each rank's state in its node's memory and on the next `replicas` nodes (training.train.peer_state):
    after a lost node, its ranks' shards come from their partners, not from the FSx checkpoint."""
    SECTION = "peer_state"
    enabled: bool = _doc(False, "keep copies of each rank's state in node memory")
    interval: int | None = _doc(None, "The most steps a lost node costs: a copy every interval // 2 + 1 steps, each "
                                      "acknowledged by the partners within the rest (training waits for it there). "
                                      "null: 1 if a copy costs at most 5% of a step and a send ends within one, "
                                      "else the fewest steps that keep both so (measured over the first steps, "
                                      "agreed by all ranks, measured again every 20 copies).")
    replicas: int = _doc(1, "other nodes holding a copy of each rank's state")
    memory_dir: str | None = _doc(None, "null: $TRAINING_NODE_MEMORY, else /dev/shm/training-peer-state")

    def validate(self) -> None:
        if self.interval is not None and self.interval < 1:
            _refuse("peer_state.interval", self.interval, "at least 1 step, or null (chosen from the measured cost)")
        if self.replicas < 1:
            _refuse("peer_state.replicas", self.replicas, "at least 1 (other nodes holding each rank's copy)")


@dataclass(frozen=True)
class ParallelConfig(_Section):
    """Replica groups (HSDP on torchft, training.train.replica_groups): FSDP2 shards the model within a
    group, torchft's Manager sums the groups' gradients every step through a Lighthouse, and a group that
    fails leaves the quorum while the others train on."""
    SECTION = "parallel"
    replica_groups: int = _doc(1, "R: groups of whole nodes, each a full copy of the model sharded over its own "
                                  "ranks (its world size is theirs). 1: plain FSDP2 over every rank, as without "
                                  "this section. R >= 2 needs torchft 0.2.0; training.global_batch_size is then "
                                  "the whole step's over every group (null: R x group world size x batch_size), "
                                  "split over the live groups by rows of micro-batches "
                                  "(training.contract.replica_groups).")
    step_timeout_s: float = _doc(8.0, "R >= 2: torchft's Manager timeout (its `timeout`), which bounds the "
                                      "cross-group all-reduce, the commit vote and a heal's state transfer: a "
                                      "group silent inside the all-reduce (a lost node: no TCP reset on EKS) "
                                      "costs the others this long, 8 s keeping their stall within 10 s; the chart "
                                      "refuses one that a heal of a group's state would not fit (Capacity.heal_s; "
                                      "torchft's default: 60 s).")
    quorum_timeout_s: float = _doc(240.0, "R >= 2: how long a group waits for the Lighthouse's quorum before its "
                                          "ranks fail (an in-job restart follows, and a group with nothing in "
                                          "memory then resumes from a live group or the checkpoint). Longer than "
                                          "a step and a checkpoint save of the slowest group, and than the "
                                          "Lighthouse's absence, during which it is asked again every second: a "
                                          "restart in place takes seconds, a move to another system node after "
                                          "its node was lost 90 s (training.contract.k8s_delays."
                                          "system_pod_moved_s). Under the rank monitor's timeouts that judge the "
                                          "wait too (torchft's default: 60 s).")
    heartbeat_timeout_s: float = _doc(1.0, "R >= 2, the Lighthouse's: a group whose manager has not heartbeaten "
                                           "(every 0.1 s) for this long is dead and leaves the quorum; the other "
                                           "groups' longest stall after a group dies (torchft's default: 5 s).")
    join_timeout_s: float = _doc(0.5, "R >= 2, the Lighthouse's: how long a quorum waits for a group that "
                                      "heartbeats but has not asked to join (torchft's default: 60 s).")
    node_pulse_timeout_s: float = _doc(5.0, "R >= 2: a node of a group whose beat in the group's rendezvous store "
                                            "(every 0.5 s) is this old, or that cannot reach the store for as long, "
                                            "is lost: the group's ranks leave, so the group drops out of the "
                                            "quorum and restarts in-job (training.train.group_pulse). Above the "
                                            "longest pause of a rank's threads (a large state's load or heal).")

    def lighthouse_options(self) -> dict[str, int]:
        """The Lighthouse's settings, by torchft's names (LighthouseServer's arguments, torchft_lighthouse's
        flags): a quorum of one group is enough (the others may all be down), a group that stops heartbeating
        is dropped after heartbeat_timeout_s. So at a fresh start the group that asks first trains alone and
        the others heal into the quorum from it."""
        return {"min_replicas": 1, "join_timeout_ms": int(self.join_timeout_s * 1000),
                "heartbeat_timeout_ms": int(self.heartbeat_timeout_s * 1000)}

    def validate(self) -> None:
        if self.replica_groups < 1:
            _refuse("parallel.replica_groups", self.replica_groups, "1 (plain FSDP2) or more (replica groups on "
                    "torchft)")
        for key in ("step_timeout_s", "quorum_timeout_s", "heartbeat_timeout_s", "join_timeout_s",
                    "node_pulse_timeout_s"):
            if not getattr(self, key) > 0:
                _refuse(f"parallel.{key}", getattr(self, key), "greater than 0 seconds")
        if self.node_pulse_timeout_s < 2:
            _refuse("parallel.node_pulse_timeout_s", self.node_pulse_timeout_s,
                    "at least 2 seconds: four of a node's beats, 0.5 s apart")
        if self.quorum_timeout_s <= self.heartbeat_timeout_s:
            _refuse("parallel.quorum_timeout_s", self.quorum_timeout_s, f"more than heartbeat_timeout_s "
                    f"({self.heartbeat_timeout_s}): the quorum after a group dies forms once its heartbeats are "
                    "that old")

    def validate_with(self, t: TrainingConfig, ft: FaultToleranceConfig) -> None:
        """The rules across sections: the groups can share training.global_batch_size, and the rank monitor
        lets a rank wait out its quorum (in setup, the first one; then outside every section, with no
        heartbeat)."""
        if self.replica_groups < 2:
            return
        if t.global_batch_size is not None:
            problem = split_problem(t.global_batch_size // t.batch_size, self.replica_groups)
            if problem:
                _refuse("parallel.replica_groups", self.replica_groups, f"training.global_batch_size="
                        f"{t.global_batch_size} in micro-batches of {t.batch_size}: {problem}")
        judges = ("setup_section_timeout", "rank_heartbeat_timeout", "out_of_section_timeout")
        if self.quorum_timeout_s >= (bound := min(getattr(ft, key) for key in judges)):
            _refuse("parallel.quorum_timeout_s", self.quorum_timeout_s, f"less than {bound:g} s, the least of "
                    f"fault_tolerance.{', '.join(f'{key}={getattr(ft, key):g}' for key in judges)}: NVRx would "
                    "end a rank's wait for its quorum first")


@dataclass(frozen=True)
class LoggingConfig(_Section):
    SECTION = "logging"
    log_interval: int = _doc(10, "steps between progress lines (rank 0)")
    sample_log: bool = _doc(False, "Each rank appends the global sample indices of every step to "
                                   "<run_dir>/samples/rank<R>.jsonl (tests check that a resumed run consumes every "
                                   "sample exactly once).")

    def validate(self) -> None:
        if self.log_interval < 1:
            _refuse("logging.log_interval", self.log_interval, "at least 1 step")


@dataclass(frozen=True)
class MetricsConfig(_Section):
    """Rank 0's Prometheus endpoint (training.train.metrics) and MFU (training.contract.flops)."""
    SECTION = "metrics"
    port: int = _doc(0, "http://<rank 0>:port/metrics; 0: off. The EKS Job's pods carry the scrape annotations for it.")
    gpu_peak_tflops: float | None = _doc(None, "Dense bf16 peak TFLOPs of one GPU, the denominator of MFU; null: no "
                                               "MFU (a CPU run, or a GPU whose peak is not known). The k8s chart fills "
                                               "it from infra.instances for the node group's GPUs.")
    event_log_refresh_s: float = _doc(30.0, "The goodput, restart and checkpoint figures re-read the event log "
                                            "(training.report.goodput) at most this often: a weeks-long log takes "
                                            "a while to read, and a scrape every 30-60 s needs no fresher figures.")

    def validate(self) -> None:
        if not (self.port == 0 or 1024 <= self.port <= 65535):
            _refuse("metrics.port", self.port, "0 (off) or a TCP port from 1024 to 65535")
        if self.gpu_peak_tflops is not None and not self.gpu_peak_tflops > 0:
            _refuse("metrics.gpu_peak_tflops", self.gpu_peak_tflops, "greater than 0, or null (no MFU)")
        if self.event_log_refresh_s < 0:
            _refuse("metrics.event_log_refresh_s", self.event_log_refresh_s, "0 (every scrape) or more seconds")


@dataclass(frozen=True)
class TrainConfig:
    run_dir: str = _doc("runs/default", "the run's directory: event log, logs, checkpoints, report")
    model: ModelConfig = field(default_factory=ModelConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    data: DataConfig = field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    fault_tolerance: FaultToleranceConfig = field(default_factory=FaultToleranceConfig)
    peer_state: PeerStateConfig = field(default_factory=PeerStateConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    faults: tuple[str, ...] = _doc((), "fault specs to inject; format in training.contract.faults")
    allow_destructive_faults: bool = _doc(False, "The chaos switch: in a Kubernetes pod the destructive fault kinds "
                                                 "(training.contract.faults.DESTRUCTIVE_KINDS) fire only when this is "
                                                 "true. The k8s Job sets it from `k8s/main.py "
                                                 "--allow-destructive-faults`.")

    def __post_init__(self) -> None:  # each section has checked itself when it was built
        if not self.run_dir:
            _refuse("run_dir", self.run_dir, "a directory path")
        self.parallel.validate_with(self.training, self.fault_tolerance)

    def for_group(self, group: int) -> "TrainConfig":
        """Replica group `group`'s config: its own run directory, and its own checkpoint directory (inside
        its run directory when the given one is inside the run's, else under the given one), from which it
        also resumes the other groups' checkpoints."""
        others = tuple(str(self._group_checkpoint_dir(g)) for g in range(self.parallel.replica_groups) if g != group)
        checkpoint = replace(self.checkpoint, dir=str(self._group_checkpoint_dir(group)),
                             also_resume_from=(*self.checkpoint.also_resume_from, *others))
        return replace(self, run_dir=str(group_run_dir(self.run_dir, group)), checkpoint=checkpoint)

    def _group_checkpoint_dir(self, group: int) -> Path:
        run_dir, given = group_run_dir(self.run_dir, group), Path(self.checkpoint_dir)
        if given.is_relative_to(self.run_dir):
            return run_dir / given.relative_to(self.run_dir)
        return group_run_dir(given, group)

    def rows_per_step(self, group_world_size: int) -> int:
        """Rows of micro-batches in every step (a row: one micro-batch per rank of a group; training.contract.
        replica_groups) with groups of `group_world_size` ranks: at R = 1 a rank's micro-batches per step
        (accumulation_steps). A shape the groups cannot share is a TrainConfigError naming the shapes that can."""
        t, groups = self.training, self.parallel.replica_groups
        if groups == 1:
            return t.accumulation_steps(group_world_size)
        if t.global_batch_size is None:  # R x group world size x batch_size: one row per group
            return groups
        problem = split_problem(t.global_batch_size // t.batch_size, groups, group_world_size)
        if problem:
            raise TrainConfigError(f"training.global_batch_size={t.global_batch_size} with parallel.replica_groups="
                                   f"{groups} cannot be reached by groups of {group_world_size} ranks: {problem}")
        return t.global_batch_size // (group_world_size * t.batch_size)

    @property
    def checkpoint_dir(self) -> str:
        return self.checkpoint.directory(self.run_dir)

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["faults"] = list(self.faults)
        return out

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)


def load_train_config(path: str | Path | None = None, overrides: Sequence[str] = ()) -> TrainConfig:
    """Load a config file (YAML or JSON; None: defaults) and apply `section.key=value` overrides."""
    data: dict[str, Any] = {}
    if path is not None:
        text = Path(path).read_text()
        try:
            loaded = json.loads(text) if str(path).endswith(".json") else _load_yaml(text)
        except (json.JSONDecodeError, yaml.YAMLError) as err:
            raise TrainConfigError(f"{path}: not valid YAML/JSON: {err}") from None
        if loaded is not None and not isinstance(loaded, dict):
            raise TrainConfigError(f"{path}: expected a mapping of sections, got {type(loaded).__name__}")
        data = loaded or {}
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise TrainConfigError(f"override {item!r}: expected section.key=value, e.g. checkpoint.mode=sync")
        *sections, leaf = key.split(".")
        target = data
        for section in sections:
            target = target.setdefault(section, {})
            if not isinstance(target, dict):
                raise TrainConfigError(f"override {item!r}: {section} is not a section")
        target[leaf] = _load_yaml(value) if value else None
    return _build(TrainConfig, data, "")


class _Yaml12Loader(yaml.SafeLoader):
    """YAML 1.1 reads on/off/yes/no as booleans, so `checkpoint.mode=off` would arrive as False;
    here, as in YAML 1.2, only true/false are booleans."""


_Yaml12Loader.yaml_implicit_resolvers = {
    first: [(tag, regexp) for tag, regexp in resolvers if tag != "tag:yaml.org,2002:bool"]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_Yaml12Loader.add_implicit_resolver("tag:yaml.org,2002:bool", re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"),
                                    list("tTfF"))


def _load_yaml(text: str) -> Any:
    return yaml.load(text, Loader=_Yaml12Loader)


def _choices(hint: Any) -> tuple[Any, ...]:
    """The values a `Literal` type allows, None included where it is optional; () for any other type."""
    if typing.get_origin(hint) is Literal:
        return typing.get_args(hint)
    literals = [arg for arg in typing.get_args(hint) if typing.get_origin(arg) is Literal]
    return (*typing.get_args(literals[0]), None) if literals else ()


class _Key(typing.NamedTuple):
    name: str  # section.key, or key at the top level
    hint: Any
    value: Any
    doc: str


def _keys(config: Any, prefix: str = "") -> list[_Key]:
    """Every key of a config and its sections, in their order."""
    hints = typing.get_type_hints(type(config))
    out = []
    for f in fields(config):
        value = getattr(config, f.name)
        if is_dataclass(hints[f.name]):
            out += _keys(value, f"{prefix}{f.name}.")
        else:
            out.append(_Key(prefix + f.name, hints[f.name], value, f.metadata["doc"]))
    return out


def config_keys_help(width: int) -> str:
    """Every config key with its type or allowed values, its default and its doc: the end of `--help`."""
    lines = ["config keys, as sections of the --config file or, where the command takes them, section.key=value:"]
    for key in _keys(TrainConfig()):
        default = key.value if isinstance(key.value, str) else json.dumps(key.value)
        lines.append(f"  {key.name}: {_type_name(key.hint)} = {default}")
        lines += textwrap.wrap(key.doc, width=width, initial_indent=" " * 6, subsequent_indent=" " * 6,
                               break_on_hyphens=False)
    return "\n".join(lines) + "\n"


def _type_name(hint: Any) -> str:
    """How `--help` names a key's type: `sync | async | off`, `int or null`, `list of str`."""
    if _choices(hint):
        return " | ".join("null" if v is None else str(v) for v in _choices(hint))
    args = typing.get_args(hint)
    if type(None) in args:
        return f"{_type_name(next(a for a in args if a is not type(None)))} or null"
    if typing.get_origin(hint) is tuple:
        return f"list of {args[0].__name__}"
    return hint.__name__


def _build(cls: type, data: Any, prefix: str) -> Any:
    if not isinstance(data, dict):
        raise TrainConfigError(f"{prefix.rstrip('.') or 'config'}: expected a mapping, got {data!r}")
    hints = typing.get_type_hints(cls)
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(data) - known)
    if unknown:
        where = prefix.rstrip(".") or "top level"
        raise TrainConfigError(f"unknown key(s) {[prefix + k for k in unknown]} in {where}; allowed: {sorted(known)}")
    kwargs = {}
    for name, value in data.items():
        hint = hints[name]
        if is_dataclass(hint):
            kwargs[name] = _build(hint, value, f"{prefix}{name}.")
        else:
            kwargs[name] = _coerce(f"{prefix}{name}", value, hint)
    return cls(**kwargs)


def _coerce(key: str, value: Any, hint: Any) -> Any:
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if value is None and type(None) in args:
        return None
    if origin is typing.Union or origin is getattr(__import__("types"), "UnionType", None):
        hint = next(a for a in args if a is not type(None))
        origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is Literal:  # read as its values' type; _Section checks the value is one of them
        hint, origin = type(args[0]), None
    if origin is tuple:
        if isinstance(value, str):
            value = [value]
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise TrainConfigError(f"{key}={value!r}: expected a list of strings")
        return tuple(value)
    if hint is bool:
        if not isinstance(value, bool):
            raise TrainConfigError(f"{key}={value!r}: expected true or false")
        return value
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise TrainConfigError(f"{key}={value!r}: expected a whole number")
        return value
    if hint is float:
        if isinstance(value, str):  # YAML reads 1e-3 (no dot) as a string
            try:
                return float(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TrainConfigError(f"{key}={value!r}: expected a number")
        return float(value)
    if hint is str:
        if not isinstance(value, (str, int, float)) or isinstance(value, bool):
            raise TrainConfigError(f"{key}={value!r}: expected a string")
        return str(value)
    raise TrainConfigError(f"{key}: unsupported type {hint}")
