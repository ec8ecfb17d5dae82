"""cdk-nag (AwsSolutions) acknowledgments: each names one finding and says why it stands.

They use CDK's own `Validations.of(...).acknowledge`, so the stacks need cdk-nag only when checked.
"""
from __future__ import annotations

from aws_cdk import Acknowledgment, Validations
from constructs import IConstruct


def acknowledge(scope: IConstruct, rule: str, reason: str) -> None:
    """Acknowledge one AwsSolutions finding (`rule` as cdk-nag prints it) on scope and its children."""
    Validations.of(scope).acknowledge(Acknowledgment(id=f"AwsSolutions::{rule}", reason=reason))


def managed_policy_rule(policy_name: str) -> str:
    """The IAM4 finding id for one AWS managed policy (`service-role/...` names included)."""
    return f"AwsSolutions-IAM4[Policy::arn:<AWS::Partition>:iam::aws:policy/{policy_name}]"


def acknowledge_managed_policies(scope: IConstruct, policies: tuple[str, ...], why: str) -> None:
    """One IAM4 acknowledgment per AWS managed policy; `why` completes "<policy> ..." into the reason."""
    for policy in policies:
        acknowledge(scope, managed_policy_rule(policy), f"{policy} {why}")
