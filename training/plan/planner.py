"""Checkpoint-interval planner: the save interval that maximizes expected goodput, and the goodput
each recovery mechanism should then reach.

Saving often costs blocking time. Saving rarely loses more work to each failure. Daly's model weighs the two
from the job MTBF M = node MTBF / nodes, the save blocking S, each mechanism's recovery time R and an async
save's commit lag D. S and R come from flags, a bench result or the capacity model of a training config.

    python -m training.plan --nodes 16 --node-mtbf-hours 2000 --save-blocking-s 3 \\
        --recovery-s inprocess=10 --recovery-s injob=17 --recovery-s k8s=270

--from-bench FILE reads S from checkpoint.<--save-mode>_blocking_s, R from recovery.NAME.median_recovery_s.
Reference: docs/capacity.md.
"""
from __future__ import annotations

import argparse
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from training.contract.capacity import ASYNC_SAVE_HEADROOM, shortest_interval_s

IN_MEMORY = ("inprocess", "peer_state")  # the mechanisms that resume from state in memory
# Llama 3 405B pre-training: 419 unexpected interruptions in 54 days on 16,384 H100s (2,048 8-GPU nodes),
# "The Llama 3 Herd of Models" (2024), section 3.3.4: failures per node-hour.
LLAMA3_NODE_FAILURE_RATE = 419 / (54 * 24 * 2048)
SCALE_NODES = (32, 256, 2048)
SCALE_RATES = ((1, "Llama 3 rate"), (10, "10x"))
NOT_FAILURES = ("drain",)  # bench mechanisms for announced events, not failures: not planned with
REPLICA_GROUPS = "replica_groups"  # the mechanism that stops only the failed node's group
BENCH_REPLICA_GROUPS = 2  # the groups of the bench's replica_groups row (bench.mechanisms)
DAY_S = 86400.0


class PlanError(ValueError):
    """An input cannot be planned with; the message names it and what is allowed."""


@dataclass(frozen=True)
class Mechanism:
    """A way to recover from a node failure.

    Args:
        name: its bench name; IN_MEMORY ones resume from state in memory.
        recovery_s: R, from the failure to the next completed step of the GPUs it stops.
        groups: replica groups (training.contract.config.ParallelConfig.replica_groups). 1: a failure stops
            every GPU. R >= 2: it stops its group's GPUs, which heal from a live group's state, and stalls
            the other groups' for survivor_stall_s.
        survivor_stall_s: the other groups' stall per failure, with groups >= 2.
    """
    name: str
    recovery_s: float
    groups: int = 1
    survivor_stall_s: float = 0.0

    @property
    def in_memory(self) -> bool:
        return self.name in IN_MEMORY or self.groups > 1

    @property
    def gpu_recovery_s(self) -> float:
        """R averaged over every GPU: the failed group's share of the GPUs pays recovery_s, the rest the stall."""
        return (self.recovery_s + (self.groups - 1) * self.survivor_stall_s) / self.groups

    def describe(self) -> str:
        if self.groups == 1:
            return f"R = {self.recovery_s:>7g} s"
        return (f"R = {self.recovery_s:>7g} s for 1 of {self.groups} groups, {self.survivor_stall_s:g} s for the "
                f"others: {self.gpu_recovery_s:.1f} s per GPU")


@dataclass(frozen=True)
class Outcome:
    mechanism: Mechanism
    goodput: float


@dataclass(frozen=True)
class Plan:
    nodes: int
    gpus_per_node: int
    mtbf_s: float  # job MTBF, the expected time to the first failure
    save_s: float
    step_s: float
    young_s: float
    daly_s: float
    optimum_s: float
    outcomes: tuple[Outcome, ...]
    commit_lag_s: float = 0.0  # D: an async save's duration; a sync save commits when it stops blocking

    @property
    def min_interval_s(self) -> float:
        return shortest_interval_s(self.commit_lag_s)

    @property
    def recommended_s(self) -> float:
        return max(self.optimum_s, self.min_interval_s)


def young_interval(save_s: float, mtbf_s: float) -> float:
    return math.sqrt(2 * save_s * mtbf_s)


