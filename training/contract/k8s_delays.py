"""Kubernetes' and EKS's own delays in replacing a lost GPU node, as named parameters.

The local cluster cannot show them: its "nodes" are processes that are replaced in milliseconds.
training.local applies one figure, --replacement-delay (a lost node's loss to its replacement's
start); `make bench` projects a node loss on EKS from the local measurements plus these parameters
(bench.projection), and labels every such figure a projection.

Each default says where it comes from; the ones marked "assumption" are typical figures that an
account's own measurements should replace (`kubectl get events`, the node group's activity history).
"""
from __future__ import annotations

from dataclasses import dataclass, fields


@dataclass(frozen=True)
class KubernetesDelays:
    # The node controller marks a node that stopped reporting NotReady and taints it unreachable after
    # kube-controller-manager's --node-monitor-grace-period: 50 s since Kubernetes 1.32 (40 s before);
    # EKS does not change it.
    node_not_ready_s: float = 50.0
    # Then the pod stays for its tolerationSeconds of that taint (the default of
    # k8s.job_config.JobConfig.node_failure_toleration_s, which reads it here; Kubernetes' default is 300 s).
    toleration_s: float = 30.0
    # The evicted pod is deleted, the Job controller creates its replacement, the scheduler binds it
    # (assumption: seconds on an idle control plane).
    pod_replacement_s: float = 5.0
    # A new p5.48xlarge: the node group launches it once EC2 reports the old instance gone, it boots,
    # joins (nodeadm) and its NVIDIA and EFA device plugins advertise GPUs and EFA interfaces
    # (assumption: 5-10 min are common for p5).
    node_boot_join_s: float = 420.0
    # The training image (NGC PyTorch base, about 20 GB unpacked) pulled from ECR onto a node that does
    # not have it (assumption).
    image_pull_cold_s: float = 240.0
    # Creating and starting the container once the image is on the node (assumption).
    container_start_s: float = 5.0
    # A node that hangs but keeps running is no lost instance: EKS node auto repair replaces a node that
    # has been NotReady for 30 min (EKS user guide, "Automatically repair nodes in EKS clusters").
    node_repair_wait_s: float = 1800.0
    # Until then, a hung node's pod, evicted by the taint manager after its toleration, stays Terminating: no
    # kubelet confirms it stopped, and the Job (podReplacementPolicy: Failed, which a podFailurePolicy
    # requires) replaces a pod only once it is Failed. A node marked out of service (the taint
    # node.kubernetes.io/out-of-service) has its terminating pods force-deleted and marked Failed by PodGC
    # (Kubernetes docs, "Non-graceful node shutdown handling" and "Pod garbage collection"): the time a
    # node is NotReady before that is done (this repository's choice; with node_not_ready_s, under 2 min).
    hung_node_out_of_service_s: float = 60.0
    # The survivors' ranks wait in a collective for the lost node until NVRx's rank monitor ends them at
    # the step section timeout, calculated as the longest step x fault_tolerance.timeout_safety_factor
    # (assumption: about 30 s for a multi-second step of a large model on p5; a lost node's EFA peers
    # may also fail their collective sooner).
    lost_peer_detection_s: float = 30.0
    # Restarting the workers of every node on p5 once the rendezvous closes: processes, CUDA and NCCL
    # initialisation, the checkpoint load. The AWS post on NVRx measured ~17 s fault to recovery with
    # ft_launcher on 2-8 p5 nodes.
    gpu_restart_s: float = 17.0

    @property
    def lost_pod_replaced_s(self) -> float:
        """From a node's loss to its pod's replacement being created: NotReady, the toleration, the Job's new pod."""
        return self.node_not_ready_s + self.toleration_s + self.pod_replacement_s

    @property
    def system_pod_moved_s(self) -> float:
        """From a system node's loss to a pod of it (a rendezvous store, the Lighthouse) running on another system
        node that holds the image already, as those that run the training image's stores do."""
        return self.lost_pod_replaced_s + self.container_start_s

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if not value >= 0:
                raise ValueError(f"{f.name}={value!r} is not allowed: 0 or more seconds")


EKS = KubernetesDelays()
