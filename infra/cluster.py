"""The EKS control plane, its system node group and the EKS add-ons the platform relies on."""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

from aws_cdk import Annotations, RemovalPolicy, Stack, aws_ec2 as ec2, aws_eks_v2 as eks, aws_kms as kms
from aws_cdk import aws_lambda as lambda_
from aws_cdk.lambda_layer_kubectl_v34 import KubectlV34Layer
from aws_cdk.lambda_layer_kubectl_v36 import KubectlV36Layer
from constructs import Construct

from infra.addon_pins import ADDON_PINS, AddonPin
from infra.config import SYSTEM_NODE_LABEL
from infra.device_plugins import GPU_TOLERATIONS
from infra.log_archive import LogArchive
from infra.nag import acknowledge, managed_policy_rule
from infra.node_defaults import IMDS_V2_ONE_HOP, encrypted_root_volume, node_role
from infra.pod_identity import pod_identity_role

# kubectl talks to a control plane one minor version older or newer than itself (Kubernetes version skew
# policy): kubectl 1.34 serves 1.33-1.35, kubectl 1.36 serves 1.35-1.37.
KUBECTL_LAYERS: dict[str, Callable[[Construct, str], lambda_.ILayerVersion]] = {
    "1.33": KubectlV34Layer,
    "1.34": KubectlV34Layer,
    "1.35": KubectlV36Layer,
    "1.36": KubectlV36Layer,
}

# The system nodes also run the rendezvous store, from the training image (NGC PyTorch: ~10 GB to pull,
# ~25 GB unpacked): EKS's default 20 GiB root volume cannot hold it; 200 GiB holds two of its
# versions (the running one and the next) beside the add-ons' images.
SYSTEM_ROOT_VOLUME_GIB = 200

OPEN_CIDR = "0.0.0.0/0"
# Where an EKS add-on runs, and so its service account, unless its NamespaceConfig says otherwise (none here
# does; CloudFormation AWS::EKS::Addon, NamespaceConfig: "override the default namespace").
ADDON_NAMESPACE = "kube-system"

@dataclass(frozen=True)
class AddonSpec:
    name: str
    # Pinned per Kubernetes minor version, as the device-plugin charts are, each pin with its source
    # (infra.addon_pins): an add-on upgrade is a reviewed change.
    versions: Mapping[str, AddonPin]
    configuration: Mapping[str, Any] | None = None  # the add-on's configuration values (its Helm values)
    # The add-on's service account (in ADDON_NAMESPACE) and the AWS managed policies of its Pod Identity role;
    # none: the add-on calls no AWS API.
    service_account: str | None = None
    managed_policies: tuple[str, ...] = ()
    # Created before the node groups, which wait for it: a node's networking needs it from the node's first
    # minute (the pattern of terraform-aws-eks's `before_compute`). The others need a node to run on.
    before_nodes: bool = False


