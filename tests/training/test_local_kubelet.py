"""The local controller plays the kubelet and the Job (training.local.cluster), in-process, with fake nodes:
what counts against a node's retries, how Ctrl-C stops a node's pod, and what a cut-off node's log counts for."""
from __future__ import annotations

import subprocess
import sys
import time

import psutil
import pytest

from training.contract.config import load_train_config
from training.contract.exit_codes import INCOMPLETE
from training.contract.events import read_events
from training.contract.faults import lost_marker
from training.local import cluster as local_cluster
from training.local.cluster import Cluster
from training.local.kubelet import KILL_WAIT_S, kill_processes
from training.local.node_lifecycle import Unreachable
from training.local.shape import ClusterShape
from training_helpers import REPO_ROOT


@pytest.fixture
def controller(tmp_path):
    """A controller of two nodes and no retries, none started: the tests give each node its process."""
    yield from _controller(tmp_path, spares=0)


@pytest.fixture
def controller_with_a_spare(tmp_path):
    yield from _controller(tmp_path, spares=1)


def _controller(tmp_path, spares):
    cfg = load_train_config(None, [f"run_dir={tmp_path / 'run'}", "training.steps=10"])
    config_path = tmp_path / "config.yaml"
    config_path.write_text(cfg.to_yaml())
    c = Cluster(cfg, config_path, ClusterShape(nodes=2, nproc_per_node=1, spares=spares, node_retries=0))
    yield c
    for node in c.nodes:
        c.kill_node(node)
    c.events.close()


def _sleeping(node):
    node.proc = psutil.Popen(["sleep", "60"], start_new_session=True)
    node.active = True  # it trains: a survivor opens the next rendezvous round, no store restart needed


def _killed(node):
    _sleeping(node)
    node.proc.kill()
    node.proc.wait(timeout=10)


def test_a_launcher_killed_by_a_signal_is_a_counted_failure_as_an_oom_kill_of_pid_1_is_on_eks(controller):
    """SIGKILL of a node's PID 1 without a node-loss (the OOM killer, a crash): its container exits 137 without
    DisruptionTarget, which the Job counts; with no retries left, the job fails."""
    survivor, victim = controller.nodes
    _sleeping(survivor)
    _killed(victim)
    assert controller._handle_exits() == 1
    assert "no retries left" in controller.failure and "killed by SIGKILL" in controller.failure


def test_a_lost_node_is_replaced_without_counting(controller):
    """A node-loss strike marks the node lost before it kills it: on EKS its pod is removed with
    DisruptionTarget, which the Job ignores, so even with no retries left the node is replaced."""
    survivor, victim = controller.nodes
    _sleeping(survivor)
    lost_marker(controller.run_dir, victim.index).parent.mkdir(parents=True, exist_ok=True)
    lost_marker(controller.run_dir, victim.index).touch()
    _killed(victim)
    assert controller._handle_exits() is None and controller.failure is None
    assert victim.start_at is not None and victim.retries == 0


def _exited_0(node):
    node.proc = psutil.Popen(["true"])
    node.proc.wait(timeout=10)


def test_the_job_succeeds_as_its_training_nodes_did_without_waiting_for_a_replacement(controller_with_a_spare):
    """Node 1 lost, the spare took its place: once node 0 and the spare exited 0 (the run completed), the Job
    succeeds (its successPolicy, job_rules.job_succeeded), though node 1's replacement is still to start."""
    node0, lost, spare = controller_with_a_spare.nodes
    lost.start_at = time.monotonic() + 3600  # its replacement, due in an hour
    _exited_0(node0)
    _sleeping(spare)
    assert controller_with_a_spare._handle_exits() is None  # one of two: the spare still trains
    spare.proc.kill()
    _exited_0(spare)
    assert controller_with_a_spare._handle_exits() == 0


def test_a_killed_process_that_nobody_reaps_counts_as_gone_at_once():
    """Its parent (killed with it, on a node) is not there to reap it: the zombie is not waited for."""
    parent = subprocess.Popen(["sh", "-c", "sleep 60 & echo $!; exec sleep 60"], stdout=subprocess.PIPE, text=True)
    try:
        orphan = psutil.Process(int(parent.stdout.readline()))  # a child of `sleep`, which never waits
        while psutil.Process(parent.pid).name() != "sleep":  # until then the shell reaps its ended jobs
            time.sleep(0.01)
        started = time.monotonic()
        kill_processes([orphan])
        assert orphan.status() == psutil.STATUS_ZOMBIE and time.monotonic() - started < KILL_WAIT_S
    finally:
        parent.kill()
        parent.wait()


