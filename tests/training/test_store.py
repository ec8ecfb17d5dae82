"""The store's process (training.pod.store): started over when the run stalls, never after it completed."""
from __future__ import annotations

import contextlib
import errno
import logging
import os
import signal
import socket
import subprocess
import sys
import time

import psutil

from training.contract.config import load_train_config
from training.contract.events import EventLog, events_dir
from training.contract.launcher import free_port
from training.local.cluster import Cluster
from training.local.shape import ClusterShape
from training.pod import store
from training.pod.store import stalled
from training_helpers import REPO_ROOT

STEPS = 10
# a store listening on `port`; with SO_REUSEADDR, as the test binds too: only a live listener keeps another out
_HOLDER = ("import socket, time\ns = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n"
           "s.bind(('127.0.0.1', {port})); s.listen(); time.sleep(60)\n")


def _config(tmp_path):
    path = tmp_path / "config.yaml"
    path.write_text(f"run_dir: {tmp_path / 'run'}\ntraining:\n  steps: {STEPS}\n")
    return path


def test_a_run_stalls_only_without_events_for_the_timeout_and_before_its_end(tmp_path):
    run = tmp_path / "run"
    now = time.time()
    assert stalled(run, STEPS, since=now - 100, timeout_s=60, now=now)  # no event at all, store up 100 s
    assert not stalled(run, STEPS, since=now - 10, timeout_s=60, now=now)  # store just started
    EventLog(run, "rank0").emit("step", step=3)
    old = now - 100
    os.utime(events_dir(run) / "rank0.jsonl", (old, old))
    assert stalled(run, STEPS, since=old, timeout_s=60, now=now)
    assert not stalled(run, STEPS, since=old, timeout_s=200, now=now)
    EventLog(run, "rank0").emit("run_end", step=STEPS, status="completed")
    os.utime(events_dir(run) / "rank0.jsonl", (old, old))
    assert not stalled(run, STEPS, since=old, timeout_s=60, now=now)  # completed: nothing to start over


def test_a_stalled_run_gets_a_new_store_and_signals_reach_it(tmp_path):
    starts = tmp_path / "starts"
    store = (f"import pathlib, time\nwith open({str(starts)!r}, 'a') as f: f.write('start\\n')\ntime.sleep(60)\n")
    proc = subprocess.Popen([sys.executable, "-m", "training.pod.store", "--config", str(_config(tmp_path)),
                             "--stall-timeout", "0.5", "--", sys.executable, "-c", store],
                            cwd=REPO_ROOT, env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and (not starts.exists() or len(starts.read_text().split()) < 2):
        time.sleep(0.1)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=30)
    assert len(starts.read_text().split()) >= 2, out  # started over
    assert "starting the store over" in out
    assert proc.returncode == 128 + signal.SIGTERM  # the store got the SIGTERM and the process exits as it did


def test_a_failing_read_of_the_event_log_is_logged_and_retried_not_fatal(tmp_path, monkeypatch, caplog):
    """An evicted Lustre client: EIO, then ESTALE, for a while; the store keeps running and is not
    taken for stalled; once the log reads again, the stall watch goes on."""
    run = tmp_path / "run"
    EventLog(run, "rank0").emit("step", step=1)
    failures = [OSError(errno.EIO, "Input/output error"), OSError(errno.ESTALE, "Stale file handle")] * 2
    real_scandir = os.scandir

    def evicted(path):
        if failures:
            raise failures.pop(0)
        return real_scandir(path)

    monkeypatch.setattr(os, "scandir", evicted)
    monkeypatch.setattr(store, "POLL_S", 0.05)
    polls = []
    real_stalled = store.stalled
    monkeypatch.setattr(store, "stalled", lambda *a: polls.append(1) or real_stalled(*a))
    caplog.set_level(logging.WARNING, "training.pod.store")
    started = time.monotonic()
    rc = store.supervise([sys.executable, "-c", "import time; time.sleep(2)"], str(run), STEPS, timeout_s=600)
    assert rc == 0 and time.monotonic() - started >= 1.9  # the store ran its course, never restarted
    assert not failures and len(polls) > 4  # every failed read was retried, and reads went on after
    lines = [r.getMessage() for r in caplog.records]
    assert "cannot read the event log" in lines[0] and "Input/output error" in lines[0]
    assert any("can be read again" in line and "4 failed read(s)" in line for line in lines)
    assert not any("starting the store over" in line for line in lines)


def test_a_store_that_dies_takes_its_nvrx_control_with_it(tmp_path):
    """Its process dies (SIGKILL, OOM): the store it ran must not keep the port from the next one."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "training.pod.store", "--config", str(_config(tmp_path)), "--",
                             sys.executable, "-c", _HOLDER.format(port=port)], cwd=REPO_ROOT,
                            env={**os.environ, "PYTHONPATH": str(REPO_ROOT)}, start_new_session=True)
    try:
        _wait_until(lambda: not _port_free(port))
        proc.kill()
        proc.wait()
        _wait_until(lambda: _port_free(port))
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)


def test_the_local_cluster_restarts_its_store_on_a_free_port(tmp_path, monkeypatch):
    """The controller starts an exited store again on its port: nothing of the old one may still hold it,
    even a child that its process left behind."""
    port = free_port()
    leaves_its_store_behind = (
        "import subprocess, sys, time\n"
        f"subprocess.Popen([sys.executable, '-c', {_HOLDER.format(port=port)!r}]); time.sleep(60)\n")
    cluster = Cluster(load_train_config(None, [f"run_dir={tmp_path / 'run'}"]), _config(tmp_path),
                      ClusterShape(nodes=1, nproc_per_node=1, node_retries=0))
    port_free_at_start = []
    monkeypatch.setattr(cluster, "start_store", lambda: port_free_at_start.append(_port_free(port)))
    cluster.store = psutil.Popen([sys.executable, "-c", leaves_its_store_behind], start_new_session=True)
    try:
        _wait_until(lambda: not _port_free(port))
        cluster.store.kill()  # the store's process dies; the child it started holds the port
        cluster.store.wait()
        cluster._handle_exits()
        assert port_free_at_start == [True]
    finally:
        cluster.stop_store()


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def _wait_until(condition, timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)
