"""The right to fence a hung GPU node: stop its EC2 instance, for the hung-node marker (k8s.mark_hung_nodes).

Kubernetes says to taint a node node.kubernetes.io/out-of-service only once it is shut down (Kubernetes docs,
"Node Shutdowns", "Non-graceful node shutdown handling"). A node whose kubelet is silent may still be running
and writing to FSx (its checkpoints, the event log, NCCL traces), where the pod's replacement writes too. The
marker stops the instance first and taints the node only once EC2 reports it stopped, so no old process can
write again. The role may stop only instances the GPU launch template tagged for this cluster.
"""
from __future__ import annotations

from aws_cdk import Stack, Token, aws_eks_v2 as eks, aws_iam as iam
from constructs import Construct

from infra.config import HUNG_NODE_MARKER_SERVICE_ACCOUNT, NAMESPACE
from infra.nag import acknowledge
from infra.pod_identity import pod_identity_role

# On every GPU instance (GpuNodegroup's launch template), its value the cluster's name: the condition that
# scopes ec2:StopInstances.
FENCE_TAG = "platform.training/fence"


class NodeFencing(Construct):
    """The marker's Pod Identity role and its association with the marker's service account."""

    role: iam.Role

    def __init__(self, scope: Construct, construct_id: str, *, cluster: eks.ICluster) -> None:
        super().__init__(scope, construct_id)
        self.role = pod_identity_role(
            self, "Role", cluster=cluster, namespace=NAMESPACE, service_account=HUNG_NODE_MARKER_SERVICE_ACCOUNT,
            managed_policies=(), why="")
        instances = Stack.of(self).format_arn(service="ec2", resource="instance", resource_name="*")
        # ec2:StopInstances takes the instance ARN and aws:ResourceTag/${TagKey}; ec2:DescribeInstances has no
        # resource-level permissions, only "*" (Service Authorization Reference, "Actions defined by Amazon EC2").
        self.role.add_to_policy(iam.PolicyStatement(
            actions=["ec2:StopInstances"], resources=[instances],
            conditions={"StringEquals": {f"aws:ResourceTag/{FENCE_TAG}": cluster.cluster_name}}))
        self.role.add_to_policy(iam.PolicyStatement(actions=["ec2:DescribeInstances"], resources=["*"]))
        eks.CfnPodIdentityAssociation(
            self, "Association", cluster_name=cluster.cluster_name, namespace=NAMESPACE,
            service_account=HUNG_NODE_MARKER_SERVICE_ACCOUNT, role_arn=self.role.role_arn)
        acknowledge(self.role, "AwsSolutions-IAM5[Resource::*]",
                    "ec2:DescribeInstances has no resource-level permissions; it reads the fenced instance's state.")
        stack = Stack.of(self)
        region, account = (value if not Token.is_unresolved(value) else f"<AWS::{name}>"  # as cdk-nag prints it
                           for value, name in ((stack.region, "Region"), (stack.account, "AccountId")))
        acknowledge(self.role, f"AwsSolutions-IAM5[Resource::arn:<AWS::Partition>:ec2:{region}:{account}:instance/*]",
                    f"ec2:StopInstances on instances tagged {FENCE_TAG} with this cluster's name only (condition).")
