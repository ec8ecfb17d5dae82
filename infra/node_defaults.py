"""What every node group shares: a node role without the VPC CNI's policy, IMDSv2 with hop limit 1, and an
encrypted gp3 root volume, in the node group's own launch template."""
from __future__ import annotations

from aws_cdk import aws_ec2 as ec2, aws_iam as iam
from constructs import Construct

from infra.nag import acknowledge_managed_policies

# kubelet's calls and image pulls. AmazonEKS_CNI_Policy, which EKS's default node role also carries, is
# on the aws-node service account's Pod Identity role instead (infra.cluster): on the node role any
# process on the node, a hostNetwork pod included, could attach network interfaces and move IP addresses.
NODE_ROLE_POLICIES = ("AmazonEKSWorkerNodePolicy", "AmazonEC2ContainerRegistryReadOnly")

# IMDSv2 only, one hop: the node's own processes and hostNetwork pods (aws-node, kube-proxy, the Pod
# Identity agent, the FSx CSI node plugin, the node monitoring agent) reach IMDS; a pod on the pod network
# is one hop further and cannot take the node role's credentials. Pods get AWS credentials from Pod Identity.
IMDS_V2_ONE_HOP = ec2.CfnLaunchTemplate.MetadataOptionsProperty(
    http_tokens="required", http_endpoint="enabled", http_put_response_hop_limit=1
)


def node_role(scope: Construct, construct_id: str) -> iam.Role:
    role = iam.Role(
        scope,
        construct_id,
        assumed_by=iam.ServicePrincipal("ec2.amazonaws.com"),
        managed_policies=[iam.ManagedPolicy.from_aws_managed_policy_name(name) for name in NODE_ROLE_POLICIES],
    )
    acknowledge_managed_policies(
        role, NODE_ROLE_POLICIES, "is what EKS documents for a managed node group's role; AWS keeps it in step "
        "with what kubelet and image pulls call."
    )
    return role


def encrypted_root_volume(gib: int) -> ec2.CfnLaunchTemplate.BlockDeviceMappingProperty:
    return ec2.CfnLaunchTemplate.BlockDeviceMappingProperty(
        device_name="/dev/xvda",  # the AL2023 EKS AMIs' root device
        ebs=ec2.CfnLaunchTemplate.EbsProperty(
            volume_size=gib, volume_type="gp3", encrypted=True, delete_on_termination=True
        ),
    )