def daly_interval(save_s: float, mtbf_s: float) -> float:
    """Daly's higher-order expansion of optimum_interval: sqrt(2 S M) (1 + sqrt(S / (2M)) / 3 + S / (18 M)) - S
    for S < 2M, else M."""
    if save_s >= 2 * mtbf_s:
        return mtbf_s
    x = save_s / (2 * mtbf_s)
    return young_interval(save_s, mtbf_s) * (1 + math.sqrt(x) / 3 + x / 9) - save_s


def optimum_interval(save_s: float, mtbf_s: float) -> float:
    """The exact optimum of expected_goodput for rollback to disk: dG/dtau = 0 gives u + ln(1 - u) = -S/M with
    u = tau/M, whatever the commit lag. Root u in (0, 1) of u + ln(1 - u) + S/M, which decreases from S/M to -inf:
    bisection always converges."""
    lo, hi = 0.0, 1.0
    while True:
        mid = (lo + hi) / 2
        if mid in (lo, hi):
            return mid * mtbf_s
        if mid + math.log1p(-mid) + save_s / mtbf_s > 0:
            lo = mid
        else:
            hi = mid


def _segment_and_lag(interval_s: float, save_s: float, mechanism: Mechanism, step_s: float,
                     commit_lag_s: float) -> tuple[float, float]:
    """(w, L) of expected_goodput: the failure-atomic segment a failure loses part of, and the commit lag it
    loses beside it.

    Rolling back to disk, w = tau + S and L = D. After a restart the first checkpoint commits tau + S + D later,
    each next one tau + S after the one before, and the work kept until the next failure is tau times the commits
    before it: e^(-D/M) / (e^((tau+S)/M) - 1) of them on average. So the lag costs like recovery time. Resuming
    from memory (IN_MEMORY), a failure loses at most the step in flight: w = step, L = 0."""
    if mechanism.in_memory:
        return step_s, 0.0
    if commit_lag_s > interval_s + save_s:
        raise PlanError(f"commit lag {commit_lag_s:g} s is longer than the interval {interval_s:g} s plus the save's "
                        f"blocking {save_s:g} s: a save would still be in flight when the next is due")
    return interval_s + save_s, commit_lag_s


def expected_goodput(interval_s: float, save_s: float, mechanism: Mechanism, mtbf_s: float, step_s: float,
                     commit_lag_s: float = 0.0) -> float:
    """Daly's model with a commit lag. Work runs in failure-atomic segments of length w: a failure loses the part
    done so far, and L, and costs R; failures strike during recovery too. One segment takes
    M e^((R+L)/M) (e^(w/M) - 1) wall seconds on average, so G = tau / (tau + S) * w / that. With replica
    groups, R is the GPU average (Mechanism.gpu_recovery_s): G counts GPU-time."""
    segment, lag = _segment_and_lag(interval_s, save_s, mechanism, step_s, commit_lag_s)
    per_segment = mtbf_s * math.exp((mechanism.gpu_recovery_s + lag) / mtbf_s) * math.expm1(segment / mtbf_s)
    return interval_s / (interval_s + save_s) * segment / per_segment


def expected_loss_s(interval_s: float, save_s: float, mechanism: Mechanism, step_s: float,
                    commit_lag_s: float = 0.0) -> float:
    """Work a failure landing uniformly in time loses on average: w/2 + L. It is expected_goodput to first order
    in 1/M, G ~ tau / (tau + S) (1 - (R + loss) / M), and what the plan prints beside each mechanism."""
    segment, lag = _segment_and_lag(interval_s, save_s, mechanism, step_s, commit_lag_s)
    return segment / 2 + lag


def make_plan(nodes: int, gpus_per_node: int, node_mtbf_h: float, save_s: float, step_s: float,
              mechanisms: Sequence[Mechanism], commit_lag_s: float = 0.0) -> Plan:
    mtbf = node_mtbf_h * 3600 / nodes
    best = optimum_interval(save_s, mtbf)
    used = max(best, shortest_interval_s(commit_lag_s))
    return Plan(nodes, gpus_per_node, mtbf, save_s, step_s, young_interval(save_s, mtbf),
                daly_interval(save_s, mtbf), best,
                tuple(Outcome(m, expected_goodput(used, save_s, m, mtbf, step_s, commit_lag_s)) for m in mechanisms),
                commit_lag_s)


