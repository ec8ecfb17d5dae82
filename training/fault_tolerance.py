"""NVRx fault tolerance: the rank side (RankMonitorClient sections) and the launcher side (the
ft_launcher flags derived from the training config). Version differences live here only.

Sections: `setup` (process start to the first step), `step` (one training step), `checkpoint`
(the blocking part of a save). After `calculate_timeouts_after` steps of an attempt, the step and
checkpoint section timeouts are recomputed from observed timings (max × safety factor) and sent to
the rank monitor; they are saved in checkpoints, so a restarted job gets tight hang detection
from its first step. A heartbeat is sent after every step, so the launcher's heartbeat timeouts
(from the config, generous) hold as a backstop.

Without ft_launcher (no rank monitor socket in the environment) every call is a no-op, announced
once with a log line.
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
from pathlib import Path
from typing import Any, Iterator

from training.config import FaultToleranceConfig
from training.exit_codes import NO_PROGRESS

log = logging.getLogger(__name__)

SECTIONS = ("setup", "step", "checkpoint")
_MONITOR_SOCKET_ENV = "FT_RANK_MONITOR_IPC_SOCKET"  # where NVRx puts the rank monitor's socket path


# Where training keeps the step a restart resumes at (newest committed checkpoint + 1; 1 before the
# first), in the checkpoint directory: NVRx's progress tracker reads it after each in-job restart cycle
# (--ft-checkpoint-iteration-file). Counting from 1 makes a fresh run's first cycle count as progress,
# so a fault before the first checkpoint still spends the budget (NVRx skips its check while it is 0).
RESUME_STEP_FILE = "resume_step"
# The path of a node's drain marker (training/drain.py): present when SIGTERM means a drain.
DRAIN_MARKER_ENV = "TRAINING_DRAIN_MARKER"
# After its --term-timeout (drain_timeout_s) ft_launcher needs a moment to SIGKILL its ranks and exit
# before the kubelet's (or the local controller's) SIGKILL: the grace period is the sum.
LAUNCHER_EXIT_MARGIN_S = 30


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
        f"--term-timeout={ft.drain_timeout_s}",  # after SIGTERM, the ranks' time to commit (training/drain.py)
        f"--ft-initial-rank-heartbeat-timeout={ft.initial_rank_heartbeat_timeout}",
        f"--ft-rank-heartbeat-timeout={ft.rank_heartbeat_timeout}",
        f"--ft-rank-section-timeouts={sections}",
        f"--ft-rank-out-of-section-timeout={ft.out_of_section_timeout}",
        f"--ft-safety-factor={ft.timeout_safety_factor}",
    ]


def rendezvous_args(ft: FaultToleranceConfig, endpoint: str, run_id: str, nodes: int, spares: int) -> list[str]:
    """The rendezvous flags of the store (nvrx-control) and of every node's ft_launcher: `nodes`
    training nodes and up to `spares` hot spares. NVRx 0.7.0's barrier rendezvous keeps the world at
    `nodes`; the others wait as standby and take a failed node's place in the next round."""
    return [f"--nnodes={nodes}:{nodes + spares}", "--rdzv-backend=c10d", f"--rdzv-endpoint={endpoint}",
            f"--rdzv-id={run_id}", "--rdzv-conf=" + ",".join((
                f"join_timeout={ft.rendezvous_join_timeout_s:g}", "is_host=false",
                # a launcher may start before the store (its pod still pulling the image on a
                # system node): probe for it this long instead of failing after one connect timeout
                f"store_connect_wait_seconds={ft.rendezvous_join_timeout_s:.0f}"))]


def store_command(ft: FaultToleranceConfig, port: int, run_id: str, nodes: int, spares: int,
                  bin_dir: str = "") -> list[str]:
    """The rendezvous store, off the training nodes: NVRx 0.7.0's `nvrx-control` owns the TCPStore and
    closes every round, so every node's ft_launcher is a client (is_host=false) and losing any node,
    index 0 too, costs the same. The store listens on `port` of every interface of its host (its own
    client connects over loopback). It exits when the rendezvous shuts down: the run ended, or a
    launcher stopped for good."""
    return [os.path.join(bin_dir, "nvrx-control"), *rendezvous_args(ft, f"127.0.0.1:{port}", run_id, nodes, spares),
            "--ft-enable-log-server=false"]  # the launchers write their own logs


