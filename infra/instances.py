"""The one table of GPU instance facts, read by the CDK node group and the k8s charts alike."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class VcpuQuota:
    """An EC2 vCPU quota in Service Quotas (service code ec2): running instances of its family count against it."""

    code: str
    name: str  # the quota's name as GetServiceQuota returns it: the preflight checks it, as the code is unverified


# Quota codes as the Service Quotas console and `aws service-quotas list-service-quotas --service-code ec2` show
# them. Unverified against an AWS documentation page: none in reach lists these codes (they appear in public
# scripts and guides, e.g. the console link .../servicequotas/home/services/ec2/quotas/L-417A185B); the preflight
# compares the name GetServiceQuota returns with `name` and fails on a mismatch rather than trusting the code.
ON_DEMAND_P = VcpuQuota("L-417A185B", "Running On-Demand P instances")
ON_DEMAND_G_VT = VcpuQuota("L-DB2E81BA", "Running On-Demand G and VT instances")

# nccl-tests' bus bandwidth (busbw) is normalised so that every collective compares with the same hardware peak,
# whatever the rank count (nccl-tests doc/PERFORMANCE.md: all_reduce busbw = algbw*2(n-1)/n, all_gather and
# reduce_scatter = algbw*(n-1)/n, broadcast = algbw). Across nodes that peak is the EFA line rate, which a healthy
# fabric approaches and a TCP fallback or lost EFA interfaces miss by far. The floors are fractions of it: 75% for
# all_reduce (the preflight's first floor, p5 300 GB/s), lower for the others, which move half an all_reduce's
# bytes per call (so fixed costs weigh more) and, for broadcast, go out of one root. These fractions are a
# conservative judgement: no public source found gives per-collective busbw expectations on p5/p5en/p4d.
BUSBW_FLOOR_FRACTIONS: dict[str, float] = {
    "all_reduce": 0.75,  # DDP, and HSDP across replicas
    "all_gather": 0.60,  # FSDP2: parameters before each forward/backward
    "reduce_scatter": 0.60,  # FSDP2: gradients after backward
    # aws-ofi-nccl 1.18.0 hung on NCCL broadcast while all-reduce passed, fixed in 1.20.0
    # (aws/deep-learning-containers PR 6551): a passing all-reduce proves nothing about it.
    "broadcast": 0.50,
}


@dataclass(frozen=True)
class InstanceFacts:
    """What a node of this type offers to a training pod."""

    name: str
    gpus: int
    network_cards: int
    efa_interfaces: int  # one EFA interface per network card that supports EFA
    memory_gib: int
    vcpus: int  # EC2 instance type specs; the AWS preflight checks it against DescribeInstanceTypes
    local_nvme_count: int  # instance-store NVMe drives (RAID0 for scratch)
    # Memory a pod may request: what the node has less kubelet/system reservations.
    pod_memory_gib: int
    hugepages_2mi_gib: int  # EFA uses hugepages for its bounce buffers
    # EFA line rate of the instance (GB/s): EC2 accelerated-computing specs, p5/p5en 3200 Gbps = 400 GB/s,
    # p4d 400 Gbps = 50 GB/s; 0: no EFA. The NCCL/EFA preflight's floors derive from it (min_busbw_gbs).
    efa_line_rate_gbs: float
    # The Service Quotas vCPU quota that on-demand instances of this type count against.
    on_demand_vcpu_quota: VcpuQuota
    # Dense (no structured sparsity) bf16 tensor-core peak of one GPU, from NVIDIA's datasheets: H100 SXM
    # 989 TFLOPs (the sheet's 1,979 is with sparsity), H200 SXM 989 (same compute as H100), A100 312, L4 121
    # (242 with sparsity). The denominator of MFU; the charts pass it to training as metrics.gpu_peak_tflops.
    gpu_peak_bf16_tflops: float

    def min_busbw_gbs(self, collective: str) -> float:
        """The NCCL/EFA preflight's floor for nccl-tests' bus bandwidth of `collective` across nodes (GB/s, at
        the largest message size): a fraction of the EFA line rate (BUSBW_FLOOR_FRACTIONS). 0: no EFA."""
        return round(self.efa_line_rate_gbs * BUSBW_FLOOR_FRACTIONS[collective], 1)


INSTANCE_TYPES: dict[str, InstanceFacts] = {
    facts.name: facts
    for facts in (
        InstanceFacts("p5.48xlarge", gpus=8, network_cards=32, efa_interfaces=32, memory_gib=2048,
                      vcpus=192, local_nvme_count=8, pod_memory_gib=1800, hugepages_2mi_gib=5,
                      gpu_peak_bf16_tflops=989.0, efa_line_rate_gbs=400, on_demand_vcpu_quota=ON_DEMAND_P),  # H100 SXM
        InstanceFacts("p5en.48xlarge", gpus=8, network_cards=16, efa_interfaces=16, memory_gib=2048,
                      vcpus=192, local_nvme_count=8, pod_memory_gib=1800, hugepages_2mi_gib=5,
                      gpu_peak_bf16_tflops=989.0, efa_line_rate_gbs=400, on_demand_vcpu_quota=ON_DEMAND_P),  # H200 SXM
        InstanceFacts("p4d.24xlarge", gpus=8, network_cards=4, efa_interfaces=4, memory_gib=1152,
                      vcpus=96, local_nvme_count=8, pod_memory_gib=1000, hugepages_2mi_gib=5,
                      gpu_peak_bf16_tflops=312.0, efa_line_rate_gbs=50, on_demand_vcpu_quota=ON_DEMAND_P),  # A100 40GB SXM
        # A small single-GPU type for trial deployments (no EFA).
        InstanceFacts("g6.xlarge", gpus=1, network_cards=1, efa_interfaces=0, memory_gib=16,
                      vcpus=4, local_nvme_count=1, pod_memory_gib=12, hugepages_2mi_gib=0,
                      gpu_peak_bf16_tflops=121.0, efa_line_rate_gbs=0, on_demand_vcpu_quota=ON_DEMAND_G_VT),  # L4
    )
}


def instance_facts(instance_type: str) -> InstanceFacts:
    try:
        return INSTANCE_TYPES[instance_type]
    except KeyError:
        allowed = ", ".join(sorted(INSTANCE_TYPES))
        raise ValueError(f"unknown GPU instance type {instance_type!r}; supported: {allowed}") from None