def format_plan(plan: Plan) -> str:
    m = plan.mtbf_s
    lines = [
        f"Job: {plan.nodes} node(s) x {plan.gpus_per_node} GPUs = {plan.nodes * plan.gpus_per_node} GPUs; "
        f"job MTBF M = {_duration(m)}",
        f"Expected time to first failure: {_duration(m)} "
        f"(P(at least one failure in 24 h) = {-math.expm1(-DAY_S / m):.1%})",
        f"Save blocking S = {plan.save_s:g} s, commit lag D = {plan.commit_lag_s:g} s, step time {plan.step_s:g} s",
        "Checkpoint interval (training time between saves):",
        f"  Young  sqrt(2 S M)           {_duration(plan.young_s)}",
        f"  Daly   higher order          {_duration(plan.daly_s)}",
        f"  exact optimum of the model   {_duration(plan.optimum_s)}"
        + ("" if plan.min_interval_s > plan.optimum_s else
           f"  <- use this: checkpoint.interval = {recommended_steps(plan)} steps"),
    ]
    if plan.min_interval_s > plan.optimum_s:
        label = f"async save duration x {ASYNC_SAVE_HEADROOM:g}"
        lines.append(f"  {label:<29}{_duration(plan.min_interval_s)}  <- use this, the optimum leaves a save no time "
                     f"to commit: checkpoint.interval = {recommended_steps(plan)} steps")
    lines.append(f"Expected goodput at {_duration(plan.recommended_s)}:")
    width = max(len(o.mechanism.name) for o in plan.outcomes)
    for o in plan.outcomes:
        rollback = ("heals from a live group: loses at most the step in flight" if o.mechanism.groups > 1 else
                    "resumes from memory: loses at most the step in flight, not half an interval"
                    if o.mechanism.in_memory else "rolls back to the last committed checkpoint")
        lost = expected_loss_s(plan.recommended_s, plan.save_s, o.mechanism, plan.step_s, plan.commit_lag_s)
        lines.append(f"  {o.mechanism.name:<{width}}  {o.mechanism.describe()}  "
                     f"{o.goodput:7.3%}  loses {_duration(lost)} per failure ({rollback})")
    return "\n".join(lines)


def recommended_steps(plan: Plan) -> int:
    return max(math.ceil(plan.recommended_s / plan.step_s) if plan.min_interval_s > plan.optimum_s
               else round(plan.recommended_s / plan.step_s), 1)


def format_scale(save_s: float, step_s: float, mechanisms: Sequence[Mechanism], commit_lag_s: float = 0.0) -> str:
    """Expected goodput (ETTR) of each mechanism at the Llama 3 failure rate and ten times it, at
    SCALE_NODES nodes, each at the interval recommended for its job MTBF."""
    columns = [(nodes, factor, label) for factor, label in SCALE_RATES for nodes in SCALE_NODES]
    node_mtbf_h = 1 / LLAMA3_NODE_FAILURE_RATE
    header = "  ".join(f"{f'{nodes} nodes, {label}':>22}" for nodes, _, label in columns)
    width = max(len(m.name) for m in mechanisms)
    lines = [f"At scale: expected goodput (ETTR) per mechanism, node failures at the Llama 3 rate "
             f"({LLAMA3_NODE_FAILURE_RATE:.2e} per node-hour, node MTBF {node_mtbf_h:.0f} h) and ten times it, "
             f"S = {save_s:g} s, D = {commit_lag_s:g} s, step {step_s:g} s, each at its recommended interval:",
             f"  {'':<{width}}  {header}"]
    for m in mechanisms:
        cells = []
        for nodes, factor, _ in columns:
            plan = make_plan(nodes, 8, node_mtbf_h / factor, save_s, step_s, (m,), commit_lag_s)
            cells.append(f"{plan.outcomes[0].goodput:>22.2%}")
        lines.append(f"  {m.name:<{width}}  " + "  ".join(cells))
    return "\n".join(lines)


