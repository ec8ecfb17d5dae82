"""NVIDIA and EFA device plugins: pinned Helm charts that run on the tainted GPU nodes."""
from __future__ import annotations

import json
import re

import pytest

from infra.account_checks import charts_for
from infra.config import GPU_NODE_LABEL, GPU_TAINT_KEY

GPU_TOLERATION = {"key": GPU_TAINT_KEY, "operator": "Exists", "effect": "NoSchedule"}


def _all_charts(synth) -> dict[str, dict]:
    return {c["Properties"]["Chart"]: c["Properties"] for c in synth.resources("Cluster", "Custom::AWSCDK-EKS-HelmChart").values()}


def _charts(synth) -> dict[str, dict]:
    """The device plugins' releases (kube-system), not the optional Prometheus server's."""
    return {name: chart for name, chart in _all_charts(synth).items() if chart["Namespace"] == "kube-system"}


def test_both_charts_from_their_repositories(full):
    charts = _charts(full)
    assert sorted(charts) == ["aws-efa-k8s-device-plugin", "nvidia-device-plugin"]
    assert charts["nvidia-device-plugin"]["Repository"] == "https://nvidia.github.io/k8s-device-plugin"
    assert charts["aws-efa-k8s-device-plugin"]["Repository"] == "https://aws.github.io/eks-charts"
    assert {c["Namespace"] for c in charts.values()} == {"kube-system"}


def test_every_chart_is_pinned_to_one_version_from_an_https_repository(full):
    """Device plugins and Prometheus alike. Their repositories are classic HTTP Helm repositories, which
    offer no digest reference to pin by (docs/security.md, "Nodes, AWS and supply chain")."""
    charts = _all_charts(full)
    assert sorted(charts) == ["aws-efa-k8s-device-plugin", "nvidia-device-plugin", "prometheus"]
    for name, chart in charts.items():
        assert re.fullmatch(r"v?\d+\.\d+\.\d+", chart["Version"]), name
        assert chart["Repository"].startswith("https://"), name


@pytest.mark.parametrize("chart", ["nvidia-device-plugin", "aws-efa-k8s-device-plugin"])
def test_chart_tolerates_the_gpu_taint_and_selects_gpu_nodes(full, chart):
    values = json.loads(_charts(full)[chart]["Values"])
    assert GPU_TOLERATION in values["tolerations"]
    assert values["nodeSelector"] == {GPU_NODE_LABEL: "true"}


def test_nvidia_affinity_replaces_the_node_feature_discovery_default(full):
    affinity = json.loads(_charts(full)["nvidia-device-plugin"]["Values"])["affinity"]
    terms = affinity["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    assert terms == [{"matchExpressions": [{"key": GPU_NODE_LABEL, "operator": "In", "values": ["true"]}]}]


def test_efa_plugin_admits_the_configured_instance_type(full):
    values = json.loads(_charts(full)["aws-efa-k8s-device-plugin"]["Values"])
    assert values["supportedInstanceLabels"]["values"] == [full.config.gpu_instance_type]


def test_no_efa_plugin_for_an_instance_without_efa(g6):
    assert sorted(_charts(g6)) == ["nvidia-device-plugin"]


@pytest.mark.parametrize("synthesized", ["full", "g6"])
def test_the_preflight_checks_every_chart_the_stacks_install_at_its_pinned_version(synthesized, request):
    """A chart the preflight does not check (or checks at another version) could still roll the stack back."""
    synth = request.getfixturevalue(synthesized)
    installed = {(c["Chart"], c["Repository"], c["Version"]) for c in _all_charts(synth).values()}
    assert installed == {(c.chart, c.repository, c.version) for c in charts_for(synth.config)}
