"""The Job against what the infra stacks create: synthesize infra/platform.py (one app per instance
type, ~5 s each), turn its outputs into the cdk-outputs.json a deploy would write, render the
charts from it, and compare names, mounts, node labels, taints, node counts and per-instance
device counts."""
from __future__ import annotations

import json
from typing import Any

import aws_cdk as cdk
import pytest

from infra.config import (CHECKPOINT_MOUNT_PATH, GPU_NODE_LABEL, GPU_TAINT_KEY, NAMESPACE, PVC_NAME, SYSTEM_NODE_LABEL,
                          PlatformConfig)
from infra.instances import INSTANCE_TYPES
from infra.platform import build_platform
from k8s.outputs import REQUIRED_KEYS
from k8s_render import fitting

IMAGE = "123456789012.dkr.ecr.us-east-1.amazonaws.com/train:1.0"  # a given imageUri is output as is
_HUGEPAGES_2MI_PER_GIB = 512


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
    config = PlatformConfig(gpu_instance_type=request.param, image_uri=IMAGE)
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
    (store,) = [o for o in r.objects() if o["kind"] == "Deployment"]
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
