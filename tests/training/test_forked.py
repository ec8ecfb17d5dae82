"""training.pod.forked: a command forked from a process that imported it behaves as the same command exec'd."""
from __future__ import annotations

import os
import signal
import subprocess
import sys

import psutil
import pytest

from training.pod.forked import FORK_ENV, ForkedChild, popen

PROBE = """
import os, sys, time
print(os.getcwd(), sys.argv[1:], os.environ["PROBE"], flush=True)
if sys.argv[1] == "sleep":
    time.sleep(60)
sys.exit(int(sys.argv[1]))
"""


def _start(tmp_path, arg: str, fork: bool):
    (tmp_path / "probe_module.py").write_text(PROBE)
    env = {**os.environ, "PYTHONPATH": str(tmp_path), "PROBE": "from the environment"}
    env.pop(FORK_ENV, None)
    if fork:
        env[FORK_ENV] = "1"
    with (tmp_path / "out").open("wb") as out:
        return popen([sys.executable, "-m", "probe_module", arg], env=env, cwd=tmp_path, stdout=out,
                     stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)


@pytest.mark.parametrize("fork", [True, False])
def test_a_forked_command_takes_its_cwd_argv_environment_streams_and_exit_code_as_an_exec(tmp_path, fork):
    child = _start(tmp_path, "3", fork)
    assert isinstance(child, ForkedChild) is fork
    assert child.wait(timeout=60) == 3 and child.returncode == 3
    assert (tmp_path / "out").read_text() == f"{tmp_path} ['3'] from the environment\n"


def test_a_forked_command_is_signalled_and_waited_for_as_a_popen(tmp_path):
    child = _start(tmp_path, "sleep", fork=True)
    with pytest.raises(subprocess.TimeoutExpired):
        child.wait(timeout=0.2)
    with pytest.raises(psutil.TimeoutExpired):
        child.wait(timeout=0.2)
    assert child.poll() is None and os.getsid(child.pid) == child.pid  # its own session
    child.terminate()
    assert child.wait(timeout=30) == -signal.SIGTERM
    child.kill()  # reaped: nothing is signalled, not another process given its pid


def test_a_forked_command_reaped_elsewhere_ends_with_code_0_as_a_popen_does(tmp_path):
    child = _start(tmp_path, "0", fork=True)
    os.waitpid(child.pid, 0)  # psutil.wait_procs does this to the processes of a killed pod
    assert child.poll() == 0 and child.wait(timeout=1) == 0
