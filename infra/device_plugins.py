"""Device plugins that advertise nvidia.com/gpu and vpc.amazonaws.com/efa on the GPU nodes."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from aws_cdk import aws_eks_v2 as eks
from constructs import Construct

from infra.chart_pins import EFA_DEVICE_PLUGIN, NVIDIA_DEVICE_PLUGIN, ChartSpec
from infra.config import GPU_NODE_LABEL, GPU_TAINT_KEY


GPU_TOLERATIONS = [{"key": GPU_TAINT_KEY, "operator": "Exists", "effect": "NoSchedule"}]
GPU_NODE_SELECTOR = {GPU_NODE_LABEL: "true"}
GPU_NODE_TERM = {"matchExpressions": [{"key": GPU_NODE_LABEL, "operator": "In", "values": ["true"]}]}


@dataclass(frozen=True)
class DevicePluginsProps:
    cluster: eks.ICluster
    instance_type: str
    efa: bool  # the instance type has EFA interfaces


class DevicePlugins(Construct):
    """Both plugins as pinned Helm releases in kube-system, running on the tainted GPU nodes only."""

    charts: list[eks.HelmChart]

    def __init__(self, scope: Construct, construct_id: str, props: DevicePluginsProps) -> None:
        super().__init__(scope, construct_id)
        self.charts = [
            self._chart(
                NVIDIA_DEVICE_PLUGIN,
                props.cluster,
                {
                    # The chart's default affinity wants Node Feature Discovery labels, which this
                    # cluster does not run; a list value replaces the default list whole.
                    "affinity": {
                        "nodeAffinity": {
                            "requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [GPU_NODE_TERM]}
                        }
                    },
                },
            )
        ]
        if props.efa:
            self.charts.append(
                self._chart(
                    EFA_DEVICE_PLUGIN,
                    props.cluster,
                    # The chart's affinity lists EFA-capable types; name ours so a chart lagging
                    # behind new instance types still schedules here.
                    {
                        "supportedInstanceLabels": {
                            "keys": ["node.kubernetes.io/instance-type"],
                            "values": [props.instance_type],
                        }
                    },
                )
            )

    def _chart(self, spec: ChartSpec, cluster: eks.ICluster, values: dict[str, Any]) -> eks.HelmChart:
        return eks.HelmChart(
            self,
            spec.release,
            cluster=cluster,
            chart=spec.chart,
            release=spec.release,
            repository=spec.repository,
            version=spec.version,
            namespace="kube-system",
            values={"tolerations": GPU_TOLERATIONS, "nodeSelector": GPU_NODE_SELECTOR, **values},
        )
