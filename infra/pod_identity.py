"""IAM roles for EKS Pod Identity, each assumable only for one service account of one cluster."""
from __future__ import annotations

from aws_cdk import aws_eks_v2 as eks, aws_iam as iam
from constructs import Construct

from infra.nag import acknowledge_managed_policies

POD_IDENTITY_PRINCIPAL = "pods.eks.amazonaws.com"
# The session tags Pod Identity sets when it assumes a role for a pod (EKS user guide, "Create IAM role with
# trust policy required by EKS Pod Identity" and "Grant Pods access to AWS resources based on tags": eks-cluster-arn,
# eks-cluster-name, kubernetes-namespace, kubernetes-service-account, kubernetes-pod-name, kubernetes-pod-uid).
CLUSTER_ARN_TAG = "aws:RequestTag/eks-cluster-arn"
NAMESPACE_TAG = "aws:RequestTag/kubernetes-namespace"
SERVICE_ACCOUNT_TAG = "aws:RequestTag/kubernetes-service-account"


def pod_identity_role(scope: Construct, construct_id: str, *, cluster: eks.ICluster, namespace: str,
                      service_account: str, managed_policies: tuple[str, ...], why: str) -> iam.Role:
    """A role that Pod Identity may assume (and tag the session of) for `namespace`/`service_account` of
    `cluster` alone: without conditions, a Pod Identity association in any cluster that names the role
    would get its credentials. The user guide scopes such roles by the session tags above,
    which Pod Identity always sets (they are on unless an association disables them; none here does).
    No aws:SourceAccount or aws:SourceArn: that user guide page conditions on the session tags alone and
    names no other key Pod Identity sets, and a condition on a key that is absent denies every pod (aws-node
    would get no credentials, no node would become Ready). The cluster ARN tag already pins the account,
    region and cluster.
    `why` completes "<policy> ..." into each managed policy's cdk-nag acknowledgment."""
    principal = iam.ServicePrincipal(POD_IDENTITY_PRINCIPAL).with_conditions({
        "StringEquals": {
            CLUSTER_ARN_TAG: cluster.cluster_arn,
            NAMESPACE_TAG: namespace,
            SERVICE_ACCOUNT_TAG: service_account,
        },
    })
    role = iam.Role(
        scope,
        construct_id,
        assumed_by=iam.SessionTagsPrincipal(principal),  # sts:AssumeRole and sts:TagSession, as Pod Identity needs
        managed_policies=[iam.ManagedPolicy.from_aws_managed_policy_name(name) for name in managed_policies],
    )
    acknowledge_managed_policies(role, managed_policies, why)
    return role
