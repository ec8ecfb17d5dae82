"""A stack's CloudWatch log groups: encrypted with one customer-managed key, kept for the configured days.

Every Lambda function of the stack (aws-cdk-lib's kubectl provider, its provider framework, the custom
resource that empties the VPC's default security group) logs to a group of the archive instead of the
`/aws/lambda/<name>` group Lambda would create unencrypted and kept forever.
"""
from __future__ import annotations

from dataclasses import dataclass

from aws_cdk import Aspects, CfnResource, IAspect, Names, RemovalPolicy, Stack, aws_iam as iam, aws_kms as kms, aws_logs as logs
from constructs import Construct, IConstruct
from jsii import implements


@dataclass(frozen=True)
class LogArchiveProps:
    retention_days: int  # one of infra.config.LOG_RETENTION_DAYS, the values CloudWatch Logs takes


class LogArchive(Construct):
    """The key, the groups made with `log_group`, and a log group for every Lambda function of the stack."""

    key: kms.Key

    def __init__(self, scope: Construct, construct_id: str, props: LogArchiveProps) -> None:
        super().__init__(scope, construct_id)
        self._retention_days = props.retention_days
        stack = Stack.of(self)
        self.key = kms.Key(
            self,
            "Key",
            description=f"CloudWatch Logs of {stack.stack_name}",
            enable_key_rotation=True,
            removal_policy=RemovalPolicy.RETAIN,  # retained groups stay readable
        )
        # CloudWatch Logs uses the key for this account's log groups in this region only (CloudWatch Logs
        # user guide, "Encrypt log data in CloudWatch Logs using AWS KMS").
        self.key.add_to_resource_policy(
            iam.PolicyStatement(
                principals=[iam.ServicePrincipal(f"logs.{stack.region}.amazonaws.com")],
                actions=["kms:Encrypt*", "kms:Decrypt*", "kms:ReEncrypt*", "kms:GenerateDataKey*", "kms:Describe*"],
                resources=["*"],
                conditions={
                    "ArnLike": {
                        "kms:EncryptionContext:aws:logs:arn":
                            f"arn:{stack.partition}:logs:{stack.region}:{stack.account}:log-group:*"
                    }
                },
            )
        )
        Aspects.of(stack).add(_LambdaLogGroups(self))

    def log_group(self, scope: Construct, construct_id: str, *, name: str | None = None,
                  removal_policy: RemovalPolicy = RemovalPolicy.RETAIN) -> logs.LogGroup:
        group = logs.LogGroup(
            scope, construct_id, log_group_name=name, encryption_key=self.key, removal_policy=removal_policy
        )
        # The L2 takes retention as an enum whose Python values are names; the config holds the day count.
        cfn = group.node.default_child
        assert isinstance(cfn, logs.CfnLogGroup)
        cfn.retention_in_days = self._retention_days
        return group


_LAMBDA_FUNCTION = "AWS::Lambda::Function"


@implements(IAspect)
class _LambdaLogGroups:
    """Points each Lambda function (L1 or L2, ours or aws-cdk-lib's) at a log group of the archive."""

    def __init__(self, archive: LogArchive) -> None:
        self._archive = archive

    def visit(self, node: IConstruct) -> None:
        if not (isinstance(node, CfnResource) and node.cfn_resource_type == _LAMBDA_FUNCTION):
            return
        group = self._archive.log_group(self._archive, f"Lambda{Names.unique_id(node)}")
        node.add_property_override("LoggingConfig.LogGroup", group.log_group_name)
