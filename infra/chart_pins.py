"""The Helm charts the platform installs, each pinned to one version.

CDK-free, like the add-on pins (infra.addon_pins), so the AWS preflight (`python -m infra.preflight`)
reads the same pins as the stacks without loading aws-cdk-lib and asks each chart's repository (its
index.yaml) whether the version exists: a version the repository lacks fails the Helm release, and with
it the Cluster stack, at deploy time.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ChartSpec:
    release: str
    chart: str
    repository: str
    version: str  # pinned: a chart upgrade is a reviewed change, not a side effect of a redeploy

    @property
    def index_url(self) -> str:
        """Where a Helm repository lists its charts' versions (Helm docs, "The Chart Repository Guide")."""
        return f"{self.repository.rstrip('/')}/index.yaml"


# Neither device-plugin chart bounds the Kubernetes version from above, so the same pins serve 1.33-1.36:
# the NVIDIA chart's Chart.yaml says kubeVersion ">= 1.10.0-0" and the EFA chart's has no kubeVersion
# (NVIDIA/k8s-device-plugin and aws/eks-charts, read at older chart versions than these pins: a bound
# added since would fail the Helm install, which the first deploy shows). Both plugins register through the
# kubelet's device plugin API v1beta1.
NVIDIA_DEVICE_PLUGIN = ChartSpec(
    "nvidia-device-plugin", "nvidia-device-plugin", "https://nvidia.github.io/k8s-device-plugin", "0.20.0"
)
EFA_DEVICE_PLUGIN = ChartSpec(
    "aws-efa-k8s-device-plugin", "aws-efa-k8s-device-plugin", "https://aws.github.io/eks-charts", "v0.5.30"
)
PROMETHEUS = ChartSpec("prometheus", "prometheus", "https://prometheus-community.github.io/helm-charts", "27.19.0")
