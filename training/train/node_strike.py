"""What strikes a node when a node fault (node-loss, node-hang) fires: a process of its own, started by the
firing rank in a session of its own, so that the strike lands whatever the rank does meanwhile. A thread of
the rank would die with it, and a rank dies quickly once another node's loss breaks a collective: two
nodes lost in the same step would then lose one and leave the other's processes (and its peer-state copies)
alive. Standard library and psutil only: it starts in a fraction of the step it strikes in.

    python -m training.train.node_strike --at MONOTONIC --signal N --top PID --rank PID [--wait-for FILE …]

At `--at` (time.monotonic(), which every process on the machine shares), once every `--wait-for` file
exists (the fired records of the other node faults of the same step, so that faults meant together land
together; at most WAIT_S), send the signal to the node's top process (unless it is PID 1: inside a
container PID 1 ignores SIGKILL sent from its own PID namespace, SIGTERM stops it instead), then to every
process under it, the firing rank last.
"""
from __future__ import annotations

import argparse
import os
import signal
import sys
import time

import psutil

WAIT_S = 10.0  # longest wait for the other node faults of the same step to fire


def strike(at: float, sig: signal.Signals, top: psutil.Process, rank: psutil.Process | None,
           wait_for: list[str]) -> None:
    time.sleep(max(0.0, at - time.monotonic()))
    deadline = time.monotonic() + WAIT_S
    while not all(os.path.exists(f) for f in wait_for) and time.monotonic() < deadline:
        time.sleep(0.01)
    missing = [f for f in wait_for if not os.path.exists(f)]
    if missing:
        print(f"node_strike: striking without waiting further for {missing} ({WAIT_S:.0f} s)", file=sys.stderr)
    others = []
    try:
        others = [p for p in top.children(recursive=True) if p.pid not in (rank and rank.pid, os.getpid())]
        if top.pid != 1:
            top.send_signal(sig)
        elif sig == signal.SIGKILL:
            top.send_signal(signal.SIGTERM)
    except psutil.Error:  # the node's top process is gone already
        pass
    for p in [*others, *([rank] if rank else [])]:
        try:
            p.send_signal(sig)
        except psutil.Error:  # already gone
            pass


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m training.train.node_strike", description=__doc__.split("\n\n")[0])
    parser.add_argument("--at", type=float, required=True, help="time.monotonic() at which to strike")
    parser.add_argument("--signal", type=int, required=True, choices=[signal.SIGKILL, signal.SIGSTOP])
    parser.add_argument("--top", type=int, required=True, help="the node's outermost process")
    parser.add_argument("--rank", type=int, required=True, help="the firing rank's process (struck last)")
    parser.add_argument("--wait-for", action="append", default=[], help="a file that must exist first")
    args = parser.parse_args(argv)
    # Identities now: a pid reused after its process ended is not struck (psutil checks the start time).
    # The rank may be gone already (a peer's loss broke its collective): the rest of its node is struck.
    try:
        top = psutil.Process(args.top)
    except psutil.NoSuchProcess:
        sys.exit(f"node_strike: the node's top process {args.top} is gone already")
    try:
        rank: psutil.Process | None = psutil.Process(args.rank)
    except psutil.NoSuchProcess:
        rank = None
    strike(args.at, signal.Signals(args.signal), top, rank, args.wait_for)


if __name__ == "__main__":
    main()
