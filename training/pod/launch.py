"""A node's entry point: the training pod's PID 1, and each emulated node's process in training.local.

    python -m training.pod.launch --config FILE -- ft_launcher ARG …

It checks the config before anything starts, runs the command as its child (passing on the kubelet's
termination signals and reaping orphans, as a container's PID 1 must), stops it when a rank asks the Job
to fail (training.contract.job_failure) or shortly after the run completed, and exits 0 exactly when the
run completed: ft_launcher 0.7.0 also exits 0 when a hot spare leaves or every rank left cleanly after
SIGTERM, which the Indexed Job would count as a completed index and never run again. Cost: a poll of the
run directory on FSx every POLL_S, whose failed reads are retried, never fatal (training.pod.read_errors).
Each step and its exit codes: docs/recovery.md, "The pod's PID 1".
"""
from __future__ import annotations

import argparse
import logging
import os
import select
import signal
import sys
import time
from pathlib import Path

from training.contract.config import ConfigArgumentParser, config_or_exit, load_train_config
from training.contract.events import EventTail, completes, run_completed
from training.contract.exit_codes import CONFIG_ERROR, INCOMPLETE
from training.contract.job_failure import FailureRequest, FailureRequests, requests_dir
from training.contract.launcher import POD_PID_ENV, STORE_ENDPOINT_ENV, rendezvous_endpoint
from training.pod.forked import popen
from training.pod.read_errors import ReadErrors

log = logging.getLogger("training.pod.launch")

JOB_INDEX_ENV = "JOB_COMPLETION_INDEX"  # what an Indexed Job gives each pod (training.local too)
MAX_PODS = 100_000  # indexes below it keep the infrastructure rank (ms x MAX_PODS + index) within int64
PASSED_ON = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)
WAKES = (signal.SIGCHLD,)  # not passed on: a child that ends wakes the loop at once, not after POLL_S
POLL_S = 0.5  # how often the child's exit and the job failure requests are looked at (one listing on FSx)
STOP_GRACE_S = 10.0  # a rank that asked for the Job to fail has left: the others need only to stop
COMPLETION_POLL_S = 5.0  # how often the event log's new lines are read for the run's completion
COMPLETED_GRACE_S = 15.0  # a launcher of a completed run normally ends within a second or two
READ_PATIENCE_S = 300.0  # how long the start and the exit wait for the run directory to answer
RETRIED = f"the launcher runs on, and the read is tried again every {POLL_S:g} s"
# Where Kubernetes reads a container's termination message (the default terminationMessagePath), which
# `kubectl describe pod` and the pod's status show: https://kubernetes.io/docs/tasks/debug/debug-application/determine-reason-pod-failure/
TERMINATION_LOG = Path("/dev/termination-log")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = ConfigArgumentParser(prog="python -m training.pod.launch", description=__doc__.split("\n\n")[0])
    p.add_argument("--config", required=True, help="the training config the command trains with")
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- CMD [ARG …]: ft_launcher's command line")
    args = p.parse_args(argv)
    if args.command[:1] == ["--"]:
        args.command = args.command[1:]
    if not args.command:
        p.error("no command after --: expected ft_launcher's command line")
    return args


def launcher_env(environ: dict[str, str], started_s: float, command: list[str]) -> dict[str, str]:
    """ft_launcher's environment, which its ranks inherit: this process's PID in POD_PID_ENV (a node fault
    strikes it first), `command`'s rendezvous endpoint in STORE_ENDPOINT_ENV,
    where the in-process Wrapper coordinates off the GPU nodes (training.train.coordination). NVRx's
    rendezvous makes the nodes present when it closes a round active in the order of their infrastructure
    rank (outside SLURM read from GROUP_RANK), the rest standby. That rank is the pod's start time (ms) and then its index (JOB_COMPLETION_INDEX), unique
    in the Job: the older pods train, a new pod (a replacement, a late spare) stands by. Ranked by index
    alone, a lost node's replacement would take the place of a spare that already trains and holds
    the peer state copies of its partners (training.train.peer_state)."""
    env = {**environ, POD_PID_ENV: str(os.getpid())}
    if (endpoint := rendezvous_endpoint(command)) is not None:
        env[STORE_ENDPOINT_ENV] = endpoint
    if (index := environ.get(JOB_INDEX_ENV)) is not None:
        env["GROUP_RANK"] = str(int(started_s * 1000) * MAX_PODS + int(index))
    return env


