"""What the kubelet does to a node's pod on the local cluster: its top process plays the pod's PID 1, its
processes are stopped or killed as a group, and its end is turned into what the Job sees (PodEnd). The Job's
side (training.local.cluster.Cluster) decides what follows, by the chart's table (training.contract.job_rules).
"""
from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import time

import psutil

from training.contract.job_rules import PodEnd
from training.pod.launch import exit_code
from training.pod.prefork import die_with_parent

GONE = (ProcessLookupError, psutil.Error, subprocess.TimeoutExpired)  # a process already gone or slow to go
KILL_WAIT_S = 5.0  # SIGKILLed processes are gone within milliseconds; longer, and the kill is left to the kernel
_PR_SET_CHILD_SUBREAPER = 36  # prctl(2): orphans below this process are re-parented to it, not to init


def pod_top_process() -> None:
    """A node's top process plays its pod's PID 1. A killed controller leaves no cluster behind: it gets
    SIGTERM and stops its own workers. And it is a child subreaper: what daemonizes below it (the Wrapper's
    monitor processes fork twice and leave their parent) stays in its tree, as in the pod, where an orphan
    goes to the PID namespace's init (pid_namespaces(7)); so a node fault (training.train.node_strike)
    and the node's kill reach it, and training.pod.launch reaps it. The attribute survives execve (prctl(2)),
    through `ip netns exec` and `unshare`."""
    die_with_parent(signal.SIGTERM)
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_CHILD_SUBREAPER, 1)


def process_group(pgid: int) -> list[psutil.Process]:
    """The processes of a process group (its leader's children, and what it left behind when it died)."""
    members = []
    for proc in psutil.process_iter():
        with contextlib.suppress(*GONE):
            if os.getpgid(proc.pid) == pgid:
                members.append(proc)
    return members


def local_pod_end(returncode: int, drained: bool, lost: bool, retries_used: int) -> PodEnd:
    """A node's launcher that exited, as the Job sees its pod. A lost node (a node-loss strike): on EKS the
    taint manager evicts the pod of a node that stopped reporting, or PodGC deletes it once the Node object is
    gone, both with DisruptionTarget, and no exit code reaches the Job. A drain (the controller plays the
    Eviction API) is a disruption too. A launcher killed by signal N otherwise is a container whose PID 1 died
    of it: exit code 128 + N and no condition (an OOM kill: 137, no DisruptionTarget; the Kubernetes docs,
    https://kubernetes.io/docs/concepts/workloads/pods/disruptions/#pod-disruption-conditions)."""
    if lost:
        return PodEnd(None, disrupted=True, retries_used=retries_used)
    return PodEnd(exit_code(returncode), disrupted=drained, retries_used=retries_used)


def kill_processes(processes: list[psutil.Process]) -> None:
    """SIGKILL to each, then wait up to KILL_WAIT_S until none is alive. A zombie counts as gone: its parent,
    killed with it, is not there to reap it, and init's reaping can take more than a second."""
    for p in processes:
        with contextlib.suppress(*GONE):
            if p.is_running():
                p.kill()
    deadline = time.monotonic() + KILL_WAIT_S
    while (left := [p for p in processes if alive(p)]) and time.monotonic() < deadline:
        psutil.wait_procs(left, timeout=0.05)  # reaps those that are this process's children


def stopped(p: psutil.Process) -> bool:
    """Stopped by a signal (SIGSTOP): a process that can neither run nor report."""
    try:
        return p.status() == psutil.STATUS_STOPPED
    except psutil.Error:
        return False


def alive(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False
