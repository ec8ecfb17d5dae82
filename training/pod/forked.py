"""Commands of this interpreter run in a fork of the process that starts them: the local cluster's forked pods.

A pod of the local cluster is a chain of fresh interpreters (its PID 1, ft_launcher, the worker template, and
the store beside the pods) that import torch and NVRx again at every pod start, and the test suite starts
over a hundred pods on two cores. With FORK_ENV set, training.local's controller imports what those commands
import once (`preload`) and `popen` forks each one, as a pod's PID 1 and the store do for their own command:
the child takes the command's environment, working directory, standard streams, session and argv, as an exec
would, then runs its module as `python -m` does or its console script's entry point. What differs from an
exec: what an import read once (the environment, rlimits) is the parent's, and /proc/<pid>/cmdline and
/proc/<pid>/environ show what the parent was exec'd with. For the tests only; the chart never sets it.
"""
from __future__ import annotations

import contextlib
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from typing import IO, TYPE_CHECKING, Any, NoReturn

import psutil

if TYPE_CHECKING:
    from importlib.metadata import EntryPoint

FORK_ENV = "TRAINING_FORK_COMMANDS"  # "1": python commands are forked from a process that imported them


def forking(env: dict[str, str] | os._Environ[str] | None = None) -> bool:
    return (os.environ if env is None else env).get(FORK_ENV) == "1"


class TimeoutExpired(psutil.TimeoutExpired, subprocess.TimeoutExpired):
    """A wait that timed out, as both psutil.Popen and subprocess.Popen report it."""

    def __init__(self, seconds: float, pid: int) -> None:
        psutil.TimeoutExpired.__init__(self, seconds, pid)
        self.cmd, self.timeout, self.output, self.stderr = [], seconds, None, None


class ForkedChild(psutil.Process):
    """A forked command, with what the callers use of psutil.Popen and subprocess.Popen: `returncode`
    (settable: a PID 1 that reaps with waitpid(-1) records it), `poll`, `wait`, and signals that reach
    only a child not reaped yet."""

    def __init__(self, pid: int) -> None:
        super().__init__(pid)
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                done, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:  # reaped elsewhere (psutil.wait_procs): its status is lost, as subprocess's
                self.returncode = 0    # Popen.poll has it then
                return 0
            if done:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:  # type: ignore[override]
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise TimeoutExpired(timeout or 0.0, self.pid)
            with contextlib.suppress(OSError):  # gone between poll and pidfd_open: the next poll reaps it
                fd = os.pidfd_open(self.pid)
                try:
                    select.select([fd], [], [], left)
                finally:
                    os.close(fd)
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, sig: int) -> None:  # type: ignore[override]
        if self.returncode is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:  # type: ignore[override]
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:  # type: ignore[override]
        self.send_signal(signal.SIGKILL)


def preload(modules: Sequence[str], scripts: Sequence[str]) -> None:
    """Import `modules` and the entry points of the console `scripts`, for the forks to share."""
    import importlib

    for module in modules:
        importlib.import_module(module)
    for script in scripts:
        if (entry := console_script(script)) is not None:
            entry.load()


def popen(command: list[str], *, env: dict[str, str], exec_with: Callable[..., Any] = subprocess.Popen,
          cwd: str | os.PathLike | None = None, stdin: IO | int | None = None, stdout: IO | int | None = None,
          stderr: IO | int | None = None, start_new_session: bool = False,
          preexec_fn: Callable[[], None] | None = None) -> Any:
    """`command` forked (a ForkedChild) where `env` asks for it (FORK_ENV) and it is `python -m MODULE` or a
    console script of this interpreter; otherwise `exec_with(command, ...)` (subprocess.Popen, psutil.Popen)."""
    target = _target(command) if forking(env) else None
    if target is None:
        return exec_with(command, env=env, cwd=cwd, stdin=stdin, stdout=stdout, stderr=stderr,
                         start_new_session=start_new_session, preexec_fn=preexec_fn)
    streams = [_fd(stdin, os.O_RDONLY, 0), _fd(stdout, os.O_WRONLY, 1)]
    streams.append(streams[1] if stderr == subprocess.STDOUT else _fd(stderr, os.O_WRONLY, 2))
    opened = {fd for fd, stream in zip(streams, (stdin, stdout, stderr)) if stream == subprocess.DEVNULL}
    pid = os.fork()
    if pid == 0:
        try:
            if start_new_session:
                os.setsid()
            if preexec_fn is not None:
                preexec_fn()
            for target_fd, fd in enumerate(streams):
                os.dup2(fd, target_fd)
            _close_other_fds()
            reset_signals()
            run_here(target, command, str(cwd or os.getcwd()), env)
        finally:
            os._exit(1)
    for fd in opened:
        os.close(fd)
    return ForkedChild(pid)


