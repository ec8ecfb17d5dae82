"""IAM roles for EKS Pod Identity, assumable only by the Pod Identity service acting for this cluster."""
from __future__ import annotations

from aws_cdk import Stack, aws_eks_v2 as eks, aws_iam as iam
from constructs import Construct

from infra.nag import acknowledge_managed_policies

POD_IDENTITY_PRINCIPAL = "pods.eks.amazonaws.com"


def pod_identity_role(scope: Construct, construct_id: str, *, cluster: eks.ICluster,
                      managed_policies: tuple[str, ...], why: str) -> iam.Role:
    """A role that the Pod Identity agent may assume (and tag the session of) for `cluster` alone: without the
    aws:SourceAccount / aws:SourceArn conditions, a Pod Identity association in any cluster of any account
    that names the role would get its credentials (confused deputy; EKS user guide, "Create the Pod Identity
    trust policy"). `why` completes "<policy> ..." into each managed policy's cdk-nag acknowledgment."""
    principal = iam.ServicePrincipal(POD_IDENTITY_PRINCIPAL).with_conditions({
        "StringEquals": {"aws:SourceAccount": Stack.of(scope).account},
        "ArnEquals": {"aws:SourceArn": cluster.cluster_arn},
    })
    role = iam.Role(
        scope,
        construct_id,
        assumed_by=iam.SessionTagsPrincipal(principal),  # sts:AssumeRole and sts:TagSession, as Pod Identity needs
        managed_policies=[iam.ManagedPolicy.from_aws_managed_policy_name(name) for name in managed_policies],
    )
    acknowledge_managed_policies(role, managed_policies, why)
    return role