def launcher_wrapper(ft: FaultToleranceConfig, python: str) -> list[str]:
    """What ft_launcher's command line starts with: with prefork_workers, `python -m
    training.prefork launch`, which starts the node's worker template and then execs ft_launcher."""
    return [python, "-m", "training.prefork", "launch"] if ft.prefork_workers else []


def worker_entrypoint(ft: FaultToleranceConfig) -> list[str]:
    """ft_launcher's entrypoint (before the training arguments): training.train, forked from the
    worker template by training.prefork's stub when prefork_workers is on."""
    return ["-m", "training.prefork", "worker", "training.train"] if ft.prefork_workers else ["-m", "training.train"]


# Above the Wrapper's hard timeout: its monitor process still needs to kill the rank and report.
HANG_FLOOR_MARGIN_S = 10.0


def section_timeout_floor(ft: FaultToleranceConfig) -> float:
    """The least a section timeout of the rank monitor may be. With in-process restarts the Wrapper
    must handle a hang first: a calculated (or checkpointed) timeout below its hard timeout would let
    the launcher kill the hung rank and turn an in-place recovery into an in-job restart."""
    return 0.0 if ft.restart == "injob" else ft.inprocess_hard_timeout + HANG_FLOOR_MARGIN_S


class RankMonitor:
    """Adapter over nvidia_resiliency_ext.fault_tolerance.RankMonitorClient."""

    def __init__(self, cfg: FaultToleranceConfig) -> None:
        self._cfg = cfg
        self._floor = section_timeout_floor(cfg)
        self._client: Any = None
        self._steps_seen = 0
        self._calculated = False
        self._observed: set[str] = set()
        if _MONITOR_SOCKET_ENV not in os.environ:
            log.info("not started by ft_launcher (%s unset): NVRx hang detection is off", _MONITOR_SOCKET_ENV)
            return
        from nvidia_resiliency_ext.fault_tolerance import RankMonitorClient

        self._client = RankMonitorClient()
        self._client.init_workload_monitoring()
        self._client.start_section("setup")
        self._observed.add("setup")

    @property
    def active(self) -> bool:
        return self._client is not None

    def end_setup(self) -> None:
        if self._client is not None:
            self._client.end_section("setup")

    @contextlib.contextmanager
    def section(self, name: str) -> Iterator[None]:
        if self._client is None:
            yield
            return
        self._client.start_section(name)
        yield
        self._client.end_section(name)
        self._observed.add(name)

    def step_done(self) -> None:
        """Heartbeat; after the warm-up, one collective timeout calculation (all ranks call this
        at the same steps)."""
        if self._client is None:
            return
        self._client.send_heartbeat()
        self._steps_seen += 1
        if not self._calculated and self._steps_seen >= self._cfg.calculate_timeouts_after:
            selected = [s for s in ("step", "checkpoint") if s in self._observed]
            self._client.calculate_and_set_section_timeouts(selected_sections=selected, calc_out_of_section=False)
            self._calculated = True
            self._clamp()
            log.info("NVRx section timeouts calculated: %s", self._client.section_timeouts.section)

    def _clamp(self) -> None:
        """Raise section timeouts below the floor (`section_timeout_floor`) to it, and say so."""
        state = self._client.state_dict()
        sections = state[self._client.CURRENT_TIMEOUTS_STATE_KEY].get("section", {}).get("section", {})
        low = {name: t for name, t in sections.items() if t is not None and t < self._floor}
        if not low:
            return
        sections.update({name: self._floor for name in low})
        self._client.load_state_dict(state)  # the public way to set timeouts: they apply at once
        log.warning("NVRx section timeouts %s raised to %.0f s: with restart=%s the in-process Wrapper's hard "
                    "timeout (%.0f s, fault_tolerance.inprocess_hard_timeout) must catch a hang first",
                    {n: round(t, 2) for n, t in low.items()}, self._floor, self._cfg.restart,
                    self._cfg.inprocess_hard_timeout)

    def state_dict(self) -> str:
        """JSON text: identical on every rank, stored in the checkpoint as one value."""
        return json.dumps(self._client.state_dict() if self._client is not None else {})

    def load_state_dict(self, text: str) -> None:
        state = json.loads(text)
        if self._client is not None and state:
            self._client.load_state_dict(state)
            self._clamp()  # the checkpoint may come from a run with restart=injob

    def shutdown(self) -> None:
        if self._client is not None:
            self._client.shutdown_workload_monitoring()
            self._client = None
