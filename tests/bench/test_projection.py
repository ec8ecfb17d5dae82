"""The EKS projection of a lost node: sums of named delays and local measurements, a spare first."""
from __future__ import annotations

from dataclasses import replace

import pytest

from bench.projection import SURVIVORS_SCENARIO, project
from bench_samples import mechanism
from training.contract.config import ParallelConfig
from training.contract.k8s_delays import EKS, KubernetesDelays


def test_each_scenario_is_the_sum_of_its_named_parts() -> None:
    recovery = {"injob": mechanism(3.0), "hot_spare": mechanism(4.0), "node_replacement": mechanism(3.5),
                "k8s_restart": mechanism(10.0)}
    by_name = {p.scenario.split(" (")[0].split(":")[0]: p for p in project(EKS, recovery)}
    spare = by_name["hot spare"]
    assert spare.total_s == pytest.approx(EKS.lost_peer_detection_s + EKS.gpu_restart_s + 1.0)  # + measured extra
    no_spare = by_name["no spare"]
    assert no_spare.total_s == pytest.approx(
        EKS.lost_peer_detection_s + max(EKS.node_not_ready_s + EKS.toleration_s + EKS.pod_replacement_s,
                                        EKS.node_boot_join_s)
        + EKS.image_pull_cold_s + EKS.container_start_s + EKS.gpu_restart_s + 0.5)
    assert spare.total_s < by_name["spare node, no standby pod"].total_s < no_spare.total_s
    assert by_name["no spare, node hangs, not marked out of service"].total_s > EKS.node_repair_wait_s


def test_a_hung_nodes_pod_is_replaced_within_two_minutes_of_the_hang_plus_a_nodes_start() -> None:
    recovery = {"injob": mechanism(3.0), "node_hang": mechanism(5.0), "node_replacement": mechanism(3.5)}
    by_name = {p.scenario.split(":")[0]: p for p in project(EKS, recovery)}
    assert EKS.node_not_ready_s + EKS.hung_node_out_of_service_s <= 120  # the bound, before a node starts
    spare_node = by_name["spare node, no standby pod, node hangs"]
    assert spare_node.mechanism == "node_hang"
    assert spare_node.total_s == pytest.approx(
        EKS.lost_peer_detection_s + EKS.node_not_ready_s + EKS.hung_node_out_of_service_s + EKS.pod_replacement_s
        + EKS.image_pull_cold_s + EKS.container_start_s + EKS.gpu_restart_s + 2.0)  # + measured extra
    no_spare = by_name["no spare, node hangs"]
    assert no_spare.total_s - spare_node.total_s == pytest.approx(EKS.node_boot_join_s - EKS.pod_replacement_s)
    # the threshold is the user's: a shorter one shortens every hung-node scenario by as much
    quicker = {p.scenario.split(":")[0]: p for p in project(KubernetesDelays(hung_node_out_of_service_s=10), recovery)}
    assert spare_node.total_s - quicker["spare node, no standby pod, node hangs"].total_s == pytest.approx(50.0)


def test_a_spare_takes_over_without_kubernetes_delays() -> None:
    """Kubernetes' replacement is off the critical path with a hot spare: slower nodes change nothing."""
    recovery = {"injob": mechanism(3.0), "hot_spare": mechanism(4.0), "node_replacement": mechanism(3.5)}
    slow = KubernetesDelays(node_not_ready_s=300, toleration_s=300, node_boot_join_s=1200, image_pull_cold_s=900)
    assert project(slow, recovery)[0].total_s == project(EKS, recovery)[0].total_s
    assert project(slow, recovery)[1].total_s > project(EKS, recovery)[1].total_s


def test_scenarios_whose_runs_are_missing_are_left_out() -> None:
    assert project(EKS, {"hot_spare": mechanism(4.0)}) == ()  # no in-job run to compare with
    assert [p.mechanism for p in project(EKS, {"injob": mechanism(3.0), "hot_spare": mechanism(4.0)})] == ["hot_spare"]


def test_delays_are_never_negative() -> None:
    with pytest.raises(ValueError, match=r"toleration_s=-1 is not allowed: 0 or more seconds"):
        KubernetesDelays(toleration_s=-1)


def test_replica_groups_survivors_wait_out_torchfts_timeout_on_eks() -> None:
    """No TCP reset from a lost node on EKS: the other groups' all-reduce with it ends at torchft's timeout."""
    groups = replace(mechanism(9.0, steps_lost=0), median_survivor_stall_s=1.2, max_survivor_stall_s=1.5)
    recovery = {"injob": mechanism(3.0), "replica_groups": groups}
    survivors, = (p for p in project(EKS, recovery) if p.scenario == SURVIVORS_SCENARIO)
    assert survivors.total_s == pytest.approx(ParallelConfig().step_timeout_s + 1.2)
    quicker, = (p for p in project(EKS, recovery, ParallelConfig(step_timeout_s=5.0))
                if p.scenario == SURVIVORS_SCENARIO)
    assert quicker.total_s == pytest.approx(6.2)
    lost_group = next(p for p in project(EKS, recovery) if p.scenario.startswith("replica groups, hot spare"))
    assert lost_group.total_s == pytest.approx(EKS.lost_peer_detection_s + EKS.gpu_restart_s + 6.0)
    assert all(p.scenario != SURVIVORS_SCENARIO
               for p in project(EKS, {**recovery, "replica_groups": mechanism(9.0)}))  # no stall measured
