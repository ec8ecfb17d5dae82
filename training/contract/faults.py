"""Fault specs, torch-free: which faults to inject when, each fired once per run (training/train/faults.py).

Spec format (config `faults:` list, `--faults` of training.local, or the TRAINING_FAULTS
environment variable, comma-separated, added to the config's list at every worker start):

    KIND@STEP[:key=value…][:persistent]

    exception@30:rank=1          rank 1 raises FaultInjected when it reaches step 30
    sigkill@60:rank=3            rank 3 SIGKILLs itself when it reaches step 60
    hang@40:rank=1               rank 1 stops (no heartbeat, no collective) and sleeps; its peers
                                 block in the next collective, inside their `step` section, until
                                 NVRx's rank monitor kills one at the step-section timeout (the hung
                                 rank's own heartbeat / out-of-section timeouts are the backstop);
                                 these must be shorter than training.collective_timeout_s so that
                                 NVRx, not gloo, detects the hang
    node-loss@50:node=1          node 1's pod (training.pod.launch, ft_launcher and every process they
                                 started) is SIGKILLed halfway through step 50 (fired by the node's
                                 local rank 0, so a hot spare's index fires once it trains); the Job /
                                 local controller replaces the node, a spare takes its place if any.
                                 Node faults of the same step land together: node-loss@50:node=0 and
                                 node-loss@50:node=1 lose both nodes in step 50 (each strikes once the
                                 other fired), as a rack's power loss would
    drain@50:node=1              node 1 is drained, as `kubectl drain` or a spot/capacity-block end
                                 would: training.local's controller (the kubelet here) sends SIGTERM
                                 to its launcher and SIGKILL after the grace period; every rank
                                 commits the step reached and leaves (training/train/drain.py), the node
                                 is replaced and the run resumes with no step lost
    partition@50:node=1:duration=20  node 1's network link goes down halfway through step 50, for 20 s
                                 (without duration: for good); its processes keep running and may
                                 still reach the file system, as behind a failed NIC or switch port.
                                 Every rank blocks in the next collective until NVRx's timeouts fire;
                                 the survivors restart without it (a spare takes its place, or they
                                 wait for it to come back or be replaced). Needs training.local
                                 --netns, which plays the network (and Kubernetes: a node unreachable
                                 for --replacement-delay seconds has its pod replaced on another
                                 machine; its old processes are killed once the link is back)
    node-hang@50:node=1          node 1 hangs but does not die, as a machine whose kernel or kubelet stops
                                 responding: halfway through step 50 every process of its pod is stopped
                                 (SIGSTOP). On EKS its kubelet stops reporting: the node goes NotReady and
                                 its pod, once evicted, stays Terminating (podReplacementPolicy: Failed)
                                 until PodGC deletes it (k8s/mark_hung_nodes.py marks the node out of
                                 service); training.local's controller plays that kubelet and the marker:
                                 a node stopped for --replacement-delay seconds has its pod replaced, its
                                 stopped processes are left where they are
    ckpt-crash@20:rank=1         rank 1 dies (SIGKILL) inside the first checkpoint save from step 20,
                                 after writing its shards and before the save commits (async mode:
                                 in the background writer); the restart loads the previous checkpoint
    corrupt-ckpt@25              rank 0 truncates every shard file of the newest committed
                                 checkpoint, then SIGKILLs itself, so that the restart must load it
                                 and fall back to the one before (ckpt_fallback event)
    disk-full@20:count=2         the first 2 checkpoint saves from step 20 fail on rank 0 with
                                 OSError(ENOSPC) as they start writing: ckpt_failed, nothing
                                 visible, training goes on and the next interval retries
    fs-eio@30:rank=0:duration=5  for 5 s from step 30, every file call of rank 0 on the run and checkpoint
                                 directories fails with EIO, as an FSx client eviction or failover makes
                                 them fail (training/train/outage.py says how, and what it cannot reach);
                                 training goes on, the saves in that window fail, the next ones commit
    exception@5:rank=1:persistent  fires on every attempt, not once: the job ends after its
                                 restart budget (fault_tolerance.max_restarts)

KIND is one of KINDS. STEP (at least 1) is the step the rank is about to run: a step fault fires
after step STEP-1 completed and before step STEP starts; a checkpoint fault (ckpt-crash, disk-full)
fires in the first save of a step >= STEP. Keys (each kind accepts its own, see KINDS):
`rank` (global rank, default 0), `node` (the node index: the pod's JOB_COMPLETION_INDEX, which
training.local sets too; else torchelastic's GROUP_RANK; a node fault takes node=N or rank=R, the
node that runs rank R at that step, which after a hot spare took over is another node),
`count` (saves that fail, default 1), `duration` (seconds a partition lasts, default: for good; seconds
an fs-eio lasts, which it needs),
and the flag `persistent` (exception, sigkill, hang, ckpt-crash).

What each kind does when it fires, and the once-per-run record, is training/train/faults.py's.
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
DESTRUCTIVE_KINDS = frozenset({"corrupt-ckpt", "disk-full", "fs-eio", "node-hang", "node-loss", "partition"})
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

    @property
    def key(self) -> str:
        """A file-name-safe identity: the normalised spec."""
        options = [f"count={self.count}" if self.count != 1 else None,
                   f"duration={self.duration}" if self.duration is not None else None,
                   f"node={self.node}" if self.node is not None else None,
                   "persistent" if self.persistent else None,
                   f"rank={self.rank}" if self.rank is not None else None]
        return "_".join([f"{self.kind}@{self.step}", *filter(None, options)])


@dataclass(frozen=True)
class FaultKind:
    help: str
    keys: frozenset[str]  # options key=value; "rank" or "node" says whom it targets
    flags: frozenset[str] = frozenset()
    # when it fires: before the step it names, or in this rank's write of a checkpoint save
    when: Literal["step", "write"] = "step"


_RANK = frozenset({"rank"})
_NODE = frozenset({"node", "rank"})  # a node fault names the node, or a rank: the node that runs it
_PERSISTENT = frozenset({"persistent"})
# What each kind does is training/train/faults.py's (ACTIONS); this table is what a spec may say.
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
}


# ---- parsing -----------------------------------------------------------------------------------
_SPEC = re.compile(r"^(?P<kind>[a-z][a-z0-9-]*)@(?P<step>[^:]+)(?P<opts>(:[^:]*)*)$")
_NUMBER_KEYS = {"rank": 0, "node": 0, "count": 1, "duration": 1}  # key -> smallest allowed value


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
                 nodes: int | None = None) -> list[FaultSpec]:
    specs = [parse_fault(t) for t in texts]
    for spec in specs:
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
