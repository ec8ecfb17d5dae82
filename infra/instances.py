"""The one table of GPU instance facts, read by the CDK node group and the k8s charts alike."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class InstanceFacts:
    """What a node of this type offers to a training pod."""

    name: str
    gpus: int
    network_cards: int
    efa_interfaces: int  # one EFA interface per network card that supports EFA
    memory_gib: int
    vcpus: int
    local_nvme_count: int  # instance-store NVMe drives (RAID0 for scratch)
    # Memory a pod may request: what the node has less kubelet/system reservations.
    pod_memory_gib: int
    hugepages_2mi_gib: int  # EFA uses hugepages for its bounce buffers
    # The NCCL/EFA preflight's floor for nccl-tests all_reduce_perf bus bandwidth across nodes (GB/s, at
    # the largest message size): 75% of the instance's EFA line rate (EC2 accelerated-computing specs:
    # p5/p5en 3200 Gbps = 400 GB/s, p4d 400 Gbps = 50 GB/s). Across nodes the bus bandwidth of a ring
    # all-reduce is bounded by, and on a healthy EFA fabric runs close to, that line rate; a run on TCP
    # sockets or with lost EFA interfaces falls far below. 0: no EFA, nothing to check.
    min_allreduce_busbw_gbs: float
    # Dense (no structured sparsity) bf16 tensor-core peak of one GPU, from NVIDIA's datasheets: H100 SXM
    # 989 TFLOPs (the sheet's 1,979 is with sparsity), H200 SXM 989 (same compute as H100), A100 312, L4 121
    # (242 with sparsity). The denominator of MFU; the charts pass it to training as metrics.gpu_peak_tflops.
    gpu_peak_bf16_tflops: float


INSTANCE_TYPES: dict[str, InstanceFacts] = {
    facts.name: facts
    for facts in (
        InstanceFacts("p5.48xlarge", gpus=8, network_cards=32, efa_interfaces=32, memory_gib=2048,
                      vcpus=192, local_nvme_count=8, pod_memory_gib=1800, hugepages_2mi_gib=5,
                      gpu_peak_bf16_tflops=989.0, min_allreduce_busbw_gbs=300),  # H100 SXM
        InstanceFacts("p5en.48xlarge", gpus=8, network_cards=16, efa_interfaces=16, memory_gib=2048,
                      vcpus=192, local_nvme_count=8, pod_memory_gib=1800, hugepages_2mi_gib=5,
                      gpu_peak_bf16_tflops=989.0, min_allreduce_busbw_gbs=300),  # H200 SXM
        InstanceFacts("p4d.24xlarge", gpus=8, network_cards=4, efa_interfaces=4, memory_gib=1152,
                      vcpus=96, local_nvme_count=8, pod_memory_gib=1000, hugepages_2mi_gib=5,
                      gpu_peak_bf16_tflops=312.0, min_allreduce_busbw_gbs=37.5),  # A100 40GB SXM
        # A small single-GPU type for trial deployments (no EFA).
        InstanceFacts("g6.xlarge", gpus=1, network_cards=1, efa_interfaces=0, memory_gib=16,
                      vcpus=4, local_nvme_count=1, pod_memory_gib=12, hugepages_2mi_gib=0,
                      gpu_peak_bf16_tflops=121.0, min_allreduce_busbw_gbs=0),  # L4
    )
}


def instance_facts(instance_type: str) -> InstanceFacts:
    try:
        return INSTANCE_TYPES[instance_type]
    except KeyError:
        allowed = ", ".join(sorted(INSTANCE_TYPES))
        raise ValueError(f"unknown GPU instance type {instance_type!r}; supported: {allowed}") from None
