"""PlatformConfig: bad values fail before synthesis, naming the key, the value and what is allowed."""
from __future__ import annotations

import dataclasses
import json
import re
import typing

import pytest

from infra.cluster import KUBECTL_LAYERS
from infra.config import KUBERNETES_VERSIONS, ConfigError, PlatformConfig


@pytest.mark.parametrize(
    ("overrides", "named"),
    [
        pytest.param({"gpuInstanceType": "p3.2xlarge"}, ["gpuInstanceType", "p3.2xlarge", "p5.48xlarge"], id="unknown-instance-type"),
        pytest.param({"fsxStorageGib": 1800}, ["fsxStorageGib", "1800", "1200 or a multiple of 2400"], id="fsx-capacity-1800"),
        pytest.param({"fsxStorageGib": 3600}, ["fsxStorageGib", "3600", "1200 or a multiple of 2400"], id="fsx-capacity-3600"),
        pytest.param({"fsxStorageGib": 0}, ["fsxStorageGib", "0"], id="fsx-capacity-zero"),
        pytest.param({"fsxThroughputPerTib": 200}, ["fsxThroughputPerTib", "200", "[125, 250, 500, 1000]"], id="fsx-throughput"),
        pytest.param({"fsxRemovalPolicy": "snapshot"}, ["fsxRemovalPolicy", "snapshot", "['retain', 'destroy']"], id="fsx-removal-snapshot"),
        pytest.param({"fsxBackupRetentionDays": 91}, ["fsxBackupRetentionDays", "91", "0 to 90 days"], id="fsx-backups-91-days"),
        pytest.param({"fsxBackupRetentionDays": -1}, ["fsxBackupRetentionDays", "-1", "0 to 90 days"], id="fsx-backups-negative"),
        pytest.param({"fsxExportBucket": True}, ["fsxBackupRetentionDays", "7", "0 with fsxExportBucket=true"], id="fsx-backups-with-s3-link"),
        pytest.param({"fsxImportS3Path": "bucket/prefix", "fsxBackupRetentionDays": 0},
                     ["fsxImportS3Path", "bucket/prefix", "s3://bucket/prefix"], id="s3-import-no-scheme"),
        pytest.param({"fsxImportS3Path": "s3://Upper_Case/x", "fsxBackupRetentionDays": 0},
                     ["fsxImportS3Path", "s3://Upper_Case/x", "bucket name rules"], id="s3-import-bad-bucket"),
        pytest.param({"fsxImportS3Path": "s3://datasets/x", "fsxExportBucket": True, "fsxBackupRetentionDays": 0},
                     ["fsxImportS3Path", "fsxExportBucket=true", "cannot overlap"], id="s3-import-with-export"),
        pytest.param({"fsxImportS3Path": "s3://datasets/x"},
                     ["fsxBackupRetentionDays", "7", "0 with fsxImportS3Path set"], id="s3-import-with-backups"),
        pytest.param({"fsxImportFsxPath": "/"}, ["fsxImportFsxPath", "'/'", "other than /"], id="fsx-import-root"),
        pytest.param({"fsxImportFsxPath": "datasets"}, ["fsxImportFsxPath", "datasets", "absolute"], id="fsx-import-relative"),
        pytest.param({"fsxImportFsxPath": "/a/../b"}, ["fsxImportFsxPath", "/a/../b"], id="fsx-import-dotdot"),
        pytest.param({"fsxBackupStartTime": "24:00"}, ["fsxBackupStartTime", "24:00", "HH:MM"], id="fsx-backup-time-24h"),
        pytest.param({"fsxBackupStartTime": "3:00"}, ["fsxBackupStartTime", "3:00", "HH:MM"], id="fsx-backup-time-unpadded"),
        pytest.param({"gpuNodesMin": 3, "gpuNodesDesired": 2}, ["gpuNodesMin=3", "gpuNodesDesired=2"], id="min-above-desired"),
        pytest.param({"gpuNodesDesired": 5, "gpuNodesMax": 4}, ["gpuNodesDesired=5", "gpuNodesMax=4"], id="desired-above-max"),
        pytest.param({"gpuNodesMin": 0, "gpuNodesDesired": 0}, ["gpuNodesMin", "0", "at least 1"], id="zero-gpu-nodes"),
        pytest.param({"gpuNodesSpare": -1}, ["gpuNodesSpare=-1", "0 or more"], id="negative-spares"),
        pytest.param({"gpuNodesSpare": 3}, ["gpuNodesSpare=3", "gpuNodesDesired + gpuNodesSpare = 5", "gpuNodesMax=4",
                                            "at most 2"], id="spares-above-max"),
        pytest.param({"systemNodes": 0}, ["systemNodes", "0", "at least 1"], id="zero-system-nodes"),
        pytest.param({"logRetentionDays": 100}, ["logRetentionDays", "100", "[1, 3, 5,", "3653]"], id="log-retention-100"),
        pytest.param({"logRetentionDays": 0}, ["logRetentionDays", "0", "CloudWatch"], id="log-retention-forever"),
        pytest.param({"apiAllowedCidrs": ["10.0.0.0/33"]}, ["apiAllowedCidrs", "10.0.0.0/33", "CIDR"], id="cidr-bad-mask"),
        pytest.param({"apiAllowedCidrs": ["10.0.0.1/24"]}, ["apiAllowedCidrs", "10.0.0.1/24", "host bits"], id="cidr-host-bits"),
        pytest.param({"apiAllowedCidrs": "not-a-cidr"}, ["apiAllowedCidrs", "not-a-cidr"], id="cidr-garbage"),
        pytest.param({"adminRoleArn": "arn:aws:iam::1234:role/Admin"}, ["adminRoleArn", "arn:aws:iam::1234:role/Admin", "IAM role ARN"], id="arn-short-account"),
        pytest.param({"adminRoleArn": "arn:aws:iam::123456789012:user/bob"}, ["adminRoleArn", "user/bob"], id="arn-not-a-role"),
        pytest.param(
            {"capacityType": "capacity-reservation", "capacityReservationId": "cr-xyz"},
            ["capacityReservationId", "cr-xyz", "cr-0123456789abcdef0"],
            id="reservation-id-malformed",
        ),
        pytest.param({"capacityType": "capacity-block"}, ["capacityReservationId", "None"], id="reservation-id-missing"),
        pytest.param({"capacityReservationId": "cr-0123456789abcdef0"}, ["capacityReservationId", "only with"], id="reservation-id-on-demand"),
        pytest.param({"capacityType": "spot"}, ["capacityType", "spot", "on-demand"], id="capacity-type"),
        pytest.param({"gpuAvailabilityZone": "us-east-1c"}, ["gpuAvailabilityZone", "us-east-1c"], id="gpu-zone-not-listed"),
        pytest.param({"kubernetesVersion": "1.29"}, ["kubernetesVersion", "1.29", "1.36"], id="kubernetes-version"),
        pytest.param({"gpuNodesMax": "four"}, ["gpuNodesMax", "four", "whole number"], id="not-a-number"),
        pytest.param({"imageUri": "train:latest"}, ["imageUri", "train:latest"], id="image-uri-not-a-registry-path"),
        pytest.param({"placementGroupName": "odcr-pg"}, ["placementGroupName", "odcr-pg", "capacity-reservation"],
                     id="placement-group-on-demand"),
        pytest.param({"capacityType": "capacity-reservation", "capacityReservationId": "cr-0123456789abcdef0",
                      "placementGroupName": "bad name"}, ["placementGroupName", "bad name"], id="placement-group-name"),
        pytest.param({"gpuNodesDesired": 0}, ["gpuNodesDesired", "0 only with capacityType=capacity-block"],
                     id="zero-nodes-on-demand"),
        pytest.param({"capacityType": "capacity-block", "capacityReservationId": "cr-0123456789abcdef0",
                      "gpuNodesMin": 0, "gpuNodesDesired": 0, "gpuNodesSpare": 1},
                     ["gpuNodesSpare=1", "gpuNodesDesired=0"], id="spare-before-the-block"),
        pytest.param({"account": "123456789012"}, ["adminRoleArn", "account=123456789012", "Unauthorized"],
                     id="account-without-admin-role"),
    ],
)
def test_bad_value_is_rejected_naming_key_value_and_allowed(overrides, named):
    with pytest.raises(ConfigError) as error:
        PlatformConfig.from_context(overrides)
    for text in named:
        assert text in str(error.value)


