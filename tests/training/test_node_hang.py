"""A node that hangs, not dies (`node-hang`): every process of its pod stops; the controller plays a kubelet
that stops reporting, and replaces the pod after --replacement-delay seconds (on EKS: NotReady, then the
force delete that podReplacementPolicy: Failed waits for), so the time to training again is bounded with or
without a spare."""
from __future__ import annotations

import signal
import sys
import time
from dataclasses import replace
from pathlib import Path

import psutil
import pytest

from training.contract.config import load_train_config
from training.contract.events import read_events
from training.contract.faults import DESTRUCTIVE_KINDS, FaultSpecError, parse_fault
from training.local.cluster import Cluster
from training.local.shape import ClusterShape
from training.local.kubelet import pod_top_process
from training.report.goodput import build_report
from training_helpers import (COMMON, TWO_NODES, assert_bitwise_equal, completed, events_named, load_final_state,
                              run_local)


def test_a_node_hang_names_its_node_and_is_destructive():
    assert parse_fault("node-hang@12:node=1").node == 1
    assert parse_fault("node-hang@12:rank=3").rank == 3  # the node that runs rank 3
    with pytest.raises(FaultSpecError, match="node-hang needs node=N"):
        parse_fault("node-hang@12")
    with pytest.raises(FaultSpecError, match="unknown option 'duration' for node-hang"):
        parse_fault("node-hang@12:node=1:duration=5")
    assert "node-hang" in DESTRUCTIVE_KINDS  # a pod needs the chaos switch for it


# A node's pod as the rank's fault finds it: a top process named ft_launcher, a rank under it that fires.
_RANK = ("import sys, time; from pathlib import Path; from training.contract.faults import parse_fault; "
         "from training.train.faults import AT_STEP, FireContext; "
         "AT_STEP['node-hang'](parse_fault('node-hang@3:node=0'), FireContext(Path('.'), Path('.'), 0.0)); "
         "time.sleep(60)")
_TOP = f"import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', {_RANK!r}]); time.sleep(60)"


