"""The capacity model: what a training config's promises cost at the size it runs, torch-free.

From the model (parameters, bytes of state per parameter, FLOPs per token), the world (nodes, GPUs per node),
the file system (FSx for Lustre storage and throughput per TiB), the node (GPUs, /dev/shm, EFA, the TCP path)
and the schedule (interval, keep, drain grace, peer state), it computes the save to FSx and whether it
finishes within the interval, the drain's commit against its grace, the peer copy and send and the interval
they allow, restores from FSx and from peers, the footprint of `keep` checkpoints, the steps each mechanism
loses, and, beside them, HSDP with replica groups (`HsdpCase`). The chart refuses a config that fails it
(k8s.job_config), `python -m training.plan --config` prints it, and the tables of docs/capacity.md are its output.

Every figure is a projection: p5 has not been measured here. Each constant names its source; those without
one say they are assumptions, to be replaced by measurements (`make bench` on a p5 node).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from training.contract.config import ParallelConfig, TrainConfig
from training.contract.flops import flops_per_token
from training.contract.k8s_delays import EKS, KubernetesDelays
from training.contract.model_source import model_shape
from training.contract.shapes import STATE_BYTES_PER_PARAMETER, ModelShape, node_memory_bytes, preset_shape

GB = 1e9
GIB = 2**30
TIB = 2**40
MB = 1e6  # FSx states throughput in MBps (MB/s): read as 10^6 bytes per second

# FSx for Lustre User Guide, "Performance characteristics of SSD and HDD storage classes", SSD table:
# PERSISTENT_2 network throughput baseline in MBps per TiB of storage, by throughput tier. Disk throughput
# baseline is the tier itself (125, 250, 500, 1000). "How FSx for Lustre file systems work" (Performance):
# a write, or a read not served from the file server's cache, runs at the lower of the two. The 125 and 250
# tiers burst to 500 MBps/TiB of disk throughput on credits: not counted, a 100 GB save outlasts a burst.
FSX_NETWORK_MBPS_PER_TIB = {125: 320, 250: 640, 500: 1300, 1000: 2600}
# FSx CreateFileSystem StorageCapacity: PERSISTENT_2 SSD takes 1200 GiB, 2400 GiB and increments of 2400 GiB
# (infra.config enforces it).
FSX_STORAGE_STEP_GIB = 2400
# us-east-1 list price of PERSISTENT_2 SSD storage, USD per GB-month, by throughput tier: Amazon FSx for Lustre
# pricing page (aws.amazon.com/fsx/lustre/pricing), billed on the provisioned capacity (1200 GiB is billed as
# 1200 GB-months). Not re-read from the page's table here (only its text came through); the 125 tier's figure
# matches third-party estimates ($174/month for 1.2 TB), and the ap-northeast-1 hourly figures stand in the
# same ratio. Check before budgeting.
FSX_USD_PER_GB_MONTH = {125: 0.145, 250: 0.210, 500: 0.340, 1000: 0.600}
# A checkpoint directory being written while `keep` complete ones stay: the in-flight save.
IN_FLIGHT_CHECKPOINTS = 1

# EC2 User Guide, "Amazon EC2 instance network bandwidth": single-flow (5-tuple) TCP traffic reaches up to
# 10 Gbps between instances of one cluster placement group (the GPU node group's: infra.gpu_nodegroup).
# gloo's peer-state send (training.train.peer_state) is one TCP connection per rank pair.
TCP_FLOW_GBPS = 10.0
# Assumption: the share of a flow's line rate gloo's send reaches (one socket per pair, a copy through the
# Python thread); the estimate of 3-5 GB/s per p5 node. Replace with the bench's measured send rate.
GLOO_TCP_EFFICIENCY = 0.5
# Assumption: NCCL over EFA reaches this share of the EFA line rate: the NCCL preflight's all_reduce floor
# (infra.instances.BUSBW_FLOOR_FRACTIONS), which a healthy p5 fabric passes.
NCCL_EFA_EFFICIENCY = 0.75
# Measured, not on p5: CRC-32 (zlib, one core) of one rank's peer-state copy, GB/s. The replication thread checksums
# each copy before it sends it, and a restore checks it before it loads it (training.train.peer_state), each
# rank on its own core. Source: bench.peer_sizes's CRC-32 column at the small preset's state (332 MiB per
# rank, larger than any cache) on the 2-vCPU bench VM. Assumption: a p5 host core checksums no slower.
CRC32_GBS = 0.78
# Assumption: one GPU's copy of its shard to pinned host memory (async staging, peer state's copy), GB/s: p5's
# hosts are 3rd-generation AMD EPYC (PCIe Gen4, 32 GB/s each way per x16 link) and eight GPUs copy at once
# through one host's memory (docs/capacity.md, "In-memory rollback at 8b on p5": the same figure).
HOST_COPY_GBS = 25.0
# "The Llama 3 Herd of Models" (2024), Table 4: 38-43% BF16 model FLOPs utilization on 8,192-16,384 H100s. The
# projected step time assumes the low end of that, rounded.
ASSUMED_MFU = 0.40
# A drain keeps the step reached only if the time left covers this many times its estimated cost: what is left of
# the in-flight save plus a save of the step reached, each as long as the last one measured (training.train.drain
# plans with it; the estimates are the last save's duration, and a save can take longer).
DRAIN_SAVE_MARGIN = 2.0
# Assumption: an async save may take up to this many times its projected duration (the projection assumes the
# job has FSx's baseline throughput to itself). A save still in flight when the next is due makes that one wait
# or be skipped (checkpoint.when_busy), so the chart refuses, and the planner never recommends, an interval
# shorter than the save's duration times this.
ASYNC_SAVE_HEADROOM = 1.5
# Peer state's schedule (training.train.peer_state, `peer_schedule` below): with peer_state.interval null a copy
# may cost at most this share of a step, and a send must end within its deadline with this headroom.
PEER_COPY_BUDGET = 0.05
PEER_SEND_HEADROOM = 1.5
# HSDP keeps per parameter fp32 weights (4 B), fp32 gradients (4 B: FSDP2's reduce_dtype in
# training.train.parallelize) and two fp32 AdamW moments (8 B) on the GPU.
TRAINING_BYTES_PER_PARAMETER = 16
# Gradient accumulation with training.gradient_reduce=step holds the whole model's unsharded fp32 gradients on
# every GPU until the last micro-batch (FSDP2 set_requires_gradient_sync(False): pytorch/pytorch PR 126166 names
# the two ways, "reduce-scatter" or "no reduce-scatter", and what each costs). Assumption: that memory is worth
# the saved communication while it stays within this share of a GPU's memory (activations, the sharded state and
# the all-gathered layers need the rest); beyond it every micro-batch reduce-scatters, torchtitan's only way
# (pytorch/torchtitan issue 292: "for memory constrained cases, we prefer to ... reduce-scatter every microbatch").
UNSHARDED_GRADIENT_SHARE = 0.10
UNSHARDED_GRADIENT_BYTES = 4  # per parameter: FSDP2's reduce_dtype (fp32)
HSDP_REPLICAS = 2
# A heal must end within parallel.step_timeout_s with this headroom: the pods' network also carries the other
# groups' traffic to the live group's nodes (a heal's source keeps training).
HEAL_HEADROOM = 1.5
SHM_RESERVE = 1 / 8  # of /dev/shm, left to NCCL and the data loaders beside peer state


def commit_lag_s(mode: str, save_s: float) -> float:
    """How long a checkpoint stays uncommitted after its save stopped blocking the step: an async save's whole
    write of `save_s`, nothing for a sync save (it blocks until it commits). A failure in that window rolls back
    to the checkpoint before, one interval further: the worst case here (`Capacity.fsx_steps_lost`) and the
    planner's expected loss per failure both count it."""
    return save_s if mode == "async" else 0.0


