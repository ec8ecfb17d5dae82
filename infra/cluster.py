"""The EKS control plane, its system node group and the EKS add-ons the platform relies on."""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Callable, Sequence

from aws_cdk import RemovalPolicy, Stack, aws_ec2 as ec2, aws_eks_v2 as eks, aws_iam as iam, aws_kms as kms
from aws_cdk.lambda_layer_kubectl_v34 import KubectlV34Layer
from constructs import Construct

from infra.config import SYSTEM_NODE_LABEL
from infra.nag import acknowledge, acknowledge_node_role, managed_policy_rule

# kubectl talks to a control plane one minor version older or newer than itself (version skew policy).
KUBECTL_LAYERS: dict[str, Callable[[Construct, str], KubectlV34Layer]] = {
    "1.33": KubectlV34Layer,
    "1.34": KubectlV34Layer,
}

# The system nodes also run the rendezvous store, from the training image (NGC PyTorch: ~10 GB to pull,
# ~25 GB unpacked): EKS's default 20 GiB root volume cannot hold it; 200 GiB holds two of its
# versions (the running one and the next) beside the add-ons' images.
SYSTEM_ROOT_VOLUME_GIB = 200

# The FSx CSI controller's service account, as the EKS add-on names it.
FSX_CSI_SERVICE_ACCOUNT = "fsx-csi-controller-sa"


@dataclass(frozen=True)
class AddonSpec:
    name: str
    service_account: str | None = None  # given: the add-on gets a Pod Identity role for it
    managed_policies: tuple[str, ...] = ()  # on that role


# Networking, DNS, Pod Identity, the FSx CSI driver (static PV on Lustre), and the node monitoring
# agent that feeds node auto repair on the GPU node group.
ADDONS = (
    AddonSpec("vpc-cni"),
    AddonSpec("coredns"),
    AddonSpec("kube-proxy"),
    AddonSpec("eks-pod-identity-agent"),
    AddonSpec("aws-fsx-csi-driver", service_account=FSX_CSI_SERVICE_ACCOUNT, managed_policies=("AmazonFSxFullAccess",)),
    AddonSpec("eks-node-monitoring-agent"),
)


@dataclass(frozen=True)
class EksClusterProps:
    cluster_name: str
    kubernetes_version: str
    vpc: ec2.IVpc
    api_allowed_cidrs: Sequence[str]
    admin_role_arn: str | None
    system_instance_type: str
    system_nodes: int


