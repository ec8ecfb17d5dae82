"""A lost p5 node on EKS, projected: each scenario's recovery as a sum of named parts, some measured
here on the local cluster, the rest Kubernetes' and EKS's delays (training.contract.k8s_delays). A
projection, not a measurement: the parameters are stated beside the result.

What the local cluster measures and EKS adds to it: every scenario ends with the in-job restart of
every node's workers on p5 (`gpu_restart_s`, the AWS post's figure), plus what the scenario costs
here beyond a plain in-job restart (the rendezvous with a spare, waiting for a replaced pod,
restarting every launcher): the local recovery of that mechanism minus the local in-job recovery.
With replica groups, the other groups' stall is projected too: on EKS a lost node sends no TCP reset,
so their cross-group all-reduce with it ends at torchft's timeout, then costs what it cost here.
"""
from __future__ import annotations

from dataclasses import dataclass

from bench.mechanisms import MechanismResult
from training.contract.config import ParallelConfig
from training.contract.k8s_delays import KubernetesDelays

REFERENCE_PLAIN_RESTART_S = 270.0  # the AWS post, plain Kubernetes restart on 2-8 p5 nodes
SURVIVORS_SCENARIO = "replica groups: the other groups' stall while the lost node's group recovers"


@dataclass(frozen=True)
class Projection:
    scenario: str
    mechanism: str  # the local mechanism whose extra over an in-job restart is part of the sum
    parts: tuple[tuple[str, float], ...]  # (what, seconds), in order

    @property
    def total_s(self) -> float:
        return sum(seconds for _, seconds in self.parts)


def project(d: KubernetesDelays, recovery: dict[str, MechanismResult],
            parallel: ParallelConfig = ParallelConfig()) -> tuple[Projection, ...]:
    """The scenarios whose local mechanism was measured (and the in-job restart it is compared to)."""
    if "injob" not in recovery:
        return ()
    injob = recovery["injob"].median_recovery_s

    def local_extra(name: str) -> tuple[str, float]:
        return (f"{name} beyond an in-job restart, measured here",
                max(0.0, recovery[name].median_recovery_s - injob))

    detect = ("survivors detect the lost peer (NVRx step section timeout)", d.lost_peer_detection_s)
    evict = ("node NotReady, toleration, pod replaced", d.lost_pod_replaced_s)
    restart = ("workers of every node restart on p5 (AWS post, in-job)", d.gpu_restart_s)
    new_node = ("a new p5 node boots and joins, in parallel with the eviction", max(0.0, d.node_boot_join_s - evict[1]))
    hung_pod_deleted = ("node NotReady, then out of service: PodGC force-deletes its pod",
                        d.node_not_ready_s + d.hung_node_out_of_service_s)
    pull = ("image pulled onto a node without it, container started", d.image_pull_cold_s + d.container_start_s)
    scenarios = (
        ("hot spare (spare node and standby pod): this repository's default", "hot_spare",
         (detect, restart)),
        ("hot spare and peer state (no completed step lost)", "peer_state", (detect, restart)),
        ("spare node, no standby pod: the replaced pod starts on it", "node_replacement",
         (detect, evict, pull, restart)),
        ("no spare: the node group replaces the lost instance", "node_replacement",
         (detect, evict, new_node, pull, restart)),
        ("spare node, no standby pod, node hangs: marked out of service once NotReady for "
         f"{d.hung_node_out_of_service_s:g} s, its pod replaced on the spare node", "node_hang",
         (detect, hung_pod_deleted, ("the replacement pod is scheduled", d.pod_replacement_s), pull, restart)),
        ("no spare, node hangs: marked out of service, a new node started for its pod (a fixed-size node group "
         "starts none until auto repair)", "node_hang",
         (detect, hung_pod_deleted, ("a new p5 node boots and joins", d.node_boot_join_s), pull, restart)),
        ("no spare, node hangs, not marked out of service (EKS auto repair after 30 min NotReady)", "node_replacement",
         (detect, ("EKS node auto repair waits", d.node_repair_wait_s), ("the replacement boots and joins",
          d.node_boot_join_s), pull, restart)),
        ("plain Kubernetes restart (no ft_launcher restarts), spare node", "k8s_restart",
         (detect, evict, pull, restart)),
        ("replica groups, hot spare: the lost node's group back in the quorum, healed from a live group",
         "replica_groups", (detect, restart)),
    )
    projections = tuple(Projection(label, name, (*parts, local_extra(name)))
                        for label, name, parts in scenarios if name in recovery)
    return projections + _survivors(recovery, parallel)


def _survivors(recovery: dict[str, MechanismResult], parallel: ParallelConfig) -> tuple[Projection, ...]:
    """The other groups' stall: the all-reduce with the silent node times out, then the quorum re-forms."""
    stall = recovery["replica_groups"].median_survivor_stall_s if "replica_groups" in recovery else None
    if stall is None:
        return ()
    return (Projection(SURVIVORS_SCENARIO, "replica_groups", (
        ("their all-reduce with the lost node times out (parallel.step_timeout_s: no TCP reset on EKS)",
         parallel.step_timeout_s),
        ("the rest of their stall, measured here (the quorum without its group, the step run again)", stall))),)

