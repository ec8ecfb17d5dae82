"""The optional Prometheus server that scrapes the training pods (prometheusServer, off by default)."""
from __future__ import annotations

import json

from infra.chart_pins import PROMETHEUS
from infra.config import SYSTEM_NODE_LABEL
from infra.metrics_collection import MONITORING_NAMESPACE


def _prometheus_charts(synth) -> list[dict]:
    return [r["Properties"] for r in synth.templates["Cluster"]["Resources"].values()
            if r["Type"] == "Custom::AWSCDK-EKS-HelmChart" and r["Properties"]["Chart"] == PROMETHEUS.chart]


def test_prometheus_server_alone_on_the_system_nodes_when_asked_for(full, defaults):
    (chart,) = _prometheus_charts(full)
    assert (chart["Repository"], chart["Version"], chart["Namespace"]) == (
        PROMETHEUS.repository, PROMETHEUS.version, MONITORING_NAMESPACE)
    values = json.loads(chart["Values"])
    assert all(values[sub]["enabled"] is False for sub in (
        "alertmanager", "prometheus-pushgateway", "prometheus-node-exporter", "kube-state-metrics"))
    assert values["server"]["nodeSelector"] == {SYSTEM_NODE_LABEL: "true"}
    # no EBS CSI driver on this cluster: a volume claim would never bind
    assert values["server"]["persistentVolume"] == {"enabled": False}
    assert _prometheus_charts(defaults) == []  # off by default
