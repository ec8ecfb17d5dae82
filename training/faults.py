"""Fault injection on a schedule, each fault fired once per run.

Spec format (config `faults:` list, or `--faults` of training.local):

    KIND@STEP[:key=value[:key=value…]]

    exception@30:rank=1    rank 1 raises FaultInjected when it reaches step 30
    sigkill@60:rank=3      rank 3 SIGKILLs itself when it reaches step 60

KIND is one of KINDS. STEP (at least 1) is the step the rank is about to run: the fault fires
after step STEP-1 completed and before step STEP starts. Keys: `rank` (global rank, default 0).
Each kind declares the keys it accepts, so new kinds (hang, node-loss, ckpt-crash, corrupt-ckpt,
disk-full) add an entry to KINDS with their own keys and handler.

Once-per-run: before firing, the faulty rank records the fault durably (an fsynced file under
`<run_dir>/faults/fired/`); after the restart that the fault causes, the recorded fault is not
fired again, even though the resumed run passes the same step again.
"""
from __future__ import annotations

import os
import re
import signal
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from training.events import EventLog


class FaultSpecError(ValueError):
    """A fault spec cannot be parsed; the message names the spec, the problem and what is allowed."""


class FaultInjected(RuntimeError):
    """Raised by the `exception` fault."""


def _raise(spec: "FaultSpec") -> None:
    raise FaultInjected(f"injected fault {spec.text}")


def _sigkill(spec: "FaultSpec") -> None:
    os.kill(os.getpid(), signal.SIGKILL)


@dataclass(frozen=True)
class FaultKind:
    fire: Callable[["FaultSpec"], None]
    keys: frozenset[str] = frozenset({"rank"})
    help: str = ""


KINDS: dict[str, FaultKind] = {
    "exception": FaultKind(_raise, help="the rank raises FaultInjected and exits non-zero"),
    "sigkill": FaultKind(_sigkill, help="the rank kills itself with SIGKILL"),
}

_SPEC = re.compile(r"^(?P<kind>[a-z][a-z0-9-]*)@(?P<step>[^:]+)(?P<opts>(:[^:]*)*)$")


@dataclass(frozen=True)
class FaultSpec:
    text: str
    kind: str
    step: int
    rank: int = 0
    options: dict[str, str] = field(default_factory=dict, compare=False, hash=False)

    @property
    def key(self) -> str:
        """A file-name-safe identity: the normalised spec."""
        opts = "".join(f"_{k}={v}" for k, v in sorted({**self.options, "rank": str(self.rank)}.items()))
        return f"{self.kind}@{self.step}{opts}"


def parse_fault(text: str) -> FaultSpec:
    kinds = "; ".join(f"{name} ({kind.help})" for name, kind in sorted(KINDS.items()))
    allowed = f"allowed kinds: {kinds}; format KIND@STEP[:rank=R], e.g. exception@30:rank=1"
    m = _SPEC.match(text.strip())
    if not m:
        raise FaultSpecError(f"fault spec {text!r}: not of the form KIND@STEP[:key=value…]; {allowed}")
    kind = m.group("kind")
    if kind not in KINDS:
        raise FaultSpecError(f"fault spec {text!r}: unknown kind {kind!r}; {allowed}")
    try:
        step = int(m.group("step"))
    except ValueError:
        raise FaultSpecError(f"fault spec {text!r}: step {m.group('step')!r} is not a whole number; {allowed}") from None
    if step < 1:
        raise FaultSpecError(f"fault spec {text!r}: step must be at least 1")
    options: dict[str, str] = {}
    for item in filter(None, m.group("opts").split(":")):
        key, sep, value = item.partition("=")
        if not sep or not value:
            raise FaultSpecError(f"fault spec {text!r}: option {item!r} is not key=value")
        if key not in KINDS[kind].keys:
            raise FaultSpecError(f"fault spec {text!r}: unknown option {key!r} for {kind}; allowed: {sorted(KINDS[kind].keys)}")
        options[key] = value
    rank_text = options.pop("rank", "0")
    if not rank_text.isdigit():
        raise FaultSpecError(f"fault spec {text!r}: rank={rank_text!r} is not a rank number (0 or more)")
    return FaultSpec(text=text.strip(), kind=kind, step=step, rank=int(rank_text), options=options)


def parse_faults(texts: tuple[str, ...] | list[str], world_size: int | None = None) -> list[FaultSpec]:
    specs = [parse_fault(t) for t in texts]
    for spec in specs:
        if world_size is not None and spec.rank >= world_size:
            raise FaultSpecError(f"fault spec {spec.text!r}: rank {spec.rank} does not exist (world size {world_size})")
    keys = [s.key for s in specs]
    duplicates = sorted({k for k in keys if keys.count(k) > 1})
    if duplicates:
        raise FaultSpecError(f"fault specs repeated: {duplicates}")
    return specs


def fired_dir(run_dir: str | os.PathLike) -> Path:
    return Path(run_dir) / "faults" / "fired"


class FaultInjector:
    """The faults of one rank. `maybe_fire(step)` is called before each step."""

    def __init__(self, specs: list[FaultSpec], run_dir: str | os.PathLike, rank: int, events: EventLog) -> None:
        self._mine = [s for s in specs if s.rank == rank]
        self._dir = fired_dir(run_dir)
        self._rank = rank
        self._events = events

    def maybe_fire(self, step: int) -> None:
        for spec in self._mine:
            if spec.step == step and not (self._dir / spec.key).exists():
                self._record(spec)
                self._events.emit("fault_injected", kind=spec.kind, rank=self._rank, step=step)
                KINDS[spec.kind].fire(spec)

    def _record(self, spec: FaultSpec) -> None:
        self._dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(self._dir / spec.key, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.write(fd, spec.text.encode())
            os.fsync(fd)
        finally:
            os.close(fd)