def shortest_interval_s(async_save_s: float) -> float:
    """The shortest interval for an async save of `async_save_s` to commit before the next is due, with
    ASYNC_SAVE_HEADROOM: what the chart accepts and the planner recommends at least."""
    return ASYNC_SAVE_HEADROOM * async_save_s


@dataclass(frozen=True)
class ModelFootprint:
    """What the model weighs: a preset's or a Hugging Face config's counts fill it alike."""

    name: str
    parameters: int
    flops_per_token: int  # forward and backward, at the sequence length trained
    state_bytes_per_parameter: int = STATE_BYTES_PER_PARAMETER  # fp32 weights and AdamW's two moments

    @classmethod
    def from_shape(cls, shape: ModelShape, seq_len: int) -> "ModelFootprint":
        return cls(shape.name, shape.parameters, flops_per_token(shape, seq_len))

    @classmethod
    def from_preset(cls, preset: str, seq_len: int) -> "ModelFootprint":
        return cls.from_shape(preset_shape(preset), seq_len)

    @classmethod
    def from_config(cls, config: TrainConfig) -> "ModelFootprint":
        """The config's model: a preset from its table, a Hugging Face model from its config.json."""
        return cls.from_shape(model_shape(config.model), config.training.seq_len)

    @property
    def state_bytes(self) -> int:
        """One checkpoint (and one peer-state copy) of the whole training state."""
        return self.parameters * self.state_bytes_per_parameter


