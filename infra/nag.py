"""cdk-nag (AwsSolutions) acknowledgments: each names one finding and says why it stands.

They use CDK's own `Validations.of(...).acknowledge`, so the stacks need cdk-nag only when checked.
"""
from __future__ import annotations

from aws_cdk import Acknowledgment, Validations
from constructs import IConstruct

# What EKS documents for managed node groups' node role.
NODE_ROLE_POLICIES = ("AmazonEKSWorkerNodePolicy", "AmazonEKS_CNI_Policy", "AmazonEC2ContainerRegistryReadOnly")


def acknowledge(scope: IConstruct, rule: str, reason: str) -> None:
    """Acknowledge one AwsSolutions finding (`rule` as cdk-nag prints it) on scope and its children."""
    Validations.of(scope).acknowledge(Acknowledgment(id=f"AwsSolutions::{rule}", reason=reason))


def managed_policy_rule(policy_name: str) -> str:
    """The IAM4 finding id for one AWS managed policy (`service-role/...` names included)."""
    return f"AwsSolutions-IAM4[Policy::arn:<AWS::Partition>:iam::aws:policy/{policy_name}]"


def acknowledge_node_role(role: IConstruct) -> None:
    for policy in NODE_ROLE_POLICIES:
        acknowledge(
            role,
            managed_policy_rule(policy),
            f"{policy} is what EKS requires on a managed node group's role; AWS keeps it in step with "
            "what kubelet, the VPC CNI and image pulls call.",
        )
