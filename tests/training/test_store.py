"""The store's process (training.pod.store): started over when the run stalls, never after it completed."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from training.contract.events import EventLog, events_dir
from training.pod.store import stalled
from training_helpers import REPO_ROOT

STEPS = 10


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
