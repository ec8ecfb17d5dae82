"""Synthesizes the platform offline, once per distinct config per session, and shares the result.

Every app is built the way app.py builds it: cdk.json's context (defaults and feature flags) under
the test's overrides, read through `PlatformConfig.from_cdk_context(app.node.get_all_context())`.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import pytest

os.environ.setdefault("JSII_SILENCE_WARNING_DEPRECATED_NODE_VERSION", "1")

import aws_cdk as cdk  # noqa: E402  (after the jsii env var)

from infra.config import PlatformConfig  # noqa: E402
from infra.platform import build_platform  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parents[2]
CDK_CONTEXT: dict[str, Any] = json.loads((REPO_ROOT / "cdk.json").read_text())["context"]
STACK_IDS = ("Network", "Storage", "Cluster")

IMAGE_URI = "123456789012.dkr.ecr.us-east-1.amazonaws.com/train:1.0"
ADMIN_ROLE_ARN = "arn:aws:iam::123456789012:role/Admin"
# Everything optional switched on; the image from a URI, since building one needs Docker. FSx takes no
# backups of a file system linked to S3, so the export bucket comes without them.
FULL = {"imageUri": IMAGE_URI, "adminRoleArn": ADMIN_ROLE_ARN, "fsxExportBucket": True, "fsxBackupRetentionDays": 0,
        "prometheusServer": True}
# The S3 import's association would overlap the export's (on /): a variant has it instead.
IMPORT = {"fsxExportBucket": False, "fsxImportS3Path": "s3://example-datasets/corpus/v1", "fsxImportFsxPath": "/datasets"}
# One synthesis per instance type; each also takes one capacity option so no config is synthesized twice.
VARIANTS = {
    "p5en": {"gpuInstanceType": "p5en.48xlarge", "capacityType": "capacity-reservation",
             "capacityReservationId": "cr-0123456789abcdef0", "placementGroupName": "p5en-odcr"},
    # Created before its block is active: 0 nodes (the EKS capacity-block flow).
    "p4d": {"gpuInstanceType": "p4d.24xlarge", "capacityType": "capacity-block",
            "capacityReservationId": "cr-0fedcba9876543210", "gpuNodesMin": 0, "gpuNodesDesired": 0},
    "g6": {"gpuInstanceType": "g6.xlarge", **IMPORT},
}


@dataclass(frozen=True)
class Synth:
    config: PlatformConfig
    outdir: Path = field(repr=False)
    templates: dict[str, dict[str, Any]] = field(repr=False)  # stack id -> template
    warnings: dict[str, list[str]] = field(repr=False, default_factory=dict)  # stack id -> synth warnings
    missing_context: list[str] = field(repr=False, default_factory=list)  # lookups `cdk synth` would need AWS for

    def resources(self, stack: str, resource_type: str) -> dict[str, dict[str, Any]]:
        return {k: v for k, v in self.templates[stack]["Resources"].items() if v["Type"] == resource_type}

    def one(self, stack: str, resource_type: str) -> dict[str, Any]:
        found = list(self.resources(stack, resource_type).values())
        assert len(found) == 1, f"expected one {resource_type} in {stack}, found {len(found)}"
        return found[0]["Properties"]

    def nodegroup(self, ami_type: str) -> dict[str, Any]:
        """Properties of the one node group of this AMI type (system: AL2023_x86_64_STANDARD)."""
        [group] = [g["Properties"] for g in self.resources("Cluster", "AWS::EKS::Nodegroup").values()
                   if g["Properties"]["AmiType"] == ami_type]
        return group

    def launch_template(self, nodegroup: dict[str, Any]) -> dict[str, Any]:
        """LaunchTemplateData of the template a node group starts from, at its latest version."""
        logical_id = nodegroup["LaunchTemplate"]["Id"]["Ref"]
        assert nodegroup["LaunchTemplate"]["Version"] == {"Fn::GetAtt": [logical_id, "LatestVersionNumber"]}
        template = self.templates["Cluster"]["Resources"][logical_id]
        assert template["Type"] == "AWS::EC2::LaunchTemplate"
        return template["Properties"]["LaunchTemplateData"]

    def security_group(self, stack: str, description_word: str) -> str:
        """Logical id of the one security group whose description holds the word."""
        [logical_id] = [k for k, v in self.resources(stack, "AWS::EC2::SecurityGroup").items()
                        if description_word in v["Properties"]["GroupDescription"]]
        return logical_id

    def gpu_subnet(self) -> str:
        """Logical id of the private subnet in the GPU zone."""
        [logical_id] = [k for k, v in self.resources("Network", "AWS::EC2::Subnet").items()
                        if v["Properties"]["AvailabilityZone"] == self.config.gpu_availability_zone
                        and not v["Properties"]["MapPublicIpOnLaunch"]]
        return logical_id

    def imported(self, stack: str, value: Any) -> dict[str, str]:
        """How another stack refers to `value` of `stack`: Fn::ImportValue of the export CDK made."""
        [name] = [o["Export"]["Name"] for o in self.templates[stack].get("Outputs", {}).values()
                  if "Export" in o and o["Value"] == value]
        return {"Fn::ImportValue": name}

    def outputs(self) -> dict[str, Any]:
        """The platform's outputs by key over all stacks, as the k8s layer reads cdk-outputs.json
        (CDK's own cross-stack ExportsOutput* left out). A key in two stacks fails here."""
        merged: dict[str, Any] = {}
        for template in self.templates.values():
            for key, output in template.get("Outputs", {}).items():
                if not key.startswith("ExportsOutput"):
                    assert key not in merged, f"output {key} in two stacks"
                    merged[key] = output["Value"]
        return merged


def make_app(outdir: Path, overrides: dict[str, Any]) -> tuple[cdk.App, PlatformConfig]:
    app = cdk.App(outdir=str(outdir), context={**CDK_CONTEXT, **overrides})
    return app, PlatformConfig.from_cdk_context(app.node.get_all_context())


def _stack_metadata(outdir: Path, artifact: dict[str, Any]) -> list[list[dict[str, Any]]]:
    """A stack's metadata entries, inline in manifest.json or in the file it names."""
    metadata = dict(artifact.get("metadata", {}))
    if "additionalMetadataFile" in artifact:
        metadata |= json.loads((outdir / artifact["additionalMetadataFile"]).read_text())
    return list(metadata.values())


def _synthesize(outdir: Path, overrides: dict[str, Any]) -> Synth:
    app, config = make_app(outdir, overrides)
    build_platform(app, config)
    assembly = app.synth()
    templates = {stack_id: assembly.get_stack_artifact(stack_id).template for stack_id in STACK_IDS}
    # The cloud assembly's manifest as the CLI reads it (jsii cannot hand its artifacts' metadata over).
    manifest = json.loads((outdir / "manifest.json").read_text())
    warnings = {stack_id: [str(entry["data"]) for entries in _stack_metadata(outdir, manifest["artifacts"][stack_id])
                           for entry in entries if entry["type"] == "aws:cdk:warning"]
                for stack_id in STACK_IDS}
    missing = [m["key"] for m in manifest.get("missing", [])]
    return Synth(config=config, outdir=outdir, templates=templates, warnings=warnings, missing_context=missing)


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist reads the groups
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Every test of this directory in one xdist group (make test's --dist loadgroup): a session fixture is one
    per worker, so on one worker each config is synthesized once and jsii's Node.js runtime starts once."""
    here = Path(__file__).parent
    for item in items:
        if here in item.path.parents:
            item.add_marker(pytest.mark.xdist_group("infra"))


@pytest.fixture(scope="session")
def synth(tmp_path_factory: pytest.TempPathFactory) -> Callable[[dict[str, Any]], Synth]:
    """synth(overrides) -> Synth; the same overrides are synthesized once per session."""
    cache: dict[str, Synth] = {}

    def run(overrides: dict[str, Any]) -> Synth:
        key = json.dumps(overrides, sort_keys=True)
        if key not in cache:
            cache[key] = _synthesize(tmp_path_factory.mktemp("cdk"), overrides)
        return cache[key]

    return run


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return REPO_ROOT


@pytest.fixture(scope="session", name="make_app")
def make_app_fixture():
    """make_app(outdir, overrides) -> (app, config), for tests that need their own app."""
    return make_app


@pytest.fixture(scope="session")
def full(synth) -> Synth:
    return synth(FULL)


@pytest.fixture(scope="session")
def defaults(synth) -> Synth:
    """cdk.json exactly as shipped: the image is built from training/Dockerfile as an asset."""
    return synth({})


@pytest.fixture(scope="session", params=sorted(VARIANTS))
def variant(request, synth) -> Synth:
    return synth({**FULL, **VARIANTS[request.param]})


@pytest.fixture(scope="session")
def with_account(synth) -> Synth:
    """Account-specific stacks (the account, and the admin role it requires), API open to one network."""
    return synth({**FULL, "account": "123456789012", "apiAllowedCidrs": ["203.0.113.0/24"]})


@pytest.fixture(scope="session")
def kubernetes_133(synth) -> Synth:
    return synth({**FULL, "kubernetesVersion": "1.33"})


@pytest.fixture(scope="session")
def g6(synth) -> Synth:
    return synth({**FULL, **VARIANTS["g6"]})
