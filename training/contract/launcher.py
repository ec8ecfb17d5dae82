"""How a node's processes are launched, torch-free: ft_launcher's and the store's arguments derived from the
training config, the environment names the launcher, the pod and the ranks pass to each other, and the
files they share. The Kubernetes Job (k8s/), the local cluster and the pod's processes build their
command lines from here; the rank side of NVRx lives in training.train.monitor.
"""
from __future__ import annotations

import os
import socket
import sys
from pathlib import Path

from training.contract.config import FaultToleranceConfig
from training.contract.exit_codes import NO_PROGRESS

SECTIONS = ("setup", "step", "checkpoint")


# Where training keeps the step a restart resumes at (newest committed checkpoint + 1; 1 before the
# first), in the checkpoint directory: NVRx's progress tracker reads it after each in-job restart cycle
# (--ft-checkpoint-iteration-file). Counting from 1 makes a fresh run's first cycle count as progress,
# so a fault before the first checkpoint still spends the budget (NVRx skips its check while it is 0).
RESUME_STEP_FILE = "resume_step"
# The path of a node's drain marker (training.train.drain): present when SIGTERM means a drain.
DRAIN_MARKER_ENV = "TRAINING_DRAIN_MARKER"
# Seconds each rank's checkpoint write is held back (training.local --save-delay): a checkpoint file system
# as slow as FSx is at the size we ship, on a machine whose disk is fast and whose model is small.
SAVE_DELAY_ENV = "TRAINING_EMULATED_SAVE_DELAY_S"
# After its --term-timeout (drain_timeout_s) ft_launcher needs a moment to SIGKILL its ranks and exit
# before the kubelet's (or the local controller's) SIGKILL: the grace period is the sum.
LAUNCHER_EXIT_MARGIN_S = 30


# ft_launcher's --workers-stop-timeout when none is given (NVRx 0.7.0 fault_tolerance/launcher.py, 15 s): after a
# fault, a survivor's launcher SIGKILLs ranks still alive this long after its SIGTERM. The Job passes none.
WORKERS_STOP_TIMEOUT_S = 15
# After its ranks stopped, a survivor's launcher finds the open round by polling the store once a second (NVRx
# 0.7.0 ft_rendezvous_barrier.py, Step 0), and a launcher still on the round before syncs to it there (its
# stale-round scan): a few polls, with room for a loaded machine.
REJOIN_POLLS_S = 3
# NVRx 0.7.0's last_call_timeout when none is given (ft_rendezvous_barrier.py, RendezvousTimeout)
NVRX_LAST_CALL_S = 1


def rendezvous_last_call_s(ft: FaultToleranceConfig, spares: int, replacement_s: float,
                           workers_stop_timeout_s: int = WORKERS_STOP_TIMEOUT_S) -> int:
    """How long a restart round waits for the previous round's nodes before it takes hot spares in their place
    (fault_tolerance.rendezvous_last_call_s). null: a survivor's worker stop and its rejoin polls where the
    round could reach its size without that survivor, else NVRx's 1 s. After one node's loss the round holds
    the survivors, the spares and a replacement already started: without a survivor it is full only with two
    spares or more, or with one spare and the lost node's replacement (`replacement_s` after the loss) joining
    before the survivor is back. Otherwise the long wait keeps no survivor's place, and every node loss would
    wait it out for the lost node, which NVRx cannot tell from a late survivor (without spares NVRx waits for
    every node anyway)."""
    if ft.rendezvous_last_call_s is not None:
        return ft.rendezvous_last_call_s
    survivor_back_s = workers_stop_timeout_s + REJOIN_POLLS_S
    if spares >= 2 or (spares == 1 and replacement_s < survivor_back_s):
        return survivor_back_s
    return NVRX_LAST_CALL_S


def resume_step_file(checkpoint_dir: str | os.PathLike) -> Path:
    return Path(checkpoint_dir) / RESUME_STEP_FILE