# Versions and their sources: infra.addon_pins; `python -m infra.preflight` checks each against the
# account's region (DescribeAddonVersions) before deploy.
ADDONS = (
    # 1.18.5 or later: EFA-only interfaces. enableNetworkPolicy starts the network policy agent, without
    # which the Job's NetworkPolicies are accepted and silently not enforced.
    # Its AWS calls (ENIs, IP addresses) run as the aws-node service account's Pod Identity role, not as
    # the node role (EKS user guide, "Configure Amazon VPC CNI plugin to use IRSA": the plugin supports
    # Pod Identity, and a separate role is the recommended setup). aws-node needs them before a node can
    # run any pod, so this add-on, its association and the Pod Identity agent exist before any node does;
    # the agent runs in the host network and takes the node role's eks-auth:AssumeRoleForPodIdentity.
    # DISABLE_CONTAINER_V6 stays unset: a replica group's heal server (torchft.http._IPv6HTTPServer) binds
    # [::], which needs IPv6 in the pod's network namespace; with containerd the plugin leaves it on unless
    # that variable is set (aws/amazon-vpc-cni-k8s PR 2499 and issue 2483).
    AddonSpec("vpc-cni", ADDON_PINS["vpc-cni"], {"enableNetworkPolicy": "true"},
              service_account="aws-node", managed_policies=("AmazonEKS_CNI_Policy",), before_nodes=True),
    AddonSpec("eks-pod-identity-agent", ADDON_PINS["eks-pod-identity-agent"], before_nodes=True),
    AddonSpec("coredns", ADDON_PINS["coredns"]),
    AddonSpec("kube-proxy", ADDON_PINS["kube-proxy"]),
    # No IAM role: the checkpoint volume is a static PV, which the driver only mounts (Lustre client on
    # the node); FSx API calls serve dynamic provisioning, resizing and deletion, which nothing here
    # asks for. AmazonFSxFullAccess would let a compromised controller delete the checkpoints.
    AddonSpec("aws-fsx-csi-driver", ADDON_PINS["aws-fsx-csi-driver"]),
    # Its DCGM DaemonSet tolerates nothing by default (chart values: dcgmAgent.tolerations: []): without
    # the GPU taint's toleration no GPU diagnostics run on the GPU nodes, the only nodes with GPUs.
    AddonSpec("eks-node-monitoring-agent", ADDON_PINS["eks-node-monitoring-agent"],
              {"dcgmAgent": {"tolerations": GPU_TOLERATIONS}}),
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
    # The FSx for Lustre clients' group (infra.network): the rendezvous store and the report Job run here
    # and mount the checkpoint volume, whose Lustre client is the node's kernel.
    lustre_client_security_group: ec2.ISecurityGroup
    logs: LogArchive  # the stack's: the control plane's log group and the kubectl provider's


class EksCluster(Construct):
    """An EKS cluster on node-group capacity (no Auto Mode, no default capacity), with a kubectl provider."""

    cluster: eks.Cluster
    system_nodegroup: eks.Nodegroup
    system_launch_template: ec2.CfnLaunchTemplate
    # The add-ons every node group waits for (AddonSpec.before_nodes).
    node_prerequisites: list[eks.CfnAddon]

    def __init__(self, scope: Construct, construct_id: str, props: EksClusterProps) -> None:
        super().__init__(scope, construct_id)
        layer = KUBECTL_LAYERS[props.kubernetes_version]
        # EKS writes the control plane's logs to this group, and creates it, unencrypted and kept forever,
        # unless it exists. It goes with the stack: a kept group of this fixed name would stop the stack
        # from being created again after `cdk destroy`.
        control_plane_logs = props.logs.log_group(
            self, "ControlPlaneLogs", name=f"/aws/eks/{props.cluster_name}/cluster",
            removal_policy=RemovalPolicy.DESTROY,
        )
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
        self.cluster.node.default_child.node.add_dependency(control_plane_logs)  # the AWS::EKS::Cluster only
        if OPEN_CIDR in props.api_allowed_cidrs:
            Annotations.of(self.cluster).add_warning_v2(
                "platform:open-api-endpoint",
                f"apiAllowedCidrs contains {OPEN_CIDR}: the Kubernetes API endpoint of {props.cluster_name} is "
                "reachable from the whole internet (IAM still authenticates every call); set apiAllowedCidrs to "
                "your networks, e.g. -c apiAllowedCidrs=203.0.113.0/24",
            )
        if not props.admin_role_arn:
            Annotations.of(self.cluster).add_warning_v2(
                "platform:no-admin-role",
                "adminRoleArn is not set: the cluster gets no access entry for you, and `kubectl` with the "
                "UpdateKubeconfigCommand output answers Unauthorized; set -c adminRoleArn=<your role ARN>",
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
        self.node_prerequisites = [
            self._add_addon(spec, props.kubernetes_version) for spec in ADDONS if spec.before_nodes
        ]
        # Add-ons, controllers and the training's rendezvous store land here (the store selects the
        # label: on-demand nodes, the default, that outlive any GPU node); the GPU nodes are tainted
        # for training pods only. Of the pods here on the pod network, which IMDS_V2_ONE_HOP keeps from
        # the node role, none calls AWS with it: CoreDNS, the rendezvous store and Prometheus call no AWS
        # API, the FSx CSI controller has no IAM role on purpose (static volume), the add-ons that do call
        # AWS use Pod Identity.
        self.system_launch_template = ec2.CfnLaunchTemplate(
            self,
            "SystemLaunchTemplate",
            launch_template_data=ec2.CfnLaunchTemplate.LaunchTemplateDataProperty(
                metadata_options=IMDS_V2_ONE_HOP,
                block_device_mappings=[encrypted_root_volume(SYSTEM_ROOT_VOLUME_GIB)],
                # A template that names groups gets no cluster group from EKS (EKS user guide, "Customize
                # managed nodes with launch templates", "Using custom security groups"): it is listed, for
                # the control plane and the other nodes, beside the Lustre clients' group.
                security_group_ids=[
                    self.cluster.cluster_security_group_id,
                    props.lustre_client_security_group.security_group_id,
                ],
            ),
        )
        self.system_nodegroup = self.cluster.add_nodegroup_capacity(
            "SystemNodes",
            ami_type=eks.NodegroupAmiType.AL2023_X86_64_STANDARD,
            instance_types=[ec2.InstanceType(props.system_instance_type)],
            launch_template_spec=eks.LaunchTemplateSpec(
                id=self.system_launch_template.ref,
                version=self.system_launch_template.attr_latest_version_number,
            ),
            node_role=node_role(self, "SystemNodeRole"),
            min_size=props.system_nodes,
            desired_size=props.system_nodes,
            max_size=props.system_nodes,
            subnets=ec2.SubnetSelection(subnet_type=ec2.SubnetType.PRIVATE_WITH_EGRESS),
            labels={SYSTEM_NODE_LABEL: "true"},
        )
        self.system_nodegroup.node.add_dependency(*self.node_prerequisites)
        for spec in ADDONS:
            if not spec.before_nodes:
                # CoreDNS and controllers stay degraded until a node can run them.
                self._add_addon(spec, props.kubernetes_version).node.add_dependency(self.system_nodegroup)
        self._acknowledge_findings()

    def _add_addon(self, spec: AddonSpec, kubernetes_version: str) -> eks.CfnAddon:
        associations = None
        if spec.service_account:
            role = pod_identity_role(
                self, f"{spec.name}-role", cluster=self.cluster, namespace=ADDON_NAMESPACE,
                service_account=spec.service_account, managed_policies=spec.managed_policies,
                why=f"is what AWS documents for the {spec.name} add-on, on its own Pod Identity role.",
            )
            associations = [eks.CfnAddon.PodIdentityAssociationProperty(
                role_arn=role.role_arn, service_account=spec.service_account
            )]
        return eks.CfnAddon(
            self,
            spec.name,
            addon_name=spec.name,
            addon_version=spec.versions[kubernetes_version].version,
            cluster_name=self.cluster.cluster_name,
            configuration_values=json.dumps(spec.configuration) if spec.configuration else None,
            pod_identity_associations=associations,
            # EKS bootstrapped self-managed vpc-cni/coredns/kube-proxy; the managed add-ons take them over.
            resolve_conflicts="OVERWRITE",
        )

    def _acknowledge_findings(self) -> None:
        acknowledge(
            self.cluster,
            managed_policy_rule("AmazonEKSClusterPolicy"),
            "The EKS service role needs exactly AmazonEKSClusterPolicy, which AWS maintains.",
        )
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
