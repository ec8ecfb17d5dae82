"""The recovery mechanisms the bench compares, and one fault run of each on the local cluster.

A Mechanism is one fault kind and one way of recovering from it; MECHANISMS lists them with their labels.
Each gets one run with the profile's deterministic faults at spread steps, on the last rank or node (rank 0
or node 0 where fault_on_host says so). The run's goodput report (training.report) gives each fault's
detection time, recovery time (fault -> next completed step) and steps lost, and the run's training and infra
goodput. summarize refuses a run whose faults another restart kind handled: it measured something else.
"""
from __future__ import annotations

import importlib.util
import shutil
import statistics
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from bench.cluster import ClusterSpec, run_cluster
from bench.profile import Profile
from training.contract.faults import KINDS
from training.contract.launcher import REJOIN_POLLS_S
from training.local.cluster import WORKERS_STOP_TIMEOUT_S
from training.local.netns import unavailable_reason as netns_unavailable_reason
from training.models.tiny import write_tiny_model
from training.report.goodput import GoodputReport, ReportError, report_run


@dataclass(frozen=True)
class Mechanism:
    name: str  # the key in the results' "recovery" object (training.plan.planner reads it)
    label: str
    restart: str  # fault_tolerance.restart
    fault: str  # a training.contract.faults kind; one that takes node=N (node-loss, drain) hits a node, others a rank
    in_job_restarts: bool  # ft_launcher may restart workers
    expected_restart_kind: str  # the restart_kind (training.contract.events) that must have handled every fault
    fault_on_host: bool = False  # the fault hits rank 0 / node 0 instead of the last one
    spares: int = 0  # hot spare nodes; their node faults name the last rank (whichever node runs it)
    needs_module: str | None = None
    overrides: tuple[str, ...] = ()  # training config overrides of this mechanism
    netns: bool = False  # each node on its own emulated machine (training.local --netns)
    # a restart_kind that may have handled a fault instead: whichever of two restarts comes first
    alternative_restart_kind: str | None = None
    hf_family: str | None = None  # train this family's tiny Hugging Face model instead of the profile's preset


MECHANISMS = (
    Mechanism("inprocess", "in-process restart", "both", "exception", True, "inprocess",
              needs_module="training.train.inprocess"),
    Mechanism("injob", "in-job restart (ft_launcher)", "injob", "exception", True, "injob"),
    Mechanism("injob_hf", "in-job restart, Hugging Face Llama", "injob", "exception", True, "injob",
              hf_family="llama"),
    Mechanism("injob_fresh", "in-job restart, fresh Python workers", "injob", "exception", True, "injob",
              overrides=("fault_tolerance.prefork_workers=false",)),
    Mechanism("node_replacement", "node lost (SIGKILL), replaced", "injob", "node-loss", True, "node"),
    Mechanism("node_zero", "node 0 lost (SIGKILL), replaced", "injob", "node-loss", True, "node",
              fault_on_host=True),
    Mechanism("hot_spare", "node lost (SIGKILL), hot spare takes over", "injob", "node-loss", True, "node",
              spares=1),
    Mechanism("peer_state", "node lost, hot spare, state from peers", "injob", "node-loss", True, "node", spares=1,
              overrides=("peer_state.enabled=true",)),
    Mechanism("drain", "node drained (SIGTERM), replaced", "injob", "drain", True, "node"),
    Mechanism("partition", "node cut off (network partition), hot spare takes over", "injob", "partition", True,
              "injob", spares=1, netns=True, alternative_restart_kind="node"),
    Mechanism("node_hang", "node hangs (SIGSTOP), its pod replaced", "injob", "node-hang", True, "injob",
              alternative_restart_kind="node"),
    Mechanism("k8s_restart", "plain Kubernetes restart (every pod replaced)", "injob", "node-loss", False, "node",
              fault_on_host=True),
    Mechanism("hang", "rank hangs, in-job restart", "injob", "hang", True, "injob"),
    # restart=both beside injob for the faults the Wrapper cannot restart in-process (a lost node, a cut-off
    # node) and for a hang, which it restarts in-process
    Mechanism("node_zero_both", "node 0 lost (SIGKILL), replaced, restart=both", "both", "node-loss", True, "node",
              fault_on_host=True),
    Mechanism("partition_both", "node cut off, hot spare takes over, restart=both", "both", "partition", True,
              "injob", spares=1, netns=True, alternative_restart_kind="node"),
    Mechanism("hang_both", "rank hangs, restart=both", "both", "hang", True, "inprocess"),
)
# The restart=both rows and the injob rows they are compared with (bench.checks)
BOTH_BESIDE_INJOB = {"node_zero_both": "node_zero", "partition_both": "partition", "hang_both": "hang"}

# With a spare: a lost node's replacement starts this much later, after the spare took over. Later than a
# survivor can be back in the restart round, so that the round's last call is NVRx's 1 s, as in the Job on
# EKS, where a replacement takes minutes (training.contract.launcher.rendezvous_last_call_s): a replacement
# that could join first would have the round wait out a survivor's longest return for every node loss.
REPLACEMENT_DELAY_S = float(WORKERS_STOP_TIMEOUT_S + REJOIN_POLLS_S + 2)
# Async checkpoints, a short gloo timeout (a CPU collective cannot be aborted; it bounds
# how long survivors of a fault can hang), generous NVRx timeouts for a busy machine.
COLLECTIVE_TIMEOUT_S = 30
BASE_OVERRIDES = ("checkpoint.mode=async", "checkpoint.keep=1",
                  f"training.collective_timeout_s={COLLECTIVE_TIMEOUT_S}", "logging.log_interval=50",
                  "fault_tolerance.timeout_safety_factor=10")


