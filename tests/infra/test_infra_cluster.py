"""Cluster stack: EKS control plane, system node group, access, add-ons."""
from __future__ import annotations

import json

from infra.cluster import ADDON_NAMESPACE, ADDONS, SYSTEM_ROOT_VOLUME_GIB
from infra.config import GPU_TAINT_KEY, HUNG_NODE_MARKER_SERVICE_ACCOUNT, KUBERNETES_VERSIONS, SYSTEM_NODE_LABEL


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
    system = full.nodegroup("AL2023_x86_64_STANDARD")
    assert system["InstanceTypes"] == [full.config.system_instance_type]
    n = full.config.system_nodes
    assert system["ScalingConfig"] == {"MinSize": n, "DesiredSize": n, "MaxSize": n}
    assert "Taints" not in system
    # The label the rendezvous store selects (k8s/charts/training.py): it needs no toleration.
    assert system["Labels"] == {SYSTEM_NODE_LABEL: "true"}
    # ... from the training image, which EKS's default 20 GiB root volume cannot hold
    [root] = full.launch_template(system)["BlockDeviceMappings"]
    assert root["Ebs"] == {"VolumeSize": SYSTEM_ROOT_VOLUME_GIB, "VolumeType": "gp3", "Encrypted": True,
                           "DeleteOnTermination": True}
    assert SYSTEM_ROOT_VOLUME_GIB >= 100 and "DiskSize" not in system


def test_system_nodes_keep_the_cluster_group_beside_the_lustre_clients_group(full):
    """The store and the report Job on these nodes mount FSx, so they carry the Lustre clients' group; a template
    that names groups gets no cluster group from EKS, without which the nodes could not join the cluster."""
    [cluster_id] = full.resources("Cluster", "AWS::EKS::Cluster")
    lustre_clients = full.imported("Network", {"Fn::GetAtt": [full.security_group("Network", "FSx for Lustre clients"),
                                                              "GroupId"]})
    template = full.launch_template(full.nodegroup("AL2023_x86_64_STANDARD"))
    assert template["SecurityGroupIds"] == [{"Fn::GetAtt": [cluster_id, "ClusterSecurityGroupId"]}, lustre_clients]


def test_system_nodes_require_imdsv2_with_one_hop(full):
    """As the GPU nodes: a pod on the pod network (the rendezvous store, CoreDNS, Prometheus) cannot reach IMDS
    and take the node role's credentials."""
    template = full.launch_template(full.nodegroup("AL2023_x86_64_STANDARD"))
    assert template["MetadataOptions"] == {"HttpTokens": "required", "HttpEndpoint": "enabled",
                                           "HttpPutResponseHopLimit": 1}


def _managed_policies(synth, role: dict) -> set[str]:
    return {arn["Fn::Join"][1][-1].rsplit("/", 1)[-1] for arn in role["Properties"].get("ManagedPolicyArns", [])}


def _role_of(synth, arn: dict) -> dict:
    logical_id = arn["Fn::GetAtt"][0]
    assert arn == {"Fn::GetAtt": [logical_id, "Arn"]}
    return synth.templates["Cluster"]["Resources"][logical_id]


def test_node_roles_carry_no_cni_policy_which_aws_node_gets_by_pod_identity(variant):
    for ami_type in ("AL2023_x86_64_STANDARD", "AL2023_x86_64_NVIDIA"):
        role = _role_of(variant, variant.nodegroup(ami_type)["NodeRole"])
        assert _managed_policies(variant, role) == {"AmazonEKSWorkerNodePolicy", "AmazonEC2ContainerRegistryReadOnly"}
    [cni] = [a["Properties"] for a in variant.resources("Cluster", "AWS::EKS::Addon").values()
             if a["Properties"]["AddonName"] == "vpc-cni"]
    [association] = cni["PodIdentityAssociations"]
    assert association["ServiceAccount"] == "aws-node"  # kube-system, the add-on's namespace
    role = _role_of(variant, association["RoleArn"])
    assert _managed_policies(variant, role) == {"AmazonEKS_CNI_Policy"}
    [trust] = role["Properties"]["AssumeRolePolicyDocument"]["Statement"]
    assert trust["Principal"] == {"Service": "pods.eks.amazonaws.com"}
    assert sorted(trust["Action"]) == ["sts:AssumeRole", "sts:TagSession"]
    # Without AmazonEKS_CNI_Policy on the node role, aws-node needs its association, and the agent that serves
    # it, before a node starts: both add-ons come before every node group.
    addons = {a["Properties"]["AddonName"]: k for k, a in variant.resources("Cluster", "AWS::EKS::Addon").items()}
    for group in variant.resources("Cluster", "AWS::EKS::Nodegroup").values():
        assert {addons["vpc-cni"], addons["eks-pod-identity-agent"]} <= set(group.get("DependsOn", []))


