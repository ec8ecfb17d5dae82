"""The Job against what the infra stacks create: synthesize infra/platform.py (one app per instance
type, ~5 s each), turn its outputs into the cdk-outputs.json a deploy would write, render the
charts from it, and compare names, mounts, node labels, taints, node counts and per-instance
device counts; then follow every pod to the node group its nodeSelector picks and that group's security
groups, and check each path the pod needs (FSx, the pods its NetworkPolicies open, EFA) passes them."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Mapping

import aws_cdk as cdk
import pytest

from infra.config import (CHECKPOINT_MOUNT_PATH, GPU_NODE_LABEL, GPU_TAINT_KEY, NAMESPACE, PVC_NAME, SYSTEM_NODE_LABEL,
                          PlatformConfig)
from infra.instances import INSTANCE_TYPES
from infra.platform import build_platform
from k8s.outputs import REQUIRED_KEYS
from k8s.charts.training import PROMETHEUS_SERVER
from k8s_render import fitting
from security_groups import ALL, NodeGroup, SecurityGroups

REPLICAS = str(Path(__file__).resolve().parents[2] / "k8s" / "train-replicas.yaml")

IMAGE = "123456789012.dkr.ecr.us-east-1.amazonaws.com/train:1.0"  # a given imageUri is output as is
_HUGEPAGES_2MI_PER_GIB = 512
# Lustre's ports, in from the clients and between the file servers, and the servers' calls back to the clients
# (FSx for Lustre user guide, "File system access control with Amazon VPC").
LUSTRE_PORTS = (988, 1018, 1023)


def _text(value: Any) -> str:
    """The literal parts of a CloudFormation value (Fn::Join, Fn::Base64), tokens left out."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        return "".join(_text(v) for v in value)
    if isinstance(value, dict):
        if "Fn::Join" in value:
            return _text(value["Fn::Join"][1])
        if "Fn::Base64" in value:
            return _text(value["Fn::Base64"])
    return "TOKEN"


def _resources(template: dict, kind: str) -> list[dict]:
    return [r["Properties"] for r in template["Resources"].values() if r["Type"] == kind]


@pytest.fixture(scope="module", params=sorted(INSTANCE_TYPES))
def synthesized(request) -> tuple[PlatformConfig, dict[str, dict]]:
    # With the Prometheus server, whose scrapes of the training pods are one of the paths to check.
    config = PlatformConfig(gpu_instance_type=request.param, image_uri=IMAGE, prometheus_server=True)
    app = cdk.App()
    platform = build_platform(app, config)
    assembly = app.synth()
    return config, {s.stack_name: assembly.get_stack_by_name(s.stack_name).template for s in platform.stacks}


def _deploy_outputs(templates: dict[str, dict]) -> dict[str, dict[str, str]]:
    """cdk-outputs.json as `cdk deploy` would write it: literal values as they are, the rest resolved."""
    return {stack: {key: out["Value"] if isinstance(out["Value"], str) else f"resolved-{key.lower()}"
                    for key, out in template.get("Outputs", {}).items()}
            for stack, template in templates.items()}


