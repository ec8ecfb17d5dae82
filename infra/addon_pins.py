"""The EKS add-on versions the cluster pins, per Kubernetes version, each with where it was seen listed.

CDK-free, so the AWS preflight (`python -m infra.preflight`) reads the same pins as infra/cluster.py without
loading aws-cdk-lib, and asks the account's region (DescribeAddonVersions) whether each is offered. An add-on
upgrade is a reviewed change here, not whatever EKS defaults to on the day of a redeploy.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

from infra.config import KUBERNETES_VERSIONS


@dataclass(frozen=True)
class AddonPin:
    version: str
    # Where this version was seen listed for this Kubernetes version; "unverified: …" where no public source
    # lists it: the AWS preflight is then the only check before deploy.
    source: str


def _all_versions(version: str, source: str) -> dict[str, AddonPin]:
    return dict.fromkeys(KUBERNETES_VERSIONS, AddonPin(version, source))


_VPC_CNI_TABLE = ("EKS user guide, 'Assign IPs to Pods with the Amazon VPC CNI', table 'Amazon VPC CNI versions': "
                  "v1.20.4-eksbuild.1 for 1.28-1.34 (seen in the docs.amazonaws.cn edition of the page; the English "
                  "edition in reach predates 1.34)")
_UNVERIFIED = "unverified: no public source lists this add-on's builds per Kubernetes version"

ADDON_PINS: Mapping[str, Mapping[str, AddonPin]] = {
    # 1.18.5 or later for EFA-only interfaces (EKS user guide, EFA page).
    "vpc-cni": _all_versions("v1.20.4-eksbuild.1", _VPC_CNI_TABLE),
    "eks-pod-identity-agent": _all_versions(
        "v1.3.8-eksbuild.2", f"{_UNVERIFIED} (the user guide's agent page has no version table; public Terraform "
                             "configs run this build on 1.33 and 1.34 clusters)"),
    "coredns": _all_versions(
        "v1.12.4-eksbuild.1", "EKS user guide, 'Manage CoreDNS for DNS in Amazon EKS clusters', table 'CoreDNS "
                              "versions': v1.12.4-eksbuild.1 for 1.33 and 1.34"),
    "kube-proxy": {
        kubernetes: AddonPin(version, "EKS user guide, 'Manage kube-proxy in Amazon EKS clusters', table "
                                      f"'kube-proxy versions': {version} for {kubernetes}")
        for kubernetes, version in (("1.33", "v1.33.5-eksbuild.2"), ("1.34", "v1.34.1-eksbuild.2"))
    },
    "aws-fsx-csi-driver": _all_versions(
        "v1.7.0-eksbuild.1", f"{_UNVERIFIED} (driver v1.7.0 exists: kubernetes-sigs/aws-fsx-csi-driver tag v1.7.0, "
                             "chart CHANGELOG v1.14.0 'Use driver image 1.7.0'; the add-on build is not listed)"),
    "eks-node-monitoring-agent": _all_versions(
        "v1.7.0-eksbuild.1", f"{_UNVERIFIED} (aws/eks-node-monitoring-agent v1.7.0, 2026-08-04: its chart's "
                             "image tag is v1.7.0-eksbuild.1; the add-on's Kubernetes versions are not listed)"),
}
