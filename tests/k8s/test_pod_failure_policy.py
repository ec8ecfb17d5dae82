"""The rendered Job's podFailurePolicy against every way a training pod ends on Kubernetes 1.34, read with
the Job controller's rules, and the local cluster's decision (training/contract/job_rules.py) for each.

Sources (Kubernetes 1.34 documentation):
- Pod disruption conditions, https://kubernetes.io/docs/concepts/workloads/pods/disruptions/#pod-disruption-conditions:
  DisruptionTarget is added, with one of these reasons, before the pod is removed: PreemptionByScheduler,
  DeletionByTaintManager (a NoExecute taint the pod does not tolerate: node.kubernetes.io/unreachable or
  not-ready once its tolerationSeconds are over), EvictionByEvictionAPI, DeletionByPodGC (bound to a node
  that no longer exists), TerminationByKubelet (node-pressure eviction, graceful node shutdown).
- Pod failure policy, https://kubernetes.io/docs/tasks/job/pod-failure-policy/ and batch/v1 PodFailurePolicyRule:
  rules are evaluated in order and the first that matches decides; onPodConditions matches when one pattern
  matches a condition of the pod (type and status); onExitCodes with `In` matches when the named container
  exited with one of the values; Ignore does not count the failure against the backoff limit and creates a
  replacement, Count counts it (also when no rule matches), FailJob fails the Job.
- Deleting a pod (`kubectl delete pod`) sets no condition: the kubelet runs the preStop hook, sends SIGTERM and
  SIGKILL after the grace period. The kernel's OOM kill of the container's PID 1 ends it with 137 (reason
  OOMKilled), also without a condition.
"""
from __future__ import annotations

from dataclasses import dataclass

import pytest

from training.contract.exit_codes import CONFIG_ERROR, INCOMPLETE, NO_PROGRESS, TERMINATED
from training.contract.job_rules import Action, Decision, FailReason, Outcome, PodEnd, decide

CONTAINER = "trainer"
RETRIES = 3  # backoffLimitPerIndex of the example; every retry already used: what still fails the Job is counted


@dataclass(frozen=True)
class Ending:
    """How a pod ended, as its status shows it to the Job controller."""
    disruption_reason: str | None  # DisruptionTarget's reason; None: no such condition
    exit_code: int | None  # the training container's; None: no termination seen (its node is gone or cut off)

    def pod_status(self) -> dict:
        conditions = ([{"type": "DisruptionTarget", "status": "True", "reason": self.disruption_reason}]
                      if self.disruption_reason else [])
        state = {"terminated": {"exitCode": self.exit_code}} if self.exit_code is not None else {"running": {}}
        return {"conditions": conditions, "containerStatuses": [{"name": CONTAINER, "state": state}]}

    def pod_end(self) -> PodEnd:
        return PodEnd(self.exit_code, disrupted=self.disruption_reason is not None, retries_used=RETRIES)


# Each way a training pod ends; the drained pod's ranks commit and exit TERMINATED (preStop marker, SIGTERM).
ENDINGS = {
    "eviction (kubectl drain, k8s/evict.py)": (Ending("EvictionByEvictionAPI", TERMINATED), Action.IGNORE),
    "node-failure taint (lost node, after the toleration)": (Ending("DeletionByTaintManager", None), Action.IGNORE),
    "node object deleted (PodGC)": (Ending("DeletionByPodGC", None), Action.IGNORE),
    "node-pressure eviction or node shutdown (kubelet)": (Ending("TerminationByKubelet", TERMINATED), Action.IGNORE),
    "preemption": (Ending("PreemptionByScheduler", TERMINATED), Action.IGNORE),
    "kubectl delete pod": (Ending(None, TERMINATED), Action.COUNT),
    "OOM kill of the container": (Ending(None, 137), Action.COUNT),
    "exit 1 (a failed launcher)": (Ending(None, 1), Action.COUNT),
    "exit 3 (CONFIG_ERROR)": (Ending(None, CONFIG_ERROR), Action.FAIL_JOB),
    "exit 75 (INCOMPLETE)": (Ending(None, INCOMPLETE), Action.COUNT),
    "exit 93 (NO_PROGRESS)": (Ending(None, NO_PROGRESS), Action.FAIL_JOB),
    "exit 143 (SIGTERM, not drained)": (Ending(None, TERMINATED), Action.COUNT),
}


def policy_action(rules: list[dict], status: dict) -> Action:
    """The action the Job controller takes on a failed pod: the first matching rule's, Count when none matches."""
    for rule in rules:
        if "onPodConditions" in rule:
            matched = any(c["type"] == p["type"] and c["status"] == p["status"]
                          for p in rule["onPodConditions"] for c in status["conditions"])
        else:
            requirement = rule["onExitCodes"]
            codes = [s["state"]["terminated"]["exitCode"] for s in status["containerStatuses"]
                     if s["name"] == requirement["containerName"] and "terminated" in s["state"]]
            matched = any((code in requirement["values"]) == (requirement["operator"] == "In") for code in codes)
        if matched:
            return Action(rule["action"])
    return Action.COUNT


@pytest.mark.parametrize("way", list(ENDINGS))
def test_the_rendered_policy_and_the_local_cluster_act_alike_on_each_way_a_pod_ends(render, way):
    ending, expected = ENDINGS[way]
    rules = render().one("Job")["spec"]["podFailurePolicy"]["rules"]
    assert policy_action(rules, ending.pod_status()) is expected
    decision = decide(ending.pod_end(), RETRIES, survivor=True)
    assert decision == {Action.IGNORE: Decision(Outcome.REPLACE),
                        Action.COUNT: Decision(Outcome.FAIL_JOB, reason=FailReason.NO_RETRIES_LEFT),
                        Action.FAIL_JOB: Decision(Outcome.FAIL_JOB, reason=FailReason.EXIT_CODE)}[expected]
