"""Log groups (VPC flow logs, EKS control plane, every Lambda function's): retention and a customer-managed key."""
from __future__ import annotations

import pytest

STACK_IDS = ("Network", "Storage", "Cluster")


def _log_groups(synth) -> dict[tuple[str, str], dict]:
    return {(stack, logical_id): resource
            for stack in STACK_IDS for logical_id, resource in synth.resources(stack, "AWS::Logs::LogGroup").items()}


def test_every_log_group_is_kept_for_the_configured_days_and_encrypted_with_its_stacks_key(full):
    groups = _log_groups(full)
    assert {stack for stack, _ in groups} == {"Network", "Cluster"}
    for (stack, logical_id), group in groups.items():
        properties = group["Properties"]
        assert properties["RetentionInDays"] == full.config.log_retention_days == 90, logical_id
        key_id = properties["KmsKeyId"]["Fn::GetAtt"][0]
        key = full.templates[stack]["Resources"][key_id]
        assert key["Type"] == "AWS::KMS::Key" and key["Properties"]["EnableKeyRotation"] is True
        # CloudWatch Logs of this region may use the key, for this account's log groups only.
        [logs_statement] = [s for s in key["Properties"]["KeyPolicy"]["Statement"]
                            if s["Principal"] == {"Service": f"logs.{full.config.region}.amazonaws.com"}]
        assert "kms:GenerateDataKey*" in logs_statement["Action"]
        condition = logs_statement["Condition"]["ArnLike"]["kms:EncryptionContext:aws:logs:arn"]
        assert condition["Fn::Join"][1][-1] == ":log-group:*"
        assert key["DeletionPolicy"] == "Retain"  # retained groups stay readable


def test_retention_follows_the_config(synth):
    weekly = synth({"logRetentionDays": 7})
    assert {g["Properties"]["RetentionInDays"] for g in _log_groups(weekly).values()} == {7}


def test_flow_logs_go_to_an_encrypted_group(full):
    flow_log = full.one("Network", "AWS::EC2::FlowLog")
    group_id = flow_log["LogGroupName"]["Ref"]
    assert "KmsKeyId" in full.templates["Network"]["Resources"][group_id]["Properties"]


def test_control_plane_log_group_exists_before_the_cluster(full):
    """EKS would otherwise create /aws/eks/<cluster>/cluster itself: unencrypted and kept forever."""
    [(cluster_id, cluster)] = full.resources("Cluster", "AWS::EKS::Cluster").items()
    [(group_id, group)] = [(k, g) for (stack, k), g in _log_groups(full).items()
                           if g["Properties"].get("LogGroupName") == f"/aws/eks/{full.config.cluster_name}/cluster"]
    assert group_id in cluster["DependsOn"]
    # It goes with the stack: a kept group of this fixed name would block creating the stack again.
    assert group["DeletionPolicy"] == "Delete"


@pytest.mark.parametrize("stack", STACK_IDS)
def test_every_lambda_function_logs_to_a_group_of_its_stack(full, stack):
    """The kubectl provider, its provider framework and the default security group's custom resource."""
    functions = full.resources(stack, "AWS::Lambda::Function")
    if stack != "Storage":
        assert functions
    groups = {logical_id for (group_stack, logical_id) in _log_groups(full) if group_stack == stack}
    for logical_id, function in functions.items():
        assert function["Properties"]["LoggingConfig"]["LogGroup"]["Ref"] in groups, logical_id
