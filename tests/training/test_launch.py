"""The node entry point (training.pod.launch): 0 means the run completed, whatever ft_launcher exits with;
signals reach the launcher; older pods rank before newer ones in NVRx's rendezvous."""
from __future__ import annotations

import contextlib
import errno
import logging
import os
import signal
import subprocess
import sys
import threading
import time

import psutil
import pytest

from training.contract.events import EventLog, EventTail
from training.contract.exit_codes import CONFIG_ERROR, INCOMPLETE
from training.contract.job_failure import (FailureRequest, FailureRequests, JobMustFail, request_job_failure,
                                           requests_dir)
from training.contract.launcher import STORE_ENDPOINT_ENV
from training.pod import launch
from training.pod.launch import MAX_PODS, fail_the_job, launcher_env
from training_helpers import REPO_ROOT

STEPS = 10


@pytest.fixture
def config(tmp_path):
    path = tmp_path / "config.yaml"
    path.write_text(f"run_dir: {tmp_path / 'run'}\ntraining:\n  steps: {STEPS}\n")
    return path


def _launch(config, *command, env=None, **popen) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "training.pod.launch", "--config", str(config), "--", *command],
                            cwd=REPO_ROOT, env={**os.environ, "PYTHONPATH": str(REPO_ROOT), **(env or {})},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **popen)


def _exit(config, *command, env=None) -> tuple[int, str]:
    proc = _launch(config, *command, env=env)
    out, _ = proc.communicate(timeout=60)
    return proc.returncode, out


def _run_end(config, step, status="completed"):
    EventLog(config.parent / "run", "rank0").emit("run_end", step=step, status=status)


def test_a_clean_exit_without_the_runs_completion_is_retried(config):
    code, out = _exit(config, "true")
    assert code == INCOMPLETE and f"has not completed {STEPS} steps" in out


def test_a_completed_run_exits_0_even_when_the_launcher_fails(config):
    _run_end(config, STEPS)
    assert _exit(config, sys.executable, "-c", "import sys; sys.exit(1)")[0] == 0


def test_a_node_started_after_the_runs_end_has_nothing_to_do(config, tmp_path):
    _run_end(config, STEPS)
    marker = tmp_path / "ran"
    code, out = _exit(config, "touch", str(marker))
    assert code == 0 and not marker.exists() and "has completed: nothing to do" in out


def test_an_earlier_shorter_run_in_the_same_directory_is_not_this_runs_end(config):
    _run_end(config, STEPS - 5)
    _run_end(config, STEPS, status="failed")
    assert _exit(config, "true")[0] == INCOMPLETE