def _wait_until(predicate, timeout: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout
    while not predicate() and time.monotonic() < deadline:
        time.sleep(0.05)
    return predicate()


def _stopped(p: psutil.Process) -> bool:
    return p.status() == psutil.STATUS_STOPPED


def test_the_fault_stops_every_process_of_the_node_and_kills_none():
    top = psutil.Popen([sys.executable, "-c", _TOP, "ft_launcher"], cwd=Path(__file__).resolve().parents[2])
    try:
        assert _wait_until(lambda: len(top.children()) == 1)
        [rank] = top.children()
        assert _wait_until(lambda: _stopped(top) and _stopped(rank))  # stopped, not gone: a hang
    finally:
        for p in (*top.children(recursive=True), top):
            p.kill()
        top.wait(timeout=10)


# A rank that first starts a daemon as NVRx's Wrapper starts its monitor process (two forks, a session of its
# own, the middle process gone: the daemon is an orphan), then fires the node fault.
_DAEMONIZING_RANK = ("import os, sys, time\n"
                     "if os.fork() == 0:\n"
                     "    os.setsid()\n"
                     "    if os.fork() == 0:\n"
                     "        time.sleep(60)\n"
                     "    os._exit(0)\n"
                     "os.wait()\n" + _RANK.replace("; ", "\n"))


def test_a_daemon_of_a_local_pod_is_struck_with_its_node(tmp_path):
    """In a pod an orphan goes to the container's PID 1, so a node fault reaches the Wrapper's monitor
    processes too; the local pod's top process is a child subreaper for the same effect."""
    top_code = f"import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', {_DAEMONIZING_RANK!r}]); time.sleep(60)"
    top = psutil.Popen([sys.executable, "-c", top_code, "ft_launcher"], cwd=Path(__file__).resolve().parents[2],
                       start_new_session=True, preexec_fn=pod_top_process)
    try:
        # the rank and its daemon, re-parented to the top process (not to init) once its parent left
        assert _wait_until(lambda: len(top.children()) == 2)
        rank, daemon = sorted(top.children(), key=psutil.Process.create_time)
        assert _wait_until(lambda: _stopped(top) and _stopped(rank) and _stopped(daemon))
    finally:
        for p in (*top.children(recursive=True), top):
            p.kill()
        top.wait(timeout=10)


@pytest.fixture
def cluster(tmp_path):
    cfg = load_train_config(None, [f"run_dir={tmp_path / 'run'}"])
    cluster = Cluster(cfg, tmp_path / "config.yaml",
                      ClusterShape(nodes=2, nproc_per_node=1, node_retries=3, replacement_delay_s=1.0))
    for node in cluster.nodes:
        node.proc, node.joined, node.active = psutil.Popen(["sleep", "60"], start_new_session=True), True, True  # both training
    yield cluster
    cluster.stop_all()
    for evicted in cluster.lifecycle.left_behind():
        cluster.kill_node(evicted)


def test_the_controller_replaces_a_hung_nodes_pod_after_the_replacement_delay_and_leaves_it_stopped(cluster):
    hung = cluster.nodes[1]
    process = hung.proc
    process.send_signal(signal.SIGSTOP)
    assert _wait_until(lambda: _stopped(process))
    cluster.lifecycle.serve()
    cluster.lifecycle.serve()  # noticed once
    assert hung.start_at is None  # NotReady, not yet force-deleted
    [detected] = [e for e in read_events(cluster.run_dir) if e["event"] == "fault_detected"]
    assert detected["kind"] == "node" and "node 1 stopped responding" in detected["detail"]
    time.sleep(1.0)
    cluster.lifecycle.serve()
    assert hung.start_at is not None and hung.proc is None  # replaced
    assert _stopped(process)  # its old processes stay stopped where they are, as on the hung machine
    assert [e["node"] for e in read_events(cluster.run_dir) if e["event"] == "node_replaced"] == [1]
    assert cluster.nodes[0].start_at is None  # the node that runs on is left alone


HANG_DELAY_S = 5
HANG_OVERRIDES = ("checkpoint.mode=sync", "fault_tolerance.timeout_safety_factor=15")  # as test_partition.py's


def _hang_run(run_dir: Path, faults: str, **shape):
    """Two nodes of one rank, `shape` changed from them, hung by `faults`."""
    return completed(run_local(run_dir, *replace(TWO_NODES, **shape).argv(), *COMMON, *HANG_OVERRIDES,
                               "--faults", faults, timeout=300))


@pytest.mark.slow
def test_a_hung_node_without_a_spare_is_replaced_and_the_run_resumes_exactly(tmp_path, reference, scratch):
    run = _hang_run(tmp_path / "run", "node-hang@12:node=1", replacement_delay_s=HANG_DELAY_S)
    [replaced] = events_named(run.run_dir, "node_replaced")
    assert replaced["node"] == 1
    [injected] = events_named(run.run_dir, "fault_injected")
    assert HANG_DELAY_S <= replaced["t"] - injected["t"] < HANG_DELAY_S + 10  # bounded by the delay, not a timeout
    [fault] = build_report(read_events(run.run_dir)).faults
    assert fault.kind == "node-hang" and fault.resumed_from == 10
    assert_bitwise_equal(load_final_state(run.run_dir, scratch), load_final_state(reference.run_dir, scratch))
    assert not [p for p in psutil.process_iter(["cmdline"]) if str(run.run_dir) in " ".join(p.info["cmdline"] or [])]


@pytest.mark.slow
def test_with_a_spare_a_hung_node_costs_nvrx_detection_not_the_replacement_delay(tmp_path, reference, scratch):
    slow_replacement_s = 120
    run = _hang_run(tmp_path / "run", "node-hang@12:node=1", spares=1, replacement_delay_s=slow_replacement_s)
    [fault] = build_report(read_events(run.run_dir)).faults
    assert fault.kind == "node-hang" and fault.resumed_from == 10
    assert fault.recovery_s < slow_replacement_s  # the spare (node 2) took node 1's place
    assert "Assigned active rank" in (run.run_dir / "logs" / "node2.log").read_text()
    assert_bitwise_equal(load_final_state(run.run_dir, scratch), load_final_state(reference.run_dir, scratch))
