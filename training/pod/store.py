"""The rendezvous store's process: NVRx's nvrx-control, started over when the run has stalled.

    python -m training.pod.store --config FILE [--stall-timeout SECONDS] -- nvrx-control ARG …

NVRx 0.7.0 opens a new rendezvous round only from a surviving launcher whose workers failed, so when every
node that was training is lost at once nobody opens it and the replacements wait for ever. This process runs
the store as its child and, when no rank has written an event for the stall timeout (longer than any round
may gather) and the run has not completed, starts it over, empty. Cost: a read of the event log on FSx
every poll, whose failures are retried, never taken for a stall (training.pod.read_errors). What follows a
restart of the store: docs/recovery.md, "Hot spares".
"""
from __future__ import annotations

import argparse
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

from training.contract.config import ConfigArgumentParser, config_or_exit, load_train_config
from training.contract.events import events_dir, run_completed
from training.pod.launch import PASSED_ON, exit_code
from training.pod.forked import popen
from training.pod.prefork import die_with_parent
from training.pod.read_errors import ReadErrors

log = logging.getLogger("training.pod.store")

STALL_MARGIN_S = 300.0
POLL_S = 5.0


def last_activity(run_dir: str | Path) -> float:
    """When a rank last wrote an event (unix time; 0 without any). Raises OSError when the file system
    cannot say (pathlib's is_dir would answer False for some errors: no events, so a stall)."""
    try:
        entries = list(os.scandir(events_dir(run_dir)))
    except FileNotFoundError:
        return 0.0
    return max((e.stat().st_mtime for e in entries if e.name.endswith(".jsonl")), default=0.0)


def stalled(run_dir: str | Path, steps: int, since: float, timeout_s: float, now: float) -> bool:
    """No event for `timeout_s` since the later of the last event and `since` (the store's start), and
    the run not completed."""
    return now - max(last_activity(run_dir), since) > timeout_s and not run_completed(run_dir, steps)


def pass_on_signals(child: Callable[[], subprocess.Popen]) -> None:
    """Send the PASSED_ON signals this process gets to `child()` (the store of the moment). Popen.send_signal
    may reap a store that just exited, which is harmless here: only Popen waits for it."""
    for sig in PASSED_ON:
        signal.signal(sig, lambda signum, _frame: child().send_signal(signum))


def start(command: list[str]) -> subprocess.Popen:
    """The store, killed by the kernel if this process dies first (nothing else would free its port)."""
    return popen(command, env=dict(os.environ), preexec_fn=lambda: die_with_parent(signal.SIGKILL))


def supervise(command: list[str], run_dir: str, steps: int, timeout_s: float) -> int:
    """Run `command`, starting it over whenever the run stalls; its exit code once it exits itself."""
    child = start(command)
    pass_on_signals(lambda: child)
    started = time.time()
    errors = ReadErrors(f"the event log in {run_dir}",
                        f"the store keeps running, and the stall watch retries every {POLL_S:.0f} s", log)
    while True:
        try:
            return exit_code(child.wait(timeout=min(POLL_S, timeout_s / 2)))
        except subprocess.TimeoutExpired:
            pass
        # a read that fails (an evicted Lustre client, for a while) is no evidence of a stall
        if errors.read(lambda: stalled(run_dir, steps, started, timeout_s, time.time()), failed=False):
            log.warning("no training event in %s for %.0f s and the run has not completed: no node is left to open "
                        "the next rendezvous round; starting the store over", run_dir, timeout_s)
            child.terminate()
            try:
                child.wait(timeout=30)
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait()
            child, started = start(command), time.time()


def main(argv: list[str] | None = None) -> int:
    p = ConfigArgumentParser(prog="python -m training.pod.store", description=__doc__.split("\n\n")[0])
    p.add_argument("--config", required=True, help="the training config (its run_dir, steps and join timeout)")
    p.add_argument("--stall-timeout", type=float, default=None, metavar="SECONDS",
                   help="default: fault_tolerance.rendezvous_join_timeout_s + %g" % STALL_MARGIN_S)
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- CMD [ARG …]: the store's command line")
    args = p.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        p.error("no command after --: expected nvrx-control's command line")
    logging.basicConfig(level=logging.INFO, format="[%(asctime)s] [store] %(message)s", datefmt="%H:%M:%S")
    cfg = config_or_exit("training.pod.store", lambda: load_train_config(args.config))
    timeout_s = args.stall_timeout or cfg.fault_tolerance.rendezvous_join_timeout_s + STALL_MARGIN_S
    return supervise(command, cfg.run_dir, cfg.training.steps, timeout_s)


if __name__ == "__main__":
    sys.exit(main())