class PassedOn:
    """The PASSED_ON signals this process receives, queued for the loop that runs the command, which passes
    them on (`wait`). A handler that signalled the command itself would race that loop: Popen.send_signal
    reaps a command that has just exited (its poll()), and the loop's waitpid then never sees it exit.
    signal.set_wakeup_fd writes each signal's number to a pipe, which also wakes the loop at once, as WAKES do.
    A context manager (signal handlers: main thread only); costs a pipe."""

    def __enter__(self) -> PassedOn:
        self._read_fd, self._write_fd = os.pipe()
        for fd in (self._read_fd, self._write_fd):
            os.set_blocking(fd, False)
        self._wakeup_fd = signal.set_wakeup_fd(self._write_fd, warn_on_full_buffer=False)
        # a Python handler, which does nothing, so that each signal reaches the pipe
        self._handlers = {sig: signal.signal(sig, lambda _signum, _frame: None) for sig in (*PASSED_ON, *WAKES)}
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._handlers.items():
            signal.signal(sig, handler)
        signal.set_wakeup_fd(self._wakeup_fd)
        os.close(self._read_fd)
        os.close(self._write_fd)

    def wait(self, timeout_s: float) -> list[int]:
        """The signals received since the last call, in order, after waiting up to `timeout_s` for one."""
        select.select([self._read_fd], [], [], timeout_s)
        try:
            received = os.read(self._read_fd, 1024)
        except BlockingIOError:  # none
            return []
        return [signum for signum in received if signum in PASSED_ON]


class Child:
    """The command, run as this process's child. Only `reap` waits for it, and it is signalled only from the
    loop that reaps it: a signal reaches it until then (an exited child not reaped yet takes it harmlessly),
    and never another process that was given its pid afterwards."""

    def __init__(self, command: list[str], env: dict[str, str]) -> None:
        self._proc = popen(command, env=env)  # forked on the local cluster with FORK_ENV

    @property
    def returncode(self) -> int | None:
        return self._proc.returncode

    def signal(self, sig: int) -> None:
        if self._proc.returncode is None:
            os.kill(self._proc.pid, sig)

    def reap(self) -> bool:
        """Reap every child that has ended, the orphans re-parented to this process (PID 1) too; whether the
        command has ended (its returncode)."""
        while self._proc.returncode is None:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                return False
            if pid == self._proc.pid:
                self._proc.returncode = os.waitstatus_to_exitcode(status)
        return True


def exit_code(returncode: int) -> int:
    """A child's return code as a shell reports it: 128 + N when killed by signal N."""
    return returncode if returncode >= 0 else 128 - returncode


class CompletionWatch:
    """Whether the run has completed, from what the event log gains while this pod runs (only that is read,
    every COMPLETION_POLL_S). A read that fails is logged and tried again; where even the log's end at the
    start could not be read, the watch starts from its first read that succeeds (a completion before it is
    then seen only by the check after the command's exit)."""

    def __init__(self, run_dir: str, steps: int) -> None:
        self.run_dir, self.steps = run_dir, steps
        self.errors = ReadErrors(f"the event log in {run_dir}", RETRIED, log)
        self._tail: EventTail | None = self.errors.read(lambda: EventTail.from_now(run_dir), failed=None)
        self._next_read = 0.0
        self.completed = False

    def poll(self, now: float) -> bool:
        if not self.completed and now >= self._next_read:
            self._next_read = now + COMPLETION_POLL_S
            self.completed = self.errors.read(self._read_new, failed=False)
        return self.completed

    def _read_new(self) -> bool:
        if self._tail is None:
            self._tail = EventTail.from_now(self.run_dir)
            return False
        try:
            completed = any(completes(r, self.steps) for r in self._tail.read_new())
        except FileNotFoundError:  # no event yet
            return False
        if not completed and self._tail.unreadable:  # those files are read from where they were next time
            raise OSError("; ".join(self._tail.unreadable.values()))
        return completed


class RequestWatch:
    """The job failure requests written while this pod runs (FailureRequests), listed at every poll. A read
    that fails is logged and tried again at the next poll; a request is not lost by it."""

    def __init__(self, run_dir: str) -> None:
        self.run_dir = run_dir
        self.errors = ReadErrors(f"the job failure requests in {requests_dir(run_dir)}", RETRIED, log)
        self._requests: FailureRequests | None = self.errors.read(lambda: FailureRequests(run_dir), failed=None)

    def poll(self) -> FailureRequest | None:
        return self.errors.read(self._new, failed=None)

    def _new(self) -> FailureRequest | None:
        if self._requests is None:  # the requests there when a listing first succeeds are an earlier Job's
            self._requests = FailureRequests(self.run_dir)
            return None
        return self._requests.new()