def _pod_identity_associations(synth) -> list[dict]:
    """Every Pod Identity association of every stack as {ClusterName, Namespace, ServiceAccount, RoleArn}: the
    AWS::EKS::PodIdentityAssociation resources and those an AWS::EKS::Addon declares, in its own namespace."""
    found = []
    for template in synth.templates.values():
        for resource in template["Resources"].values():
            props = resource.get("Properties", {})
            if resource["Type"] == "AWS::EKS::PodIdentityAssociation":
                assert not props.get("DisableSessionTags"), "the trust conditions need the session tags"
                found.append({k: props[k] for k in ("ClusterName", "Namespace", "ServiceAccount", "RoleArn")})
            elif resource["Type"] == "AWS::EKS::Addon":
                namespace = props.get("NamespaceConfig", {}).get("Namespace", ADDON_NAMESPACE)
                found += [{"ClusterName": props["ClusterName"], "Namespace": namespace, **association}
                          for association in props.get("PodIdentityAssociations", [])]
    return found


def test_every_pod_identity_role_trusts_exactly_the_service_account_its_association_names(variant):
    """Pod Identity tags the session with the pod's cluster, namespace and service account (EKS user guide,
    "Create IAM role with trust policy required by EKS Pod Identity"): each role's trust names those of the
    association that uses it, and no key that page does not name (a condition on a key absent from the request
    denies it). A role whose conditions drifted from its association would
    deny that pod its credentials (for aws-node: no node ever Ready); an unscoped one would serve any pod."""
    [cluster_id] = variant.resources("Cluster", "AWS::EKS::Cluster")
    associations = _pod_identity_associations(variant)
    trusting = []
    for stack, template in variant.templates.items():
        for logical_id, role in template["Resources"].items():
            if role["Type"] != "AWS::IAM::Role":
                continue
            for statement in role["Properties"]["AssumeRolePolicyDocument"]["Statement"]:
                if "pods.eks.amazonaws.com" not in json.dumps(statement.get("Principal")):
                    continue
                trusting.append(logical_id)
                assert stack == "Cluster"
                assert sorted(statement["Action"]) == ["sts:AssumeRole", "sts:TagSession"]
                [using] = [a for a in associations if a["RoleArn"] == {"Fn::GetAtt": [logical_id, "Arn"]}]
                assert using["ClusterName"] == {"Ref": cluster_id}
                assert statement["Condition"] == {"StringEquals": {
                    "aws:RequestTag/eks-cluster-arn": {"Fn::GetAtt": [cluster_id, "Arn"]},
                    "aws:RequestTag/kubernetes-namespace": using["Namespace"],
                    "aws:RequestTag/kubernetes-service-account": using["ServiceAccount"],
                }}, logical_id
    assert trusting  # the VPC CNI's role at least
    # and no association hands out a role that is not scoped so
    assert sorted(a["RoleArn"]["Fn::GetAtt"][0] for a in associations) == sorted(trusting)


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


def _addons(synth) -> dict[str, dict]:
    return {a["Properties"]["AddonName"]: a["Properties"] for a in synth.resources("Cluster", "AWS::EKS::Addon").values()}