def _target(command: list[str]) -> str | None:
    """The module of `python -m MODULE …` of this interpreter, ':' and the script of a console script of its
    scripts directory, or None for anything else."""
    if command[:2] == [sys.executable, "-m"] and len(command) > 2:
        return command[2]
    return f":{command[0]}" if console_script(command[0]) is not None else None


def _fd(stream: IO | int | None, flags: int, inherited: int) -> int:
    """The file descriptor a child's standard stream takes: subprocess's conventions, less PIPE."""
    if stream is None:
        return inherited
    if stream == subprocess.DEVNULL:
        return os.open(os.devnull, flags)
    if stream == subprocess.PIPE:
        raise ValueError("a forked command cannot have a pipe for a standard stream; give it a file")
    return stream if isinstance(stream, int) else stream.fileno()


def _close_other_fds() -> None:
    """What an exec with close_fds (subprocess's default) leaves: the standard streams only."""
    for name in os.listdir("/proc/self/fd"):
        if int(name) > 2:
            with contextlib.suppress(OSError):
                os.close(int(name))


def reset_signals() -> None:
    """A new interpreter's signal dispositions: the parent's Python handlers and wake-up fd are its own."""
    with contextlib.suppress(ValueError):
        signal.set_wakeup_fd(-1)
    for sig in signal.valid_signals():
        with contextlib.suppress(OSError, ValueError, TypeError):
            handler = signal.getsignal(sig)
            if callable(handler) and handler is not signal.default_int_handler:
                signal.signal(sig, signal.SIG_DFL)


def run_here(target: str, command: list[str], cwd: str, env: dict[str, str]) -> NoReturn:
    """In a forked child: take `cwd`, `env` and the standard streams on fds 0-2, then run `target` (a module
    as `python -m` runs it, or ':' and a console script) with `command`'s arguments, and exit with its status."""
    import atexit
    import logging
    import runpy
    import traceback

    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    # the import path a fresh `python -m` would have: the working directory, then PYTHONPATH
    extra = [cwd, *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    sys.path[:0] = [entry for entry in extra if entry not in sys.path]
    sys.stdin = sys.__stdin__ = open(0, closefd=False)
    sys.stdout = sys.__stdout__ = open(1, "w", buffering=1, closefd=False)
    sys.stderr = sys.__stderr__ = open(2, "w", buffering=1, closefd=False)
    logging.root.handlers.clear()  # the parent's: the command's logging.basicConfig writes to its own streams
    apply_thread_count()
    try:
        if target.startswith(":"):
            sys.argv = list(command)
            entry = console_script(target[1:])
            assert entry is not None
            code = exit_code(entry.load()())
        else:
            sys.argv = [target, *command[3:]]
            sys.modules.pop(target, None)  # as in `python -m`: it runs as __main__ only
            runpy.run_module(target, run_name="__main__", alter_sys=True)
            code = 0
    except SystemExit as exit_request:
        code = exit_code(exit_request.code)
    except BaseException:  # noqa: BLE001 - as the interpreter would: print it, exit 1
        traceback.print_exc()
        code = 1
    atexit._run_exitfuncs()
    with contextlib.suppress(OSError):
        sys.stdout.flush()
        sys.stderr.flush()
    os._exit(code)


def apply_thread_count() -> None:
    """OpenMP read the environment of the process that loaded torch; apply this one's."""
    threads = os.environ.get("OMP_NUM_THREADS", "")
    if threads.isdigit() and int(threads) > 0 and "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(int(threads))


def exit_code(code: object) -> int:
    """The status an interpreter exits with for `sys.exit(code)`."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


def console_script(command: str) -> EntryPoint | None:
    """The entry point that `command` runs, where it is a console script in this interpreter's scripts
    directory: a wrapper that calls its entry point and exits with what it returns ("Entry points
    specification", use for scripts: https://packaging.python.org/en/latest/specifications/entry-points/)."""
    import importlib.metadata
    import shutil
    import sysconfig
    from pathlib import Path

    found = shutil.which(command)
    if found is None or Path(found).resolve().parent != Path(sysconfig.get_path("scripts")).resolve():
        return None
    scripts = importlib.metadata.entry_points(group="console_scripts", name=Path(found).name)
    return next(iter(scripts), None)
