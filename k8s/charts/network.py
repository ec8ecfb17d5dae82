"""NetworkPolicies of the training namespace: every pod is denied all traffic in and out, and each
workload's own policy opens only what it needs (tests.k8s.test_k8s_security evaluates them
against the rendered pods).

Enforced by the VPC CNI add-on's network policy agent (enableNetworkPolicy, infra.cluster), which also
lets the kubelet's probes in from the node. What no pod policy sees: EFA traffic (NCCL over libfabric
bypasses the kernel's network stack), and FSx for Lustre, whose client is the node's kernel (the CSI driver
mounts on the host): the FSx security group fences that one (infra.storage).
"""
from __future__ import annotations

from typing import Any, Mapping

from cdk8s import Chart
from constructs import Construct

from infra.config import VPC_CIDR
from k8s.charts.objects import api_object
from k8s.job_config import JobConfig

# The kubernetes Service's range that EKS picks for a VPC in 10.0.0.0/8 (serviceIpv4Cidr left unset): the
# policy agent sees the Service IP before kube-proxy translates it to the API server's ENIs in the VPC.
EKS_SERVICE_CIDR = "172.20.0.0/16"
DNS: dict[str, Any] = {
    "to": [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "kube-system"}},
            "podSelector": {"matchLabels": {"k8s-app": "kube-dns"}}}],
    "ports": [{"protocol": "UDP", "port": 53}, {"protocol": "TCP", "port": 53}],
}
KUBERNETES_API: dict[str, Any] = {
    "to": [{"ipBlock": {"cidr": VPC_CIDR}}, {"ipBlock": {"cidr": EKS_SERVICE_CIDR}}],
    "ports": [{"protocol": "TCP", "port": 443}],
}


# The EKS Pod Identity agent, which hands a pod its role's credentials, on the node's link-local address
# (EKS user guide, "Set up the Amazon EKS Pod Identity Agent": 169.254.170.23, port 80).
POD_IDENTITY_AGENT: dict[str, Any] = {
    "to": [{"ipBlock": {"cidr": "169.254.170.23/32"}}],
    "ports": [{"protocol": "TCP", "port": 80}],
}
# A regional AWS API endpoint (public addresses, reached through the NAT gateway; no VPC endpoint here).
AWS_API: dict[str, Any] = {
    "to": [{"ipBlock": {"cidr": "0.0.0.0/0"}}],
    "ports": [{"protocol": "TCP", "port": 443}],
}


def pods(labels: Mapping[str, str]) -> dict[str, Any]:
    """A peer: the pods of this namespace with these labels."""
    return {"podSelector": {"matchLabels": dict(labels)}}


def network_policy(scope: Construct, id: str, job: JobConfig, name: str, selected: Mapping[str, str], *,
                   ingress: list[dict] | None = None, egress: list[dict] | None = None) -> None:
    """A policy for the pods with `selected` labels, in both directions: what it lists is all they may do
    (no list: nothing)."""
    spec: dict[str, Any] = {"podSelector": {"matchLabels": dict(selected)}, "policyTypes": ["Ingress", "Egress"]}
    if ingress:
        spec["ingress"] = ingress
    if egress:
        spec["egress"] = egress
    api_object(scope, id, api_version="networking.k8s.io/v1", kind="NetworkPolicy", name=name,
               namespace=job.namespace, body={"spec": spec})


def among_themselves(labels: Mapping[str, str], *, egress: tuple[dict, ...] = ()) -> dict[str, list[dict]]:
    """Pods that talk to each other on any port (ranks, MPI), plus `egress` and DNS."""
    return {"ingress": [{"from": [pods(labels)]}], "egress": [{"to": [pods(labels)]}, *egress, DNS]}


class NetworkDefaultsChart(Chart):
    """Default deny in and out, for every pod of the namespace: what a workload needs, its chart opens."""

    def __init__(self, scope: Construct, id: str, job: JobConfig) -> None:
        super().__init__(scope, id, labels={"app.kubernetes.io/part-of": job.infra.cluster_name})
        api_object(self, "default-deny", api_version="networking.k8s.io/v1", kind="NetworkPolicy",
                   name="default-deny", namespace=job.namespace,
                   body={"spec": {"podSelector": {}, "policyTypes": ["Ingress", "Egress"]}})
