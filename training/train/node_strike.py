"""What strikes a node when a node fault (node-loss, node-hang) fires: a process of its own, in a session of
its own, so that the strike lands whatever the rank does meanwhile. A thread of the rank would die with it,
and a rank dies quickly once another node's loss breaks a collective: two nodes lost in the same step would
then lose one and leave the other's processes (and its peer-state copies) alive. A rank that may fire one
starts it ahead of time, so its imports cost the strike nothing. It reads one `Strike` on stdin (`main`) and
carries it out (`strike`). Standard library and psutil only.
"""
from __future__ import annotations

import dataclasses
import json
import os
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import psutil

WAIT_S = 10.0  # longest wait for the other node faults of the same step to fire


def strike(at: float, sig: signal.Signals, top: psutil.Process, rank: psutil.Process | None,
           wait_for: list[str], marker: str = "") -> None:
    """At `at` (time.monotonic(), which every process on the machine shares), once every `wait_for` file exists
    (the fired records of the other node faults of the same step, so that faults meant together land together;
    at most WAIT_S), create `marker` (if not ""), then send the signal to the node's top process (unless it is
    PID 1: inside a container PID 1 ignores SIGKILL sent from its own PID namespace, SIGTERM stops it instead),
    then to every process under it, the firing rank last."""
    time.sleep(max(0.0, at - time.monotonic()))
    deadline = time.monotonic() + WAIT_S
    while not all(os.path.exists(f) for f in wait_for) and time.monotonic() < deadline:
        time.sleep(0.01)
    missing = [f for f in wait_for if not os.path.exists(f)]
    if missing:
        print(f"node_strike: striking without waiting further for {missing} ({WAIT_S:.0f} s)", file=sys.stderr)
    if marker:
        Path(marker).parent.mkdir(parents=True, exist_ok=True)
        Path(marker).touch()
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


@dataclass(frozen=True)
class Strike:
    """One strike, as the JSON line that `main` reads: {"at": MONOTONIC, "signal": N, "top": PID, "rank": PID,
    "wait_for": [FILE, …], "marker": FILE}."""
    at: float  # time.monotonic() at which to strike
    signal: int  # SIGKILL (node-loss) or SIGSTOP (node-hang)
    top: int  # the node's outermost process
    rank: int  # the firing rank's process, struck last
    wait_for: tuple[str, ...] = ()  # files that must exist first
    marker: str = ""  # a file created just before the strike (a lost node's: contract.faults.lost_marker)

    def line(self) -> bytes:
        return (json.dumps(dataclasses.asdict(self)) + "\n").encode()


def main() -> None:
    """`python -m training.train.node_strike`: reads one strike as a JSON line on stdin; at EOF, leaves."""
    line = sys.stdin.readline()
    if not line:  # the rank ended without firing
        return
    s = Strike(**json.loads(line))
    if s.signal not in (signal.SIGKILL, signal.SIGSTOP):
        sys.exit(f"node_strike: signal {s.signal} is neither SIGKILL nor SIGSTOP")
    # Identities now: a pid reused after its process ended is not struck (psutil checks the start time).
    # The rank may be gone already (a peer's loss broke its collective): the rest of its node is struck.
    try:
        top = psutil.Process(s.top)
    except psutil.NoSuchProcess:
        sys.exit(f"node_strike: the node's top process {s.top} is gone already")
    try:
        rank: psutil.Process | None = psutil.Process(s.rank)
    except psutil.NoSuchProcess:
        rank = None
    strike(s.at, signal.Signals(s.signal), top, rank, list(s.wait_for), s.marker)


if __name__ == "__main__":
    main()
