"""The Job's rules for a pod that ended: one table that the chart renders into the Job's podFailurePolicy
and the local cluster decides by (no torch: the charts read it).

Kubernetes evaluates podFailurePolicy rules in order; the first rule that matches a failed pod decides
its action, and a failed pod that no rule matches is counted against its index's retries
(backoffLimitPerIndex). FailJob fails the whole Job, Ignore replaces the pod without counting it, Count
replaces it counted. A pod that exited 0 completed its index. Source: the Kubernetes docs, "Handling
retriable and non-retriable pod failures with Pod failure policy"
(https://kubernetes.io/docs/tasks/job/pod-failure-policy/), and the batch/v1 PodFailurePolicyRule API.
"""
from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import ClassVar

from training.contract.exit_codes import CONFIG_ERROR, NO_PROGRESS


class Action(Enum):
    """A podFailurePolicy rule's action, spelled as the Job's spec spells it."""
    FAIL_JOB = "FailJob"
    IGNORE = "Ignore"
    COUNT = "Count"


@dataclass(frozen=True)
class DisruptionRule:
    """A pod with the DisruptionTarget condition, which Kubernetes 1.34 sets before it removes a pod for a
    reason outside it (https://kubernetes.io/docs/concepts/workloads/pods/disruptions/#pod-disruption-conditions):
    evicted through the Eviction API (a drain, k8s.evict), deleted by the taint manager from a node that
    became unreachable or not ready (a lost node, after the pod's toleration), deleted by PodGC because its node
    is gone, terminated by the kubelet (node pressure, graceful node shutdown), preempted. A plain delete
    (`kubectl delete pod`) and an OOM kill set no such condition."""
    action: Action
    condition: ClassVar[str] = "DisruptionTarget"


@dataclass(frozen=True)
class ExitRule:
    """A pod whose training container exited with one of `exit_codes`."""
    exit_codes: tuple[int, ...]
    action: Action


JOB_RULES: tuple[DisruptionRule | ExitRule, ...] = (
    # Drains, evictions and preemptions are not the training's fault: retry without counting. First, so
    # that a drained pod is retried whatever its exit code.
    DisruptionRule(Action.IGNORE),
    # An invalid config, checkpoints that cannot load, restarts that made no progress: a retry fails the
    # same way.
    ExitRule((CONFIG_ERROR, NO_PROGRESS), Action.FAIL_JOB),
)


@dataclass(frozen=True)
class PodEnd:
    """How a pod ended, as the Job controller sees it."""
    # its training container's exit code (0-255); None: no exit seen, its node lost or cut off from the
    # network (the taint manager or PodGC removed the pod, its processes died with the node or run on there)
    exit_code: int | None
    disrupted: bool  # the pod has the DisruptionTarget condition (drained, evicted, its node lost)
    retries_used: int  # counted replacements of its index so far

    def __post_init__(self) -> None:
        if self.exit_code is None and not self.disrupted:
            raise ValueError("a pod that ended without an exit code was evicted: disrupted=True")
        if self.exit_code is not None and not 0 <= self.exit_code <= 255:
            raise ValueError(f"exit code {self.exit_code}: a container's exit code is 0 to 255 (128 + N when "
                             "killed by signal N); a pod whose node was lost has none (None)")


class Outcome(Enum):
    DONE = "done"  # the index completed
    FAIL_JOB = "fail the Job"
    REPLACE = "replace the pod"


class FailReason(Enum):
    EXIT_CODE = "a FailJob rule matched its exit code"
    NO_RETRIES_LEFT = "its index used up its retries (backoffLimitPerIndex)"


@dataclass(frozen=True)
class Decision:
    outcome: Outcome
    reason: FailReason | None = None  # FAIL_JOB: why
    counted: bool = False  # REPLACE: the replacement uses one of its index's retries
    # REPLACE: no other training node is left to open NVRx's next rendezvous round, where standby and new
    # launchers would wait for ever: the local cluster starts the rendezvous over (a new store)
    start_over: bool = False


def matching_action(end: PodEnd) -> Action:
    """The action of the first rule that matches a failed pod; Count when none does."""
    for rule in JOB_RULES:
        if (end.disrupted if isinstance(rule, DisruptionRule) else end.exit_code in rule.exit_codes):
            return rule.action
    return Action.COUNT


def decide(end: PodEnd, retry_limit: int, survivor: bool) -> Decision:
    """What the Job does about a pod that ended, given its index's retry limit (backoffLimitPerIndex) and
    whether another training node is still up to open the next rendezvous round."""
    if end.exit_code == 0:
        return Decision(Outcome.DONE)
    action = matching_action(end)
    if action is Action.FAIL_JOB:
        return Decision(Outcome.FAIL_JOB, reason=FailReason.EXIT_CODE)
    counted = action is Action.COUNT
    if counted and end.retries_used >= retry_limit:
        return Decision(Outcome.FAIL_JOB, reason=FailReason.NO_RETRIES_LEFT)
    return Decision(Outcome.REPLACE, counted=counted, start_over=not survivor)


def job_succeeded(succeeded_pods: int, training_nodes: int) -> bool:
    """The Job's successPolicy, `succeededCount: training_nodes`, which the chart renders. A pod exits 0 only once
    the run completed (training.pod.launch), so that many successes mean the run is done; the pods left linger (a
    lost node's replacement not yet scheduled, a standby, a node cut off that cannot hear of the end) and the Job
    controller removes them as the Job succeeds. Without it every index must succeed: a Job whose run completed
    stays active until a lost node's replacement runs, which, with no capacity left, is never. Source: the
    Kubernetes docs, "Jobs: Success policy", GA in 1.33
    (https://kubernetes.io/docs/concepts/workloads/controllers/job/#success-policy)."""
    return succeeded_pods >= training_nodes
