"""The EKS add-on versions the cluster pins, per Kubernetes version, each with where it was seen listed.

CDK-free, so the AWS preflight (`python -m infra.preflight`) reads the same pins as infra.cluster without
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


def _per_version(source: str, versions: Mapping[str, str]) -> dict[str, AddonPin]:
    return {kubernetes: AddonPin(version, f"{source}: {version} for {kubernetes}")
            for kubernetes, version in versions.items()}


_UNVERIFIED = "unverified: no public source lists this add-on's builds per Kubernetes version"
# The user guide's tables list the newest build per Kubernetes version; a pin an older edition listed is kept
# while it is still offered (the preflight asks). The 1.35 and 1.36 rows are in the Japanese edition of each
# page (docs.aws.amazon.com/ja_jp/…/userguide/<page>.md), the newest edition in reach.
_NEWEST_EDITION = "(1.35, 1.36: the page's ja_jp edition)"

ADDON_PINS: Mapping[str, Mapping[str, AddonPin]] = {
    # 1.18.5 or later for EFA-only interfaces (EKS user guide, EFA page).
    "vpc-cni": {
        **_all_versions("v1.20.4-eksbuild.1", "EKS user guide, 'Assign IPs to Pods with the Amazon VPC CNI', table "
                        "'Amazon VPC CNI versions': v1.20.4-eksbuild.1 for 1.28-1.34 (the docs.amazonaws.cn edition)"),
        **dict.fromkeys(("1.35", "1.36"), AddonPin(
            "v1.20.4-eksbuild.1", f"{_UNVERIFIED} (no edition of the VPC CNI page in reach has 1.35 or 1.36 rows; "
                                  "the build the page lists for 1.28-1.34)")),
    },
    "eks-pod-identity-agent": _all_versions(
        "v1.3.8-eksbuild.2", f"{_UNVERIFIED} (the user guide's agent page has no version table; public Terraform "
                             "configs run this build on 1.33 and 1.34)"),
    "coredns": _per_version(
        f"EKS user guide, 'Manage CoreDNS for DNS in Amazon EKS clusters', table 'CoreDNS versions' {_NEWEST_EDITION}",
        {"1.33": "v1.12.4-eksbuild.1", "1.34": "v1.12.4-eksbuild.1",
         "1.35": "v1.14.3-eksbuild.3", "1.36": "v1.14.3-eksbuild.3"}),
    "kube-proxy": _per_version(
        f"EKS user guide, 'Manage kube-proxy in Amazon EKS clusters', table 'kube-proxy versions' {_NEWEST_EDITION}",
        {"1.33": "v1.33.5-eksbuild.2", "1.34": "v1.34.1-eksbuild.2",
         "1.35": "v1.35.3-eksbuild.13", "1.36": "v1.36.0-eksbuild.14"}),
    "aws-fsx-csi-driver": _all_versions(
        "v1.7.0-eksbuild.1", f"{_UNVERIFIED} (driver v1.7.0 exists: kubernetes-sigs/aws-fsx-csi-driver tag v1.7.0, "
                             "chart CHANGELOG v1.14.0 'Use driver image 1.7.0'; the add-on build is not listed)"),
    "eks-node-monitoring-agent": _all_versions(
        "v1.7.0-eksbuild.1", f"{_UNVERIFIED} (aws/eks-node-monitoring-agent v1.7.0, 2026-08-04: its chart's "
                             "image tag is v1.7.0-eksbuild.1; the add-on's Kubernetes versions are not listed)"),
}