def run(command: list[str], requests: RequestWatch, completion: CompletionWatch,
        signals: PassedOn) -> tuple[int, FailureRequest | None]:
    """Run `command`, passing on the PASSED_ON signals (also those received before it started), until it
    exits; stop it when a job failure request appears, or COMPLETED_GRACE_S after the run completed. Its exit
    code, and the request that stopped it (None: it ended on its own, or the run completed)."""
    child = Child(command, launcher_env(dict(os.environ), time.time(), command))
    request, stop_at, kill_at = None, float("inf"), None  # kill_at: once SIGTERM was sent
    received = signals.wait(0)
    while True:
        for sig in received:
            child.signal(sig)
        if child.reap():
            return exit_code(child.returncode), request
        now = time.monotonic()
        if request is None and (request := requests.poll()) is not None:
            stop_at = min(stop_at, now)
        elif completion.poll(now):
            stop_at = min(stop_at, now + COMPLETED_GRACE_S)
        if kill_at is None and now >= stop_at:
            child.signal(signal.SIGTERM)
            kill_at = now + STOP_GRACE_S
        elif kill_at is not None and now > kill_at:
            child.signal(signal.SIGKILL)
            kill_at = float("inf")
        received = signals.wait(POLL_S)


def run_completed_patiently(run_dir: str, steps: int, meanwhile: str) -> bool:
    """run_completed, read again every POLL_S while it fails, for at most READ_PATIENCE_S; False after that."""
    errors = ReadErrors(f"the event log in {run_dir}", meanwhile, log)
    give_up_at = time.monotonic() + READ_PATIENCE_S
    while True:
        try:
            completed = run_completed(run_dir, steps)
        except OSError as err:
            errors.failure(err, time.monotonic())
            if time.monotonic() >= give_up_at:
                log.warning("the event log in %s still cannot be read after %.0f s: the run counts as not completed",
                            run_dir, READ_PATIENCE_S)
                return False
            time.sleep(POLL_S)
            continue
        errors.success(time.monotonic())
        return completed


def fail_the_job(request: FailureRequest, termination_log: Path = TERMINATION_LOG) -> int:
    """Say why the Job must fail, last on the pod's log and in its termination message; CONFIG_ERROR."""
    message = f"{request.source} asked for the Job to fail, as no restart can help: {request.cause}"
    print(f"training.pod.launch: {message}", file=sys.stderr, flush=True)
    if termination_log.exists():  # in a pod; Kubernetes keeps at most 4096 bytes of it
        try:
            termination_log.write_text(message[:4096])
        except OSError as err:  # the log line above says it all the same
            print(f"training.pod.launch: no termination message ({err})", file=sys.stderr, flush=True)
    return CONFIG_ERROR


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="training.pod.launch: %(message)s")
    with PassedOn() as signals:  # from the start: a signal that lands before the command starts is passed on
        return run_pod(args, signals)


def run_pod(args: argparse.Namespace, signals: PassedOn) -> int:
    """The pod's exit code (the module's docstring says which)."""
    cfg = config_or_exit("training.pod.launch", lambda: load_train_config(args.config))
    # watched from before the check: a completion recorded while the check reads the log is seen by the watch
    completion = CompletionWatch(cfg.run_dir, cfg.training.steps)
    if run_completed_patiently(cfg.run_dir, cfg.training.steps, f"{args.command[0]} starts once it can be read, "
                               f"or after {READ_PATIENCE_S:.0f} s"):  # e.g. a lost node's replacement, started late
        print(f"training.pod.launch: the run in {cfg.run_dir} has completed: nothing to do", flush=True)
        return 0
    code, request = run(args.command, RequestWatch(cfg.run_dir), completion, signals)
    # whatever became of this node, the run is done; a signal that lands from now on changes nothing
    if completion.completed or run_completed_patiently(cfg.run_dir, cfg.training.steps,
                                                       "the pod's exit code waits for it"):
        return 0
    if request is not None:
        return fail_the_job(request)
    if code == 0:
        print(f"training.pod.launch: {args.command[0]} exited 0 but the run in {cfg.run_dir} has not completed "
              f"{cfg.training.steps} steps (a standby left, or the ranks stopped on SIGTERM): exit {INCOMPLETE}, "
              "to be run again", file=sys.stderr, flush=True)
        return INCOMPLETE
    return code


if __name__ == "__main__":
    sys.exit(main())