def drain_grace_period_s(ft: FaultToleranceConfig) -> float:
    """SIGTERM to SIGKILL of a drained node's launcher (a pod's terminationGracePeriodSeconds)."""
    return ft.drain_timeout_s + LAUNCHER_EXIT_MARGIN_S


def section_timeouts(ft: FaultToleranceConfig) -> dict[str, float]:
    """The configured timeout of each NVRx section, by section name."""
    return {name: getattr(ft, f"{name}_section_timeout") for name in SECTIONS}


def launcher_ft_args(ft: FaultToleranceConfig, resume_step_file: str) -> list[str]:
    """ft_launcher flags for this config (the local runner and the Kubernetes Job build their command
    lines from this one list). `resume_step_file` (RESUME_STEP_FILE): NVRx's progress tracker reads
    it after every cycle and stops restarting, with exit code NO_PROGRESS, after max_restarts cycles
    in a row in which it did not grow."""
    sections = ",".join(f"{name}:{timeout}" for name, timeout in section_timeouts(ft).items())
    return [
        f"--max-restarts={ft.launcher_max_restarts}",
        f"--ft-max-no-progress-cycles={ft.max_restarts}",
        f"--ft-checkpoint-iteration-file={resume_step_file}",
        f"--ft-no-restart-exit-code={NO_PROGRESS}",
        "--ft-restart-policy=any-failed",
        f"--term-timeout={ft.drain_timeout_s}",  # after SIGTERM, the ranks' time to commit (training.train.drain)
        f"--ft-initial-rank-heartbeat-timeout={ft.initial_rank_heartbeat_timeout}",
        f"--ft-rank-heartbeat-timeout={ft.rank_heartbeat_timeout}",
        f"--ft-rank-section-timeouts={sections}",
        f"--ft-rank-out-of-section-timeout={ft.out_of_section_timeout}",
        f"--ft-safety-factor={ft.timeout_safety_factor}",
        # NVRx 0.7.0 fault_tolerance/config.py: workload_check_interval, 5.0 s unless set; the rank monitor's
        # loop (rank_monitor_server.py) sleeps that long between its checks of sections and heartbeats
        f"--ft-workload-check-interval={ft.rank_check_interval_s}",
    ]


def rendezvous_args(ft: FaultToleranceConfig, endpoint: str, run_id: str, nodes: int, spares: int,
                    replacement_s: float, workers_stop_timeout_s: int = WORKERS_STOP_TIMEOUT_S) -> list[str]:
    """The rendezvous flags of the store (nvrx-control) and of every node's ft_launcher: `nodes`
    training nodes and up to `spares` hot spares. NVRx 0.7.0's barrier rendezvous keeps the world at
    `nodes`; the others wait as standby and take a failed node's place in the next round, once the
    survivors had the last call to rejoin (rendezvous_last_call_s: a lost node's replacement starts
    `replacement_s` after its loss; `workers_stop_timeout_s` is the launchers')."""
    return [f"--nnodes={nodes}:{nodes + spares}", "--rdzv-backend=c10d", f"--rdzv-endpoint={endpoint}",
            f"--rdzv-id={run_id}", "--rdzv-conf=" + ",".join((
                f"join_timeout={ft.rendezvous_join_timeout_s:g}", "is_host=false",
                # the store (is_host) applies it; the launchers parse it as whole seconds
                f"last_call_timeout={rendezvous_last_call_s(ft, spares, replacement_s, workers_stop_timeout_s)}",
                # a launcher may start before the store (its pod still pulling the image on a
                # system node): probe for it this long instead of failing after one connect timeout
                f"store_connect_wait_seconds={ft.rendezvous_join_timeout_s:.0f}"))]


