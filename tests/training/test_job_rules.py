"""The Job's rules for a pod that ended (training/contract/job_rules.py): what the local controller decides,
case by case, without a process. The controller's multi-process tests (test_local_cluster.py,
test_partition.py, test_fault_matrix.py) test it as their adapter."""
from __future__ import annotations

import pytest

from training.contract import exit_codes
from training.contract.exit_codes import CONFIG_ERROR, INCOMPLETE, NO_PROGRESS, TERMINATED
from training.contract.job_rules import (JOB_RULES, Action, Decision, DisruptionRule, ExitRule, FailReason, Outcome,
                                         PodEnd, decide, matching_action)
from training.local.kubelet import local_pod_end

RETRY_LIMIT = 3
DONE = Decision(Outcome.DONE)
FAILS_ON_EXIT_CODE = Decision(Outcome.FAIL_JOB, reason=FailReason.EXIT_CODE)
OUT_OF_RETRIES = Decision(Outcome.FAIL_JOB, reason=FailReason.NO_RETRIES_LEFT)
COUNTED = Decision(Outcome.REPLACE, counted=True)
UNCOUNTED = Decision(Outcome.REPLACE, counted=False)


def test_every_exit_code_of_the_contract_has_its_action():
    """A new exit code must be placed here: failing the Job at once, or retried like any failure."""
    codes = {name: value for name, value in vars(exit_codes).items() if name.isupper() and isinstance(value, int)}
    expected = {CONFIG_ERROR: Action.FAIL_JOB, NO_PROGRESS: Action.FAIL_JOB, TERMINATED: Action.COUNT,
                INCOMPLETE: Action.COUNT}
    assert set(codes.values()) == set(expected), f"exit codes without an expected action: {codes}"
    assert {code: matching_action(PodEnd(code, disrupted=False, retries_used=0)) for code in expected} == expected


@pytest.mark.parametrize("exit_code, disrupted, retries_used, expected", [
    (0, False, 0, DONE),
    (0, True, 0, DONE),  # drained, yet every rank left after the run completed
    (0, False, RETRY_LIMIT, DONE),
    (CONFIG_ERROR, False, 0, FAILS_ON_EXIT_CODE),
    (NO_PROGRESS, False, 0, FAILS_ON_EXIT_CODE),
    (NO_PROGRESS, False, RETRY_LIMIT, FAILS_ON_EXIT_CODE),  # the rule, before the budget
    (CONFIG_ERROR, True, 0, UNCOUNTED),  # the disruption rule comes first
    (NO_PROGRESS, True, 0, UNCOUNTED),
    (TERMINATED, False, 0, COUNTED),  # SIGTERM without a drain: a failure like any other
    (TERMINATED, True, 0, UNCOUNTED),  # a drain's SIGTERM
    (TERMINATED, True, RETRY_LIMIT, UNCOUNTED),  # disruptions never use up the retries
    (INCOMPLETE, False, 0, COUNTED),  # a launcher that left before the run completed
    (INCOMPLETE, False, RETRY_LIMIT - 1, COUNTED),
    (INCOMPLETE, False, RETRY_LIMIT, OUT_OF_RETRIES),
    (1, False, 0, COUNTED),  # a failed pod
    (1, False, RETRY_LIMIT, OUT_OF_RETRIES),
    (137, False, 0, COUNTED),  # SIGKILL of PID 1 (an OOM kill): no disruption
    (None, True, 0, UNCOUNTED),  # a lost node, or one cut off from the network: its pod removed
    (None, True, RETRY_LIMIT, UNCOUNTED),
])
def test_a_pods_end_decides_the_job(exit_code, disrupted, retries_used, expected):
    assert decide(PodEnd(exit_code, disrupted, retries_used), RETRY_LIMIT, survivor=True) == expected


def test_no_retries_allowed_fails_the_first_counted_failure_only():
    assert decide(PodEnd(1, disrupted=False, retries_used=0), 0, survivor=True) == OUT_OF_RETRIES
    assert decide(PodEnd(TERMINATED, disrupted=True, retries_used=0), 0, survivor=True) == UNCOUNTED


@pytest.mark.parametrize("end", [PodEnd(1, False, 0), PodEnd(TERMINATED, True, 0), PodEnd(None, True, 0)])
def test_a_replacement_without_a_surviving_training_node_starts_the_rendezvous_over(end):
    decision = decide(end, RETRY_LIMIT, survivor=False)
    assert decision.outcome is Outcome.REPLACE and decision.start_over


@pytest.mark.parametrize("end, expected", [(PodEnd(0, False, 0), DONE),
                                           (PodEnd(CONFIG_ERROR, False, 0), FAILS_ON_EXIT_CODE),
                                           (PodEnd(1, False, RETRY_LIMIT), OUT_OF_RETRIES)])
def test_only_a_replacement_starts_over(end, expected):
    assert decide(end, RETRY_LIMIT, survivor=False) == expected


def test_a_pod_without_an_exit_code_was_evicted():
    with pytest.raises(ValueError, match="disrupted=True"):
        PodEnd(None, disrupted=False, retries_used=0)


@pytest.mark.parametrize("code", [-9, 256])
def test_an_exit_code_is_one_a_container_can_have(code):
    with pytest.raises(ValueError, match=f"exit code {code}: a container's exit code is 0 to 255"):
        PodEnd(code, disrupted=False, retries_used=0)


@pytest.mark.parametrize("returncode, drained, lost, expected", [
    (-9, False, True, PodEnd(None, disrupted=True, retries_used=RETRY_LIMIT)),  # node-loss: its strike marked it lost
    (-9, False, False, PodEnd(137, disrupted=False, retries_used=RETRY_LIMIT)),  # PID 1 killed alone: an OOM kill
    (-15, False, False, PodEnd(TERMINATED, disrupted=False, retries_used=RETRY_LIMIT)),
    (TERMINATED, True, False, PodEnd(TERMINATED, disrupted=True, retries_used=RETRY_LIMIT)),  # a drain
    (-9, True, False, PodEnd(137, disrupted=True, retries_used=RETRY_LIMIT)),  # a drain's SIGKILL after the grace
    (1, False, False, PodEnd(1, disrupted=False, retries_used=RETRY_LIMIT)),
])
def test_the_local_cluster_plays_a_pods_end_as_eks_reports_it(returncode, drained, lost, expected):
    """A lost node's pod is removed by the taint manager or PodGC with DisruptionTarget, so a node lost any number
    of times never uses up its retries; a launcher killed by signal N otherwise is a container whose PID 1 died of
    it (exit code 128 + N, counted), as an OOM kill's 137 is."""
    end = local_pod_end(returncode, drained, lost, retries_used=RETRY_LIMIT)
    assert end == expected
    assert decide(end, RETRY_LIMIT, survivor=True) == (UNCOUNTED if lost or drained else OUT_OF_RETRIES)


def test_the_table_is_one_kubernetes_accepts():
    # batch/v1 PodFailurePolicy: at most 20 rules; an In requirement's values are 1 to 255 exit codes,
    # ordered, without duplicates, and never 0 (a container that exited 0 succeeded)
    assert len(JOB_RULES) <= 20
    for rule in (r for r in JOB_RULES if isinstance(r, ExitRule)):
        assert 0 < len(rule.exit_codes) <= 255 and 0 not in rule.exit_codes
        assert list(rule.exit_codes) == sorted(set(rule.exit_codes))
    # First match wins: a drained pod is retried whatever it exited with.
    assert isinstance(JOB_RULES[0], DisruptionRule) and JOB_RULES[0].action is Action.IGNORE
