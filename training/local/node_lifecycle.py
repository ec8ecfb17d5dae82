"""Kubernetes' node lifecycle, as the local controller plays it: a node that stops reporting (its machine cut off
from the network by a `partition` fault, with --netns, or every process of its pod stopped by `node-hang`) is
unreachable; once it has been so for the replacement delay, its pod is evicted and replaced on another machine,
the old pod's processes left where they are; when a cut-off machine is back on the network, its kubelet kills
them. The Job controller (training.local.cluster.Cluster) calls `serve` every round.
"""
from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import psutil

from training.contract.faults import controller_requests_dir, partitioned_marker
from training.local.kubelet import stopped
from training.local.netns import Machine, VirtualNetwork


class Pod(Protocol):
    """What the lifecycle reads of a node's pod (training.local.cluster.Node)."""
    index: int
    proc: psutil.Popen | None
    start_at: float | None  # replaced: its replacement starts at this time (monotonic)
    machine: Machine | None


@dataclass
class Unreachable:
    """A node whose kubelet stopped reporting (monotonic times): its machine cut off from the network (a
    partition), or every process of its pod stopped (a hang)."""
    machine: Machine | None  # None: a hung node without --netns
    node: int
    since: float
    until: float  # inf: for good
    evicted: Pod | None = None  # the pod that was replaced on another machine: its processes, left there
    hung: bool = False


class Controller(Protocol):
    """What the lifecycle asks of the Job controller (training.local.cluster.Cluster)."""
    detected_at: float  # monotonic time of the controller's last fault_detected

    @property
    def nodes(self) -> Sequence[Pod]: ...
    def detect(self, kind: str, by: str, detail: str) -> None: ...
    def say(self, message: str) -> None: ...
    def kill_node(self, node: Pod) -> None: ...
    def hand_over(self, node: Pod) -> Pod: ...
    def replace_evicted(self, node: Pod) -> None: ...


class NodeLifecycle:
    """Args:
        controller: the Job controller whose nodes it watches
        run_dir: the run's directory: the partition requests of `partition` faults, the partitioned markers
        network: with --netns, the emulated machines' network; None: no partition is served
        replacement_delay_s: how long a node is unreachable before its pod is evicted and replaced
    """

    def __init__(self, controller: Controller, run_dir: Path, network: VirtualNetwork | None,
                 replacement_delay_s: float) -> None:
        self.controller, self.run_dir, self.network = controller, run_dir, network
        self.replacement_delay_s = replacement_delay_s
        self.unreachable: list[Unreachable] = []  # nodes that do not report: cut off (partition) or hung (node-hang)

    def cut_off(self, node: Pod) -> bool:
        """Whether nothing the node's pod logs reaches the cluster: its machine cut off, or it hung."""
        return ((node.machine is not None and self.unreachable_machine(node.machine) is not None)
                or any(u.hung and u.node == node.index and u.evicted is None for u in self.unreachable))

    def unreachable_machine(self, machine: Machine) -> Unreachable | None:
        """The machine's record while it does not report: cut off, or hung."""
        return next((p for p in self.unreachable if p.machine is machine), None)

    def left_behind(self) -> list[Pod]:
        """The evicted pods whose processes are still where they were: the run's end kills them."""
        return [u.evicted for u in self.unreachable if u.evicted is not None]

    def serve(self) -> None:
        """One round: notice hung nodes, serve partition requests, evict and heal what is due."""
        self._serve_hangs()
        self._serve_partitions()

    def _serve_hangs(self) -> None:
        """Play the kubelet of a node that hangs (a `node-hang` fault stops every process of its pod): it
        stops reporting, which the partitions' node lifecycle then handles as it does an unreachable
        node. On EKS the node goes NotReady after the node-monitor grace period, the taint manager evicts
        the pod, which stays Terminating while nobody confirms it stopped; the Job (podReplacementPolicy:
        Failed) replaces it once PodGC deletes it as Failed, when the hung-node marker (k8s.mark_hung_nodes)
        has marked the node out of service (k8s_delays.KubernetesDelays.hung_node_out_of_service_s). Here the
        replacement comes --replacement-delay seconds after the hang, uncounted; the stopped processes stay
        where they are until the run ends."""
        for node in self.controller.nodes:
            if node.proc is None or node.start_at is not None or self.cut_off(node) or not stopped(node.proc):
                continue
            self.unreachable.append(Unreachable(node.machine, node.index, time.monotonic(), float("inf"), hung=True))
            detail = (f"node {node.index} stopped responding (every process of its pod is stopped): its kubelet "
                      f"stops reporting; marked out of service after {self.replacement_delay_s:g} s, its pod is "
                      "deleted (PodGC) and replaced")
            self.controller.detect("node", "controller", detail)
            self.controller.say(detail)

    def _serve_partitions(self) -> None:
        """Play the network and Kubernetes' node lifecycle for `partition` faults: take a node's link down
        when asked; replace the pod of a node unreachable for --replacement-delay seconds on a new machine
        (the Job replaces a pod that the taint manager evicts; the old one runs on, cut off); when the
        link is back, the old pod's kubelet learns it was deleted and kills its processes."""
        now = time.monotonic()
        for request in sorted(controller_requests_dir(self.run_dir, "partition").glob("node*")):
            node = self.controller.nodes[int(request.name.removeprefix("node"))]
            duration = request.read_text().strip()
            request.unlink()
            if self.network is None or node.machine is None or self.unreachable_machine(node.machine) is not None:
                continue
            self.network.set_link(node.machine, up=False)
            until = now + float(duration) if duration else float("inf")
            self.unreachable.append(Unreachable(node.machine, node.index, now, until))
            marker = partitioned_marker(self.run_dir, node.index)
            marker.parent.mkdir(parents=True, exist_ok=True)
            marker.touch()
            self.controller.say(f"node {node.index} ({node.machine.hostname}, {node.machine.address}) is cut off "
                                f"from the network {f'for {duration} s' if duration else 'for good'}")
        for record in self.unreachable:
            node = self.controller.nodes[record.node]
            if (record.evicted is None and node.machine is record.machine and node.start_at is None
                    and now - record.since >= self.replacement_delay_s and record.until > now):
                self._evict(node, record, unreachable_s=now - record.since)
            if record.until <= now:
                self._heal(record)
        self.unreachable = [p for p in self.unreachable if p.until > now]

    def _evict(self, node: Pod, record: Unreachable, unreachable_s: float) -> None:
        """The node's pod is replaced on another machine; the old pod's processes are left where they are."""
        record.evicted = self.controller.hand_over(node)
        left = "stay stopped on the hung machine" if record.hung else "run on, cut off"
        detail = (f"node {node.index} unreachable for {unreachable_s:.0f} s: its pod is replaced on another "
                  f"machine; the old pod's processes {left}")
        if self.controller.detected_at < record.since:  # else Kubernetes catches up with a fault training handled
            self.controller.detect("node", "controller", detail)
        self.controller.say(detail)
        self.controller.replace_evicted(node)

    def _heal(self, record: Unreachable) -> None:
        assert self.network is not None and record.machine is not None
        self.network.set_link(record.machine, up=True)
        partitioned_marker(self.run_dir, record.node).unlink(missing_ok=True)
        self.controller.say(f"node {record.node}'s old machine {record.machine.hostname} is back on the network"
                            + ("; its kubelet kills the evicted pod's processes" if record.evicted else ""))
        if record.evicted is not None:
            self.controller.kill_node(record.evicted)