# The rendezvous store's HOST:PORT, which training.pod.launch reads off ft_launcher's command line and hands
# the ranks: with restart=both the in-process Wrapper coordinates there, off the GPU nodes
# (training.train.coordination).
STORE_ENDPOINT_ENV = "TRAINING_STORE_ENDPOINT"
POD_PID_ENV = "TRAINING_POD_PID"  # the pod's PID 1 (training.pod.launch), which a node fault strikes first
_ENDPOINT_FLAGS = ("--rdzv-endpoint", "--rdzv_endpoint")  # ft_launcher takes both spellings, as torchrun does


def rendezvous_endpoint(command: list[str]) -> str | None:
    """The --rdzv-endpoint of a launcher command line (`--rdzv-endpoint=E` or `--rdzv-endpoint E`); None without."""
    for i, arg in enumerate(command):
        flag, equals, value = arg.partition("=")
        if flag in _ENDPOINT_FLAGS:
            return value if equals else (command[i + 1] if i + 1 < len(command) else None)
    return None


def store_command(ft: FaultToleranceConfig, port: int, run_id: str, nodes: int, spares: int, replacement_s: float,
                  bin_dir: str = "", workers_stop_timeout_s: int = WORKERS_STOP_TIMEOUT_S) -> list[str]:
    """The rendezvous store, off the training nodes: NVRx 0.7.0's `nvrx-control` owns the TCPStore and
    closes every round, so every node's ft_launcher is a client (is_host=false) and losing any node,
    index 0 too, costs the same. The store listens on `port` of every interface of its host (its own
    client connects over loopback). It exits when the rendezvous shuts down: the run ended, or a
    launcher stopped for good."""
    return [os.path.join(bin_dir, "nvrx-control"), *rendezvous_args(ft, f"127.0.0.1:{port}", run_id, nodes, spares,
                                                                    replacement_s, workers_stop_timeout_s),
            "--ft-enable-log-server=false"]  # the launchers write their own logs


def launch_command(config_path: str, python: str = sys.executable) -> list[str]:
    """What comes before the launcher's own command line: the pod's PID 1 (training.pod.launch)."""
    return [python, "-m", "training.pod.launch", "--config", config_path, "--"]


def launcher_wrapper(ft: FaultToleranceConfig, python: str) -> list[str]:
    """What ft_launcher's command line starts with: with prefork_workers, `python -m
    training.pod.prefork launch`, which forks the node's worker template and then runs ft_launcher."""
    return [python, "-m", "training.pod.prefork", "launch"] if ft.prefork_workers else []


def worker_entrypoint(ft: FaultToleranceConfig) -> list[str]:
    """ft_launcher's entrypoint (before the training arguments): training.train, forked from the
    worker template by training.pod.prefork's stub when prefork_workers is on."""
    return ["-m", "training.pod.prefork", "worker", "training.train"] if ft.prefork_workers else ["-m", "training.train"]


# Above the Wrapper's hard timeout: its monitor process still needs to kill the rank and report.
HANG_FLOOR_MARGIN_S = 10.0


def section_timeout_floor(ft: FaultToleranceConfig) -> float:
    """The least a section timeout of the rank monitor may be. With in-process restarts the Wrapper
    must handle a hang first: a calculated (or checkpointed) timeout below its hard timeout would let
    the launcher kill the hung rank and turn an in-place recovery into an in-job restart."""
    return 0.0 if ft.restart == "injob" else ft.inprocess_hard_timeout + HANG_FLOOR_MARGIN_S


# The pod's NCCL_DEBUG for its first worker attempt (ft_launcher's TORCHELASTIC_RESTART_COUNT=0): NCCL
# then logs its transport once per node (NET/OFI on EFA, NET/Socket after a silent TCP fallback).
FIRST_ATTEMPT_NCCL_DEBUG_ENV = "NCCL_DEBUG_FIRST_ATTEMPT"
# The node's memory directory for peer state (the pod's /dev/shm on the cluster).
NODE_MEMORY_ENV = "TRAINING_NODE_MEMORY"


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
