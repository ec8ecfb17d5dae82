"""NVRx fault tolerance, the rank side: RankMonitorClient sections and heartbeats. The launcher side (the
ft_launcher flags derived from the training config) is training.contract.launcher.

Why: the launcher's rank monitor can stop a hung rank within seconds only if each section's timeout fits
what the rank really does, so the `step` (and, for sync saves, `checkpoint`) timeouts are recalculated
from observed timings and saved in checkpoints; async saves keep the configured checkpoint timeout, since
that section also holds waits as long as a whole save. Cost: a heartbeat per step; every call is a no-op
without ft_launcher. The sections and rules: docs/training.md, "Section timeouts".
"""
from __future__ import annotations

import contextlib
import copy
import json
import logging
import os
from typing import Any, Iterator

from training.contract.config import CheckpointMode, FaultToleranceConfig
from training.contract.launcher import section_timeout_floor, section_timeouts
from training.train.hang_watch import HangWatch

log = logging.getLogger(__name__)

_MONITOR_SOCKET_ENV = "FT_RANK_MONITOR_IPC_SOCKET"  # where NVRx puts the rank monitor's socket path


class RankMonitor:
    """Adapter over nvidia_resiliency_ext.fault_tolerance.RankMonitorClient."""

    def __init__(self, cfg: FaultToleranceConfig, checkpoint_mode: CheckpointMode,
                 watch: HangWatch | None = None) -> None:
        self._cfg = cfg
        self._watch = watch  # restart=both: the calculated timeouts applied in-process (training.train.hang_watch)
        self._floor = section_timeout_floor(cfg)
        # the sections whose timeouts are learned from observed timings (the module's docstring: why not async's)
        self._mode = checkpoint_mode
        self._learned_sections = ("step", "checkpoint") if checkpoint_mode == "sync" else ("step",)
        self._client: Any = None
        # NVRx's state as learned or loaded, before the floor: what checkpoints hold and what the next
        # calculation merges with, so a run under restart=both learns the timeouts a run under injob would
        self._learned: dict[str, Any] | None = None
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
        if self._watch is not None:
            self._watch.opened(name)
        yield
        if self._watch is not None:
            self._watch.closed()
        self._client.end_section(name)
        self._observed.add(name)

    @contextlib.contextmanager
    def outside(self, name: str) -> Iterator[None]:
        """Section `name`, open around this, closed within it: for a wait that another component's timeout
        ends (torchft's, for the other replica groups), which a timeout learned from this rank's own work must
        not judge. The out-of-section timeout still applies."""
        if self._client is None:
            yield
            return
        self._client.end_section(name)
        if self._watch is not None:
            self._watch.closed()
        try:
            yield
        finally:
            self._client.start_section(name)
            if self._watch is not None:
                self._watch.opened(name)

    def step_done(self) -> None:
        """Heartbeat; after the warm-up, one collective timeout calculation (all ranks call this
        at the same steps)."""
        if self._client is None:
            return
        self._client.send_heartbeat()
        self._steps_seen += 1
        if not self._calculated and self._steps_seen >= self._cfg.calculate_timeouts_after:
            if self._learned is not None:  # NVRx merges the new timings with the current timeouts, not the floor
                self._client.load_state_dict(self._learned)  # (0.7.0 TimeoutsCalc._get_merged_section_timeouts)
            selected = [s for s in self._learned_sections if s in self._observed]
            self._client.calculate_and_set_section_timeouts(selected_sections=selected, calc_out_of_section=False)
            self._calculated = True
            self._apply_rules()
            log.info("NVRx section timeouts calculated: %s", self._client.section_timeouts.section)

    def _apply_rules(self) -> None:
        """Put back the configured timeout of a section this run does not learn, keep the result as learned
        (and hand it to the hang watch: the Wrapper applies what injob's launcher would), then raise section
        timeouts below the floor (`section_timeout_floor`) to it, and say so."""
        state = self._client.state_dict()
        timeouts = state[self._client.CURRENT_TIMEOUTS_STATE_KEY].get("section", {})
        sections = timeouts.get("section", {})
        # NVRx 0.7.0 SectionTimeouts (fault_tolerance/data.py): `section` by name, `calculated_sections` the
        # learned ones; RankMonitorClient.state_dict/load_state_dict carry both
        calculated = timeouts.get("calculated_sections", ())
        unlearned = {name: t for name, t in sections.items()
                     if name in calculated and name not in self._learned_sections}
        for name in unlearned:
            sections[name] = section_timeouts(self._cfg)[name]
            calculated.remove(name)
        self._learned = copy.deepcopy(state)
        if self._watch is not None:
            self._watch.learned({name: sections.get(name) for name in calculated})
        low = {name: t for name, t in sections.items() if t is not None and t < self._floor}
        sections.update({name: self._floor for name in low})
        if not (unlearned or low):
            return
        self._client.load_state_dict(state)  # the public way to set timeouts: they apply at once
        if unlearned:
            log.warning("NVRx section timeouts %s learned earlier put back to their configured values: with "
                        "checkpoint.mode=%s only %s are learned", {n: round(t, 2) for n, t in unlearned.items()},
                        self._mode, "/".join(self._learned_sections))
        if not low:
            return
        log.warning("NVRx section timeouts %s raised to %.0f s: with restart=%s the in-process Wrapper's hard "
                    "timeout (%.0f s, fault_tolerance.inprocess_hard_timeout) must catch a hang first",
                    {n: round(t, 2) for n, t in low.items()}, self._floor, self._cfg.restart,
                    self._cfg.inprocess_hard_timeout)

    def state_dict(self) -> str:
        """JSON text: identical on every rank, stored in the checkpoint as one value."""
        if self._client is None:
            return json.dumps({})
        return json.dumps(self._learned if self._learned is not None else self._client.state_dict())

    def load_state_dict(self, text: str) -> None:
        state = json.loads(text)
        if self._client is not None and state:
            self._client.load_state_dict(state)
            self._apply_rules()  # the checkpoint may come from a run in another checkpoint mode

    def shutdown(self) -> None:
        if self._client is not None:
            self._client.shutdown_workload_monitoring()
            self._client = None
