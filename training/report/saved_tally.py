"""The metrics endpoint's tally, saved beside the event log, so that rank 0's next process (each attempt
starts one) catches up from where it was saved and reads only the log's tail: without it, a catch-up read
the whole log, seconds at millions of events (bench.event_log measures it).

The file (`save`) stays the size of a checkpoint interval, whatever the log's length. `load` trusts it only
while the event files it names hold the same bytes; otherwise the log is read whole, as without it. Cost:
the file is written whole at each save (training.contract.files.replace_file).
"""
from __future__ import annotations

import hashlib
import json
import logging
import sys
from array import array
from collections import Counter
from dataclasses import fields
from pathlib import Path

from training.contract.events import events_dir
from training.contract.files import replace_file
from training.report.tally import RunTally, UsefulSteps

log = logging.getLogger(__name__)

TALLY_FILE = "metrics-tally.bin"
VERSION = 1
FINGERPRINT_BYTES = 4096  # of each event file's head and of its bytes before the saved offset
_ARRAY_TYPES = "qqd"  # UsefulSteps.arrays(): steps, ids, sums


def tally_path(run_dir: str | Path) -> Path:
    return Path(run_dir) / TALLY_FILE


def fingerprint(path: Path, offset: int) -> str | None:
    """A hash of `path`'s first bytes and of those before `offset`; None if it is shorter than `offset`."""
    start = max(0, offset - FINGERPRINT_BYTES)
    with path.open("rb", buffering=0) as f:  # unbuffered: these bytes and no more
        head = f.read(min(FINGERPRINT_BYTES, offset))
        f.seek(start)
        before = f.read(offset - start)
    if len(before) < offset - start:
        return None
    return hashlib.sha256(b"%d:" % offset + head + before).hexdigest()


def save(run_dir: str | Path, tally: RunTally, offsets: dict[str, int]) -> None:
    """Save `tally`, which holds the event files up to `offsets` (name -> bytes, at a line's end), written whole
    (training.contract.files.replace_file). <run_dir>/metrics-tally.bin holds one JSON line (the format's
    version and byte order, each event file's offset at a line's end and a fingerprint of its bytes before that
    offset, the tally's figures) and then the raw bytes of the useful-step arrays after the floor: the steps up
    to the newest committed checkpoint are folded into their count and time (UsefulSteps.folded), so the file
    stays the size of a checkpoint interval, whatever the log's length."""
    directory = events_dir(run_dir)
    useful = tally.useful.folded(tally.committed_step)
    # field by field: asdict would deep-copy the useful-steps arrays and the restart counts only to drop them
    figures = {f.name: getattr(tally, f.name) for f in fields(tally) if f.name not in ("useful", "restarts")}
    header = {
        "version": VERSION, "byteorder": sys.byteorder,
        "files": {name: [offset, fingerprint(directory / name, offset)] for name, offset in offsets.items()},
        "figures": figures, "restarts": dict(tally.restarts),
        "floor": [useful.floor_step, useful.floor_count, useful.floor_seconds],
        "lengths": [len(a) for a in useful.arrays()],
    }
    body = b"".join(a.tobytes() for a in useful.arrays())
    replace_file(tally_path(run_dir), json.dumps(header).encode() + b"\n" + body)


def load(run_dir: str | Path) -> tuple[RunTally, dict[str, int]] | None:
    """The saved tally and the offsets it holds the event files up to; None when there is none to trust.

    It is trusted only if every file it names still holds the same bytes at its head and just before the
    offset; a log truncated, replaced or rewritten, a file of another format, or an unreadable one is ignored:
    the log is read whole, as without it. Files it does not name (new since) are read from their start. A
    resume below the floor (an older checkpoint than the newest, all of them damaged) raises BelowFloor as it
    is read (training.report.tally): the caller reads the log whole again, once."""
    try:
        data = tally_path(run_dir).read_bytes()
        line, _, body = data.partition(b"\n")
        header = json.loads(line)
        if header.get("version") != VERSION or header.get("byteorder") != sys.byteorder:
            return None
        directory = events_dir(run_dir)
        offsets = {}
        for name, (offset, saved) in header["files"].items():
            if "/" in name or fingerprint(directory / name, offset) != saved:
                log.info("saved metrics tally not used: %s changed since it was saved; reading the log whole", name)
                return None
            offsets[name] = offset
        arrays, at = [], 0
        for code, length in zip(_ARRAY_TYPES, header["lengths"]):
            a = array(code)
            a.frombytes(body[at:at + length * a.itemsize])
            at += length * a.itemsize
            arrays.append(a)
        if at != len(body) or len({len(a) for a in arrays}) != 1:
            return None
        tally = RunTally(**header["figures"], restarts=Counter(header["restarts"]), useful=UsefulSteps())
        tally.useful.restore(tuple(arrays), *header["floor"])
        return tally, offsets
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError) as err:  # unreadable, or not this format
        log.warning("saved metrics tally %s not used (%s: %s); reading the log whole", tally_path(run_dir),
                    type(err).__name__, err)
        return None
