"""A node's entry point: the training pod's PID 1, and each emulated node's process in training.local.

    python -m training.pod.launch --config FILE -- ft_launcher ARG …

1. Pre-flight: the training config must load, or the node exits CONFIG_ERROR (ft_launcher would
   exit 1 whatever its ranks exit with, and the Job would retry a config that cannot work).
2. Runs the command (ft_launcher, or `python -m training.pod.prefork launch ft_launcher …`) as its
   child, with the pod's start time and index as NVRx's infrastructure rank and the rendezvous store's
   endpoint for the ranks' in-process coordination (launcher_env), passes on the
   termination signals the kubelet (or the local controller) sends, and reaps every process that
   ends up orphaned under it, as a container's PID 1 must.
3. Watches the run's job failure requests (training/contract/job_failure.py): when a rank asks, it stops
   the command (SIGTERM, SIGKILL after STOP_GRACE_S) and exits CONFIG_ERROR at once, the cause on its last
   line and in the container's termination message, whatever the restart mode would have done next.
4. Stops the command COMPLETED_GRACE_S after the run completed, if it has not ended by then: a node still
   starting as the run ended (a lost node's replacement, standing by) may join the store the Deployment
   started again after the rendezvous shut down, and would wait there for a round until the join timeout.
5. Exits 0 exactly when the run completed (a completed run_end in the event log,
   training.contract.events.run_completed), whatever ft_launcher exited with: a node that starts or fails
   after the run's end has nothing left to do, and the Indexed Job needs every index to succeed.
   Otherwise it exits as ft_launcher did, but never 0: ft_launcher 0.7.0 also exits 0 when a hot
   spare leaves and when every rank left cleanly after SIGTERM, which the Job would count as a
   completed index and never run again; that becomes INCOMPLETE, which the Job retries.
"""
from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

from training.contract.config import ConfigArgumentParser, TrainConfigError, load_train_config
from training.contract.events import EventTail, completes, run_completed
from training.contract.exit_codes import CONFIG_ERROR, INCOMPLETE
from training.contract.job_failure import FailureRequest, FailureRequests
from training.contract.launcher import STORE_ENDPOINT_ENV, rendezvous_endpoint

JOB_INDEX_ENV = "JOB_COMPLETION_INDEX"  # what an Indexed Job gives each pod (training.local too)
MAX_PODS = 100_000  # indexes below it keep the infrastructure rank (ms x MAX_PODS + index) within int64
PASSED_ON = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)
POLL_S = 0.5  # how often the child's exit and the job failure requests are looked at (one listing on FSx)
STOP_GRACE_S = 10.0  # a rank that asked for the Job to fail has left: the others need only to stop
COMPLETION_POLL_S = 5.0  # how often the event log's new lines are read for the run's completion
COMPLETED_GRACE_S = 15.0  # a launcher of a completed run normally ends within a second or two
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
    """ft_launcher's environment, which its ranks inherit: `command`'s rendezvous endpoint in STORE_ENDPOINT_ENV,
    where the in-process Wrapper coordinates off the GPU nodes (training/train/coordination.py). NVRx's
    rendezvous makes the nodes present when it closes a round active in the order of their infrastructure
    rank (outside SLURM read from GROUP_RANK), the rest standby. That rank is the pod's start time (ms) and then its index (JOB_COMPLETION_INDEX), unique
    in the Job: the older pods train, a new pod (a replacement, a late spare) stands by. Ranked by index
    alone, a lost node's replacement would take the place of a spare that already trains and holds
    the peer state copies of its partners (training/train/peer_state.py)."""
    env = dict(environ)
    if (endpoint := rendezvous_endpoint(command)) is not None:
        env[STORE_ENDPOINT_ENV] = endpoint
    if (index := environ.get(JOB_INDEX_ENV)) is not None:
        env["GROUP_RANK"] = str(int(started_s * 1000) * MAX_PODS + int(index))
    return env


def pass_on_signals(child: Callable[[], subprocess.Popen]) -> None:
    """Send the PASSED_ON signals this process gets to `child()` (the child process of the moment)."""
    for sig in PASSED_ON:
        signal.signal(sig, lambda signum, _frame: child().send_signal(signum))


def exit_code(returncode: int) -> int:
    """A child's return code as a shell reports it: 128 + N when killed by signal N."""
    return returncode if returncode >= 0 else 128 - returncode


class CompletionWatch:
    """Whether the run has completed, from what the event log gains while this pod runs (only that is read,
    every COMPLETION_POLL_S)."""

    def __init__(self, run_dir: str, steps: int) -> None:
        self.steps = steps
        self._tail = EventTail.from_now(run_dir)
        self._next_read = 0.0
        self.completed = False

    def poll(self, now: float) -> bool:
        if not self.completed and now >= self._next_read:
            self._next_read = now + COMPLETION_POLL_S
            try:
                self.completed = any(completes(r, self.steps) for r in self._tail.read_new())
            except FileNotFoundError:  # no event yet
                pass
        return self.completed


def run(command: list[str], requests: FailureRequests,
        completion: CompletionWatch) -> tuple[int, FailureRequest | None]:
    """Run `command`, passing on PASSED_ON signals, until it exits; stop it when a job failure request
    appears, or COMPLETED_GRACE_S after the run completed. Its exit code, and the request that stopped it
    (None: it ended on its own, or the run completed)."""
    child = subprocess.Popen(command, env=launcher_env(dict(os.environ), time.time(), command))
    pass_on_signals(lambda: child)
    request, stop_at, kill_at = None, float("inf"), None  # kill_at: once SIGTERM was sent
    while True:
        pid, status = os.waitpid(-1, os.WNOHANG)  # any child: orphans re-parented to PID 1 are reaped too
        if pid == child.pid:
            child.returncode = os.waitstatus_to_exitcode(status)
            return exit_code(child.returncode), request
        if pid:
            continue
        now = time.monotonic()
        if request is None and (request := requests.new()) is not None:
            stop_at = min(stop_at, now)
        elif completion.poll(now):
            stop_at = min(stop_at, now + COMPLETED_GRACE_S)
        if kill_at is None and now >= stop_at:
            child.send_signal(signal.SIGTERM)
            kill_at = now + STOP_GRACE_S
        elif kill_at is not None and now > kill_at:
            child.kill()
            kill_at = float("inf")
        time.sleep(POLL_S)


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
    try:
        cfg = load_train_config(args.config)
    except (TrainConfigError, OSError) as err:
        print(f"training.pod.launch: invalid training config: {err}", file=sys.stderr)
        return CONFIG_ERROR
    # watched from before the check: a completion recorded while the check reads the log is seen by the watch
    completion = CompletionWatch(cfg.run_dir, cfg.training.steps)
    if run_completed(cfg.run_dir, cfg.training.steps):  # e.g. a lost node's replacement, started late
        print(f"training.pod.launch: the run in {cfg.run_dir} has completed: nothing to do", flush=True)
        return 0
    code, request = run(args.command, FailureRequests(cfg.run_dir), completion)
    if run_completed(cfg.run_dir, cfg.training.steps):  # whatever became of this node, the run is done
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
