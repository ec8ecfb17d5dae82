"""Checkpoint-interval planner: the save interval that maximizes expected goodput, and the goodput
each recovery mechanism should then reach.

    python -m training.plan --nodes 16 --gpus-per-node 8 --node-mtbf-hours 2000 --save-blocking-s 3 \\
        --recovery-s inprocess=10 --recovery-s injob=17 --recovery-s k8s=270
    python -m training.plan --nodes 16 --node-mtbf-hours 2000 --from-bench bench.json

Model (J. T. Daly, "A higher order estimate of the optimum checkpoint interval for restart dumps", 2006):
  M    job MTBF = node MTBF / nodes. Node failures are independent with exponentially distributed
       times between them and any one stops the job, so job failures are a Poisson process of rate
       1/M and the expected time to the first failure is M.
  S    time one save blocks training (seconds); tau is the training time between saves.
  R    recovery time of a mechanism, failure to training again; independent of tau, and failures
       may strike during recovery too.
  D    commit lag: how long a checkpoint stays uncommitted after its save stopped blocking (an async
       save's write, 0 for a sync save; training.contract.capacity.commit_lag_s). D <= tau + S.
Work runs in failure-atomic segments of length w: a failure loses the part of the current segment
done so far, and what L adds, and costs R. One segment takes M e^((R+L)/M) (e^(w/M) - 1) wall seconds on
average, so
    G(tau) = tau / (tau + S) * w / (M e^((R+L)/M) (e^(w/M) - 1))
with
    w = tau + S,  for mechanisms that roll back to the last checkpoint on disk (injob, node replacement,
    L = D         Kubernetes restart): G = tau / (M e^((R+D)/M) (e^((tau+S)/M) - 1)), Daly's model with
                  the lag. After a restart the first checkpoint commits tau + S + D later, each next one
                  tau + S after the one before, and the work kept until the next failure is tau times the
                  commits before it: e^(-D/M) / (e^((tau+S)/M) - 1) of them on average. So the lag costs
                  like recovery time: a failure landing uniformly in time loses (tau + S)/2 + D, not (tau + S)/2;
    w = step,     for the mechanisms that resume from memory (IN_MEMORY: "inprocess", in-process restart
    L = 0         with in-memory rollback, and "peer_state", a lost node's state from its partner's
                  memory): a failure loses at most the step in flight (--step-s), not half an
                  interval, so only the save overhead tau / (tau + S) depends on tau.
The interval is chosen for rollback to disk. D does not move the optimum: dG/dtau = 0 gives, with u = tau/M,
    u + ln(1 - u) = -S/M          (solved numerically: the exact optimum of the model)
whose expansions are Young's first order  tau = sqrt(2 S M)  and Daly's higher order
    tau = sqrt(2 S M) (1 + sqrt(S / (2M)) / 3 + S / (18 M)) - S   for S < 2M, else tau = M.
With a lag the recommended interval is at least ASYNC_SAVE_HEADROOM times it (shortest_interval_s): the
save must commit before the next is due, with room for a slower save.
Not modelled: a mechanism is assumed to handle every failure (in reality in-process restart cannot
survive a lost node), failed saves, slowdown from an asynchronous save finishing in the background
(only its blocking time counts), recovery time growing with the interval.

--config FILE (a training config, e.g. k8s/train.yaml) takes S, the step time and R from the capacity model
(training.contract.capacity) for that config on --nodes p5.48xlarge nodes against the FSx of
--fsx-storage-gib and --fsx-throughput-per-tib (default: cdk.json's): S is the time a save blocks the step, R the
recovery of a lost node from FSx (injob) and from peer state, and D an async save's modelled duration. It prints
the capacity table first.
--capacity-tables prints the tables of docs/capacity.md (8b and 70b on 2, 32 and 256 p5 nodes, and HSDP beside them).

--from-bench FILE takes S and R from a benchmark result (JSON):
    {"checkpoint": {"async_blocking_s": 0.4, "sync_blocking_s": 6.2},
     "recovery": {"inprocess": {"median_recovery_s": 9.8}, "injob": {"median_recovery_s": 17.0},
                  "node_replacement": {"median_recovery_s": 95.0}, "k8s_restart": {"median_recovery_s": 270.0}}}
S is checkpoint.<--save-mode>_blocking_s (async by default); every mechanism under "recovery" must
have median_recovery_s, and the bench's "drain" is left out: a drain is announced, not a failure, and
loses no work. --save-blocking-s and --recovery-s, when given, take precedence over the file.
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
DAY_S = 86400.0


class PlanError(ValueError):
    """An input cannot be planned with; the message names it and what is allowed."""


@dataclass(frozen=True)
class Mechanism:
    name: str
    recovery_s: float

    @property
    def in_memory(self) -> bool:
        return self.name in IN_MEMORY


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
    if save_s >= 2 * mtbf_s:
        return mtbf_s
    x = save_s / (2 * mtbf_s)
    return young_interval(save_s, mtbf_s) * (1 + math.sqrt(x) / 3 + x / 9) - save_s


def optimum_interval(save_s: float, mtbf_s: float) -> float:
    """Root u in (0, 1) of u + ln(1 - u) + S/M, which decreases from S/M to -inf: bisection always converges."""
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
    """(w, L) of the module's model: what a failure can lose of the work since the last failure-atomic point,
    and the commit lag it loses beside it."""
    if mechanism.in_memory:
        return step_s, 0.0
    if commit_lag_s > interval_s + save_s:
        raise PlanError(f"commit lag {commit_lag_s:g} s is longer than the interval {interval_s:g} s plus the save's "
                        f"blocking {save_s:g} s: a save would still be in flight when the next is due")
    return interval_s + save_s, commit_lag_s


def expected_goodput(interval_s: float, save_s: float, mechanism: Mechanism, mtbf_s: float, step_s: float,
                     commit_lag_s: float = 0.0) -> float:
    segment, lag = _segment_and_lag(interval_s, save_s, mechanism, step_s, commit_lag_s)
    per_segment = mtbf_s * math.exp((mechanism.recovery_s + lag) / mtbf_s) * math.expm1(segment / mtbf_s)
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
        rollback = ("resumes from memory: loses at most the step in flight, not half an interval"
                    if o.mechanism.in_memory else "rolls back to the last committed checkpoint")
        lost = expected_loss_s(plan.recommended_s, plan.save_s, o.mechanism, plan.step_s, plan.commit_lag_s)
        lines.append(f"  {o.mechanism.name:<{width}}  R = {o.mechanism.recovery_s:>7g} s  "
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
    return save, tuple(
        Mechanism(name, positive(_lookup(data, path, "recovery", name, "median_recovery_s"),
                                 f"{path}: recovery.{name}.median_recovery_s"))
        for name in recovery if name not in NOT_FAILURES)


def _lookup(data: Any, path: Path, *keys: str) -> Any:
    for i, key in enumerate(keys):
        if not isinstance(data, dict) or key not in data:
            raise PlanError(f"{path}: missing key {'.'.join(keys[:i + 1])} "
                            "(the expected layout is in `python -m training.plan --help`)")
        data = data[key]
    return data