def test_job_matches_what_the_stacks_create(synthesized, render):
    config, templates = synthesized
    facts = INSTANCE_TYPES[config.gpu_instance_type]
    outputs = _deploy_outputs(templates)
    all_keys = {key for stack in outputs.values() for key in stack}
    assert set(REQUIRED_KEYS) <= all_keys, f"infra no longer outputs {set(REQUIRED_KEYS) - all_keys}"

    r = render(*fitting(config.gpu_instance_type), context={"gpuInstanceType": config.gpu_instance_type,
                                                            "imageUri": IMAGE}, outputs=outputs)
    job = r.one("Job")
    cluster = next(t for t in templates.values() if _resources(t, "AWS::EKS::Nodegroup"))

    # Namespace, PVC, image, mount path: the names infra outputs and applies are the ones the Job uses.
    (manifest,) = _resources(cluster, "Custom::AWSCDK-EKS-KubernetesResource")
    applied = json.loads(_text(manifest["Manifest"]))
    namespaces = [o["metadata"]["name"] for o in applied if o["kind"] == "Namespace"]
    (claim,) = [o for o in applied if o["kind"] == "PersistentVolumeClaim"]
    assert namespaces == [job["metadata"]["namespace"]] == [NAMESPACE]
    # Pod Security Admission: baseline enforced on the namespace the stack applies, restricted warned
    (namespace,) = [o for o in applied if o["kind"] == "Namespace"]
    assert namespace["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "baseline"
    assert namespace["metadata"]["labels"]["pod-security.kubernetes.io/warn"] == "restricted"
    assert claim["metadata"]["namespace"] == job["metadata"]["namespace"]
    assert {"name": "fsx", "persistentVolumeClaim": {"claimName": claim["metadata"]["name"]}} in r.pod["volumes"]
    assert claim["metadata"]["name"] == PVC_NAME
    assert "ReadWriteMany" in claim["spec"]["accessModes"]  # every pod of the Job mounts it
    # the Job's own directory of the file system, at its run_dir
    assert {"name": "fsx", "mountPath": f"{CHECKPOINT_MOUNT_PATH}/runs/fsdp-train", "subPath": "runs/fsdp-train",
            "readOnly": False} in r.container["volumeMounts"]
    assert r.container["image"] == IMAGE

    # GPU nodes: the Job selects their label and instance type and tolerates their taint.
    groups = _resources(cluster, "AWS::EKS::Nodegroup")
    (gpu_group,) = [g for g in groups if GPU_NODE_LABEL in g.get("Labels", {})]
    assert r.pod["nodeSelector"][GPU_NODE_LABEL] == gpu_group["Labels"][GPU_NODE_LABEL]
    assert {(t["Key"], t["Effect"]) for t in gpu_group["Taints"]} == {(GPU_TAINT_KEY, "NO_SCHEDULE")}
    assert {"key": GPU_TAINT_KEY, "operator": "Exists", "effect": "NoSchedule"} in r.pod["tolerations"]
    (template_data,) = [lt["LaunchTemplateData"] for lt in _resources(cluster, "AWS::EC2::LaunchTemplate")
                        if "InstanceType" in lt["LaunchTemplateData"]]  # the GPU nodes (the system nodes name none)
    assert r.pod["nodeSelector"]["node.kubernetes.io/instance-type"] == template_data["InstanceType"]

    # Node counts: a pod per training node and per hot spare, and the node group runs that many.
    spec, scaling = job["spec"], gpu_group["ScalingConfig"]
    assert spec["completions"] == spec["parallelism"] == config.gpu_nodes_desired + config.spare_nodes == 3
    assert spec["completions"] <= scaling["DesiredSize"] <= scaling["MaxSize"]

    # The rendezvous store: on the system nodes by their label, which carry no taint to tolerate.
    (system_group,) = [g for g in groups if g is not gpu_group]
    store = r.store
    store_pod = store["spec"]["template"]["spec"]
    assert store_pod["nodeSelector"] == {SYSTEM_NODE_LABEL: system_group["Labels"][SYSTEM_NODE_LABEL]}
    assert "Taints" not in system_group
    assert store_pod["containers"][0]["image"] == IMAGE

    # Devices: GPUs and EFA interfaces of the instance table, as the node is built.
    limits = r.container["resources"]["limits"]
    args = r.container["args"]
    assert limits["nvidia.com/gpu"] == args[args.index("--nproc-per-node") + 1] == str(facts.gpus)
    efa_interfaces = [n for n in template_data["NetworkInterfaces"] if n.get("InterfaceType") in ("efa", "efa-only")]
    assert len(efa_interfaces) == facts.efa_interfaces
    assert limits.get("vpc.amazonaws.com/efa") == (str(len(efa_interfaces)) if efa_interfaces else None)
    helm_charts = {c["Chart"] for c in _resources(cluster, "Custom::AWSCDK-EKS-HelmChart")}
    assert ("aws-efa-k8s-device-plugin" in helm_charts) == bool(efa_interfaces)
    assert "nvidia-device-plugin" in helm_charts

    # Node setup: hugepages reserved as requested, and the NVMe RAID0 under the kubelet that the pod's emptyDirs are on.
    user_data = _text(template_data["UserData"])
    if facts.hugepages_2mi_gib:
        assert f"vm.nr_hugepages = {facts.hugepages_2mi_gib * _HUGEPAGES_2MI_PER_GIB}" in user_data
        assert limits["hugepages-2Mi"] == f"{facts.hugepages_2mi_gib}Gi"
    assert "strategy: RAID0" in user_data and "emptyDir" in r.pod_volumes["scratch"]


@dataclass(frozen=True)
class Pod:
    name: str
    namespace: str
    labels: Mapping[str, str]
    spec: Mapping[str, Any]


def _pods_of(obj: dict) -> Iterator[Pod]:
    """Every pod template of a rendered object, at any depth (Job, Deployment, MPIJob replica specs)."""
    def walk(node: Any) -> Iterator[Pod]:
        if isinstance(node, dict):
            if "containers" in node.get("spec", {}):
                yield Pod(f"{obj['kind']}/{obj['metadata']['name']}", obj["metadata"]["namespace"],
                          node.get("metadata", {}).get("labels", {}), node["spec"])
            for value in node.values():
                yield from walk(value)
        elif isinstance(node, list):
            for value in node:
                yield from walk(value)
    return walk(obj.get("spec", {}))


def _prometheus_server(cluster_template: dict) -> Pod:
    """The server pod of the Prometheus chart the cluster stack installs: its values' nodeSelector, the labels
    the training's NetworkPolicy admits it by."""
    [chart] = [c for c in _resources(cluster_template, "Custom::AWSCDK-EKS-HelmChart") if c["Chart"] == "prometheus"]
    values = json.loads(chart["Values"])
    return Pod("prometheus-server", chart["Namespace"], PROMETHEUS_SERVER, {"nodeSelector": values["server"]["nodeSelector"]})


def _selects(selector: Mapping[str, Any], labels: Mapping[str, str]) -> bool:
    assert set(selector) <= {"matchLabels"}, f"only matchLabels is followed here: {selector}"
    return all(labels.get(k) == v for k, v in selector.get("matchLabels", {}).items())


def _peers(peer: Mapping[str, Any], namespace: str, pods: list[Pod]) -> list[Pod]:
    """The pods a NetworkPolicy peer names (an ipBlock names none)."""
    if "ipBlock" in peer:
        return []
    if "namespaceSelector" in peer:
        [(key, namespace)] = peer["namespaceSelector"]["matchLabels"].items()
        assert key == "kubernetes.io/metadata.name", peer
    return [p for p in pods if p.namespace == namespace and _selects(peer.get("podSelector", {}), p.labels)]


def _flows(policies: list[dict], pods: list[Pod]) -> Iterator[tuple[Pod, Pod, str, int | None]]:
    """(source, target, protocol, port) of every connection between pods a NetworkPolicy opens; port None:
    all traffic. From both ends: a policy's ingress rules and its egress rules to pods."""
    for policy in policies:
        namespace, spec = policy["metadata"]["namespace"], policy["spec"]
        selected = [p for p in pods if p.namespace == namespace and _selects(spec["podSelector"], p.labels)]
        for direction, peers_key in (("ingress", "from"), ("egress", "to")):
            for rule in spec.get(direction, []):
                peers = [p for peer in rule.get(peers_key, []) for p in _peers(peer, namespace, pods)]
                ports = [(port["protocol"].lower(), port["port"]) for port in rule.get("ports", [])] or [(ALL, None)]
                for protocol, port in ports:
                    assert port is None or isinstance(port, int), f"{policy['metadata']['name']}: named port {port}"
                    for selected_pod in selected:
                        for peer in peers:
                            yield ((peer, selected_pod) if direction == "ingress" else (selected_pod, peer)) + (protocol, port)


def _rendered(config: PlatformConfig, outputs: dict, render) -> list[dict]:
    """Everything the k8s layer renders for this platform: the training, the report Job and, where the
    instance has EFA, the NCCL preflight."""
    context = {"gpuInstanceType": config.gpu_instance_type, "imageUri": IMAGE}
    runs = [(), ("--report",)] + ([("--preflight",)] if INSTANCE_TYPES[config.gpu_instance_type].efa_interfaces else [])
    if config.gpu_instance_type == PlatformConfig().gpu_instance_type:  # the replica groups' Jobs
        runs.append(("--train-config", REPLICAS))
    return [o for args in runs for o in render(*fitting(config.gpu_instance_type), *args, context=context,
                                               outputs=outputs).objects()]


def _node_group(pod: Pod, node_groups: list[NodeGroup]) -> NodeGroup:
    selector = pod.spec.get("nodeSelector", {})
    matching = [g for g in node_groups if g.selected_by(selector)]
    assert len(matching) == 1, f"{pod.name}: nodeSelector {selector} picks {[g.logical_id for g in matching]}"
    return matching[0]


def test_every_pod_reaches_what_it_needs_through_the_security_groups(synthesized, render):
    """A path that a security group blocks shows up late: a pod that mounts FSx waits in ContainerCreating, a
    launcher never reaches the store, Prometheus scrapes nothing. Each pod is followed to the node group its
    nodeSelector picks, to that group's security groups, and each path it needs is checked against the rules."""
    config, templates = synthesized
    objects = _rendered(config, _deploy_outputs(templates), render)
    cluster = next(t for t in templates.values() if _resources(t, "AWS::EKS::Nodegroup"))
    pods = [p for o in objects for p in _pods_of(o)] + [_prometheus_server(cluster)]
    network = SecurityGroups(templates)
    node_groups = network.node_groups()
    blocked = []

    # FSx: every pod that mounts the claim, its node's Lustre client to the file servers and back.
    [(storage, fs)] = [(stack, props) for stack, t in templates.items() for props in _resources(t, "AWS::FSx::FileSystem")]
    fsx = frozenset(network.group(storage, g) for g in fs["SecurityGroupIds"])
    mounting = [p for p in pods if any(v.get("persistentVolumeClaim", {}).get("claimName") == PVC_NAME
                                       for v in p.spec.get("volumes", []))]
    assert {p.name for p in mounting} >= {"Job/fsdp-train", "Deployment/fsdp-train-rendezvous", "Job/fsdp-train-report"}
    for pod in mounting:
        nodes = _node_group(pod, node_groups).groups
        for port in LUSTRE_PORTS:
            for source, target, what in ((nodes, fsx, "to FSx"), (fsx, nodes, "FSx back to the node"),
                                         (fsx, fsx, "between the file servers")):
                if not network.passes(source, target, "tcp", port):
                    blocked.append(f"{pod.name}: Lustre tcp/{port} {what}")

    # Pods to pods: every connection a NetworkPolicy opens (the store's port from the training pods, the metrics
    # port from Prometheus, the ranks among themselves, the preflight's launcher and workers), node to node.
    policies = [o for o in objects if o["kind"] == "NetworkPolicy"]
    flows = set()
    for source, target, protocol, port in _flows(policies, pods):
        flows.add((source.name, target.name, protocol, port))
        if not network.passes(_node_group(source, node_groups).groups, _node_group(target, node_groups).groups,
                              protocol, port):
            blocked.append(f"{source.name} -> {target.name}: {protocol}/{port if port is not None else 'all'}")
    assert ("Job/fsdp-train", "Deployment/fsdp-train-rendezvous", "tcp", 29500) in flows
    assert ("Job/fsdp-train", "Job/fsdp-train", ALL, None) in flows
    assert ("prometheus-server", "Job/fsdp-train", "tcp", 9464) in flows
    if config.gpu_instance_type == PlatformConfig().gpu_instance_type:
        assert ("Job/fsdp-train-g0", "Deployment/fsdp-train-lighthouse", "tcp", 29510) in flows
        assert ("Job/fsdp-train-g0", "Job/fsdp-train-g1", ALL, None) in flows

    # EFA: NCCL's OS-bypass traffic needs a group on every EFA interface that lets all traffic in from and out to
    # itself (EC2 user guide, "Get started with EFA and NCCL for ML workloads", "Prepare an EFA-enabled security group").
    for pod in pods:
        if any("vpc.amazonaws.com/efa" in c.get("resources", {}).get("limits", {}) for c in pod.spec.get("containers", [])):
            for interface in _node_group(pod, node_groups).efa_interface_groups:
                if not any(network.passes(frozenset([g]), frozenset([g]), ALL, None) for g in interface):
                    blocked.append(f"{pod.name}: EFA interface groups {sorted(interface)} have no all-traffic self rule")
    assert blocked == []