def test_a_process_of_a_pod_that_outlived_its_pid_1_in_a_session_of_its_own_is_killed_with_the_node(controller):
    """As ft_launcher's workers lead sessions of their own, out of the pod's process group: what the
    controller saw last of the node's process tree (one scan of /proc for every node) is killed with it."""
    node = controller.nodes[0]
    node.proc = psutil.Popen(["sh", "-c", "setsid sleep 60 & echo $!; exec sleep 60"], stdout=subprocess.PIPE,
                             text=True, start_new_session=True)
    worker = psutil.Process(int(node.proc.stdout.readline()))
    node.refresh_descendants(local_cluster.children_by_parent())
    assert worker.pid in [p.pid for p in node.descendants] and worker.ppid() == node.proc.pid
    node.proc.kill()
    node.proc.wait(timeout=10)
    assert worker.is_running() and worker.ppid() != node.proc.pid  # an orphan now, left in its own session
    controller.kill_node(node)
    assert not worker.is_running() or worker.status() == psutil.STATUS_ZOMBIE


# A node's pod: PID 1 (training.pod.launch) and its launcher, which writes a line per SIGTERM it gets and leaves
# a second after the first, as ft_launcher stops its workers; or ignores SIGTERM and stays.
_LAUNCHER = ("import pathlib, signal, sys, time\nlog, terms = pathlib.Path(sys.argv[1]), []\n"
             "def term(*_):\n    terms.append(1)\n    log.write_text('TERM\\n' * len(terms))\n"
             "signal.signal(signal.SIGTERM, {handler})\nlog.write_text('')\n"
             "while not terms:\n    time.sleep(0.01)\ntime.sleep(1)\n")


def _pod(controller, node, log, leaves=True):
    launcher = _LAUNCHER.format(handler="term" if leaves else "signal.SIG_IGN")
    node.proc = psutil.Popen([sys.executable, "-m", "training.pod.launch", "--config", str(controller.config_path),
                              "--", sys.executable, "-c", launcher, str(log)],
                             cwd=REPO_ROOT, start_new_session=True, stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while not log.exists():
        assert time.monotonic() < deadline, "the fake launcher did not start"
        time.sleep(0.05)


def test_ctrl_c_signals_each_pods_pid_1_only_then_kills_what_is_left_after_the_grace(controller, tmp_path,
                                                                                    monkeypatch):
    """As the kubelet: SIGTERM to the container's main process, which passes it on (the launcher gets it once,
    not also from a signal to its whole process group), SIGKILL of every process left after the grace."""
    monkeypatch.setattr(local_cluster, "STOP_GRACE_S", 3.0)
    leaves, stays = tmp_path / "leaves.log", tmp_path / "stays.log"
    _pod(controller, controller.nodes[0], leaves)
    _pod(controller, controller.nodes[1], stays, leaves=False)
    tree = [p for n in controller.nodes for p in [n.proc, *n.proc.children(recursive=True)]]
    controller.stop_all()
    assert leaves.read_text() == "TERM\n"
    assert controller.nodes[0].proc.returncode == INCOMPLETE  # its PID 1 ended on its own within the grace
    assert not [p for p in tree if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]


_NVRX_TIMEOUT = ("2026-12-04 21:05:49,172 [INFO] [vm] [workload:2(0) infra:?(?)] rank_monitor_server.py:379 "
                 "Section 'step' has been open for 8.08 seconds. Timeout is 3.27 seconds.\n")


def test_a_cut_off_nodes_own_timeouts_are_no_fault_and_its_evicted_pod_logs_apart(controller, monkeypatch):
    """A cut-off node's NVRx sees its peers stop and says so, but nothing it logs reaches the cluster; after the
    eviction its old processes run on beside the replacement. Neither is a new fault: the survivors' detection
    and the eviction are, and the replacement's log starts empty."""
    survivor, victim = controller.nodes
    _sleeping(survivor)
    _sleeping(victim)
    monkeypatch.setattr(controller, "start", lambda node: None)  # the replacement pod is not started here
    controller.lifecycle.unreachable.append(Unreachable(None, victim.index, time.monotonic(), float("inf"), hung=True))
    victim.log.path.parent.mkdir(parents=True, exist_ok=True)
    victim.log.path.write_text(_NVRX_TIMEOUT)  # logged while cut off
    assert controller.tick() is None  # read, then evicted (--replacement-delay 0)
    evicted_log = victim.log.path.with_name(f"{victim.log.path.stem}.evicted1.log")
    with evicted_log.open("a") as old_pod:
        old_pod.write(_NVRX_TIMEOUT)  # the old pod, still running cut off
    controller.read_output(victim, detect=True)
    controller.events.close()
    detected = [e for e in read_events(controller.run_dir) if e["event"] == "fault_detected"]
    assert [e["detail"] for e in detected] == [
        f"node {victim.index} unreachable for 0 s: its pod is replaced on another machine; the old pod's processes "
        "stay stopped on the hung machine"]
    assert evicted_log.read_text() == _NVRX_TIMEOUT * 2 and not victim.log.path.exists()
