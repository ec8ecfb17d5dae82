"""Replica groups on the local cluster (`--replica-groups R`): each group a Cluster of its own, as on EKS
each is an Indexed Job of its own (its store, nodes, spares and run directory `<run_dir>/group<g>`), all under
one torchft Lighthouse in its own process. One loop ticks every group's controller, so a fault in one group
is played while the others train. A Lighthouse that exits is started again on its port, as its Deployment
restarts it. What it costs: each group writes its own checkpoints, so FSx-style saves happen R times.
"""
from __future__ import annotations

import contextlib
import signal
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import psutil

from training.contract.faults import controller_requests_dir, lighthouse_lost_marker
from training.contract.replica_groups import group_run_dir
from training.contract.events import read_events
from training.pod.prefork import die_with_parent

LIGHTHOUSE_READY_S = 10.0  # torchft_lighthouse listens within milliseconds; longer means it cannot start


class GroupJob(Protocol):
    """What run_groups drives of a group's controller (training.local.cluster.Cluster)."""
    run_dir: Path

    def begin(self) -> None: ...
    def tick(self) -> int | None: ...
    def end(self, status: int | None) -> None: ...
    def say(self, message: str) -> None: ...


class LighthouseError(RuntimeError):
    """The Lighthouse did not come up: the run cannot start."""


@dataclass
class Lighthouse:
    """torchft's Lighthouse server (training.contract.replica_groups.lighthouse_command) on `port`."""
    command: list[str]
    port: int
    log_path: Path
    proc: psutil.Popen | None = None
    restarts: int = 0

    def start(self) -> None:
        """Started, and listening (LighthouseError if it is not within LIGHTHOUSE_READY_S)."""
        with self.log_path.open("ab") as log_file:
            self.proc = psutil.Popen(self.command, stdout=log_file, stderr=log_file, stdin=subprocess.DEVNULL,
                                     start_new_session=True, preexec_fn=lambda: die_with_parent(signal.SIGTERM))
        deadline = time.monotonic() + LIGHTHOUSE_READY_S
        while not _listening(self.port):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise LighthouseError(f"the Lighthouse ({' '.join(self.command)}) did not listen on port "
                                      f"{self.port} within {LIGHTHOUSE_READY_S:g} s: see {self.log_path}")
            time.sleep(0.05)

    def exited(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    def stop(self) -> None:
        """SIGKILL, as a lost system node or an OOM kill does (`run_groups` starts it again), or at the end."""
        if self.proc is not None:
            with contextlib.suppress(psutil.Error):
                self.proc.kill()
                self.proc.wait(timeout=5)


def _listening(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.2)
        return s.connect_ex(("127.0.0.1", port)) == 0


def run_groups(clusters: list[GroupJob], lighthouse: Lighthouse) -> int:
    """Every group's Job to its end under one Lighthouse: 0 when every group completed, 130 when stopped,
    else 1. A group whose Job failed leaves the others training."""
    lighthouse.start()
    statuses: dict[int, int] = {}
    try:
        for cluster in clusters:
            cluster.begin()
        while len(statuses) < len(clusters):
            _kill_on_request(clusters, lighthouse)
            if (rc := lighthouse.exited()) is not None:
                lighthouse.restarts += 1
                clusters[0].say(f"the Lighthouse exited with code {rc}; starting it again, as its Deployment does")
                lighthouse.start()
            for index, cluster in enumerate(clusters):
                if index not in statuses and (status := cluster.tick()) is not None:
                    statuses[index] = status
                    cluster.end(status)
            time.sleep(0.2)
    finally:
        for index, cluster in enumerate(clusters):
            if index not in statuses:
                cluster.end(None)
        lighthouse.stop()
    return 130 if 130 in statuses.values() else max(statuses.values())


def _kill_on_request(clusters: list[GroupJob], lighthouse: Lighthouse) -> None:
    """A rank's `lighthouse-loss` fault (training.train.faults) asks for the Lighthouse to be killed."""
    for cluster in clusters:
        requests = sorted(controller_requests_dir(cluster.run_dir, "lighthouse-loss").glob("node*"))
        if not requests:
            continue
        cluster.say("fault: killing the Lighthouse (SIGKILL)")
        lighthouse.stop()
        for request in requests:
            request.unlink()
        marker = lighthouse_lost_marker(cluster.run_dir)
        marker.parent.mkdir(parents=True, exist_ok=True)
        marker.touch()


def longest_stall(run_dir: Path) -> tuple[float, int] | None:
    """A group's longest time between two committed steps of one attempt (its own restarts are recovery, not
    a stall), and the step that ended it; None under two such steps. A survivor's stall after another
    group's fault is this figure."""
    previous, gaps = None, []
    for e in read_events(run_dir):
        if e["event"] == "resume":
            previous = None
        elif e["event"] == "step":
            if previous is not None:
                gaps.append((e["t"] - previous["t"], e["step"]))
            previous = e
    return max(gaps, default=None)


def stall_summary(run_dir: Path, groups: int) -> list[str]:
    """One line per group: the steps it trained and its longest stall."""
    lines = []
    for group in range(groups):
        directory = group_run_dir(run_dir, group)
        steps = sum(e["event"] == "step" for e in read_events(directory))
        stall = longest_stall(directory)
        lines.append(f"group {group}: {steps} step(s) trained" + (
            f"; its longest stall while training {stall[0]:.2f} s, before step {stall[1]}" if stall else ""))
    return lines