def test_eks_addons_are_pinned_per_kubernetes_version(full, kubernetes_133):
    addons = _addons(full)
    assert sorted(addons) == sorted(
        ["vpc-cni", "coredns", "kube-proxy", "eks-pod-identity-agent", "aws-fsx-csi-driver", "eks-node-monitoring-agent"]
    )
    assert all(a["AddonVersion"].startswith("v") and "-eksbuild." in a["AddonVersion"] for a in addons.values())
    # kube-proxy follows the control plane's minor version.
    assert addons["kube-proxy"]["AddonVersion"].startswith(f"v{full.config.kubernetes_version}.")
    older = _addons(kubernetes_133)
    assert older["kube-proxy"]["AddonVersion"].startswith("v1.33.")
    assert {name: a["AddonVersion"] for name, a in older.items()} == {s.name: s.versions["1.33"].version for s in ADDONS}


def test_every_addon_is_pinned_for_every_allowed_kubernetes_version_with_its_source():
    for spec in ADDONS:
        assert sorted(spec.versions) == sorted(KUBERNETES_VERSIONS), spec.name
        for kubernetes, pin in spec.versions.items():
            assert pin.version.startswith("v") and "-eksbuild." in pin.version, (spec.name, kubernetes)
            # a public source that lists it, or an honest "unverified" that the AWS preflight makes up for
            assert pin.source.startswith(("EKS user guide", "unverified: ")), (spec.name, kubernetes, pin.source)


def test_vpc_cni_has_efa_only_support_and_enforces_network_policies(full):
    vpc_cni = _addons(full)["vpc-cni"]
    major, minor, patch = (int(p) for p in vpc_cni["AddonVersion"].lstrip("v").split("-")[0].split("."))
    assert (major, minor, patch) >= (1, 18, 5)  # EFA-only interfaces need 1.18.5
    assert json.loads(vpc_cni["ConfigurationValues"]) == {"enableNetworkPolicy": "true"}


def test_node_monitoring_agent_dcgm_tolerates_the_gpu_taint(full):
    config = json.loads(_addons(full)["eks-node-monitoring-agent"]["ConfigurationValues"])
    assert config == {"dcgmAgent": {"tolerations": [{"key": GPU_TAINT_KEY, "operator": "Exists", "effect": "NoSchedule"}]}}


def test_fsx_csi_driver_gets_no_aws_permissions(full):
    """A static PV is only mounted: no FSx API call, so no role that could delete the file system."""
    fsx = _addons(full)["aws-fsx-csi-driver"]
    assert "PodIdentityAssociations" not in fsx and "ServiceAccountRoleArn" not in fsx
    assert "AmazonFSx" not in json.dumps(full.templates["Cluster"])
    # The one standalone association is the hung-node marker's (infra/node_fencing.py), in the training namespace.
    assert [r["Properties"]["ServiceAccount"] for r in full.resources("Cluster", "AWS::EKS::PodIdentityAssociation")
            .values()] == [HUNG_NODE_MARKER_SERVICE_ACCOUNT]


def test_open_api_endpoint_and_missing_admin_role_warn_at_synth(defaults, with_account):
    [open_endpoint] = [w for w in defaults.warnings["Cluster"] if "0.0.0.0/0" in w]
    assert "apiAllowedCidrs" in open_endpoint
    assert [w for w in defaults.warnings["Cluster"] if "adminRoleArn is not set" in w]
    assert not [w for w in with_account.warnings["Cluster"] if "0.0.0.0/0" in w or "adminRoleArn" in w]


def test_account_specific_stacks_synthesize_without_lookups(with_account):
    """`cdk synth -c account=…` needs no AWS credentials: nothing is left for the CLI to look up."""
    assert with_account.missing_context == []
    assert with_account.config.account == "123456789012"
    subnets = with_account.resources("Network", "AWS::EC2::Subnet").values()
    assert sorted({s["Properties"]["AvailabilityZone"] for s in subnets}) == sorted(with_account.config.availability_zones)
    [admin] = [e["Properties"] for e in with_account.resources("Cluster", "AWS::EKS::AccessEntry").values()
               if e["Properties"]["PrincipalArn"] == with_account.config.admin_role_arn]
    assert admin["AccessPolicies"][0]["AccessScope"] == {"Type": "cluster"}