def _duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.1f} s"
    if seconds < 7200:
        return f"{seconds:.0f} s ({seconds / 60:.1f} min)"
    return f"{seconds:.0f} s ({seconds / 3600:.1f} h)"


def positive(value: Any, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise PlanError(f"{what}: expected a positive number, got {value!r}")
    return float(value)


def positive_float_arg(text: str) -> float:
    try:
        return positive(float(text), "value")
    except (ValueError, PlanError):
        raise argparse.ArgumentTypeError(f"expected a positive number of seconds or hours, got {text!r}") from None


def positive_int_arg(text: str) -> int:
    if not text.strip().isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return int(text)


def with_replica_groups(mechanisms: Sequence[Mechanism], groups: int | None,
                        survivor_stall_s: float | None) -> tuple[Mechanism, ...]:
    """The REPLICA_GROUPS mechanism planned with `groups` groups and that stall (each: its own if None)."""
    if groups is not None and groups < 2:
        raise PlanError(f"--replica-groups {groups}: expected 2 or more (1 is plain FSDP: every other mechanism)")
    if not any(m.name == REPLICA_GROUPS for m in mechanisms) and (groups or survivor_stall_s):
        raise PlanError(f"--replica-groups and --survivor-stall-s plan the {REPLICA_GROUPS} mechanism: give "
                        f"--recovery-s {REPLICA_GROUPS}=SECONDS or a bench result that measured it")
    planned = []
    for m in mechanisms:
        if m.name == REPLICA_GROUPS:
            stall = survivor_stall_s or m.survivor_stall_s
            if not stall:
                raise PlanError(f"--recovery-s {REPLICA_GROUPS}: give the other groups' stall per failure "
                                "with --survivor-stall-s SECONDS")
            m = Mechanism(m.name, m.recovery_s, groups or max(m.groups, BENCH_REPLICA_GROUPS), stall)
        planned.append(m)
    return tuple(planned)


def mechanism_arg(text: str) -> Mechanism:
    name, sep, seconds = text.rpartition("=")
    if sep and not re.fullmatch(r"[A-Za-z][\w-]*", name):
        raise argparse.ArgumentTypeError(f"expected NAME=SECONDS with a name like injob, got {text!r}")
    return Mechanism(name or "restart", positive_float_arg(seconds))


def from_bench(path: Path, save_mode: str) -> tuple[float, tuple[Mechanism, ...]]:
    try:
        data = json.loads(path.read_text())
    except OSError as err:
        raise PlanError(f"{path}: cannot read bench result ({err.strerror})") from None
    except json.JSONDecodeError as err:
        raise PlanError(f"{path}: not JSON ({err})") from None
    key = f"{save_mode}_blocking_s"
    save = positive(_lookup(data, path, "checkpoint", key), f"{path}: checkpoint.{key}")
    recovery = _lookup(data, path, "recovery")
    if not isinstance(recovery, dict) or not recovery:
        raise PlanError(f"{path}: recovery: expected an object of mechanisms, e.g. "
                        '{"injob": {"median_recovery_s": 17}}')
    return save, tuple(_bench_mechanism(data, path, name) for name in recovery if name not in NOT_FAILURES)


def _bench_mechanism(data: Any, path: Path, name: str) -> Mechanism:
    """A measured mechanism; a replica-group one (bench.mechanisms: two groups) with its survivors' stall."""
    recovery = positive(_lookup(data, path, "recovery", name, "median_recovery_s"),
                        f"{path}: recovery.{name}.median_recovery_s")
    stall = data["recovery"][name].get("median_survivor_stall_s")
    if stall is None:
        return Mechanism(name, recovery)
    return Mechanism(name, recovery, BENCH_REPLICA_GROUPS,
                     positive(stall, f"{path}: recovery.{name}.median_survivor_stall_s"))


def _lookup(data: Any, path: Path, *keys: str) -> Any:
    for i, key in enumerate(keys):
        if not isinstance(data, dict) or key not in data:
            raise PlanError(f"{path}: missing key {'.'.join(keys[:i + 1])} "
                            "(the expected layout is in `python -m training.plan --help`)")
        data = data[key]
    return data