# context key -> allowed values, for every field whose type is a Literal
CLOSED_SETS = {PlatformConfig.context_key(f.name): typing.get_args(hint) for f in dataclasses.fields(PlatformConfig)
               if typing.get_origin(hint := typing.get_type_hints(PlatformConfig)[f.name]) is typing.Literal}


def test_every_closed_set_is_a_literal_type():
    assert {"kubernetesVersion", "gpuInstanceType", "capacityType", "fsxThroughputPerTib", "fsxRemovalPolicy",
            "logRetentionDays"} <= set(CLOSED_SETS)


@pytest.mark.parametrize(("key", "allowed"), CLOSED_SETS.items(), ids=list(CLOSED_SETS))
def test_a_closed_set_refuses_a_value_outside_it(key, allowed):
    outside = max(allowed) + 1 if isinstance(allowed[0], int) else "not-a-choice"
    with pytest.raises(ConfigError) as error:
        PlatformConfig.from_context({key: outside})
    assert f"{key}={outside!r} is not allowed: one of {list(allowed)}" in str(error.value)


def test_unknown_key_is_rejected_with_the_allowed_keys():
    with pytest.raises(ConfigError, match=r"unknown config key\(s\) \['gpuNodeCount'\].*gpuNodesDesired"):
        PlatformConfig.from_context({"gpuNodeCount": 3})


