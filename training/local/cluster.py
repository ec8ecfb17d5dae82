"""The local emulated cluster: one ft_launcher per emulated node on 127.0.0.1, and a controller that
plays the Kubernetes Indexed Job.

It is how everything runs and is tested without AWS or a GPU, so it runs what the cluster runs. Each node
runs the pod's own command (training.pod.launch around ft_launcher) with its JOB_COMPLETION_INDEX; the
rendezvous store is its own process. Cluster plays what Kubernetes does around them: the Job, replacing or
failing pods by the table the chart renders (training.contract.job_rules); the kubelet, for drains and stops
(its process handling: training.local.kubelet); the node lifecycle of hung nodes and, with --netns, of nodes a
partition cuts off (training.local.node_lifecycle). It turns NVRx's log lines (training.local.pod_log) into
fault_detected events, so that the report measures detection time. EKS's delays it cannot play are parameters
(--replacement-delay).
"""
from __future__ import annotations

import collections
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from training.contract.config import TrainConfig
from training.contract.events import EventLog, read_events
from training.contract.exit_codes import NO_PROGRESS
from training.contract.faults import controller_requests_dir, lost_marker, partitioned_marker
from training.contract.job_failure import FailureRequests
from training.contract.job_rules import Decision, FailReason, Outcome, PodEnd, decide, job_succeeded
from training.contract.launcher import (DRAIN_MARKER_ENV, NODE_MEMORY_ENV, drain_grace_period_s, free_port,
                                        launch_command, launcher_ft_args, launcher_wrapper, rendezvous_args,
                                        resume_step_file, store_command, worker_entrypoint)
from training.contract.replica_groups import LIGHTHOUSE_ENV, REPLICA_GROUP_ENV
from training.local.kubelet import GONE, kill_processes, local_pod_end, pod_top_process, process_group, stopped
from training.local.netns import Machine, VirtualNetwork
from training.local.node_lifecycle import NodeLifecycle
from training.local.pod_log import PodLog, detection, rendezvous_role
from training.local.shape import ClusterShape
from training.pod.launch import exit_code
from training.pod import forked, prefork
from training.pod.forked import forking, popen
from training.pod.prefork import PRELOAD, die_with_parent

REPO_ROOT = Path(__file__).resolve().parents[2]
BIN_DIR = Path(sys.executable).parent  # ft_launcher's, nvrx-control's: this interpreter's console scripts
# What the pods' and the store's commands import, for the forks of Cluster.preload: their modules and console scripts
POD_MODULES = ("training.pod.launch", "training.pod.store", *PRELOAD)
POD_SCRIPTS = (str(BIN_DIR / "ft_launcher"), str(BIN_DIR / "nvrx-control"))
# SIGKILL a node's workers still alive this long after its launcher's SIGTERM (ft_launcher's default: 15 s); the
# restart round's last call for the survivors follows it (training.contract.launcher.rendezvous_last_call_s)
WORKERS_STOP_TIMEOUT_S = 5
STOP_GRACE_S = 10.0


def pod_import_env(restart: str) -> dict[str, str]:
    """What a pod's imports read from the environment the controller gives it: OpenMP's thread count (2 cores,
    4 ranks: no oversubscription) and, under fault_tolerance.restart `restart` other than injob, c10's log
    level (an in-process abort shuts gloo's sockets; torch then warns about them twice a second)."""
    return {"OMP_NUM_THREADS": "1", **({"TORCH_CPP_LOG_LEVEL": "ERROR"} if restart != "injob" else {})}


@dataclass
class Node:
    index: int
    log: PodLog
    proc: psutil.Popen | None = None
    retries: int = 0
    done: bool = False
    drain_deadline: float | None = None  # drained: SIGKILL at this time (monotonic) if still running
    start_at: float | None = None  # replaced: the new launcher starts at this time (monotonic)
    joined: bool = False  # its launcher was given an active rank at least once
    machine: Machine | None = None  # with --netns: the emulated machine its pod runs on
    active: bool = False  # its launcher's last rendezvous round made it train
    # every process this node's launcher started, as last seen: killed when the launcher dies
    descendants: list[psutil.Process] = field(default_factory=list)

    def refresh_descendants(self, tree: Mapping[int, list[int]] | None = None) -> None:
        """Args:
            tree: each process's children (children_by_parent), when the caller scanned for every node
        """
        if self.proc is None:
            return
        tree = children_by_parent() if tree is None else tree
        known = {p.pid for p in self.descendants}
        unseen = list(tree.get(self.proc.pid, ()))
        while unseen:
            pid = unseen.pop()
            unseen += tree.get(pid, ())
            if pid not in known:
                with contextlib.suppress(psutil.NoSuchProcess):
                    self.descendants.append(psutil.Process(pid))
        self.descendants = [p for p in self.descendants if p.is_running()]


