"""How big each part of a bench run is: `FULL` for `make bench`, `QUICK` for `--quick`, `GPU` for bench/gpu.sh."""
from __future__ import annotations

from dataclasses import dataclass

MiB = 1 << 20


@dataclass(frozen=True)
class Profile:
    name: str
    device: str  # training.device of every run
    # Checkpoint stall: the same state saved sync and async. With stall_preset None, a synthetic
    # sharded state of state_bytes between synthetic compute steps; else a real training run of
    # that model preset on the local cluster (one node, stall_world ranks).
    state_bytes: int  # over all ranks (synthetic state only)
    stall_preset: str | None
    stall_world: int
    stall_interval: int | None  # steps between saves; None: calibrated (bench.stall)
    stall_saves: int  # saves per checkpoint mode (CPU: rounds of the interleaved modes)
    matmuls_per_step: int  # the synthetic step: this many 512x512 matmuls, then an all-reduce
    # Synthetic state only: where stall_world ranks keep every CPU busy, the stall again with one CPU
    # left to the background writer, as a GPU host's idle cores are (bench.stall.spare_cpu_world).
    stall_spare_cpu: bool
    # Recovery: one local-cluster run per mechanism with `faults` deterministic faults.
    mechanisms: tuple[str, ...]
    preset: str
    nodes: int
    nproc_per_node: int
    faults: int
    first_fault: int  # step of the first fault
    fault_spacing: int  # steps between faults
    # Steps between faults where a hot spare takes over: the lost node's replacement, started
    # bench.mechanisms.REPLACEMENT_DELAY_S after the loss, must be on standby before the next fault.
    spare_fault_spacing: int
    # Steps between faults of a replica group, and after its last: the other groups train on while it
    # restarts, and it heals to their step, which must come before its next fault and before their end.
    group_fault_spacing: int
    tail_steps: int  # steps after the last fault: room for a drain, which lands steps after it is asked for
    checkpoint_interval: int
    floor_repeats: int
    # In-memory rollback: a synthetic shard of this size saved by training.train.rollback, for the host copy
    # bandwidth (its cost per step comes from the in-process fault run). CPU: a rank's share of the stall's
    # state; GPU: enough for a steady device-to-host figure.
    rollback_copy_bytes: int
    # Peer state's copy, send and restore at each of these presets' state (bench.peer_sizes): growth measured.
    peer_presets: tuple[str, ...]

    @property
    def world(self) -> int:
        return self.nodes * self.nproc_per_node

    def fault_steps(self, spacing: int) -> list[int]:
        """The steps the faults strike at, `spacing` steps apart."""
        return [self.first_fault + i * spacing for i in range(self.faults)]


ALL = ("inprocess", "injob", "injob_hf", "injob_fresh", "node_replacement", "node_zero", "hot_spare", "peer_state", "drain",
       "partition", "node_hang", "k8s_restart", "hang", "node_zero_both", "partition_both", "hang_both",
       "replica_groups")
# Six saves per mode: on 2 busy cores one async save in three or four can block 4-7x longer than
# the rest (its staging copy starved of CPU), which moved the median of four from 0.07x to 0.17x.
# 15 steps after the last fault: a drain landed 1-7 steps after it was asked for here (the controller
# polls every 0.2 s; a step takes 20-70 ms), and it must land before the run's last step.
# With a hot spare, 100 steps between faults (10-20 s at 0.1-0.2 s a step with its saves): the replacement,
# started 10 s after the loss (bench.mechanisms.REPLACEMENT_DELAY_S) and up in 1-4 s, is on standby again.
# With replica groups, 250: a group restarts in 10-12 s here while the other trains about 110 steps.
FULL = Profile("full", "cpu", state_bytes=1024 * MiB, stall_preset=None, stall_world=2, stall_interval=None,
               stall_saves=6, matmuls_per_step=10, stall_spare_cpu=True,
               mechanisms=ALL, preset="tiny", nodes=2, nproc_per_node=2,
               faults=5, first_fault=15, fault_spacing=40, spare_fault_spacing=100, group_fault_spacing=250,
               tail_steps=15,
               checkpoint_interval=10, floor_repeats=3,
               rollback_copy_bytes=512 * MiB, peer_presets=("tiny", "small"))
# Two faults per mechanism, a quarter of the state (still 256 MiB), one rank per node: about 3 minutes
# on 2 cores (each fault costs a restart of 7-20 s here). No spare-CPU stall pass: 128 MiB on one rank
# saves in about 0.1 s, so the calibrated interval falls to its minimum and the figures say nothing.
QUICK = Profile("quick", "cpu", state_bytes=256 * MiB, stall_preset=None, stall_world=2, stall_interval=None,
                stall_saves=3, matmuls_per_step=10, stall_spare_cpu=False,
                mechanisms=ALL, preset="tiny", nodes=2, nproc_per_node=1,
                faults=2, first_fault=15, fault_spacing=40, spare_fault_spacing=250, group_fault_spacing=250,
                tail_steps=15,
                checkpoint_interval=10, floor_repeats=1,
                rollback_copy_bytes=128 * MiB, peer_presets=("tiny", "small"))
# One GPU: the 1b preset (about 15 GB of model and optimizer state) in one NCCL process (NCCL
# refuses two ranks on one device), NVRx async checkpoints, in-process vs in-job recovery (node
# loss and full restarts need several nodes). Few saves: each writes about 15 GB; the first fault
# comes well after the first save, so that in-job restarts load a committed checkpoint.
GPU = Profile("gpu", "cuda", state_bytes=0, stall_preset="1b", stall_world=1, stall_interval=5, stall_saves=1,
              matmuls_per_step=0, stall_spare_cpu=False,
              mechanisms=("inprocess", "injob"), preset="1b", nodes=1, nproc_per_node=1,
              faults=3, first_fault=25, fault_spacing=10, spare_fault_spacing=10, group_fault_spacing=10,
              tail_steps=4,
              checkpoint_interval=20, floor_repeats=1,
              rollback_copy_bytes=4096 * MiB, peer_presets=())