@dataclass(frozen=True)
class NodeSpec:
    """A GPU node as the capacity model sees it; k8s.job_config builds it from infra.instances."""

    name: str
    gpus: int
    gpu_peak_tflops: float  # dense bf16
    efa_gbs: float  # EFA line rate, GB/s (0: none)
    shm_bytes: int  # the pod's /dev/shm, where peer state lives
    # The primary ENA interface's bandwidth, GB/s: the pods' TCP traffic and the Lustre client both use it. FSx for
    # Lustre User Guide, "Throughput to individual client instances": what one client drives depends on the file
    # system type (ours has no EFA) and the client's network interface; its table of per-client limits was not
    # readable here. Assumption: 100 Gbps, p5's primary network card (DescribeInstanceTypes' per-card figure,
    # not read here either); no figure at the sizes docs/capacity.md tabulates depends on it.
    ena_gbs: float = 12.5

    @property
    def tcp_send_gbs(self) -> float:
        """A node's peer-state send: one gloo flow per local rank, capped by the ENA interface."""
        return min(self.gpus * TCP_FLOW_GBPS / 8, self.ena_gbs) * GLOO_TCP_EFFICIENCY


# The node the Job renders by default (p5.48xlarge in infra.instances, with JobConfig.shm_fraction's /dev/shm of a
# quarter of the pod's 1800 GiB); a test checks the chart builds the same.
P5_48XLARGE = NodeSpec("p5.48xlarge", gpus=8, gpu_peak_tflops=989.0, efa_gbs=400.0, shm_bytes=450 * GIB)


@dataclass(frozen=True)
class FsxSpec:
    storage_gib: int
    throughput_per_tib: int  # PERSISTENT_2: 125, 250, 500 or 1000 MBps/TiB

    def __post_init__(self) -> None:
        if self.throughput_per_tib not in FSX_NETWORK_MBPS_PER_TIB:
            raise ValueError(f"throughput_per_tib={self.throughput_per_tib} is not allowed: one of "
                             f"{sorted(FSX_NETWORK_MBPS_PER_TIB)} (PERSISTENT_2)")
        if not (self.storage_gib == 1200 or (self.storage_gib > 0 and self.storage_gib % FSX_STORAGE_STEP_GIB == 0)):
            raise ValueError(f"storage_gib={self.storage_gib} is not allowed: 1200 or a multiple of "
                             f"{FSX_STORAGE_STEP_GIB} (PERSISTENT_2)")

    @property
    def capacity_bytes(self) -> int:
        return self.storage_gib * GIB

    @property
    def throughput_gbs(self) -> float:
        """Sustained write (and uncached read) throughput of the whole file system, GB/s."""
        tib = self.storage_gib * GIB / TIB
        per_tib = min(self.throughput_per_tib, FSX_NETWORK_MBPS_PER_TIB[self.throughput_per_tib])
        return tib * per_tib * MB / GB

    @property
    def usd_per_month(self) -> float:
        return self.storage_gib * FSX_USD_PER_GB_MONTH[self.throughput_per_tib]

    def describe(self) -> str:
        return f"{self.storage_gib} GiB x {self.throughput_per_tib} MBps/TiB = {self.throughput_gbs:.2f} GB/s"