def test_unknown_camel_case_cdk_context_key_is_rejected_cdk_keys_pass():
    """`cdk synth -c gpuNodeMin=3` must not synthesize with the default; CDK's own keys are not ours to judge."""
    cdk_keys = {"@aws-cdk/core:defaultCrossStackReferences": "strong", "aws:cdk:enable-path-metadata": True,
                "aws-cdk:enableDiffNoFail": "true", "availability-zones:account=1:region=us-east-1": ["a"]}
    assert PlatformConfig.from_cdk_context({**cdk_keys, "gpuNodesMax": "5"}).gpu_nodes_max == 5
    with pytest.raises(ConfigError, match=r"unknown config key\(s\) \['gpuNodeMin'\].*'gpuNodesMin'"):
        PlatformConfig.from_cdk_context({**cdk_keys, "gpuNodeMin": "3"})


def test_capacity_block_group_may_wait_at_zero_nodes():
    config = PlatformConfig.from_context({"capacityType": "capacity-block", "capacityReservationId": "cr-0123456789abcdef0",
                                          "gpuNodesMin": "0", "gpuNodesDesired": "0"})
    assert (config.gpu_nodes_min, config.gpu_nodes_desired, config.spare_nodes, config.gpu_nodes_running) == (0, 0, 0, 0)


def test_command_line_strings_are_converted():
    """`cdk synth -c gpuNodesMax=8 -c fsxExportBucket=true -c fsxBackupRetentionDays=0 -c apiAllowedCidrs=a,b`
    arrive as strings."""
    config = PlatformConfig.from_context(
        {"gpuNodesMax": "8", "fsxExportBucket": "true", "fsxBackupRetentionDays": "0",
         "apiAllowedCidrs": "203.0.113.0/24,198.51.100.0/24"}
    )
    assert config.gpu_nodes_max == 8
    assert config.fsx_export_bucket is True
    assert config.fsx_backup_retention_days == 0
    assert config.api_allowed_cidrs == ("203.0.113.0/24", "198.51.100.0/24")


@pytest.mark.parametrize(("overrides", "spares"), [
    pytest.param({}, 1, id="default-one-where-max-leaves-room"),
    pytest.param({"gpuNodesDesired": 4}, 0, id="default-none-at-max"),
    pytest.param({"gpuNodesSpare": 0}, 0, id="explicit-none"),
    pytest.param({"gpuNodesSpare": "2"}, 2, id="explicit-fills-max-from-the-command-line"),
])
def test_hot_spares_run_beside_the_training_nodes(overrides, spares):
    config = PlatformConfig.from_context(overrides)
    assert config.spare_nodes == spares
    assert config.gpu_nodes_running == config.gpu_nodes_desired + spares <= config.gpu_nodes_max


def test_cdk_json_context_holds_every_key_with_its_default(repo_root):
    context = json.loads((repo_root / "cdk.json").read_text())["context"]
    platform_keys = {k: v for k, v in context.items() if not k.startswith("@")}
    assert platform_keys == PlatformConfig().to_context()


def test_cdk_json_runs_app_py_with_the_project_venv(repo_root):
    assert json.loads((repo_root / "cdk.json").read_text())["app"] == ".venv/bin/python app.py"


def test_every_allowed_kubernetes_version_has_a_kubectl_layer():
    """kubectl v34 serves 1.33-1.35 control planes, kubectl v36 1.35-1.37; 1.32 is out of both."""
    assert set(KUBECTL_LAYERS) == set(KUBERNETES_VERSIONS)
    with pytest.raises(ConfigError, match=re.escape("kubernetesVersion='1.32' is not allowed") + ".*1.33.*1.36"):
        PlatformConfig(kubernetes_version="1.32")


def test_the_default_kubernetes_version_is_in_eks_standard_support_and_older_ones_stay_selectable():
    """EKS release calendar: 1.34 left standard support on 2026-12-02 (1.33 on 2026-07-29); a new cluster on
    either pays extended support from its first hour."""
    assert PlatformConfig().kubernetes_version == "1.36"
    assert PlatformConfig.from_context({"kubernetesVersion": "1.34"}).kubernetes_version == "1.34"
    with pytest.raises(ConfigError, match="1.33 and 1.34 are in EKS extended support"):
        PlatformConfig.from_context({"kubernetesVersion": "1.31"})