def children_by_parent() -> dict[int, list[int]]:
    """Each process's children, from one scan of /proc: what psutil's children(recursive=True) scans per call.
    The parent is the field after the state in /proc/<pid>/stat (proc(5)), after the name's last ")"."""
    tree: dict[int, list[int]] = collections.defaultdict(list)
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat", "rb") as stat:
                    parent = int(stat.read().rsplit(b")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):  # gone meanwhile
                continue
            tree[parent].append(int(name))
    return tree


class Cluster:
    def __init__(self, cfg: TrainConfig, config_path: Path, shape: ClusterShape,
                 network: VirtualNetwork | None = None, replica_group: int | None = None,
                 lighthouse: str | None = None) -> None:
        """Args:
            cfg: the training config its ranks load (config_path holds it)
            shape: this Job's nodes (one replica group's: ClusterShape.of_group), spares and retries
            network: with --netns, the emulated machines' network (its owner closes it)
            replica_group: this Job's replica group (training.local.replica_groups); None without groups
            lighthouse: the torchft Lighthouse's address, with replica groups
        """
        self.cfg, self.config_path = cfg, config_path
        self.nproc_per_node, self.node_retries = shape.nproc_per_node, shape.node_retries
        self.training_nodes, self.spares = shape.nodes, shape.spares
        self.replacement_delay_s = shape.replacement_delay_s
        self.run_dir = Path(cfg.run_dir)
        (self.run_dir / "logs").mkdir(parents=True, exist_ok=True)
        self.nodes = [Node(i, PodLog(self.run_dir / "logs" / f"node{i}.log"))
                      for i in range(shape.nodes + shape.spares)]
        self.events = EventLog(self.run_dir, "controller")
        self.replica_group, self.lighthouse = replica_group, lighthouse
        self.name = "controller" if replica_group is None else f"group{replica_group} controller"
        self.failure_requests = FailureRequests(self.run_dir)  # a rank's cause, when a node exits CONFIG_ERROR
        self.failure: str | None = None  # why the job failed
        self.network = network
        self.store_host = network.host_address if network else "127.0.0.1"  # with --netns: the host's end
        self.detected_at = -float("inf")  # monotonic time of the last fault_detected this controller emitted
        self.lifecycle = NodeLifecycle(self, self.run_dir, network, self.replacement_delay_s)
        self.new_rendezvous()
        self.store: psutil.Popen | None = None
        # each node's memory (a pod's /dev/shm): what peer state keeps there outlives its workers, not the node
        shm = Path("/dev/shm")
        self.memory_root = (shm if shm.is_dir() else Path(tempfile.gettempdir())) / f"training-{self.run_id}"
        self._stop_requested = False
        self._attempts = 0

    def new_rendezvous(self) -> None:
        """A port for a new store, and the rendezvous id its nodes join with."""
        self.store_port, self.run_id = free_port(), f"local-{uuid.uuid4().hex[:8]}"

    def start_store(self) -> None:
        """The rendezvous store, as the cluster's store Deployment runs it (NVRx's nvrx-control under
        training.pod.store): before any node, and again whenever it exits. Every launcher joins it as a
        client, so losing node 0 costs what losing any node costs."""
        with (self.run_dir / "logs" / "store.log").open("ab") as log_file:
            command = [sys.executable, "-m", "training.pod.store", "--config", str(self.config_path), "--",
                       *store_command(self.cfg.fault_tolerance, self.store_port, self.run_id, self.training_nodes,
                                      self.spares, self.replacement_delay_s, bin_dir=str(BIN_DIR),
                                      workers_stop_timeout_s=WORKERS_STOP_TIMEOUT_S)]
            self.store = popen(command, exec_with=psutil.Popen, cwd=REPO_ROOT, env=self.env(), stdout=log_file,
                               stderr=log_file, stdin=subprocess.DEVNULL, start_new_session=True,
                               preexec_fn=lambda: die_with_parent(signal.SIGTERM))

    def launcher_command(self, node: Node) -> list[str]:
        ft = self.cfg.fault_tolerance
        return [
            *launch_command(str(self.config_path)),
            *launcher_wrapper(ft, sys.executable),
            POD_SCRIPTS[0],
            *rendezvous_args(self.cfg.fault_tolerance, f"{self.store_host}:{self.store_port}", self.run_id,
                             self.training_nodes, self.spares, self.replacement_delay_s, WORKERS_STOP_TIMEOUT_S),
            *([f"--local-addr={node.machine.address}"] if node.machine else []),  # what its peers dial
            f"--nproc-per-node={self.nproc_per_node}",
            f"--workers-stop-timeout={WORKERS_STOP_TIMEOUT_S}",
            *launcher_ft_args(ft, str(resume_step_file(self.cfg.checkpoint_dir))),
            *worker_entrypoint(ft), "--config", str(self.config_path),
        ]

    def env(self) -> dict[str, str]:
        env = {**os.environ, **pod_import_env(self.cfg.fault_tolerance.restart),
               "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])),
               "PYTHONUNBUFFERED": "1"}
        if self.replica_group is not None:  # what each group's Job sets in its pods
            env[REPLICA_GROUP_ENV] = str(self.replica_group)
            env[LIGHTHOUSE_ENV] = str(self.lighthouse)
        if self.network is None:
            # NVRx 0.7.0's rendezvous closes when two launchers share a host, unless told this is a
            # simulation; every node here is on localhost
            env["NVRX_ENABLE_MULTI_LAUNCHERS_PER_NODE"] = "1"
        return env

    def start(self, node: Node) -> None:
        memory = self.memory_root / f"node{node.index}"
        shutil.rmtree(memory, ignore_errors=True)  # a new pod's memory is empty
        env = {**self.env(), "JOB_COMPLETION_INDEX": str(node.index),  # what the Indexed Job gives each pod
               DRAIN_MARKER_ENV: str(self.drain_marker(node)), NODE_MEMORY_ENV: str(memory)}
        self.drain_marker(node).unlink(missing_ok=True)  # a new pod is not being drained, cut off, nor lost
        partitioned_marker(self.run_dir, node.index).unlink(missing_ok=True)
        lost_marker(self.run_dir, node.index).unlink(missing_ok=True)
        node.start_at = None
        # a new pod lands on a new machine: the scheduler avoids one that is unreachable
        if self.network is not None and (node.machine is None
                                         or self.lifecycle.unreachable_machine(node.machine) is not None):
            node.machine = self.network.add_machine(f"node{node.index}-m{len(self.network.machines)}")
        command = self.launcher_command(node)
        if self.network is not None and node.machine is not None:
            command = self.network.command(node.machine, command)
        # Its own session: a terminal's Ctrl-C reaches the controller alone, which stops each node as the
        # kubelet stops a pod (stop_all), and kill_node can kill the node's process group.
        with node.log.path.open("ab") as log_file:
            node.proc = popen(command, exec_with=psutil.Popen, cwd=REPO_ROOT, env=env, stdout=log_file,
                              stderr=log_file, stdin=subprocess.DEVNULL, start_new_session=True,
                              preexec_fn=pod_top_process)
        node.descendants = []
        node.active = False

    def request_stop(self, signum: int, _frame: object) -> None:
        self._stop_requested = True

    def run(self) -> int:
        """Run to completion; returns 0 when every node finished, 1 on failure, 130 when stopped."""
        self.begin()
        status = None
        try:
            while (status := self.tick()) is None:
                time.sleep(0.2)
        finally:
            self.end(status)
        return status

    def begin(self) -> None:
        """The Job is created: its store, then its training nodes."""
        if forking():
            self.preload()
        self.events.emit("job_start", nodes=self.training_nodes, nproc_per_node=self.nproc_per_node,
                         spares=self.spares)
        self.start_store()
        for node in self.nodes[:self.training_nodes]:
            self.start(node)

    def preload(self) -> None:
        """With FORK_ENV (training.pod.forked): import what the pods' and the store's commands import, in the
        environment they read as they load (pod_import_env), before the first fork."""
        os.environ.update(pod_import_env(self.cfg.fault_tolerance.restart))
        forked.preload(POD_MODULES, scripts=POD_SCRIPTS)
        prefork.preload()  # the template's own steps before it forks: no CUDA context, the imports frozen

    def tick(self) -> int | None:
        """One round of the controller: read the nodes' output, play the kubelet and the network, start what
        is due, act on exits. The job's status once it is decided (130: a stop was requested), else None."""
        if self._stop_requested:
            self.say("stop requested: shutting down every node")
            return 130
        tree = children_by_parent()  # one scan for every node, five times a second
        for node in self.nodes:
            node.refresh_descendants(tree)
            self.read_output(node, detect=not self.lifecycle.cut_off(node))  # what a cut-off node sees reaches nobody
        self.serve_drains()
        self.lifecycle.serve()
        for node in self.nodes:
            if node.start_at is not None and time.monotonic() >= node.start_at:
                self.start(node)
        # Spares start once every training node has joined the first round: NVRx makes whoever is there
        # first active, and a `node=N` fault with N < --nodes must hit a training node.
        if self.nodes[-1].proc is None and all(n.joined for n in self.nodes[:self.training_nodes]):
            for spare in self.nodes[self.training_nodes:]:
                self.start(spare)
        return self._handle_exits()

    def end(self, status: int | None) -> None:
        """Every node and the store stopped, what they left behind killed, the rest of their output read;
        `status` (None: the controller itself failed) recorded."""
        try:
            self.stop_all()
            self.stop_store()
            for evicted in self.lifecycle.left_behind():
                self.kill_node(evicted)
            shutil.rmtree(self.memory_root, ignore_errors=True)
            for node in self.nodes:
                self.read_output(node, detect=False)  # the rest of the output; stopping is no fault
        finally:
            if status is not None and status != 0:
                self.events.emit("run_end", step=last_step(self.run_dir),
                                 status="failed" if status == 1 else "stopped")
            self.events.close()

    def _handle_exits(self) -> int | None:
        """Act on launchers that exited, as the Job and its podFailurePolicy would (job_rules.decide, from the
        table the chart renders), each failure recorded as fault_detected; returns the job's status once it is
        decided, else None."""
        if self.store is not None and self.store.poll() is not None:
            # It ends when the rendezvous shuts down: the run's end, or a launcher that stopped for good
            # (no in-job restarts); then every node's pod is replaced and joins a new rendezvous.
            self.say(f"the rendezvous store exited with code {self.store.returncode}; starting it again, "
                     "as its Deployment does")
            self.stop_store()  # whatever of it is left (a container's processes go with it): the port is free
            self.start_store()
        for node in self.nodes:
            rc = node.proc.poll() if not node.done and node.start_at is None and node.proc is not None else None
            if rc is None:
                continue
            drained, node.drain_deadline = node.drain_deadline is not None, None
            lost = rc < 0 and lost_marker(self.run_dir, node.index).exists()
            detail = self.pod_failed(node, rc, drained, lost) if rc != 0 else ""
            decision = decide(local_pod_end(rc, drained, lost, node.retries), self.node_retries,
                              survivor=self.survivor_besides(node))
            if decision.outcome is Outcome.DONE:  # training.pod.launch exits 0 only once the run completed
                node.done = True
            elif decision.outcome is Outcome.FAIL_JOB:
                self.fail_job(rc, detail, decision.reason)
                return 1
            else:
                self.replace(node, detail, decision)
        # The Job's successPolicy: the pods left (a replacement still to start, a node cut off from the network
        # that cannot hear that the run completed) are stopped with the rest, as the Job controller removes them.
        if job_succeeded(sum(n.done for n in self.nodes), self.training_nodes):
            return 0
        return None

    def serve_drains(self) -> None:
        """Play the kubelet for the drains that `drain` faults ask for: SIGTERM to the node's launcher
        (a pod's PID 1), SIGKILL of all it started once the grace period is over."""
        for request in sorted(controller_requests_dir(self.run_dir, "drain").glob("node*")):
            node = self.nodes[int(request.name.removeprefix("node"))]
            request.unlink()
            if node.proc is None or node.proc.poll() is not None or node.drain_deadline is not None:
                continue
            grace = drain_grace_period_s(self.cfg.fault_tolerance)
            self.detect("drain", "controller", f"drain of node {node.index}: SIGTERM to its launcher, SIGKILL after "
                                               f"{grace:.0f} s")
            self.say(f"draining node {node.index}: SIGTERM to its launcher (grace period {grace:.0f} s)")
            node.drain_deadline = time.monotonic() + grace
            self.drain_marker(node).parent.mkdir(parents=True, exist_ok=True)
            self.drain_marker(node).touch()  # the pod's preStop hook: SIGTERM now means drain
            with contextlib.suppress(*GONE):
                node.proc.send_signal(signal.SIGTERM)
        for node in self.nodes:
            if node.drain_deadline is not None and time.monotonic() > node.drain_deadline:
                self.say(f"node {node.index} outlived its grace period: SIGKILL")
                self.kill_node(node)

    def hand_over(self, node: Node) -> Node:
        """The node's pod as it is now (its process, what it started, the rest of its log), for the node
        lifecycle to leave where it is; the node has no pod until its replacement starts."""
        node.refresh_descendants()
        self.read_output(node, detect=False)
        old = Node(node.index, PodLog(node.log.hand_over()), proc=node.proc, descendants=node.descendants)
        node.proc, node.descendants, node.active = None, [], False
        return old

    def replace_evicted(self, node: Node) -> None:
        """An evicted pod's replacement, at once (unreachable for the replacement delay already): a
        disruption, which the Job's rules replace uncounted."""
        decision = decide(PodEnd(None, disrupted=True, retries_used=node.retries), self.node_retries,
                          survivor=self.survivor_besides(node))
        self._schedule_replacement(node, 0.0, decision.start_over)

    def drain_marker(self, node: Node) -> Path:
        return self.run_dir / "drain" / f"node{node.index}"

    def pod_failed(self, node: Node, rc: int, drained: bool, lost: bool) -> str:
        """A launcher that exited non-zero: the fault it stands for (a drain's was recorded as it began),
        and the processes it left behind killed, as they would die with a pod's container."""
        if drained:
            detail = f"launcher of drained node {node.index} exited with code {rc}"
        elif lost:
            detail = (f"node {node.index} lost (its launcher was killed by {signal.Signals(-rc).name}; on EKS the "
                      "taint manager or PodGC removes its pod with DisruptionTarget)")
        elif rc < 0:
            detail = (f"the launcher of node {node.index} was killed by {signal.Signals(-rc).name} (on EKS its "
                      f"container exits {exit_code(rc)}, as in an OOM kill, and the Job counts the failure)")
        else:
            detail = f"launcher of node {node.index} exited with code {rc}"
        if not drained:  # a drain's was recorded as it began
            self.detect("node", "controller", detail)
        kill_processes(node.descendants)
        return detail

    def survivor_besides(self, node: Node) -> bool:
        """Whether another training node is up: what opens NVRx's next rendezvous round."""
        return any(n.active and n.proc is not None and n.proc.poll() is None for n in self.nodes if n is not node)

    def replace(self, node: Node, detail: str, decision: Decision) -> None:
        """Start a node again, as the Job replaces a pod: one that failed (exited non-zero), counted against
        node_retries (backoffLimitPerIndex); a lost or drained one uncounted (a disruption)."""
        node.retries += decision.counted
        when = f" in {self.replacement_delay_s:g} s" if self.replacement_delay_s else ""
        self.say(f"{detail}; starting a replacement{when} ({node.retries}/{self.node_retries})")
        self._schedule_replacement(node, self.replacement_delay_s, decision.start_over)

    def _schedule_replacement(self, node: Node, delay_s: float, start_over: bool) -> None:
        """The Job's part of replacing a node's pod: a new attempt and its events, the new pod's start,
        and a new rendezvous when no training node is left to open the next round (`start_over`)."""
        self._attempts += 1
        self.events.emit("node_replaced", node=node.index, attempt=self._attempts)
        self.events.emit("restart", attempt=self._attempts, restart_kind="node")
        node.start_at = time.monotonic() + delay_s
        if start_over:
            self.start_over()

    def start_over(self) -> None:
        """No training node survived, and a survivor is what opens NVRx's next rendezvous round: standby
        and new launchers would wait for it forever. The rendezvous starts over instead: a new store, and
        the nodes still up restarted into it (not counted against their retries)."""
        self.say("no training node survived to open the next rendezvous round: starting the rendezvous over")
        self.stop_store()
        self.new_rendezvous()
        self.start_store()
        for n in self.nodes:
            if n.proc is not None and n.start_at is None and n.proc.poll() is None:
                self.kill_node(n)
                n.start_at = time.monotonic()

    def fail_job(self, rc: int, detail: str, reason: FailReason | None) -> None:
        """The Job fails: an exit code its podFailurePolicy fails it on, or a node out of retries. Its cause
        is kept (`failure`), for the last line of the run's output."""
        if reason is FailReason.NO_RETRIES_LEFT:
            self.failure = (f"{detail}; no retries left ({self.node_retries}, --node-retries: the Job's "
                            f"backoffLimitPerIndex); the job fails. {fault_summary(self.run_dir)}")
        elif rc == NO_PROGRESS:
            self.failure = (f"{detail}: {self.cfg.fault_tolerance.max_restarts} in-job restart(s) in a row made no "
                            "progress (no newer checkpoint; fault_tolerance.max_restarts), so ft_launcher stopped "
                            "restarting: fix the fault named below, then run again to resume from the last "
                            f"checkpoint; the job fails. {fault_summary(self.run_dir)}")
        else:
            self.say(f"{detail}: the training config or its checkpoints cannot work, no restart can help; the job "
                     f"fails. {fault_summary(self.run_dir)}")
            request = self.failure_requests.new()
            self.failure = f"{request.source}: {request.cause}" if request else "the cause is in the node logs above"
        self.say(self.failure)

    def stop_all(self) -> None:
        """Stop every node as the kubelet stops a pod: SIGTERM to the main process of its container (the pod's
        PID 1, training.pod.launch, which passes it on), SIGKILL to any process left after the grace period
        (https://kubernetes.io/docs/concepts/workloads/pods/pod-termination/). Not its whole process group: the
        launcher would get SIGTERM twice, from here and from PID 1."""
        # a hung node's processes cannot act on SIGTERM (stopped): they are killed below, without the grace wait
        live = [n for n in self.nodes if n.proc is not None and n.proc.poll() is None and not stopped(n.proc)]
        for node in live:
            node.refresh_descendants()
            with contextlib.suppress(*GONE):
                node.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + STOP_GRACE_S
        for node in live:
            with contextlib.suppress(*GONE):
                node.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        for node in self.nodes:
            self.kill_node(node)

    def stop_store(self) -> None:
        """Its rendezvous state goes with it: only when no node needs it (the end), or all start over.
        Every process of its group, so that no nvrx-control outlives it on the port."""
        if self.store is not None:
            kill_processes(process_group(self.store.pid))  # its leader may be gone, its store not
            with contextlib.suppress(*GONE):
                self.store.wait(timeout=5)  # reaped

    def kill_node(self, node: Node) -> None:
        node.refresh_descendants()
        if node.proc is not None:
            with contextlib.suppress(*GONE):
                os.killpg(node.proc.pid, signal.SIGKILL)
            with contextlib.suppress(*GONE):
                node.proc.wait(timeout=5)
        kill_processes(node.descendants)

    def read_output(self, node: Node, detect: bool) -> None:
        """Echo rank 0's lines; with `detect`, record the faults that NVRx's log lines report (a rank monitor's
        timeout, ft_launcher's failed worker) as fault_detected, so that the report measures detection time."""
        for line in node.log.new_lines():
            if "[rank0]" in line:
                print(line if self.replica_group is None else f"[group{self.replica_group}] {line}", flush=True)
            role = rendezvous_role(line)
            if role is not None:
                node.active = role
                node.joined |= role
            found = detection(line) if detect else None
            if found is not None:
                self.detect(found.kind, f"{found.party} (node {node.index})",
                            f"local rank {found.local_rank}: {found.what}")

    def detect(self, kind: str, by: str, detail: str) -> None:
        """Record a fault the controller saw (the report measures detection from it)."""
        self.detected_at = time.monotonic()
        self.events.emit("fault_detected", kind=kind, rank=None, by=by, detail=detail)

    def say(self, message: str) -> None:
        print(f"[{time.strftime('%H:%M:%S')}] [{self.name}] {message}", flush=True)


def last_step(run_dir: Path) -> int:
    steps = [e["step"] for e in read_events(run_dir) if e["event"] == "step"]
    return max(steps, default=0)


def fault_summary(run_dir: Path) -> str:
    """The injected faults of the run, by rank and spec, from its event log: what a failed job names."""
    fired: dict[tuple[int | None, str], list[int]] = {}
    for e in read_events(run_dir):
        if e["event"] == "fault_injected":
            fired.setdefault((e.get("rank"), e.get("spec", e["kind"])), []).append(e["step"])
    if not fired:
        return "No injected fault was recorded: see the node logs."
    return "Injected faults: " + "; ".join(
        f"rank {rank}: {spec} fired {len(steps)} time(s) (at step {', '.join(map(str, steps))})"
        for (rank, spec), steps in sorted(fired.items(), key=lambda item: str(item[0])))
