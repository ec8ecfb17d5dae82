"""Optional in-cluster collection of the training metrics (config key prometheusServer, off by default).

Why a Prometheus server and not CloudWatch Container Insights: the training pods carry the standard
prometheus.io/scrape annotations, which the Prometheus chart's default `kubernetes-pods` job scrapes as
they are; Container Insights' Prometheus support needs a second CloudWatch agent deployment beside the
amazon-cloudwatch-observability add-on, a list of which metrics to import, and is billed per metric.
The server keeps its data in the pod (no EBS CSI driver on this cluster): a restart of it starts the
history over, while the run's own record, the event log on FSx, stays complete.
"""
from __future__ import annotations

from dataclasses import dataclass

from aws_cdk import aws_eks_v2 as eks
from constructs import Construct

from infra.config import MONITORING_NAMESPACE, SYSTEM_NODE_LABEL
from infra.chart_pins import PROMETHEUS

RETENTION = "15d"


@dataclass(frozen=True)
class MetricsCollectionProps:
    cluster: eks.ICluster


class MetricsCollection(Construct):
    """The Prometheus server alone (no alertmanager, pushgateway, node exporter or kube-state-metrics: the
    training's metrics are what it is for), on the system nodes."""

    chart: eks.HelmChart

    def __init__(self, scope: Construct, construct_id: str, props: MetricsCollectionProps) -> None:
        super().__init__(scope, construct_id)
        self.chart = eks.HelmChart(
            self,
            PROMETHEUS.release,
            cluster=props.cluster,
            chart=PROMETHEUS.chart,
            release=PROMETHEUS.release,
            repository=PROMETHEUS.repository,
            version=PROMETHEUS.version,
            namespace=MONITORING_NAMESPACE,
            values={
                "alertmanager": {"enabled": False},
                "prometheus-pushgateway": {"enabled": False},
                "prometheus-node-exporter": {"enabled": False},
                "kube-state-metrics": {"enabled": False},
                "server": {
                    "nodeSelector": {SYSTEM_NODE_LABEL: "true"},
                    "persistentVolume": {"enabled": False},
                    "retention": RETENTION,
                },
            },
        )