@dataclass(frozen=True)
class MechanismResult:
    median_recovery_s: float
    median_detection_s: float | None
    median_steps_lost: float
    max_steps_lost: int
    median_time_lost_s: float | None
    recovered: int  # faults followed by a completed step
    faults: int
    training_goodput: float
    infra_goodput: float
    wall_s: float
    status: str
    restart_kinds: tuple[str, ...]
    run_dir: str
    per_fault: tuple[dict[str, Any], ...]


class Unavailable(Exception):
    """The mechanism cannot be measured here; the message says why."""


def unavailable_reason(m: Mechanism) -> str | None:
    if m.needs_module and importlib.util.find_spec(m.needs_module) is None:
        return f"{m.needs_module} does not exist in this checkout yet"
    if m.fault not in KINDS:
        return f"training.contract.faults.KINDS has no {m.fault!r} fault kind"
    if m.netns:
        return netns_unavailable_reason()
    return None


def fault_specs(m: Mechanism, profile: Profile) -> tuple[str, ...]:
    if "node" in KINDS[m.fault].keys and not m.spares:
        target = f"node={0 if m.fault_on_host else profile.nodes - 1}"
    else:
        target = f"rank={0 if m.fault_on_host else profile.world - 1}"
    return tuple(f"{m.fault}@{step}:{target}" for step in profile.fault_steps(spare=m.spares > 0))


def model_overrides(m: Mechanism, profile: Profile, run_dir: Path) -> tuple[str, ...]:
    """The profile's preset, or the mechanism's tiny Hugging Face model, written beside the run's directory."""
    if m.hf_family is None:
        return (f"model.preset={profile.preset}",)
    model_dir = run_dir.parent / f"tiny-hf-{m.hf_family}"
    if not (model_dir / "config.json").is_file():
        write_tiny_model(model_dir, m.hf_family)
    return ("model.source=huggingface", f"model.path={model_dir}")


def cluster_spec(m: Mechanism, profile: Profile, run_dir: Path) -> ClusterSpec:
    # A budget every mechanism's restarts fit in. Without in-job restarts a fault shuts the rendezvous
    # down and the store restarts: a node's replacement that meets it before then fails once more.
    retries = (profile.faults + 1) * (1 if m.in_job_restarts else 2)
    budgets = (f"fault_tolerance.max_restarts={retries if m.in_job_restarts else 0}",
               *((f"fault_tolerance.inprocess_max_restarts={retries}",) if m.restart == "both" else ()))
    return ClusterSpec(
        run_dir=run_dir, nodes=profile.nodes, nproc_per_node=profile.nproc_per_node,
        steps=profile.steps(spare=m.spares > 0),
        overrides=(*BASE_OVERRIDES, *model_overrides(m, profile, run_dir), f"training.device={profile.device}",
                   f"checkpoint.interval={profile.checkpoint_interval}", f"fault_tolerance.restart={m.restart}",
                   *budgets, *m.overrides),
        faults=fault_specs(m, profile), node_retries=retries, spares=m.spares, netns=m.netns,
        replacement_delay_s=REPLACEMENT_DELAY_S if m.spares else 0.0)


def measure_mechanism(m: Mechanism, profile: Profile, run_dir: Path) -> MechanismResult:
    reason = unavailable_reason(m)
    if reason:
        raise Unavailable(reason)
    shutil.rmtree(run_dir, ignore_errors=True)
    run_cluster(cluster_spec(m, profile, run_dir))
    try:
        _, report = report_run(run_dir)
    except ReportError as err:
        raise Unavailable(f"the run left no report: {err}") from None
    return summarize(m, report, str(run_dir))


def summarize(m: Mechanism, report: GoodputReport, run_dir: str) -> MechanismResult:
    faults = report.faults
    recovered = [f for f in faults if f.recovery_s is not None]
    if not recovered:
        raise Unavailable(f"no fault recovered in {run_dir} ({len(faults)} faults, run {report.status})")
    kinds = tuple(sorted({f.restart_kind or "none" for f in faults}))
    if not set(kinds) <= {m.expected_restart_kind, m.alternative_restart_kind}:
        raise Unavailable(f"faults were handled by {', '.join(kinds)} restarts, not {m.expected_restart_kind} "
                          f"(run {run_dir})")
    lost = [f.steps_lost for f in recovered if f.steps_lost is not None]
    return MechanismResult(
        median_recovery_s=statistics.median(f.recovery_s for f in recovered),
        median_detection_s=_median(f.detection_s for f in faults),
        median_steps_lost=statistics.median(lost) if lost else 0.0,
        max_steps_lost=max(lost, default=0),
        median_time_lost_s=_median(f.time_lost_s for f in faults),
        recovered=len(recovered), faults=len(faults),
        training_goodput=report.training_goodput, infra_goodput=report.infra_goodput, wall_s=report.wall_s,
        status=report.status, restart_kinds=kinds, run_dir=run_dir,
        per_fault=tuple(asdict(f) for f in faults))


def _median(values) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None
