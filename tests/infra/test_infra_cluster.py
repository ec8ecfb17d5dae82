"""Cluster stack: EKS control plane, system node group, access, add-ons."""
from __future__ import annotations

import json

from infra.cluster import FSX_CSI_SERVICE_ACCOUNT, SYSTEM_ROOT_VOLUME_GIB
from infra.config import SYSTEM_NODE_LABEL


def test_cluster_version_name_and_node_group_capacity_without_auto_mode(full):
    cluster = full.one("Cluster", "AWS::EKS::Cluster")
    assert cluster["Name"] == full.config.cluster_name
    assert cluster["Version"] == full.config.kubernetes_version
    assert cluster["ComputeConfig"] == {"Enabled": False}
    # No default capacity: exactly the system and the GPU node groups.
    assert len(full.resources("Cluster", "AWS::EKS::Nodegroup")) == 2


def test_all_control_plane_log_types(full):
    logging = full.one("Cluster", "AWS::EKS::Cluster")["Logging"]["ClusterLogging"]["EnabledTypes"]
    assert sorted(t["Type"] for t in logging) == ["api", "audit", "authenticator", "controllerManager", "scheduler"]


def test_secrets_encrypted_with_a_rotating_kms_key(full):
    [config] = full.one("Cluster", "AWS::EKS::Cluster")["EncryptionConfig"]
    assert config["Resources"] == ["secrets"]
    key_id = config["Provider"]["KeyArn"]["Fn::GetAtt"][0]
    key = full.templates["Cluster"]["Resources"][key_id]
    assert key["Type"] == "AWS::KMS::Key" and key["Properties"]["EnableKeyRotation"] is True


def test_endpoint_public_only_from_configured_cidrs_and_private(full):
    vpc_config = full.one("Cluster", "AWS::EKS::Cluster")["ResourcesVpcConfig"]
    assert vpc_config["EndpointPrivateAccess"] is True
    assert vpc_config["PublicAccessCidrs"] == list(full.config.api_allowed_cidrs)
    # Control plane ENIs in the private subnets of both zones.
    assert len(vpc_config["SubnetIds"]) == len(full.config.availability_zones)


def test_system_node_group_is_al2023_with_configured_size_label_and_disk(full):
    groups = [g["Properties"] for g in full.resources("Cluster", "AWS::EKS::Nodegroup").values()]
    [system] = [g for g in groups if g["AmiType"] == "AL2023_x86_64_STANDARD"]
    assert system["InstanceTypes"] == [full.config.system_instance_type]
    n = full.config.system_nodes
    assert system["ScalingConfig"] == {"MinSize": n, "DesiredSize": n, "MaxSize": n}
    assert "Taints" not in system
    # The label the rendezvous store selects (k8s/charts/training.py): it needs no toleration.
    assert system["Labels"] == {SYSTEM_NODE_LABEL: "true"}
    # ... from the training image, which EKS's default 20 GiB root volume cannot hold
    assert system["DiskSize"] == SYSTEM_ROOT_VOLUME_GIB >= 100


def test_kubectl_provider_layer_matches_the_kubernetes_minor_version(full):
    layers = [v["Properties"].get("Description", "") for v in full.resources("Cluster", "AWS::Lambda::LayerVersion").values()]
    [kubectl] = [d for d in layers if "/opt/kubectl/kubectl" in d]
    assert kubectl.startswith(f"/opt/kubectl/kubectl {full.config.kubernetes_version}.")


def test_admin_role_gets_a_cluster_admin_access_entry(full, defaults):
    entries = [e["Properties"] for e in full.resources("Cluster", "AWS::EKS::AccessEntry").values()]
    [admin] = [e for e in entries if e["PrincipalArn"] == full.config.admin_role_arn]
    [policy] = admin["AccessPolicies"]
    assert json.dumps(policy["PolicyArn"]).endswith(':cluster-access-policy/AmazonEKSClusterAdminPolicy"]]}')
    assert policy["AccessScope"] == {"Type": "cluster"}
    assert not [
        e for e in defaults.resources("Cluster", "AWS::EKS::AccessEntry").values()
        if isinstance(e["Properties"]["PrincipalArn"], str) and ":role/" in e["Properties"]["PrincipalArn"]
    ]


def test_eks_addons(full):
    names = sorted(a["Properties"]["AddonName"] for a in full.resources("Cluster", "AWS::EKS::Addon").values())
    assert names == sorted(
        ["vpc-cni", "coredns", "kube-proxy", "eks-pod-identity-agent", "aws-fsx-csi-driver", "eks-node-monitoring-agent"]
    )


def test_fsx_csi_driver_has_a_pod_identity_role(full):
    [fsx] = [a["Properties"] for a in full.resources("Cluster", "AWS::EKS::Addon").values()
             if a["Properties"]["AddonName"] == "aws-fsx-csi-driver"]
    [association] = fsx["PodIdentityAssociations"]
    assert association["ServiceAccount"] == FSX_CSI_SERVICE_ACCOUNT
    role = full.templates["Cluster"]["Resources"][association["RoleArn"]["Fn::GetAtt"][0]]["Properties"]
    [statement] = role["AssumeRolePolicyDocument"]["Statement"]
    assert statement["Principal"] == {"Service": "pods.eks.amazonaws.com"}
    assert sorted(statement["Action"]) == ["sts:AssumeRole", "sts:TagSession"]
    assert "AmazonFSxFullAccess" in json.dumps(role["ManagedPolicyArns"])
