"""`JobConfig`: everything the charts render, from the platform config, the training config and
the infra outputs, checked before any manifest is written.

Derived values (grace period, ft_launcher's --term-timeout, restart budget per mode) live here as
properties so the charts, the launcher command and the tests read one definition.
"""
from __future__ import annotations

import posixpath
import re
from dataclasses import dataclass, replace
from pathlib import PurePosixPath

from infra.config import CHECKPOINT_MOUNT_PATH, RENDEZVOUS_PORT, PlatformConfig
from infra.instances import InstanceFacts
from k8s.outputs import InfraOutputs
from training.contract.capacity import (GIB, SHM_RESERVE, Capacity, FsxSpec, ModelFootprint, NodeSpec, Schedule,
                                        capacity_of)
from training.contract.config import TrainConfig, TrainConfigError
from training.contract.faults import DESTRUCTIVE_KINDS, FaultSpecError, parse_faults
from training.contract.k8s_delays import EKS
from training.contract.launcher import LAUNCHER_EXIT_MARGIN_S
from training.contract.model_source import ModelSourceError, model_shape
from training.contract.replica_groups import LIGHTHOUSE_PORT
from training.contract.shapes import ModelShape

# A pod's hostname is "<job>-<index>" (at most 63), the chaos CronJob "<job>-chaos" (at most 52) and
# the store "<job>-rendezvous" (at most 51).
_JOB_NAME = re.compile(r"^[a-z]([-a-z0-9]{0,38}[a-z0-9])?$")
_CRON = re.compile(r"^(@(hourly|daily|weekly|monthly|yearly)|(\S+\s+){4}\S+)$")
CLUSTER_DOMAIN = "cluster.local"  # the EKS default
MAX_NODE_FAILURE_TOLERATION_S = 300
# The kernel's hostname (utsname nodename), which a pod with setHostnameAsFQDN gets its FQDN as: a longer one
# fails the pod's start (Kubernetes docs, "DNS for Services and Pods", "Pod's setHostnameAsFQDN field").
MAX_HOSTNAME = 64


class JobConfigError(ValueError):
    """A job setting is not allowed or contradicts another; the message names both."""


@dataclass(frozen=True)
class FaultInjectionConfig:
    """A chaos drill: evict one training pod on a schedule (off unless given)."""

    schedule: str = "*/30 * * * *"
    target_index: int | None = None  # None: any index, picked at random by each drill
    # Seconds the evicted pod gets before SIGKILL: 1 (SIGTERM, then SIGKILL) is the closest to a
    # crash; more is a graceful stop.
    grace_period_s: int = 1