class EksCluster(Construct):
    """An EKS cluster on node-group capacity (no Auto Mode, no default capacity), with a kubectl provider."""

    cluster: eks.Cluster
    system_nodegroup: eks.Nodegroup

    def __init__(self, scope: Construct, construct_id: str, props: EksClusterProps) -> None:
        super().__init__(scope, construct_id)
        layer = KUBECTL_LAYERS[props.kubernetes_version]
        self.cluster = eks.Cluster(
            self,
            "Cluster",
            cluster_name=props.cluster_name,
            version=eks.KubernetesVersion.of(props.kubernetes_version),
            default_capacity_type=eks.DefaultCapacityType.NODEGROUP,
            default_capacity=0,
            vpc=props.vpc,
            vpc_subnets=[ec2.SubnetSelection(subnet_type=ec2.SubnetType.PRIVATE_WITH_EGRESS)],
            endpoint_access=eks.EndpointAccess.PUBLIC_AND_PRIVATE.only_from(*props.api_allowed_cidrs),
            cluster_logging=list(eks.ClusterLoggingTypes),
            secrets_encryption_key=kms.Key(
                self,
                "SecretsKey",
                description=f"EKS secrets of {props.cluster_name}",
                enable_key_rotation=True,
                removal_policy=RemovalPolicy.DESTROY,  # useless without the cluster; deletion waits 30 days
            ),
            kubectl_provider_options=eks.KubectlProviderOptions(kubectl_layer=layer(self, "KubectlLayer")),
            # The platform writes its own UpdateKubeconfigCommand output under a fixed key.
            output_config_command=False,
        )
        if props.admin_role_arn:
            self.cluster.grant_access(
                "AdminAccess",
                props.admin_role_arn,
                [
                    eks.AccessPolicy.from_access_policy_name(
                        "AmazonEKSClusterAdminPolicy", access_scope_type=eks.AccessScopeType.CLUSTER
                    )
                ],
            )
        # Add-ons, controllers and the training's rendezvous store land here (the store selects the
        # label: on-demand nodes, the default, that outlive any GPU node); the GPU nodes are tainted
        # for training pods only.
        self.system_nodegroup = self.cluster.add_nodegroup_capacity(
            "SystemNodes",
            ami_type=eks.NodegroupAmiType.AL2023_X86_64_STANDARD,
            instance_types=[ec2.InstanceType(props.system_instance_type)],
            min_size=props.system_nodes,
            desired_size=props.system_nodes,
            max_size=props.system_nodes,
            subnets=ec2.SubnetSelection(subnet_type=ec2.SubnetType.PRIVATE_WITH_EGRESS),
            disk_size=SYSTEM_ROOT_VOLUME_GIB,
            labels={SYSTEM_NODE_LABEL: "true"},
        )
        for spec in ADDONS:
            self._add_addon(spec)
        self._acknowledge_findings()

    def _add_addon(self, spec: AddonSpec) -> None:
        associations = None
        if spec.service_account:
            role = iam.Role(
                self,
                f"{spec.name}-role",
                description=f"Pod Identity role of the {spec.name} add-on",
                assumed_by=iam.SessionTagsPrincipal(iam.ServicePrincipal("pods.eks.amazonaws.com")),
                managed_policies=[iam.ManagedPolicy.from_aws_managed_policy_name(p) for p in spec.managed_policies],
            )
            for policy in spec.managed_policies:
                acknowledge(
                    role,
                    managed_policy_rule(policy),
                    f"{policy} is the policy EKS documents for the {spec.name} add-on; AWS keeps it in step "
                    "with the calls the add-on makes.",
                )
            associations = [
                eks.CfnAddon.PodIdentityAssociationProperty(
                    role_arn=role.role_arn, service_account=spec.service_account
                )
            ]
        addon = eks.CfnAddon(
            self,
            spec.name,
            addon_name=spec.name,
            cluster_name=self.cluster.cluster_name,
            pod_identity_associations=associations,
            # EKS bootstrapped self-managed vpc-cni/coredns/kube-proxy; the managed add-ons take them over.
            resolve_conflicts="OVERWRITE",
        )
        # CoreDNS and controllers stay degraded until a node can run them.
        addon.node.add_dependency(self.system_nodegroup)

    def _acknowledge_findings(self) -> None:
        acknowledge(
            self.cluster,
            managed_policy_rule("AmazonEKSClusterPolicy"),
            "The EKS service role needs exactly AmazonEKSClusterPolicy, which AWS maintains.",
        )
        acknowledge_node_role(self.system_nodegroup.role)
        # The kubectl provider is aws-cdk-lib's: its roles, policies and runtime are not ours to shape.
        provider = self.cluster.node.find_child("KubectlProvider")
        handler = provider.node.find_child("Handler")
        stack = Stack.of(self)
        handler_id = stack.get_logical_id(handler.node.default_child)
        cdk_owned = "Part of the kubectl provider that aws-cdk-lib generates for aws_eks_v2; "
        for policy, use in (
            ("service-role/AWSLambdaBasicExecutionRole", "writes the handlers' logs"),
            ("service-role/AWSLambdaVPCAccessExecutionRole", "puts the handlers in the VPC, by the private endpoint"),
            ("AmazonEC2ContainerRegistryReadOnly", "lets helm pull OCI charts from ECR"),
        ):
            acknowledge(provider, managed_policy_rule(policy), cdk_owned + f"{policy} {use}.")
        # The finding names the policy as the template renders it: a condition on the handler.
        ecr_public_arn = [
            "arn:", {"Ref": "AWS::Partition"}, ":iam::aws:policy/AmazonElasticContainerRegistryPublicReadOnly"
        ]
        ecr_public = {
            "Fn::If": [
                stack.get_logical_id(handler.node.find_child("HasEcrPublic")),
                {"Fn::Join": ["", ecr_public_arn]},
                {"Ref": "AWS::NoValue"},
            ]
        }
        acknowledge(
            provider,
            f"AwsSolutions-IAM4[Policy::{json.dumps(ecr_public, separators=(',', ':'))}]",
            cdk_owned + "ECR Public read-only is attached only when a chart comes from public.ecr.aws.",
        )
        acknowledge(
            provider,
            f"AwsSolutions-IAM5[Resource::<{handler_id}.Arn>:*]",
            cdk_owned + "the provider framework may invoke any version of its own handler function.",
        )
        acknowledge(provider, "AwsSolutions-L1", cdk_owned + "the Lambda runtime moves with aws-cdk-lib.")
