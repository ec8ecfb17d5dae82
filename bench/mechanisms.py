"""The recovery mechanisms the bench compares, and one fault run of each on the local cluster.

A Mechanism is one fault kind and one way of recovering from it; MECHANISMS lists them with their labels.
Each gets one run with the profile's deterministic faults at spread steps, on the last rank or node (rank 0
or node 0 where fault_on_host says so). The run's goodput report (training.report) gives each fault's
detection time, recovery time (fault -> next completed step) and steps lost, and the run's training and infra
goodput. summarize refuses a run whose faults another restart kind handled: it measured something else.
"""
from __future__ import annotations

import dataclasses
import importlib.util
import shutil
import statistics
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from bench.cluster import ClusterSpec, run_cluster
from bench.profile import Profile
from training.contract.events import read_events
from training.contract.faults import KINDS
from training.contract.launcher import REJOIN_POLLS_S
from training.contract.replica_groups import check_torchft, group_run_dir
from training.local.cluster import WORKERS_STOP_TIMEOUT_S
from training.local.netns import unavailable_reason as netns_unavailable_reason
from training.local.shape import ClusterShape
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
    replica_groups: int = 1  # R >= 2: the faults strike the last group; the others' stall is measured

    def fault_schedule(self, p: Profile) -> tuple[list[int], int]:
        """The steps its faults strike at, and the run's steps: a spare's replacement must be on standby
        before the next fault, a replica group healed before its next fault and the other groups' end."""
        if self.replica_groups > 1:
            faults = p.fault_steps(p.group_fault_spacing)
            return faults, faults[-1] + p.group_fault_spacing
        faults = p.fault_steps(p.spare_fault_spacing if self.spares else p.fault_spacing)
        return faults, faults[-1] + p.tail_steps


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
    # each group one node: the lost node is its whole group, replaced; the other group trains on
    Mechanism("replica_groups", "node lost, replica groups (the other group trains on)", "injob", "node-loss", True,
              "node", replica_groups=2, alternative_restart_kind="injob"),
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
    # replica groups: the other groups' longest time between two steps across each fault (median, max); the
    # figures above are the faulted group's, the goodputs every group's mean (each holds as many GPUs)
    median_survivor_stall_s: float | None = None
    max_survivor_stall_s: float | None = None
    # the median time from one step to the next (the survivor's, with replica groups): what a step costs,
    # quorum, cross-group sum and saves included
    median_step_s: float | None = None


class Unavailable(Exception):
    """The mechanism cannot be measured here; the message says why."""


def unavailable_reason(m: Mechanism) -> str | None:
    if m.needs_module and importlib.util.find_spec(m.needs_module) is None:
        return f"{m.needs_module} does not exist in this checkout yet"
    if m.fault not in KINDS:
        return f"training.contract.faults.KINDS has no {m.fault!r} fault kind"
    if m.netns:
        return netns_unavailable_reason()
    if m.replica_groups > 1:
        return check_torchft()
    return None


def fault_specs(m: Mechanism, profile: Profile) -> tuple[str, ...]:
    """The faults, on the last node or rank (of the last replica group) unless fault_on_host says 0."""
    nodes = profile.nodes // m.replica_groups
    if "node" in KINDS[m.fault].keys and not m.spares:
        target = f"node={0 if m.fault_on_host else nodes - 1}"
    else:
        target = f"rank={0 if m.fault_on_host else nodes * profile.nproc_per_node - 1}"
    if m.replica_groups > 1:
        target += f":group={m.replica_groups - 1}"
    return tuple(f"{m.fault}@{step}:{target}" for step in m.fault_schedule(profile)[0])


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
    shape = ClusterShape(profile.nodes, profile.nproc_per_node, m.spares, REPLACEMENT_DELAY_S if m.spares else 0.0,
                         retries, m.replica_groups, m.netns)
    return ClusterSpec(
        run_dir=run_dir, shape=shape, steps=m.fault_schedule(profile)[1],
        overrides=(*BASE_OVERRIDES, *model_overrides(m, profile, run_dir), f"training.device={profile.device}",
                   f"checkpoint.interval={profile.checkpoint_interval}", f"fault_tolerance.restart={m.restart}",
                   *budgets, *m.overrides),
        faults=fault_specs(m, profile))


def measure_mechanism(m: Mechanism, profile: Profile, run_dir: Path) -> MechanismResult:
    reason = unavailable_reason(m)
    if reason:
        raise Unavailable(reason)
    shutil.rmtree(run_dir, ignore_errors=True)
    run_cluster(cluster_spec(m, profile, run_dir))
    if m.replica_groups > 1:
        groups = [group_run_dir(run_dir, g) for g in range(m.replica_groups)]
        return dataclasses.replace(summarize_groups(m, groups), median_step_s=step_period(read_events(groups[0])))
    try:
        _, report = report_run(run_dir)
    except ReportError as err:
        raise Unavailable(f"the run left no report: {err}") from None
    return dataclasses.replace(summarize(m, report, str(run_dir)), median_step_s=step_period(read_events(run_dir)))


def summarize_groups(m: Mechanism, groups: list[Path]) -> MechanismResult:
    """The faulted (last) group's recovery, the others' stall across each of its faults."""
    try:
        reports = [report_run(g)[1] for g in groups]
    except ReportError as err:
        raise Unavailable(f"a replica group left no report: {err}") from None
    faulted = summarize(m, reports[-1], str(groups[-1]))
    fired = [e["t"] for e in read_events(groups[-1]) if e["event"] == "fault_injected"]
    stalls = [max(stall_across(read_events(g), t) for g in groups[:-1]) for t in fired]
    if None in stalls:
        raise Unavailable(f"a surviving group did not train across every fault ({groups[0]})")
    return dataclasses.replace(
        faulted, run_dir=str(groups[-1].parent),
        training_goodput=statistics.mean(r.training_goodput for r in reports),
        infra_goodput=statistics.mean(r.infra_goodput for r in reports),
        median_survivor_stall_s=statistics.median(stalls), max_survivor_stall_s=max(stalls))


def step_period(events: list[dict[str, Any]]) -> float | None:
    """The median time between two steps in a row (a step and the next one), faults' stalls a few among many."""
    steps = [(e["step"], e["t"]) for e in events if e["event"] == "step"]
    return _median(b - a for (i, a), (j, b) in zip(steps, steps[1:]) if j == i + 1)


def stall_across(events: list[dict[str, Any]], t: float) -> float | None:
    """The time between a group's last step before `t` and its first after (None: it trained on neither side)."""
    times = [e["t"] for e in events if e["event"] == "step"]
    before, after = [x for x in times if x <= t], [x for x in times if x > t]
    return after[0] - before[-1] if before and after else None


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