@dataclass(frozen=True)
class JobConfig:
    platform: PlatformConfig
    train: TrainConfig
    infra: InfraOutputs
    name: str = "fsdp-train"
    nodes: int | None = None  # None: gpuNodesDesired, the training size
    spares: int | None = None  # hot spare pods beyond nodes; None: the platform's (gpuNodesSpare)
    backoff_limit_per_index: int = 3  # pod failures per index before that index (and so the job) fails
    ttl_seconds_after_finished: int = 86400
    termination_grace_s: int | None = None  # None: long enough for an in-flight checkpoint
    shm_fraction: float = 0.25  # /dev/shm size as a part of the pod's memory (it counts against it)
    # How long a pod stays on a node tainted unreachable or not-ready before it is evicted and
    # replaced (Kubernetes' default: 300 s). The node controller taints a node only after 50 s
    # without status, so 30 s more replaces a lost node's pod after ~80 s; much less would evict
    # healthy pods whenever a kubelet misses a few updates (restart, API server hiccup). The EKS
    # projection (training.contract.k8s_delays) uses the same figure.
    node_failure_toleration_s: int = int(EKS.toleration_s)
    # A GPU node whose kubelet has been silent this long is marked out of service, so that PodGC deletes its
    # pod and the Job replaces it (k8s.charts.hung_nodes); None: no marker, a hung node's pod waits for
    # EKS auto repair (30 min). With the node controller's 50 s, the default replaces it within 2 min.
    hung_node_out_of_service_s: int | None = int(EKS.hung_node_out_of_service_s)
    fault_injection: FaultInjectionConfig | None = None
    # The chaos switch: lets the destructive fault kinds (corrupt-ckpt, disk-full, node-hang, node-loss, partition)
    # fire in the pods; written into the training config's immutable ConfigMap (allow_destructive_faults).
    allow_destructive_faults: bool = False
    # A Hugging Face model's directory lies on FSx, which is not mounted where the chart renders: a local copy
    # of it (its config.json is enough) sizes what the chart checks (peer state's /dev/shm). None: model.path.
    model_dir: str | None = None
    # With parallel.replica_groups R >= 2 the chart renders one Job per group (JobConfig.group): a group's
    # JobConfig names its index and the set of groups it belongs to. None: a Job of every node, or the set.
    replica_group: int | None = None
    group_set: str | None = None

    def __post_init__(self) -> None:
        if self.nodes is None:
            object.__setattr__(self, "nodes", self.platform.gpu_nodes_desired)
        if self.spares is None:
            object.__setattr__(self, "spares", self.platform.spare_nodes)
        train = replace(_with_fsx_paths(self.train, self.name), allow_destructive_faults=self.allow_destructive_faults)
        object.__setattr__(self, "train", _with_gpu_peak(train, self.instance))
        _validate(self)

    @property
    def instance(self) -> InstanceFacts:
        return self.platform.instance

    @property
    def namespace(self) -> str:
        return self.infra.namespace

    @property
    def service_name(self) -> str:
        return self.name

    @property
    def restart_mode(self) -> str:
        return self.train.fault_tolerance.restart

    @property
    def inprocess(self) -> bool:
        return self.restart_mode == "both"

    @property
    def pods(self) -> int:
        """The Job's indexes, every training node's pod and every hot spare's; of a set of replica groups,
        every group's (each has `spares` of its own)."""
        return self.nodes + self.spares * (self.replica_groups if self.is_group_set else 1)

    @property
    def replica_groups(self) -> int:
        return self.train.parallel.replica_groups

    @property
    def is_group_set(self) -> bool:
        """Several replica groups, each rendered as a Job of its own (JobConfig.group)."""
        return self.replica_groups > 1 and self.replica_group is None

    def group(self, g: int) -> "JobConfig":
        """Replica group g's Job: nodes / R of the nodes, `spares` of its own, its own run directory
        (TrainConfig.for_group) and rendezvous store, named `<name>-g<g>`."""
        return replace(self, name=f"{self.name}-g{g}", nodes=self.nodes // self.replica_groups,
                       train=self.train.for_group(g), replica_group=g, group_set=self.name)

    @property
    def groups(self) -> tuple["JobConfig", ...]:
        """Every Job the chart renders: each replica group's, or this one."""
        return tuple(self.group(g) for g in range(self.replica_groups)) if self.is_group_set else (self,)

    @property
    def set_name(self) -> str:
        """The name of the set of replica groups (this Job's own without groups): the Lighthouse's prefix."""
        return self.group_set or self.name

    @property
    def lighthouse_name(self) -> str:
        """The Lighthouse's Deployment and Service, one for every replica group."""
        return f"{self.set_name}-lighthouse"

    @property
    def lighthouse_endpoint(self) -> str:
        """The address torchft's Managers reach the Lighthouse at (training.contract.replica_groups.LIGHTHOUSE_ENV)."""
        return f"http://{self.lighthouse_name}.{self.namespace}.svc.{CLUSTER_DOMAIN}:{LIGHTHOUSE_PORT}"

    @property
    def pod_fqdn_length(self) -> int:
        """The longest pod FQDN, `<name>-<index>.<service>.<namespace>.svc.<domain>`: with replica groups the
        kernel hostname (setHostnameAsFQDN), at most 64 characters."""
        return len(f"{self.name}-{self.pods - 1}.{self.service_name}.{self.namespace}.svc.{CLUSTER_DOMAIN}")

    @property
    def lost_pod_replaced_s(self) -> float:
        """From a node's loss to its pod's replacement (NotReady, this Job's toleration, the new pod): the
        soonest that replacement can join a restart round (training.contract.launcher.rendezvous_last_call_s)."""
        return replace(EKS, toleration_s=self.node_failure_toleration_s).lost_pod_replaced_s

    @property
    def store_name(self) -> str:
        """The rendezvous store's Deployment and Service."""
        return f"{self.name}-rendezvous"

    @property
    def job_dir(self) -> str:
        """The Job's own directory on FSx, relative to the volume's root: the only part of FSx its pods
        mount read-write (a volumeMount subPath), at the same path (its run_dir)."""
        return str(PurePosixPath(self.train.run_dir).relative_to(CHECKPOINT_MOUNT_PATH))

    @property
    def data_dir(self) -> str | None:
        """The directory of the token file on FSx, mounted read-only; None when the data is elsewhere."""
        path = self.train.data.path
        if path is None or not _on_fsx(path):
            return None
        return str(PurePosixPath(path).parent.relative_to(CHECKPOINT_MOUNT_PATH))

    @property
    def rendezvous_endpoint(self) -> str:
        return f"{self.store_name}.{self.namespace}.svc.{CLUSTER_DOMAIN}:{RENDEZVOUS_PORT}"

    @property
    def term_timeout_s(self) -> int:
        # SIGTERM (drain, eviction) -> ft_launcher forwards it and waits this long (its --term-timeout)
        # for its ranks to commit the in-flight save and the step reached (training.train.drain).
        return _ceil(self.train.fault_tolerance.drain_timeout_s)

    @property
    def grace_period_s(self) -> int:
        return self.termination_grace_s or self.term_timeout_s + LAUNCHER_EXIT_MARGIN_S

    @property
    def model_shape(self) -> ModelShape:
        """The model's sizes: a preset's from its table, a Hugging Face model's from its config.json."""
        model = self.train.model
        if model.source == "huggingface" and self.model_dir is not None:
            model = replace(model, path=self.model_dir)
        try:
            return model_shape(model)
        except ModelSourceError as err:
            raise JobConfigError(f"{err}. The chart sizes the Job from the model's config.json: pass --model-dir with a "
                                 f"local copy of {self.train.model.path} (config.json is enough)") from None

    @property
    def capacity(self) -> Capacity:
        """The config at its size: the model, these nodes (a replica group's: each shards the model over its
        own), the FSx that cdk.json (or -c) provisions (training.contract.capacity)."""
        if self.is_group_set:
            return self.group(0).capacity
        node = NodeSpec(self.instance.name, self.instance.gpus, self.instance.gpu_peak_bf16_tflops,
                        self.instance.efa_line_rate_gbs, self.shm_gib * GIB)
        return capacity_of(ModelFootprint.from_shape(self.model_shape, self.train.training.seq_len), node, self.nodes,
                           FsxSpec(self.platform.fsx_storage_gib, self.platform.fsx_throughput_per_tib),
                           Schedule.from_config(self.train, self.nodes * self.instance.gpus))

    @property
    def peer_state_gib(self) -> float:
        """/dev/shm that peer state takes on each node (0 when off)."""
        return self.capacity.peer_shm_bytes / GIB if self.train.peer_state.enabled else 0.0

    @property
    def staging_gib(self) -> float:
        """/dev/shm that async saves' staging buffers take on each node (0 unless checkpoint.mode=async)."""
        return self.capacity.staging_shm_bytes / GIB

    @property
    def shm_gib(self) -> int:
        return max(1, int(self.instance.pod_memory_gib * self.shm_fraction))

    @property
    def pod_cpus(self) -> int:
        # Requests equal limits (Guaranteed QoS, evicted last); leave the kubelet reservation and
        # the node's daemon sets (CNI, device plugins, CSI) a few cores.
        return self.instance.vcpus - max(2, self.instance.vcpus // 24)

def _ceil(seconds: float) -> int:
    return int(-(-seconds // 1))


def _with_fsx_paths(train: TrainConfig, job_name: str) -> TrainConfig:
    """Relative run/checkpoint dirs would die with the pod: root them on the shared FSx volume. Every
    path is normalised first ('..' and '.' folded), so that the FSx checks judge where it really points:
    /fsx/../etc is /etc. Symlinks cannot be resolved here (FSx is not mounted when rendering): the pods
    mount the Job's directory by subPath, and the kubelet refuses a subPath that is a symlink out of it."""
    run_dir = train.run_dir
    if not PurePosixPath(run_dir).is_absolute():
        run_dir = str(PurePosixPath(CHECKPOINT_MOUNT_PATH) / "runs" / job_name)
    run_dir = posixpath.normpath(run_dir)
    ckpt = train.checkpoint
    if ckpt.dir is not None:
        ckpt = replace(ckpt, dir=posixpath.normpath(posixpath.join(run_dir, ckpt.dir)))
    ckpt = replace(ckpt, also_resume_from=tuple(posixpath.normpath(posixpath.join(run_dir, d))
                                                for d in ckpt.also_resume_from))
    data = train.data
    if data.path is not None and PurePosixPath(data.path).is_absolute():
        data = replace(data, path=posixpath.normpath(data.path))
    model = train.model
    if model.path is not None:
        model = replace(model, path=posixpath.normpath(model.path))
    return replace(train, run_dir=run_dir, checkpoint=ckpt, data=data, model=model)


def _with_gpu_peak(train: TrainConfig, instance: InstanceFacts) -> TrainConfig:
    """MFU's denominator from the instance table, unless the training config names its own."""
    if train.metrics.gpu_peak_tflops is not None:
        return train
    return replace(train, metrics=replace(train.metrics, gpu_peak_tflops=instance.gpu_peak_bf16_tflops))


def _on_fsx(path: str) -> bool:
    return PurePosixPath(path).is_relative_to(CHECKPOINT_MOUNT_PATH)


def _validate(j: JobConfig) -> None:
    if not _JOB_NAME.match(j.name):
        raise JobConfigError(f"job name {j.name!r} is not allowed: lower-case letters, digits and '-', "
                             "starting with a letter, at most 40 characters")
    if j.nodes < 1:
        raise JobConfigError(f"nodes={j.nodes} is not allowed: at least 1 (one pod per GPU node)")
    if j.nodes > j.platform.gpu_nodes_max:
        raise JobConfigError(f"nodes={j.nodes} exceeds gpuNodesMax={j.platform.gpu_nodes_max}: "
                             "the pods of the extra indexes could never be scheduled")
    if j.spares < 0:
        raise JobConfigError(f"spares={j.spares} is not allowed: 0 or more hot spare pods")
    if j.is_group_set:
        _validate_group_set(j)
        return
    if j.pods > j.platform.gpu_nodes_max:
        raise JobConfigError(f"nodes={j.nodes} + spares={j.spares} = {j.pods} exceeds gpuNodesMax="
                             f"{j.platform.gpu_nodes_max}: every pod needs a GPU node of its own; allowed: "
                             f"at most {j.platform.gpu_nodes_max - j.nodes} spares with these nodes")
    for path, key in ((j.train.run_dir, "run_dir"), (j.train.checkpoint_dir, "checkpoint.dir"),
                      *((d, "checkpoint.also_resume_from") for d in j.train.checkpoint.also_resume_from)):
        if not _on_fsx(path) or path == CHECKPOINT_MOUNT_PATH:
            raise JobConfigError(f"{key}={path!r} is not allowed on the cluster: it must be a directory below "
                                 f"{CHECKPOINT_MOUNT_PATH} (FSx), or relative, so it outlives the pod")
    if not PurePosixPath(j.train.checkpoint_dir).is_relative_to(j.train.run_dir):
        raise JobConfigError(f"checkpoint.dir={j.train.checkpoint_dir!r} is not allowed on the cluster: it must be "
                             f"inside run_dir={j.train.run_dir!r}, the Job's own directory, the only part of FSx "
                             "its pods can write")
    model = j.train.model
    if model.source == "huggingface" and not _on_fsx(model.path):
        raise JobConfigError(f"model.path={model.path!r} is not allowed on the cluster: the pods read the model from "
                             f"FSx, a directory below {CHECKPOINT_MOUNT_PATH} (e.g. where the S3 import puts it)")
    _validate_faults(j)
    _validate_global_batch(j)
    if j.replica_group is not None and j.pod_fqdn_length > MAX_HOSTNAME:
        raise JobConfigError(f"job name {j.set_name!r} in namespace {j.namespace!r} is too long for replica groups: "
                             f"a pod's hostname is its FQDN ({j.name}-{j.pods - 1}.{j.service_name}.{j.namespace}.svc."
                             f"{CLUSTER_DOMAIN}, {j.pod_fqdn_length} characters), at most {MAX_HOSTNAME}")
    if j.backoff_limit_per_index < 0:
        raise JobConfigError(f"backoff_limit_per_index={j.backoff_limit_per_index} is not allowed: 0 or more")
    if j.ttl_seconds_after_finished < 0:
        raise JobConfigError(f"ttl_seconds_after_finished={j.ttl_seconds_after_finished} is not allowed: 0 or more")
    if not 0 < j.shm_fraction <= 0.5:
        raise JobConfigError(f"shm_fraction={j.shm_fraction} is not allowed: more than 0, at most 0.5 "
                             "(/dev/shm is pod memory that the training process cannot use)")
    if j.peer_state_gib + j.staging_gib > j.shm_gib * (1 - SHM_RESERVE):
        users, knobs = [], ["train on more nodes", "raise shm_fraction"]
        if j.peer_state_gib:
            users.append(f"peer state {j.peer_state_gib:.0f} GiB ({j.train.peer_state.replicas} replica(s))")
            knobs.append("turn peer state off")
        if j.staging_gib:
            users.append(f"async checkpoint staging {j.staging_gib:.0f} GiB")
            knobs.append("use checkpoint.mode=sync")
        raise JobConfigError(
            f"each node's /dev/shm must hold {' and '.join(users)} for {j.model_shape.name} on {j.nodes} nodes, "
            f"more than {1 - SHM_RESERVE:.0%} of its {j.shm_gib} GiB (shm_fraction={j.shm_fraction} of "
            f"{j.instance.pod_memory_gib} GiB): {', '.join(knobs[:-1])}, or {knobs[-1]}")
    problems = j.capacity.problems()
    if problems:
        raise JobConfigError(f"{j.model_shape.name} on {j.nodes} x {j.instance.name}: " + "; and ".join(problems))
    if not 0 <= j.node_failure_toleration_s <= MAX_NODE_FAILURE_TOLERATION_S:
        raise JobConfigError(f"node_failure_toleration_s={j.node_failure_toleration_s} is not allowed: 0 to "
                             f"{MAX_NODE_FAILURE_TOLERATION_S} seconds (Kubernetes' default, which it shortens)")
    if j.hung_node_out_of_service_s is not None and not 0 < j.hung_node_out_of_service_s < EKS.node_repair_wait_s:
        raise JobConfigError(f"hung_node_out_of_service_s={j.hung_node_out_of_service_s} is not allowed: 1 to "
                             f"{EKS.node_repair_wait_s - 1:.0f} seconds (EKS auto repair replaces the node after "
                             f"{EKS.node_repair_wait_s:.0f} s), or None for no hung-node marker")
    minimum_grace = j.term_timeout_s + LAUNCHER_EXIT_MARGIN_S
    if j.termination_grace_s is not None and j.termination_grace_s < minimum_grace:
        raise JobConfigError(
            f"termination_grace_s={j.termination_grace_s} contradicts "
            f"fault_tolerance.drain_timeout_s={j.train.fault_tolerance.drain_timeout_s}: "
            f"a drained pod must be able to commit its checkpoint; use at least {minimum_grace} "
            f"(drain timeout + {LAUNCHER_EXIT_MARGIN_S} s for the launcher to exit)")
    if j.fault_injection is not None:
        fi = j.fault_injection
        if not _CRON.match(fi.schedule.strip()):
            raise JobConfigError(f"fault_injection.schedule={fi.schedule!r} is not allowed: "
                                 "a cron schedule such as '*/30 * * * *'")
        if fi.target_index is not None and not 0 <= fi.target_index < j.pods:
            raise JobConfigError(f"fault_injection.target_index={fi.target_index} is not allowed: "
                                 f"an index of the job{' (of each replica group)' if j.replica_group is not None else ''}"
                                 f", 0..{j.pods - 1}")
        _validate_drill_interval(j, fi.schedule)
        if fi.grace_period_s < 1:
            raise JobConfigError(f"fault_injection.grace_period_s={fi.grace_period_s} is not allowed: 1 or more")


def _validate_group_set(j: JobConfig) -> None:
    """A set of replica groups: whole groups of nodes, names that fit every group's, and each group valid as
    a Job of its own (all are alike: group 0 is checked)."""
    groups, last = j.replica_groups, f"{j.name}-g{j.replica_groups - 1}"
    if j.nodes % groups:
        allowed = [n for n in range(groups, j.platform.gpu_nodes_max + 1, groups)]
        raise JobConfigError(f"nodes={j.nodes} is not allowed with parallel.replica_groups={groups}: each group is "
                             f"whole nodes, the same number each; allowed nodes: {allowed or 'none up to gpuNodesMax'}")
    if not _JOB_NAME.match(last):
        raise JobConfigError(f"job name {j.name!r} is too long for {groups} replica groups: each group's Job is "
                             f"<name>-g<g> ({last!r}), at most 40 characters")
    if j.pods > j.platform.gpu_nodes_max:
        raise JobConfigError(f"nodes={j.nodes} + {groups} replica groups x spares={j.spares} = {j.pods} exceeds "
                             f"gpuNodesMax={j.platform.gpu_nodes_max}: each group has its own hot spares, and every "
                             f"pod needs a GPU node of its own; allowed: at most "
                             f"{(j.platform.gpu_nodes_max - j.nodes) // groups} spares per group with these nodes")
    try:
        j.group(0)
    except JobConfigError as err:
        raise JobConfigError(f"each of {groups} replica groups ({j.nodes // groups} of the {j.nodes} nodes): {err}"
                             ) from None


def _validate_faults(j: JobConfig) -> None:
    try:
        specs = parse_faults(j.train.faults, groups=j.train.parallel.replica_groups)
    except FaultSpecError as err:
        raise JobConfigError(str(err)) from None
    destructive = [s.text for s in specs if s.kind in DESTRUCTIVE_KINDS]
    if destructive and not j.allow_destructive_faults:
        raise JobConfigError(f"faults={destructive} are not allowed without the chaos switch: "
                             f"{sorted(DESTRUCTIVE_KINDS)} destroy checkpoints or take a node down; render with "
                             "--allow-destructive-faults to let them fire in the pods")


def _validate_global_batch(j: JobConfig) -> None:
    """The training nodes' GPUs must reach training.global_batch_size: say which node counts can."""
    t, gpus = j.train.training, j.instance.gpus
    if j.replica_group is not None:
        try:
            j.train.rows_per_step(j.nodes * gpus)
        except TrainConfigError as err:
            raise JobConfigError(f"nodes={j.nodes} x {gpus} GPUs per group: {err}") from None
        return
    try:
        t.accumulation_steps(j.nodes * gpus)
    except TrainConfigError as err:
        nodes = [w // gpus for w in t.reachable_world_sizes() if w % gpus == 0]
        raise JobConfigError(f"nodes={j.nodes} x {gpus} GPUs: {err}; with {gpus} GPUs per node, allowed nodes: "
                             f"{nodes or 'none (global_batch_size / batch_size is no multiple of the GPUs per node)'}"
                             ) from None


def _validate_drill_interval(j: JobConfig, schedule: str) -> None:
    """An eviction is not counted against the index's retries, but it is one restart of the worker
    group, and fault_tolerance.max_restarts restarts in a row without a newer checkpoint fail the
    Job (NO_PROGRESS). The rule: two drills must be at least one restart and one save apart, by the
    config's own bounds for them (initial_rank_heartbeat_timeout + checkpoint_section_timeout)."""
    ft = j.train.fault_tolerance
    needed_s = _ceil(ft.initial_rank_heartbeat_timeout + ft.checkpoint_section_timeout)
    try:
        gap_s = _cron_min_gap_s(schedule.strip())
    except ValueError:
        raise JobConfigError(f"fault_injection.schedule={schedule!r} is not allowed: "
                             "a cron schedule such as '*/30 * * * *'") from None
    if gap_s < needed_s:
        raise JobConfigError(
            f"fault_injection.schedule={schedule!r} evicts a pod as often as every {gap_s // 60} min, faster "
            f"than the Job can recover: at least {_ceil(needed_s / 60)} min between drills "
            f"(fault_tolerance.initial_rank_heartbeat_timeout + checkpoint_section_timeout = {needed_s} s), "
            f"or every restart lacks a new checkpoint and fault_tolerance.max_restarts={ft.max_restarts} "
            "of them in a row fail the Job")


def _cron_values(field: str, low: int, high: int) -> set[int]:
    """The values of one cron field (`*`, `?`, `a`, `a-b`, each with an optional `/step`, comma lists)."""
    values: set[int] = set()
    for item in field.split(","):
        span, slash, step = item.partition("/")
        if span in ("*", "?"):
            first, last = low, high
        else:
            start, _, end = span.partition("-")
            first, last = int(start), int(end) if end else (high if slash else int(start))
        values |= set(range(first, last + 1, int(step) if slash else 1))  # step 0: ValueError
    if not values or not values <= set(range(low, high + 1)):
        raise ValueError(field)
    return values


def _cron_min_gap_s(schedule: str) -> int:
    """The shortest time between two runs of a cron schedule, from its minute and hour fields: the
    day fields can only leave runs out, which never brings two runs closer."""
    if schedule.startswith("@"):
        return 3600 if schedule == "@hourly" else 86400
    minute, hour = schedule.split()[:2]
    runs = sorted(h * 60 + m for h in _cron_values(hour, 0, 23) for m in _cron_values(minute, 0, 59))
    return 60 * min(b - a for a, b in zip(runs, [*runs[1:], runs[0] + 24 * 60]))
