"""A node's pod log on the local cluster, read as the controller reads it: the lines added since the last
read, a log handed over when an evicted pod's processes keep writing to it, and what NVRx's lines say: a
fault it detected (a rank monitor's timeout, ft_launcher's failed worker), or the node's place in the
rendezvous. The detections become fault_detected events, so that the report measures detection time.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

# NVRx 0.7.0 log lines that report a detected fault: (pattern, kind, detecting party). Its logger tags
# lines with the rank a rank monitor watches, [workload:<rank>(<local rank>) infra:…], and the
# monitor's messages start with the restart cycle, [Cycle N].
DETECTIONS = (
    (re.compile(r"\[workload:[^(\]]*\((?P<local_rank>\d+)\)[^\]]*\] rank_monitor_server\.py:\d+ (\[Cycle \d+\] )?"
                r"(?P<what>(Section '\w+' has been open|Was out of section|Did not get (initial|subsequent) heartbeat).*)"),
     "hang", "nvrx rank monitor"),
    (re.compile(r"\] (?P<what>failed \(exitcode: -?\d+\)) local_rank: (?P<local_rank>\d+)"), "rank", "ft_launcher"),
)
# NVRx 0.7.0's rendezvous log lines: a launcher that will train, one left out of a round (standby, late).
# A launcher that trained stays active while it waits for the next round: it is the one that opens it.
ACTIVE_RANK = "Assigned active rank"
LEFT_OUT = ("Standby (rank=", "Late joiner detected")


@dataclass(frozen=True)
class Detection:
    kind: str  # a training.contract.events fault kind
    party: str  # who detected it
    local_rank: str
    what: str  # NVRx's words


def detection(line: str) -> Detection | None:
    """The fault an NVRx log line reports, if any."""
    for pattern, kind, party in DETECTIONS:
        m = pattern.search(line)
        if m:
            return Detection(kind, party, m.group("local_rank"), m.group("what"))
    return None


def rendezvous_role(line: str) -> bool | None:
    """True: the line gives the node an active rank; False: it leaves the node out of the round; None: neither."""
    if ACTIVE_RANK in line:
        return True
    return False if any(w in line for w in LEFT_OUT) else None


@dataclass
class PodLog:
    """A pod's log file, read in increments."""
    path: Path
    _offset: int = 0
    _partial: str = ""

    def hand_over(self) -> Path:
        """Rename the log to `<stem>.evicted<k>.log` for the evicted pod, whose processes keep writing to the open
        file, and read the replacement's new log from its start. Returns the evicted pod's log."""
        earlier = len(list(self.path.parent.glob(f"{self.path.stem}.evicted*.log")))
        evicted = self.path.with_name(f"{self.path.stem}.evicted{earlier + 1}.log")
        if self.path.exists():
            self.path.rename(evicted)
        self._offset, self._partial = 0, ""
        return evicted

    def new_lines(self) -> list[str]:
        """The whole lines written since the last call."""
        if not self.path.exists():
            return []
        with self.path.open("rb") as f:
            f.seek(self._offset)
            chunk = f.read().decode(errors="replace")
            self._offset = f.tell()
        lines = (self._partial + chunk).split("\n")
        self._partial = lines.pop()
        return lines
