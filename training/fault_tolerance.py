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
from typing import Any, Iterator

from training.config import FaultToleranceConfig

log = logging.getLogger(__name__)

SECTIONS = ("setup", "step", "checkpoint")
# Both NVRx 0.4.1 and 0.7.0 put the rank monitor's socket path in this variable.
_MONITOR_SOCKET_ENV = "FT_RANK_MONITOR_IPC_SOCKET"


def section_timeouts(ft: FaultToleranceConfig) -> dict[str, float]:
    """The configured timeout of each NVRx section, by section name."""
    return {name: getattr(ft, f"{name}_section_timeout") for name in SECTIONS}


def launcher_ft_args(ft: FaultToleranceConfig) -> list[str]:
    """ft_launcher flags for this config; spellings accepted by NVRx 0.4.1 and 0.7.0 (the local
    runner and the Kubernetes Job build their command lines from this one list)."""
    sections = ",".join(f"{name}:{timeout}" for name, timeout in section_timeouts(ft).items())
    return [
        f"--max-restarts={ft.launcher_max_restarts}",
        "--ft-restart-policy=any-failed",  # 0.7.0 dropped min-healthy
        f"--ft-initial-rank-heartbeat-timeout={ft.initial_rank_heartbeat_timeout}",
        f"--ft-rank-heartbeat-timeout={ft.rank_heartbeat_timeout}",
        f"--ft-rank-section-timeouts={sections}",
        f"--ft-rank-out-of-section-timeout={ft.out_of_section_timeout}",
        f"--ft-safety-factor={ft.timeout_safety_factor}",
    ]


def launcher_wrapper(ft: FaultToleranceConfig, python: str) -> list[str]:
    """What ft_launcher's command line starts with: with prefork_workers, `python -m
    training.prefork launch`, which starts the node's worker template and then execs ft_launcher."""
    return [python, "-m", "training.prefork", "launch"] if ft.prefork_workers else []


def worker_entrypoint(ft: FaultToleranceConfig) -> list[str]:
    """ft_launcher's entrypoint (before the training arguments): training.train, forked from the
    worker template by training.prefork's stub when prefork_workers is on."""
    return ["-m", "training.prefork", "worker", "training.train"] if ft.prefork_workers else ["-m", "training.train"]


class RankMonitor:
    """Adapter over nvidia_resiliency_ext.fault_tolerance.RankMonitorClient."""

    def __init__(self, cfg: FaultToleranceConfig) -> None:
        self._cfg = cfg
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
            timeouts = self._client.section_timeouts
            log.info("NVRx section timeouts calculated: %s", getattr(timeouts, "section", timeouts))

    def state_dict(self) -> str:
        """JSON text: identical on every rank, stored in the checkpoint as one value."""
        return json.dumps(self._client.state_dict() if self._client is not None else {})

    def load_state_dict(self, text: str) -> None:
        state = json.loads(text)
        if self._client is not None and state:
            self._client.load_state_dict(state)

    def shutdown(self) -> None:
        if self._client is not None:
            self._client.shutdown_workload_monitoring()
            self._client = None
