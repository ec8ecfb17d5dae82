"""Fault specs, torch-free: which faults to inject when, each fired once per run unless persistent.

A spec is `KIND@STEP[:key=value…][:persistent]`, KIND one of KINDS. What each kind does and which keys it
takes is in docs/faults.md ("Fault grammar"), which a test checks against KINDS; firing them is
training.train.faults'.
"""
from __future__ import annotations

import dataclasses
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from training.contract.config import TrainConfig

ENV_VAR = "TRAINING_FAULTS"
# Kinds that destroy data (checkpoints) or take a node's pod or network down. In a pod they need the
# config's chaos switch (allow_destructive_faults, in the Job's immutable ConfigMap): TRAINING_FAULTS, an
# environment variable, cannot turn them on by itself. The local cluster and tests run outside a pod.
DESTRUCTIVE_KINDS = frozenset({"corrupt-ckpt", "disk-full", "fs-eio", "lighthouse-loss", "node-hang", "node-loss",
                               "partition"})
POD_ENV = "KUBERNETES_SERVICE_HOST"  # the kubelet sets it in every container


class FaultSpecError(ValueError):
    """A fault spec cannot be parsed; the message names the spec, the problem and what is allowed."""


@dataclass(frozen=True)
class FaultSpec:
    text: str
    kind: str
    step: int
    rank: int | None = 0  # None for node faults
    node: int | None = None
    count: int = 1
    duration: int | None = None  # partition: seconds until the link is back; None: for good
    persistent: bool = False
    group: int = 0  # the replica group whose rank or node it targets (parallel.replica_groups)

    @property
    def key(self) -> str:
        """A file-name-safe identity: the normalised spec."""
        options = [f"count={self.count}" if self.count != 1 else None,
                   f"duration={self.duration}" if self.duration is not None else None,
                   f"group={self.group}" if self.group else None,
                   f"node={self.node}" if self.node is not None else None,
                   "persistent" if self.persistent else None,
                   f"rank={self.rank}" if self.rank is not None else None]
        return "_".join([f"{self.kind}@{self.step}", *filter(None, options)])


@dataclass(frozen=True)
class FaultKind:
    help: str
    keys: frozenset[str]  # options key=value; "rank" or "node" says whom it targets, in replica group `group`
    flags: frozenset[str] = frozenset()
    # when it fires: before the step it names, or in this rank's write of a checkpoint save
    when: Literal["step", "write"] = "step"


_RANK = frozenset({"rank", "group"})
_NODE = frozenset({"node", "rank", "group"})  # a node fault names the node, or a rank: the node that runs it
_PERSISTENT = frozenset({"persistent"})
# What each kind does is training.train.faults' (AT_STEP, IN_WRITE); this table is what a spec may say.
KINDS: dict[str, FaultKind] = {
    "exception": FaultKind("the rank raises FaultInjected and exits non-zero", _RANK, _PERSISTENT),
    "sigkill": FaultKind("the rank kills itself with SIGKILL", _RANK, _PERSISTENT),
    "hang": FaultKind("the rank stops heartbeating and sleeps; NVRx timeouts detect it", _RANK, _PERSISTENT),
    "node-loss": FaultKind("the node's pod is SIGKILLed halfway through the step", _NODE),
    "node-hang": FaultKind("every process of the node's pod is stopped (SIGSTOP) halfway through the step: the "
                           "node hangs, it does not die", _NODE),
    "drain": FaultKind("the node is drained: SIGTERM to its launcher, SIGKILL after the grace period", _NODE),
    "partition": FaultKind("the node's network link goes down (for `duration` seconds, or for good); its "
                           "processes keep running", _NODE | {"duration"}),
    "ckpt-crash": FaultKind("the rank dies while a checkpoint save is in flight", _RANK, _PERSISTENT, when="write"),
    "corrupt-ckpt": FaultKind("the newest committed checkpoint is truncated, then the rank dies", _RANK),
    "disk-full": FaultKind("the next `count` saves fail with ENOSPC; training goes on", _RANK | {"count"},
                           when="write"),
    "fs-eio": FaultKind("the rank's file calls on the run directory fail with EIO for `duration` seconds; training "
                        "goes on", _RANK | {"duration"}),
    "lighthouse-loss": FaultKind("the replica groups' Lighthouse is SIGKILLed; its Deployment starts it again",
                                 _RANK),
}


# ---- parsing -----------------------------------------------------------------------------------
_SPEC = re.compile(r"^(?P<kind>[a-z][a-z0-9-]*)@(?P<step>[^:]+)(?P<opts>(:[^:]*)*)$")
_NUMBER_KEYS = {"rank": 0, "node": 0, "count": 1, "duration": 1, "group": 0}  # key -> smallest allowed value


def _allowed() -> str:
    kinds = "; ".join(f"{name} [{', '.join(sorted(k.keys | k.flags))}] ({k.help})" for name, k in sorted(KINDS.items()))
    return f"allowed kinds [options]: {kinds}; format KIND@STEP[:key=value…][:persistent], e.g. exception@30:rank=1"