@pytest.mark.parametrize("command, code", [
    ((sys.executable, "-c", "import sys; sys.exit(7)"), 7),
    ((sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"), 128 + 9),
])
def test_a_failure_exits_as_the_launcher_did(config, command, code):
    assert _exit(config, *command)[0] == code


def test_sigterm_reaches_the_launcher(config, tmp_path):
    ready = tmp_path / "ready"
    child = (f"import signal, sys, time, pathlib\nsignal.signal(signal.SIGTERM, lambda *a: sys.exit(42))\n"
             f"pathlib.Path({str(ready)!r}).touch()\ntime.sleep(60)\n")
    proc = _launch(config, sys.executable, "-c", child)
    deadline = time.monotonic() + 30
    while not ready.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    proc.communicate(timeout=30)
    assert proc.returncode == 42


def test_the_launchers_infrastructure_rank_is_the_pods_start_then_its_index(config):
    before = time.time()
    _, out = _exit(config, "sh", "-c", 'echo "rank=$GROUP_RANK"', env={"JOB_COMPLETION_INDEX": "5"})
    rank = int(out.split("rank=")[1].split()[0])
    assert rank % MAX_PODS == 5 and before * 1000 - 1 <= rank // MAX_PODS <= time.time() * 1000
    # a replacement of index 0 started later ranks after a spare of index 2 started earlier: the
    # spare, which already trains, keeps its place
    spare, replacement = (int(launcher_env({"JOB_COMPLETION_INDEX": i}, t, [])["GROUP_RANK"])
                          for i, t in (("2", 100.0), ("0", 160.5)))
    assert spare < replacement
    assert "GROUP_RANK" not in launcher_env({}, 100.0, [])  # not a pod of an Indexed Job: NVRx's own ranks


@pytest.mark.parametrize("command", [["ft_launcher", "--nnodes=2", "--rdzv-endpoint=store.ns:29400", "-m", "x"],
                                     ["ft_launcher", "--rdzv_endpoint", "store.ns:29400", "-m", "x"]])
def test_the_ranks_are_told_where_the_rendezvous_store_is(command):
    """The in-process Wrapper coordinates in the rendezvous store, which outlives every node."""
    assert launcher_env({}, 100.0, command)[STORE_ENDPOINT_ENV] == "store.ns:29400"
    assert STORE_ENDPOINT_ENV not in launcher_env({}, 100.0, ["ft_launcher", "--standalone", "-m", "x"])


def test_an_invalid_config_fails_before_the_launcher_starts(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("training:\n  steps: -1\n")
    code, out = _exit(bad, "true")
    assert code == CONFIG_ERROR and "training.steps" in out


# ---- a rank's request that the Job fail (training/contract/job_failure.py) --------------------------

def _asks_for_job_failure(run_dir, cause):
    """A launcher whose rank asks for the Job to fail, then carries on as ft_launcher would (restarting)."""
    return (sys.executable, "-c", "import time\nfrom training.contract.job_failure import request_job_failure\n"
            f"request_job_failure({str(run_dir)!r}, 'rank1', {cause!r})\ntime.sleep(120)\n")


def test_a_ranks_request_fails_the_pod_at_once_with_config_error_and_its_cause(config):
    cause = "checkpoint step_00000010 is intact but cannot be loaded into this run's model and optimizer"
    started = time.monotonic()
    code, out = _exit(config, *_asks_for_job_failure(config.parent / "run", cause))
    assert code == CONFIG_ERROR and time.monotonic() - started < 15  # not after the launcher's restarts
    assert out.strip().splitlines()[-1] == (f"training.pod.launch: rank1 asked for the Job to fail, as no restart "
                                            f"can help: {cause}")


def test_a_request_left_by_an_earlier_job_is_not_this_ones(config):
    request_job_failure(config.parent / "run", "rank0", "an earlier Job's cause, fixed since")
    assert _exit(config, "true")[0] == INCOMPLETE


def test_the_cause_is_the_containers_termination_message(tmp_path):
    log = tmp_path / "termination-log"
    log.touch()  # the kubelet creates it in every container
    assert fail_the_job(FailureRequest("rank0", "x" * 5000), log) == CONFIG_ERROR
    assert log.read_text() == ("rank0 asked for the Job to fail, as no restart can help: " + "x" * 5000)[:4096]
    assert fail_the_job(FailureRequest("rank0", "cause"), tmp_path / "absent") == CONFIG_ERROR  # not in a pod


def test_failure_requests_are_read_once_each_and_only_whole_ones(tmp_path):
    request_job_failure(tmp_path, "rank0", "before")
    requests = FailureRequests(tmp_path)
    assert requests.new() is None
    (requests_dir(tmp_path) / "foreign.json").write_text("{not json")
    error = request_job_failure(tmp_path, "rank3", "after")
    assert isinstance(error, JobMustFail) and not isinstance(error, Exception)  # the Wrapper lets it through
    assert requests.new() == FailureRequest("rank3", "after")
    assert requests.new() is None


def test_a_request_that_cannot_be_read_now_is_read_again_not_skipped(tmp_path, monkeypatch):
    """An EIO on the request's file (FSx's client evicted as the rank wrote it): the next listing reads it."""
    requests = FailureRequests(tmp_path)
    request_job_failure(tmp_path, "rank2", "cause")
    real_read = type(tmp_path).read_text
    failures = [OSError(errno.EIO, "Input/output error")]

    def evicted(path, *args, **kwargs):
        if path.parent == requests_dir(tmp_path) and failures:
            raise failures.pop()
        return real_read(path, *args, **kwargs)

    monkeypatch.setattr(type(tmp_path), "read_text", evicted)
    with pytest.raises(OSError, match="Input/output error"):
        requests.new()
    assert requests.new() == FailureRequest("rank2", "cause")


def test_a_launcher_still_running_after_the_runs_completion_is_stopped(config, monkeypatch):
    """A node that stood by as the run ended may wait for a round that never comes (a store started again after
    the rendezvous shut down): it is stopped once the run completed, and the pod exits 0."""
    monkeypatch.setattr(launch, "COMPLETION_POLL_S", 0.2)
    monkeypatch.setattr(launch, "COMPLETED_GRACE_S", 0.5)
    monkeypatch.setattr(launch, "POLL_S", 0.05)
    run_dir = config.parent / "run"
    _run_end(config, STEPS - 5)  # an earlier run's end, there before the launcher started: not this run's
    watch = launch.CompletionWatch(str(run_dir), STEPS)
    started = time.monotonic()
    threading.Timer(1.0, _run_end, (config, STEPS)).start()
    with launch.PassedOn() as signals:
        code, request = launch.run([sys.executable, "-c", "import time; time.sleep(60)"],
                                   launch.RequestWatch(str(run_dir)), watch, signals)
    assert (code, request) == (128 + signal.SIGTERM, None) and time.monotonic() - started < 10


def test_a_completion_recorded_while_the_pod_starts_is_not_missed(config, monkeypatch):
    """The run's end is written just after the start-up check read the log (a replacement started as the run
    ended): the pod watches from before that check, so it still stops its launcher and exits 0."""
    monkeypatch.setattr(launch, "COMPLETION_POLL_S", 0.2)
    monkeypatch.setattr(launch, "COMPLETED_GRACE_S", 0.5)
    monkeypatch.setattr(launch, "POLL_S", 0.05)
    checked = launch.run_completed

    def completes_right_after_the_check(run_dir, steps):
        seen = checked(run_dir, steps)
        _run_end(config, STEPS)
        monkeypatch.setattr(launch, "run_completed", checked)
        return seen

    monkeypatch.setattr(launch, "run_completed", completes_right_after_the_check)
    started = time.monotonic()
    # a launcher left alone sleeps 30 s (and the pod would then exit 0 too, late)
    code = launch.main(["--config", str(config), "--", sys.executable, "-c", "import time; time.sleep(30)"])
    assert code == 0 and time.monotonic() - started < 10


# ---- the run directory on FSx, while its Lustre client is evicted (training.pod.read_errors) --------------

class EvictedClient:
    """Every read PID 1 makes of the run directory fails, with EIO and ESTALE by turns, while the file `down`
    holds a unix time still to come: the fake launcher, which reads and writes as it likes, starts the outage."""

    def __init__(self, monkeypatch, down):
        self.down, self.failed = down, 0
        for owner, name in ((launch, "run_completed"), (EventTail, "_read_new_lines"), (FailureRequests, "_names")):
            monkeypatch.setattr(owner, name, self._failing(getattr(owner, name)))
        monkeypatch.setattr(EventTail, "from_now", staticmethod(self._failing(EventTail.from_now)))

    def _failing(self, read):
        def evicted(*args, **kwargs):
            if self.down.exists() and time.time() < float(self.down.read_text()):
                self.failed += 1
                raise OSError(*((errno.EIO, "Input/output error") if self.failed % 2 else
                                (errno.ESTALE, "Stale file handle")))
            return read(*args, **kwargs)
        return evicted


def _launcher(*lines):
    return (sys.executable, "-c", "\n".join(["import pathlib, time", *lines]))


def _outage(down, seconds):
    return f"pathlib.Path({str(down)!r}).write_text(str(time.time() + {seconds}))"


@pytest.fixture
def quick_polls(monkeypatch):
    monkeypatch.setattr(launch, "POLL_S", 0.05)
    monkeypatch.setattr(launch, "COMPLETION_POLL_S", 0.05)


def test_pid_1_outlives_reads_that_fail_while_its_launcher_runs_and_loses_no_request(config, tmp_path, monkeypatch,
                                                                                     caplog, quick_polls):
    """The rank's request lands while PID 1 cannot read the run directory for a second: PID 1 keeps its launcher,
    logs the failure once (not at every poll), and acts on the request once the reads succeed again."""
    down = tmp_path / "down"
    fsx = EvictedClient(monkeypatch, down)
    caplog.set_level(logging.WARNING, "training.pod.launch")
    code = launch.main(["--config", str(config), "--", *_launcher(
        "from training.contract.job_failure import request_job_failure", _outage(down, 1.0),
        f"request_job_failure({str(config.parent / 'run')!r}, 'rank1', 'a cause')", "time.sleep(60)")])
    assert code == CONFIG_ERROR and fsx.failed > 10  # the request was acted on, after many failed reads
    lines = [r.getMessage() for r in caplog.records]
    failing = [line for line in lines if line.startswith("cannot read the job failure requests")]
    assert len(failing) == 1 and "Input/output error" in failing[0] and "the launcher runs on" in failing[0]
    assert any(line.startswith("the job failure requests") and "can be read again" in line for line in lines)


def test_a_completed_run_exits_0_though_the_run_directory_cannot_be_read_as_its_launcher_exits(config, tmp_path,
                                                                                               monkeypatch,
                                                                                               quick_polls):
    """The launcher exits 0 as the run completes, and the event log cannot be read for a while: the pod's exit
    code waits for it, and is 0, not a traceback's 1 (the Job would retry the index)."""
    down = tmp_path / "down"
    fsx = EvictedClient(monkeypatch, down)
    code = launch.main(["--config", str(config), "--", *_launcher(
        "from training.contract.events import EventLog", _outage(down, 1.0),
        f"EventLog({str(config.parent / 'run')!r}, 'rank0').emit('run_end', step={STEPS}, status='completed')")])
    assert code == 0 and fsx.failed > 0


def test_a_pod_starts_once_the_run_directory_answers(config, tmp_path, monkeypatch, quick_polls):
    """The check before the start, the watches' first reads: all fail at first; the launcher starts when the
    run directory answers, and its exit decides."""
    down = tmp_path / "down"
    down.write_text(str(time.time() + 0.5))
    fsx = EvictedClient(monkeypatch, down)
    assert launch.main(["--config", str(config), "--", sys.executable, "-c", "import sys; sys.exit(7)"]) == 7
    assert fsx.failed > 0


# ---- signals in every order of events ------------------------------------------------------------------------

# PID 1 as in a container, where orphans are re-parented to it (a child subreaper here: prctl(2)), polling
# every 10 s, so that each signal lands between two polls
_PID_1 = ("import ctypes, sys\nfrom training.pod import launch\n"
          "ctypes.CDLL(None).prctl(36, 1)  # PR_SET_CHILD_SUBREAPER\n"
          "launch.POLL_S = 10.0\n{patch}\nsys.exit(launch.main(sys.argv[1:]))\n")
_NOT_WOKEN_BY_ITS_END = "launch.WAKES = ()"  # the launcher's end waits for the next poll too


def _pid_1(config, *command, patch=""):
    return subprocess.Popen([sys.executable, "-c", _PID_1.format(patch=patch), "--config", str(config), "--", *command],
                            cwd=REPO_ROOT, env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _wait_for(condition, seconds=30.0):
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def _zombie(pid):
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@pytest.mark.parametrize("orphan", [False, True], ids=["alone", "with an orphan alive"])
def test_a_signal_just_after_the_launcher_exited_keeps_its_exit_code(config, tmp_path, orphan):
    """SIGTERM lands after the launcher exited and before PID 1 reaped it (a pod deleted as its launcher
    fails): PID 1 exits as the launcher did, at once, with or without an orphan of it still running."""
    pid_file, orphan_file = tmp_path / "pid", tmp_path / "orphan"
    orphan_start = f"sleep 30 >/dev/null 2>&1 & echo $! > {orphan_file}; " if orphan else ""
    script = f"{orphan_start}echo $$ > {pid_file}; sleep 1; exit 3"  # PID 1 waits for its next poll meanwhile
    proc = _pid_1(config, "sh", "-c", script, patch=_NOT_WOKEN_BY_ITS_END)
    try:
        _wait_for(lambda: pid_file.exists() and pid_file.read_text().strip())
        launcher = int(pid_file.read_text())
        _wait_for(lambda: _zombie(launcher))  # exited, not reaped: PID 1 is between two polls
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=8)  # at once: not at PID 1's next poll, nor after the orphan's 30 s
        assert proc.returncode == 3, out
    finally:
        proc.kill()
        if orphan and orphan_file.exists():
            with contextlib.suppress(psutil.NoSuchProcess):
                psutil.Process(int(orphan_file.read_text())).kill()


def test_pid_1_sees_the_launchers_end_at_once_not_at_its_next_poll(config):
    proc = _pid_1(config, "sh", "-c", "sleep 1; exit 3")
    out, _ = proc.communicate(timeout=8)  # its next poll would be 10 s after the start
    assert proc.returncode == 3, out


def test_a_signal_before_the_launcher_starts_reaches_it_and_one_after_its_exit_changes_nothing(config):
    """SIGTERM lands while PID 1 reads the event log before the start (the kubelet stops a pod just started):
    the launcher gets it once it runs; another lands as PID 1 reads the log after the exit: no effect."""
    patch = ("import os, signal\nread = launch.run_completed\n"
             "launch.run_completed = lambda *a: os.kill(os.getpid(), signal.SIGTERM) or read(*a)")
    proc = _pid_1(config, "sleep", "60", patch=patch)
    out, _ = proc.communicate(timeout=40)  # the launcher was stopped, not left to sleep 60 s
    assert proc.returncode == 128 + signal.SIGTERM, out
