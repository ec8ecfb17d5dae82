"""training.pod.prefork: workers forked from a template that already imported torch behave, for
ft_launcher, like the `python -m` they replace: argv, environment, cwd, stdio, exit status,
signals; and none outlives the stub that ft_launcher started."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from nvidia_resiliency_ext.fault_tolerance import ft_rendezvous_barrier

from training.pod import rendezvous_names
from training.pod.forked import console_script
from training.pod.prefork import SERVER_ENV

REPO = Path(__file__).resolve().parents[2]
PROBE = '''
import gc, json, os, sys, time
mode, arg = sys.argv[1], sys.argv[2]
if mode == "report":
    import torch
    print(json.dumps({"pid": os.getpid(), "ppid": os.getppid(), "sid": os.getsid(0), "argv": sys.argv[1:],
                      "cwd": os.getcwd(), "marker": os.environ.get("PROBE_MARKER"),
                      "threads": torch.get_num_threads(), "file": __file__, "umask": os.umask(0),
                      "cpus": sorted(os.sched_getaffinity(0)), "frozen": gc.get_freeze_count()}))
    sys.exit(int(arg))
import subprocess
helper = subprocess.Popen(["sleep", "120"])  # a process the worker started, as DataLoader workers are
with open(arg, "w") as f:  # mode "wait": say who runs, then wait to be signalled
    f.write(f"{os.getpid()} {helper.pid}")
time.sleep(120)
'''


@pytest.fixture(scope="module")
def template(tmp_path_factory):
    """A launched template (what `prefork launch ft_launcher …` starts) and the value of SERVER_ENV;
    the launched command reports it and sleeps, standing in for ft_launcher."""
    launcher = subprocess.Popen(
        [sys.executable, "-m", "training.pod.prefork", "launch", "sh", "-c", f'echo "${SERVER_ENV}"; exec sleep 600'],
        cwd=REPO, stdout=subprocess.PIPE, text=True)
    server = launcher.stdout.readline().strip()
    template = psutil.Process(int(server.split(":")[0]))
    yield server
    launcher.kill()
    launcher.wait()
    _, alive = psutil.wait_procs([template], timeout=10)
    assert not alive, "the template must end with its launcher"


@pytest.fixture()
def probe_dir(tmp_path):
    (tmp_path / "prefork_probe.py").write_text(PROBE)
    return tmp_path


def _stub(probe_dir: Path, server: str | None, *args: str, umask: int = -1, cpus: set[int] | None = None,
          **env: str) -> subprocess.Popen:
    environ = {k: v for k, v in os.environ.items() if k != SERVER_ENV}
    environ.update(PYTHONPATH=f"{probe_dir}{os.pathsep}{REPO}", **env)
    if server is not None:
        environ[SERVER_ENV] = server
    return subprocess.Popen([sys.executable, "-m", "training.pod.prefork", "worker", "prefork_probe", *args],
                            cwd=probe_dir, env=environ, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            umask=umask, preexec_fn=None if cpus is None else lambda: os.sched_setaffinity(0, cpus))


def _worker_and_helper(pid_file: Path) -> list[psutil.Process]:
    deadline = time.monotonic() + 60
    while not (pid_file.exists() and pid_file.read_text()):
        assert time.monotonic() < deadline, "the worker never started"
        time.sleep(0.05)
    return [psutil.Process(int(pid)) for pid in pid_file.read_text().split()]


def _all_gone(processes: list[psutil.Process]) -> bool:
    _, alive = psutil.wait_procs(processes, timeout=10)
    return not alive


def test_worker_is_forked_from_the_template_with_the_stubs_argv_env_cwd_and_exit_code(template, probe_dir):
    cpus = {sorted(os.sched_getaffinity(0))[-1]}  # as a NUMA binding by the launcher would
    stub = _stub(probe_dir, template, "report", "3", umask=0o027, cpus=cpus, PROBE_MARKER="from-the-stub",
                 OMP_NUM_THREADS="1")
    out, err = stub.communicate(timeout=60)
    assert stub.returncode == 3, err
    seen = json.loads(out)
    assert seen["pid"] != stub.pid and seen["ppid"] != stub.pid, "forked by the template, not started by the stub"
    assert seen["sid"] == seen["pid"], "in its own session, as ft_launcher's workers are"
    assert seen["argv"] == ["report", "3"]
    assert seen["cwd"] == str(probe_dir) and seen["file"] == str(probe_dir / "prefork_probe.py")
    assert seen["marker"] == "from-the-stub"
    assert seen["threads"] == 1  # OMP_NUM_THREADS of the stub, not of the template
    assert seen["umask"] == 0o027 and seen["cpus"] == sorted(cpus)
    # the template's imports are frozen: a full collection in the worker (the Wrapper's at every in-process
    # restart) does not walk torch's and NVRx's objects
    assert seen["frozen"] > 100_000


def test_the_preloaded_training_module_runs_as_main_like_python_m(template, tmp_path):
    environ = {**os.environ, SERVER_ENV: template, "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-m", "training.pod.prefork", "worker", "training.train", "--help"],
                          cwd=tmp_path, env=environ, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "usage: python -m training.train" in proc.stdout
    assert "Warning" not in proc.stderr  # runpy complains when the module is already in sys.modules


def test_a_signal_to_the_stub_reaches_the_workers_group_and_the_stub_dies_by_it(template, probe_dir):
    pid_file = probe_dir / "pid"
    stub = _stub(probe_dir, template, "wait", str(pid_file))
    processes = _worker_and_helper(pid_file)
    stub.send_signal(signal.SIGTERM)  # what ft_launcher sends to stop its workers
    assert stub.wait(timeout=30) == -signal.SIGTERM
    assert _all_gone(processes)


def test_a_worker_killed_by_the_rank_monitor_is_reported_as_that_signal_and_its_helpers_go(template, probe_dir):
    pid_file = probe_dir / "pid"
    stub = _stub(probe_dir, template, "wait", str(pid_file))
    worker, helper = _worker_and_helper(pid_file)
    worker.kill()  # NVRx's rank monitor kills the PID its client reported
    assert stub.wait(timeout=30) == -signal.SIGKILL, stub.stderr.read()
    assert _all_gone([helper]), "a helper of a dead worker was left running"


def test_a_killed_stub_takes_its_worker_and_helpers_with_it(template, probe_dir):
    pid_file = probe_dir / "pid"
    stub = _stub(probe_dir, template, "wait", str(pid_file))
    processes = _worker_and_helper(pid_file)
    stub.kill()  # ft_launcher's SIGKILL after its stop timeout
    stub.wait(timeout=30)
    assert _all_gone(processes), "the worker outlived the process ft_launcher started"


def test_without_a_template_the_stub_runs_the_module_itself(probe_dir):
    stub = _stub(probe_dir, None, "report", "0")
    out, err = stub.communicate(timeout=60)
    assert stub.returncode == 0, err
    assert json.loads(out)["pid"] == stub.pid  # exec'd in place: a plain `python -m`


def test_with_its_template_gone_the_stub_says_so_and_runs_the_module_itself(probe_dir):
    gone = subprocess.Popen(["true"])
    gone.wait()
    stub = _stub(probe_dir, f"{gone.pid}:training-prefork-test-nobody-listens", "report", "5")
    out, err = stub.communicate(timeout=60)
    assert stub.returncode == 5
    assert json.loads(out)["pid"] == stub.pid
    assert "no worker template" in err and "starting a fresh Python" in err


def test_a_stub_refuses_a_socket_that_is_not_its_templates(probe_dir):
    """Anyone in the network namespace can bind an abstract name: the stub checks who listens."""
    impostor = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    impostor.bind("\0training-prefork-test-impostor")
    impostor.listen(1)
    with impostor:
        stub = _stub(probe_dir, f"{os.getppid()}:training-prefork-test-impostor", "report", "0")
        out, err = stub.communicate(timeout=60)
    assert stub.returncode == 0, err
    assert json.loads(out)["pid"] == stub.pid, "the stub must run the module itself"
    assert "refusing the worker template's address" in err


def test_ft_launcher_runs_in_the_launch_process_and_any_other_command_is_execd():
    """ft_launcher, a console script of this interpreter, is run by its entry point (its imports are then the
    template's too); `sh` is exec'd."""
    ft_launcher = console_script(str(Path(sys.executable).parent / "ft_launcher"))
    assert ft_launcher is not None and ft_launcher.value == "nvidia_resiliency_ext.fault_tolerance.launcher:main"
    assert console_script("sh") is None and console_script("no-such-command") is None


def test_ft_launchers_rendezvous_names_its_events_as_nvrx_does_without_inspect_stack(monkeypatch):
    """`launch` installs training.pod.rendezvous_names in ft_launcher's process: each rendezvous event keeps
    its name (the method that records it), read from the caller's frame."""
    nvrx_names = ft_rendezvous_barrier.get_method_name
    monkeypatch.setattr(ft_rendezvous_barrier, "get_method_name", nvrx_names)  # NVRx's, after this test
    rendezvous_names.install()
    assert ft_rendezvous_barrier.get_method_name is rendezvous_names.caller_name

    def _record(name):  # as FtRendezvousBarrierHandler._record calls it
        return name()

    def next_rendezvous(name):
        return _record(name)

    assert next_rendezvous(rendezvous_names.caller_name) == next_rendezvous(nvrx_names) == "next_rendezvous"
    assert rendezvous_names.caller_name(10_000) == nvrx_names(10_000) == "no_method_name"


def test_usage_error_names_the_commands():
    proc = subprocess.run([sys.executable, "-m", "training.pod.prefork", "start"], cwd=REPO, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 1
    assert "launch CMD" in proc.stderr and "worker MODULE" in proc.stderr