def parse_fault(text: str) -> FaultSpec:
    m = _SPEC.match(text.strip())
    if not m:
        raise FaultSpecError(f"fault spec {text!r}: not of the form KIND@STEP[:key=value…]; {_allowed()}")
    kind = m.group("kind")
    if kind not in KINDS:
        raise FaultSpecError(f"fault spec {text!r}: unknown kind {kind!r}; {_allowed()}")
    try:
        step = int(m.group("step"))
    except ValueError:
        raise FaultSpecError(f"fault spec {text!r}: step {m.group('step')!r} is not a whole number; {_allowed()}") from None
    if step < 1:
        raise FaultSpecError(f"fault spec {text!r}: step must be at least 1")
    options: dict[str, int | bool | None] = {}
    for item in filter(None, m.group("opts").split(":")):
        key, value = _parse_option(text, kind, item)
        if key in options:
            raise FaultSpecError(f"fault spec {text!r}: option {key!r} given twice")
        options[key] = value
    if "node" in KINDS[kind].keys:  # a node fault: the node with that index, or the one that runs that rank
        if ("node" in options) == ("rank" in options):
            raise FaultSpecError(f"fault spec {text!r}: {kind} needs node=N (the node index) or rank=R (the node "
                                 "that runs rank R, wherever it is: after a hot spare took over, another node)")
        options.setdefault("rank", None)
    if kind == "fs-eio" and "duration" not in options:
        raise FaultSpecError(f"fault spec {text!r}: fs-eio needs duration=SECONDS (how long the file system fails)")
    return FaultSpec(text=text.strip(), kind=kind, step=step, **options)  # type: ignore[arg-type]


def _parse_option(text: str, kind: str, item: str) -> tuple[str, int | bool]:
    key, sep, value = item.partition("=")
    known = KINDS[kind]
    if key not in known.keys | known.flags:
        raise FaultSpecError(f"fault spec {text!r}: unknown option {key!r} for {kind}; "
                             f"allowed: {sorted(known.keys | known.flags)}")
    if key in known.flags:
        if sep:
            raise FaultSpecError(f"fault spec {text!r}: {key} is a flag and takes no value")
        return key, True
    if not sep or not value:
        raise FaultSpecError(f"fault spec {text!r}: option {item!r} is not key=value")
    if not value.isdigit() or int(value) < _NUMBER_KEYS[key]:
        what = "a rank number" if key == "rank" else f"a whole number, at least {_NUMBER_KEYS[key]}"
        raise FaultSpecError(f"fault spec {text!r}: {key}={value!r} is not {what}")
    return key, int(value)


def parse_faults(texts: tuple[str, ...] | list[str], world_size: int | None = None,
                 nodes: int | None = None, groups: int | None = None) -> list[FaultSpec]:
    """The specs, each checked against the shape when it is given: `world_size` ranks and `nodes` nodes (of
    one replica group), `groups` replica groups."""
    specs = [parse_fault(t) for t in texts]
    for spec in specs:
        if groups is not None and spec.group >= groups:
            raise FaultSpecError(f"fault spec {spec.text!r}: replica group {spec.group} does not exist "
                                 f"(parallel.replica_groups={groups}: group=0 to {groups - 1})")
        if world_size is not None and spec.rank is not None and spec.rank >= world_size:
            raise FaultSpecError(f"fault spec {spec.text!r}: rank {spec.rank} does not exist (world size {world_size})")
        if nodes is not None and spec.node is not None and spec.node >= nodes:
            raise FaultSpecError(f"fault spec {spec.text!r}: node {spec.node} does not exist ({nodes} node(s))")
    keys = [s.key for s in specs]
    duplicates = sorted({k for k in keys if keys.count(k) > 1})
    if duplicates:
        raise FaultSpecError(f"fault specs repeated: {duplicates}")
    return specs


def check_chaos_switch(specs: list[FaultSpec], allowed: bool) -> None:
    """In a pod, destructive faults only with the config's chaos switch on."""
    destructive = [s.text for s in specs if s.kind in DESTRUCTIVE_KINDS]
    if destructive and not allowed and POD_ENV in os.environ:
        raise FaultSpecError(f"fault spec(s) {destructive}: {sorted(DESTRUCTIVE_KINDS)} destroy checkpoints or take "
                             "a node down; in a pod they need allow_destructive_faults=true in the training config "
                             "(k8s/main.py --allow-destructive-faults)")


def with_env_faults(cfg: TrainConfig) -> TrainConfig:
    """The config with the specs of TRAINING_FAULTS (comma-separated) added, those already in its
    list left out: an operator injects a fault into a running cluster's next worker start."""
    extra = [s.strip() for s in os.environ.get(ENV_VAR, "").split(",") if s.strip() and s.strip() not in cfg.faults]
    return dataclasses.replace(cfg, faults=(*cfg.faults, *extra)) if extra else cfg


# ---- where the ranks and the controller meet -----------------------------------------------------
def controller_requests_dir(run_dir: str | os.PathLike, kind: str) -> Path:
    """Where a rank asks the controller for a `kind` fault (drain, partition): one file per node."""
    return Path(run_dir) / "faults" / f"{kind}-requests"


def partitioned_marker(run_dir: str | os.PathLike, node: int) -> Path:
    """Written by the controller once the node's link is down."""
    return Path(run_dir) / "faults" / "partitioned" / f"node{node}"


def lighthouse_lost_marker(run_dir: str | os.PathLike) -> Path:
    """Written by the local controller once it killed the Lighthouse a rank of this run directory asked it to."""
    return Path(run_dir) / "faults" / "lighthouse-lost"


def lost_marker(run_dir: str | os.PathLike, node: int) -> Path:
    """Written by a node-loss strike just before it kills the node: what tells the local controller that the
    node's machine was lost (its pod removed with DisruptionTarget on EKS), not only its pod's PID 1 killed."""
    return Path(run_dir) / "faults" / "lost" / f"node{node}"


def fired_dir(run_dir: str | os.PathLike) -> Path:
    return Path(run_dir) / "faults" / "fired"


def node_index() -> int:
    """This process's node: the pod index of the Indexed Job (training.local sets it too), else
    torchelastic's node rank."""
    return int(os.environ.get("JOB_COMPLETION_INDEX", os.environ.get("GROUP_RANK", 0)))
