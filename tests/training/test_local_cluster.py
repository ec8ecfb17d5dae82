"""The local controller: it replaces a node whose launcher died, and Ctrl-C leaves no process behind.

These test it as the adapter of the Job's rules; what the rules decide, case by case, test_job_rules.py tests."""
from __future__ import annotations

import contextlib

import psutil
import pytest

from training.contract.events import read_events
from training.local.shape import ClusterShape
from training_helpers import StartedRun, start_local as _start, wait_for_step as _wait_for_step

pytestmark = pytest.mark.slow


def _node(controller: StartedRun, node: int) -> tuple[psutil.Process, dict[str, str]]:
    """The node's top process (a pod's PID 1: training.pod.launch) and the environment its ranks have, read from
    the first of its processes that was exec'd (a forked one's /proc/<pid>/environ is what its parent's exec had)."""
    top = psutil.Process(controller.pid)
    for process in top.children(recursive=True):
        with contextlib.suppress(psutil.Error):
            if (env := process.environ()).get("JOB_COMPLETION_INDEX") == str(node):
                while process.ppid() != top.pid:
                    process = process.parent()
                return process, env
    raise AssertionError(f"no process of node {node} under the controller")


def _alive(processes: list[psutil.Process]) -> list[psutil.Process]:
    def running(p: psutil.Process) -> bool:
        try:
            return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False
    return [p for p in processes if running(p)]


def test_controller_replaces_a_dead_node(tmp_path):
    run_dir = tmp_path / "run"
    proc = _start(run_dir, *ClusterShape(nodes=2, nproc_per_node=1).argv(), "--steps", "40",
                  "checkpoint.interval=5", "training.collective_timeout_s=20",
                  "fault_tolerance.timeout_safety_factor=50")
    _wait_for_step(run_dir, 8, proc)
    victim, _ = _node(proc, 1)
    # both launchers share this host: NVRx 0.7.0's rendezvous closes for good unless told it is a simulation
    assert {_node(proc, n)[1].get("NVRX_ENABLE_MULTI_LAUNCHERS_PER_NODE") for n in (0, 1)} == {"1"}
    orphans = victim.children(recursive=True)
    victim.kill()  # the pod's PID 1 dies alone (an OOM kill: counted), its launcher and ranks would be orphaned
    out, _ = proc.communicate(timeout=180)
    assert proc.returncode == 0, out[-4000:]
    events = read_events(run_dir)
    assert [(e["node"], e["attempt"]) for e in events if e["event"] == "node_replaced"] == [(1, 1)]
    assert any(e["event"] == "restart" and e["restart_kind"] == "node" for e in events)
    assert [e["status"] for e in events if e["event"] == "run_end"] == ["completed"]
    assert max(e["step"] for e in events if e["event"] == "step") == 40
    assert not _alive(orphans)


@pytest.mark.xdist_group("ctrl-c")  # one worker makes the run for both (conftest's stopped_by_ctrl_c)
def test_ctrl_c_stops_every_process(stopped_by_ctrl_c):
    """The run: training_helpers.run_stopped_by_ctrl_c (its metrics: test_metrics.py)."""
    run = stopped_by_ctrl_c
    # the store; 2 nodes, each training.pod.launch, ft_launcher, a rank and a rank monitor at least
    assert len(run.tree) >= 9
    assert run.returncode == 130, run.output[-3000:]
    assert not _alive(run.tree), [p.pid for p in _alive(run.tree)]
    assert "stop requested" in run.output
    assert [e["status"] for e in read_events(run.run_dir) if e["event"] == "run_end"] == ["stopped"]