@dataclass(frozen=True)
class Schedule:
    """The training config's promises (checkpoint, drain, peer state) and what a step holds."""

    interval: int  # steps between checkpoints
    keep: int
    mode: str  # sync | async | off
    drain_timeout_s: float
    peer_state: bool
    peer_replicas: int = 1
    peer_interval: int | None = None  # None: chosen from the copy's cost (peer_state.interval null)
    tokens_per_gpu: int = 8192  # of one optimizer step: its micro-batches x batch_size x seq_len
    replica_groups: int = 1  # parallel.replica_groups; the Capacity is then one group's
    step_timeout_s: float = ParallelConfig().step_timeout_s  # torchft's bound on a heal's transfer

    @classmethod
    def from_config(cls, config: TrainConfig, gpus: int, interval: int | None = None) -> "Schedule":
        """The config's schedule on `gpus` GPUs, a replica group's with parallel.replica_groups >= 2 (a step's
        share of training.global_batch_size depends on them); `interval` in place of its checkpoint.interval."""
        ckpt, peer, t = config.checkpoint, config.peer_state, config.training
        groups = config.parallel.replica_groups
        # with replica groups a rank trains one micro-batch per row of its group's share, the largest share
        # being ceil(rows / groups) rows (training.contract.replica_groups.share_of)
        micro_batches = (t.global_batch(gpus) // gpus // t.batch_size if groups == 1
                         else -(-config.rows_per_step(gpus) // groups))
        return cls(interval or ckpt.interval, ckpt.keep, ckpt.mode, config.fault_tolerance.drain_timeout_s,
                   peer.enabled, peer.replicas, peer.interval, micro_batches * t.batch_size * t.seq_len,
                   groups, config.parallel.step_timeout_s)


@dataclass(frozen=True)
class Capacity:
    """Every figure of one config at one size. Seconds, bytes, steps."""

    model: ModelFootprint
    node: NodeSpec
    nodes: int
    fsx: FsxSpec
    schedule: Schedule
    step_s: float
    delays: KubernetesDelays = EKS

    @property
    def gpus(self) -> int:
        return self.nodes * self.node.gpus

    @property
    def state_bytes(self) -> int:
        return self.model.state_bytes

    @property
    def node_bytes(self) -> float:
        return self.state_bytes / self.nodes

    @property
    def gpu_bytes(self) -> float:
        return self.state_bytes / self.gpus

    # FSx
    @property
    def fsx_gbs(self) -> float:
        """What the job can write to (or read from) FSx: the file system's or all clients', the lower."""
        return min(self.fsx.throughput_gbs, self.nodes * self.node.ena_gbs)

    @property
    def save_s(self) -> float:
        return self.state_bytes / (self.fsx_gbs * GB)

    @property
    def staging_s(self) -> float:
        """What an async save blocks the step for: each GPU's copy of its shard to host memory."""
        return self.gpu_bytes / (HOST_COPY_GBS * GB)

    @property
    def blocking_s(self) -> float:
        return self.save_s if self.schedule.mode == "sync" else self.staging_s

    @property
    def interval_s(self) -> float:
        return self.schedule.interval * self.step_s

    @property
    def min_interval_steps(self) -> int:
        """The fewest steps between saves for an async save to commit before the next is due (shortest_interval_s)."""
        return max(1, math.ceil(shortest_interval_s(self.save_s) / self.step_s))

    @property
    def save_fits_interval(self) -> bool:
        return self.schedule.mode != "async" or shortest_interval_s(self.save_s) <= self.interval_s

    @property
    def commit_lag_s(self) -> float:
        return commit_lag_s(self.schedule.mode, self.save_s)

    @property
    def restore_fsx_s(self) -> float:
        return self.save_s

    @property
    def footprint_bytes(self) -> int:
        return (self.schedule.keep + IN_FLIGHT_CHECKPOINTS) * self.state_bytes

    @property
    def footprint_fits(self) -> bool:
        return self.schedule.mode == "off" or self.footprint_bytes <= self.fsx.capacity_bytes

    # drains
    @property
    def drain_commit_s(self) -> float:
        """The worst case of committing the in-flight save: it had just started when SIGTERM came."""
        return self.save_s if self.schedule.mode != "off" else 0.0

    @property
    def drain_commits(self) -> bool:
        return self.drain_commit_s <= self.schedule.drain_timeout_s

    @property
    def drain_grace_for_step_s(self) -> float:
        """The grace that also saves the step reached in the worst case: the in-flight save had just started, and
        training.train.drain asks DRAIN_SAVE_MARGIN times the estimated cost (the rest of it, then a save of the
        step reached)."""
        return DRAIN_SAVE_MARGIN * (self.drain_commit_s + self.save_s)

    # peer state
    @property
    def peer_copy_s(self) -> float:
        return self.gpu_bytes / (HOST_COPY_GBS * GB)

    @property
    def peer_checksum_s(self) -> float:
        """CRC-32 of one rank's copy, on its own core: before each send and before a restore loads it."""
        return self.gpu_bytes / (CRC32_GBS * GB)

    @property
    def peer_send_s(self) -> float:
        """The replication thread's part of a save: the copy's checksum, then the node's send over TCP."""
        return self.peer_checksum_s + self.schedule.peer_replicas * self.node_bytes / (self.node.tcp_send_gbs * GB)

    @property
    def _peer_schedule(self) -> PeerSchedule:
        configured = self.schedule.peer_interval
        if configured:
            return PeerSchedule.fixed(configured)
        return PeerSchedule.measured(self.peer_copy_s / self.step_s, self.peer_send_s / self.step_s)

    @property
    def peer_deadline_steps(self) -> int:
        """Steps a copy has to reach its partners before training waits for it (PeerSchedule)."""
        return self._peer_schedule.deadline

    @property
    def peer_interval_steps(self) -> int:
        """Steps between peer copies (PeerSchedule)."""
        return self._peer_schedule.every

    @property
    def peer_shm_bytes(self) -> int:
        return node_memory_bytes(self.model.parameters, self.nodes, self.schedule.peer_replicas)

    @property
    def staging_shm_bytes(self) -> int:
        """/dev/shm that async saves' staging buffers take on each node: a copy of the node's share of the state,
        held for the run (training.train.checkpoint.staging; on CUDA only where NVRx's async writer is missing,
        counted all the same: the image decides which writer runs, not the chart)."""
        return math.ceil(self.node_bytes) if self.schedule.mode == "async" else 0

    @property
    def peer_fits_shm(self) -> bool:
        return self.peer_shm_bytes <= self.node.shm_bytes * (1 - SHM_RESERVE)

    @property
    def restore_peer_s(self) -> float:
        """The lost node's replacement receives its node's shards from a partner over TCP, and each rank checks
        its copy's checksum before loading it."""
        return self.node_bytes / (self.node.tcp_send_gbs * GB) + self.peer_checksum_s

    # steps lost, worst case
    @property
    def fsx_steps_lost(self) -> int:
        """A restart from FSx: the interval and the commit lag's steps (a failure before the newest save commits
        rolls back to the one before)."""
        return self.schedule.interval + math.ceil(self.commit_lag_s / self.step_s)

    @property
    def peer_steps_lost(self) -> int:
        """A lost node resumed from peers: at most the interval peer state keeps (a send slower than its
        deadline makes training wait, not lose more)."""
        return self._peer_schedule.interval

    @property
    def drain_steps_lost(self) -> int:
        if self.drain_grace_for_step_s <= self.schedule.drain_timeout_s:
            return 0
        return self.fsx_steps_lost if self.drain_commits else self.fsx_steps_lost + self.schedule.interval

    @property
    def recovery_fsx_s(self) -> float:
        """A lost node, a hot spare: survivors detect it, every node restarts and loads from FSx."""
        return self.delays.lost_peer_detection_s + self.delays.gpu_restart_s + self.restore_fsx_s

    @property
    def recovery_peer_s(self) -> float:
        return self.delays.lost_peer_detection_s + self.delays.gpu_restart_s + self.restore_peer_s

    @property
    def heal_s(self) -> float:
        """A restarted replica group's heal: each of its nodes receives its share of the group's state (the
        model and optimizer, as a checkpoint holds them) from the same node of a live group, every rank from its
        counterpart, over torchft's HTTP transport on the pods' TCP network (the VPC CNI's ENA interface, not
        EFA). Network-bound: the torch.save and torch.load at either end are not counted."""
        return self.node_bytes / (self.node.tcp_send_gbs * GB)

    @property
    def heal_fits(self) -> bool:
        return self.schedule.replica_groups < 2 or HEAL_HEADROOM * self.heal_s <= self.schedule.step_timeout_s

    def problems(self) -> list[str]:
        """What the config promises and cannot keep at this size, each with its numbers and its knobs."""
        out = []
        if not self.heal_fits:
            out.append(
                f"a restarted replica group heals {self.node_bytes / GB:.1f} GB per node from a live group over the "
                f"pods' TCP network at {self.node.tcp_send_gbs:.1f} GB/s: {self.heal_s:.1f} s, and with "
                f"{HEAL_HEADROOM:g}x headroom {HEAL_HEADROOM * self.heal_s:.1f} s, longer than "
                f"parallel.step_timeout_s={self.schedule.step_timeout_s:g}, which bounds it: the group would never "
                f"rejoin. Raise parallel.step_timeout_s to at least {math.ceil(HEAL_HEADROOM * self.heal_s)}, or give "
                f"each group more nodes (fewer parallel.replica_groups)")
        if not self.save_fits_interval:
            out.append(
                f"an async save of {self.state_bytes / GB:.1f} GB to FSx ({self.fsx.describe()}) takes "
                f"{self.save_s:.0f} s, and with {ASYNC_SAVE_HEADROOM:g}x headroom for a slower save needs "
                f"{shortest_interval_s(self.save_s):.0f} s, longer than checkpoint.interval={self.schedule.interval} "
                f"steps (~{self.interval_s:.0f} s at a projected {self.step_s:.2f} s per step): saves would not keep "
                f"up. Raise checkpoint.interval to at least {self.min_interval_steps}, or FSx throughput "
                f"(fsxThroughputPerTib, fsxStorageGib) to "
                f"{ASYNC_SAVE_HEADROOM * self.state_bytes / self.interval_s / GB:.2f} GB/s")
        if not self.drain_commits:
            out.append(
                f"a drain cannot commit within its grace: the in-flight save of {self.state_bytes / GB:.1f} GB takes "
                f"up to {self.drain_commit_s:.0f} s to FSx ({self.fsx.describe()}), more than "
                f"fault_tolerance.drain_timeout_s={self.schedule.drain_timeout_s:g}. Raise drain_timeout_s to at "
                f"least {math.ceil(self.drain_commit_s)} ({math.ceil(self.drain_grace_for_step_s)} to also save the "
                f"step reached), or FSx throughput (fsxThroughputPerTib, fsxStorageGib)")
        if not self.footprint_fits:
            out.append(
                f"checkpoint.keep={self.schedule.keep} checkpoints and one in flight take "
                f"{self.footprint_bytes / GIB:.0f} GiB, more than FSx's {self.fsx.storage_gib} GiB: lower "
                f"checkpoint.keep or raise fsxStorageGib to {smallest_storage_gib(self.footprint_bytes)}")
        return out


@dataclass(frozen=True)
class PeerSchedule:
    """Peer state's copies (training.train.peer_state, which the capacity model projects with the same rule):
    a copy every `every` steps, each acknowledged by the partners within `deadline` steps (training waits for it
    there), so a lost node costs at most `interval` steps."""
    every: int
    deadline: int
    interval: int

    @classmethod
    def fixed(cls, interval: int) -> PeerSchedule:
        """A configured interval: a copy about every half of it, each with the other half to reach the partners."""
        return cls(interval // 2 + 1, (interval + 1) // 2, interval)

    @classmethod
    def measured(cls, copy_ratio: float, send_steps: float) -> PeerSchedule:
        """From a copy's share of a step and a send's length in steps: the send with PEER_SEND_HEADROOM (at least
        a step) is its deadline; a copy every max(deadline, the steps that keep the copy within PEER_COPY_BUDGET
        of a step) steps; the promise is their sum minus one (1 when both fit in a step)."""
        deadline = max(1, math.ceil(send_steps * PEER_SEND_HEADROOM))
        every = max(deadline, math.ceil(copy_ratio / PEER_COPY_BUDGET))
        return cls(every, deadline, every + deadline - 1)


def gradient_reduce(setting: str, parameters: int, device_memory_bytes: float) -> str:
    """training.gradient_reduce resolved: `setting` unless auto; auto reduces once per step while the unsharded
    gradients fit UNSHARDED_GRADIENT_SHARE of the device's memory, else after every micro-batch."""
    if setting != "auto":
        return setting
    held = UNSHARDED_GRADIENT_BYTES * parameters
    return "step" if held <= UNSHARDED_GRADIENT_SHARE * device_memory_bytes else "micro_batch"


def project_step_s(model: ModelFootprint, node: NodeSpec, tokens_per_gpu: int, mfu: float = ASSUMED_MFU) -> float:
    """A step's time on `node`'s GPUs at `mfu`: each GPU does its tokens' FLOPs (weak scaling, FSDP)."""
    return tokens_per_gpu * model.flops_per_token / (node.gpu_peak_tflops * 1e12 * mfu)


def smallest_storage_gib(needed_bytes: float) -> int:
    """The smallest PERSISTENT_2 storage capacity holding `needed_bytes`."""
    if needed_bytes <= 1200 * GIB:
        return 1200
    return FSX_STORAGE_STEP_GIB * math.ceil(needed_bytes / (FSX_STORAGE_STEP_GIB * GIB))


@dataclass(frozen=True)
class HsdpCase:
    """HSDP with `replicas` replica groups, each a full FSDP shard of the model on nodes / replicas nodes, beside
    today's FSDP over every node. A lost node's shards stream from the same node of another replica group over
    EFA, into a hot spare; the other replica groups keep training, so no survivor restarts and no completed step
    is lost. That is torchft's design (https://github.com/pytorch/torchft) and HyperPod's checkpointless training
    (https://docs.aws.amazon.com/sagemaker/latest/dg/sagemaker-eks-checkpointless-in-process-recovery.html)."""

    capacity: Capacity
    replicas: int = HSDP_REPLICAS

    @property
    def fsdp_gpu_bytes(self) -> float:
        return TRAINING_BYTES_PER_PARAMETER * self.capacity.model.parameters / self.capacity.gpus

    @property
    def hsdp_gpu_bytes(self) -> float:
        return self.fsdp_gpu_bytes * self.replicas

    @property
    def gpu_efa_gbs(self) -> float:
        node = self.capacity.node
        return node.efa_gbs / node.gpus * NCCL_EFA_EFFICIENCY

    @property
    def step_cost_s(self) -> float:
        """The gradient all-reduce across replica groups, each GPU its fp32 gradient shard (ring: 2(R-1)/R of it
        sent), not overlapped with the backward: an upper bound."""
        shard = 4 * self.capacity.model.parameters * self.replicas / self.capacity.gpus
        return 2 * (self.replicas - 1) / self.replicas * shard / (self.gpu_efa_gbs * GB)

    @property
    def stream_s(self) -> float:
        """The replacement node's whole training state (its replica group's shard, R times today's) over EFA."""
        node_state = TRAINING_BYTES_PER_PARAMETER * self.capacity.model.parameters * self.replicas / self.capacity.nodes
        return node_state / (self.capacity.node.efa_gbs * NCCL_EFA_EFFICIENCY * GB)

    @property
    def recovery_s(self) -> float:
        d = self.capacity.delays
        return d.lost_peer_detection_s + d.gpu_restart_s + self.stream_s

    @property
    def lost_gpu_s(self) -> float:
        """GPU-seconds lost per node failure: only the failed replica group waits."""
        return self.recovery_s * self.capacity.gpus / self.replicas

    def today_lost_gpu_s(self, recovery_s: float, steps_lost: int) -> float:
        return (recovery_s + steps_lost * self.capacity.step_s) * self.capacity.gpus


def capacity_of(model: ModelFootprint, node: NodeSpec, nodes: int, fsx: FsxSpec, schedule: Schedule,
                step_s: float | None = None) -> Capacity:
    step = step_s if step_s is not None else project_step_s(model, node, schedule.tokens_per_gpu)
    return Capacity(model, node, nodes, fsx, schedule, step)


def format_capacity(c: Capacity) -> str:
    """The table `python -m training.plan --config` prints."""
    s = c.schedule
    rows = [
        ("model", f"{c.model.name}: {c.model.parameters / 1e9:.2f} B parameters, state "
                  f"{c.state_bytes / GB:.1f} GB ({c.model.state_bytes_per_parameter} B/parameter)"),
        ("world", f"{c.nodes} x {c.node.name} = {c.gpus} GPUs; {c.node_bytes / GB:.1f} GB per node, "
                  f"{c.gpu_bytes / GB:.2f} GB per GPU"),
        ("step", f"{c.step_s:.2f} s (projected: {s.tokens_per_gpu} tokens per GPU at {ASSUMED_MFU:.0%} MFU)"),
        ("FSx", f"{c.fsx.describe()}, {c.fsx_gbs:.2f} GB/s usable; ${c.fsx.usd_per_month:,.0f}/month "
                f"(us-east-1 list price)"),
        ("save to FSx", f"{c.save_s:.0f} s; blocks the step {c.blocking_s:.2f} s ({s.mode})"),
        ("interval", f"{s.interval} steps = {c.interval_s:.0f} s; an async save needs at least "
                     f"{c.min_interval_steps} steps ({ASYNC_SAVE_HEADROOM:g}x its duration): "
                     f"{'fits' if c.save_fits_interval else 'DOES NOT FIT'}"),
        ("drain", f"commit of the in-flight save up to {c.drain_commit_s:.0f} s against "
                  f"drain_timeout_s={s.drain_timeout_s:g}: {'commits' if c.drain_commits else 'CANNOT COMMIT'}; "
                  f"{c.drain_grace_for_step_s:.0f} s also saves the step reached"),
        ("keep", f"{s.keep} + {IN_FLIGHT_CHECKPOINTS} in flight = {c.footprint_bytes / GIB:.0f} GiB of "
                 f"{c.fsx.storage_gib} GiB: {'fits' if c.footprint_fits else 'DOES NOT FIT'}"),
        ("peer state", (f"copy {c.peer_copy_s:.2f} s, send {c.peer_send_s:.1f} s (CRC-32 {c.peer_checksum_s:.1f} s, "
                        f"then TCP at {c.node.tcp_send_gbs:.1f} GB/s per node): every {c.peer_interval_steps} steps; "
                        f"/dev/shm {c.peer_shm_bytes / GIB:.0f} of {c.node.shm_bytes / GIB:.0f} GiB"
                        f"{'' if c.peer_fits_shm else ': DOES NOT FIT'}")
         if s.peer_state else "off"),
        ("restore", f"from FSx {c.restore_fsx_s:.0f} s; from peers {c.restore_peer_s:.1f} s"),
        ("steps lost", f"restart from FSx <= {c.fsx_steps_lost}; node loss from peers <= "
                       f"{c.peer_steps_lost if s.peer_state else '-'}; drain {c.drain_steps_lost}"),
    ]
    if s.replica_groups >= 2:
        rows.append(("heal", f"{c.node_bytes / GB:.1f} GB per node from a live group over the pods' TCP network at "
                             f"{c.node.tcp_send_gbs:.1f} GB/s: {c.heal_s:.1f} s; parallel.step_timeout_s="
                             f"{s.step_timeout_s:g} with {HEAL_HEADROOM:g}x headroom: "
                             f"{'fits' if c.heal_fits else 'DOES NOT FIT'}"))
    width = max(len(k) for k, _ in rows)
    lines = ["Capacity (projected; constants and their sources: training.contract.capacity):"]
    lines += [f"  {k:<{width}}  {v}" for k, v in rows]
    problems = c.problems()
    lines += [f"  REFUSED: {p}" for p in problems] or ["  every promise holds at this size"]
    return "\n".join(lines)
