"""What the deployed infrastructure tells the charts: `cdk deploy --outputs-file cdk-outputs.json`.

The file is {"StackName": {"OutputKey": value}}. Keys are looked up across all stacks, so the
charts do not care which stack owns which output. Without the file (offline, before the first
deploy) the charts use the shared constants of infra.config and a clearly invalid image name.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from infra.config import NAMESPACE, PVC_NAME, PlatformConfig

# The outputs the charts need; infra also writes UpdateKubeconfigCommand and the FSx ids.
REQUIRED_KEYS = ("ClusterName", "Namespace", "PvcName", "ImageUri")
# `.invalid` is a reserved TLD (RFC 2606): a pull fails loudly instead of fetching something else.
PLACEHOLDER_IMAGE = "placeholder.invalid/ft-training:set-imageUri-or-run-cdk-deploy"


class OutputsError(ValueError):
    """cdk-outputs.json is unreadable, lacks a key, or two stacks disagree on one."""


@dataclass(frozen=True)
class InfraOutputs:
    cluster_name: str
    namespace: str
    pvc_name: str
    image_uri: str
    source: str  # the outputs file, or a sentence saying what stood in for it


def read_stack_outputs(path: Path) -> dict[str, str]:
    """Flatten {"Stack": {"Key": value}} into {"Key": value}; a key with two values is an error."""
    try:
        stacks = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise OutputsError(f"{path}: not valid JSON: {err}") from None
    if not isinstance(stacks, dict) or not all(isinstance(v, dict) for v in stacks.values()):
        raise OutputsError(f"{path}: expected {{\"StackName\": {{\"OutputKey\": value}}}}")
    flat: dict[str, str] = {}
    for stack, outputs in stacks.items():
        for key, value in outputs.items():
            if key in flat and flat[key] != value:
                raise OutputsError(f"{path}: output {key} differs between stacks "
                                   f"({flat[key]!r}, then {value!r} in {stack})")
            flat[key] = value
    return flat


def load_infra_outputs(platform: PlatformConfig, path: Path) -> InfraOutputs:
    """The deployed names from `path` when it exists, else the platform's own names."""
    if not path.exists():
        image = platform.image_uri or PLACEHOLDER_IMAGE
        return InfraOutputs(platform.cluster_name, NAMESPACE, PVC_NAME, image,
                            source=f"{path} not found: placeholders (namespace, PVC from infra.config; image {image})")
    outputs = read_stack_outputs(path)
    missing = [key for key in REQUIRED_KEYS if not outputs.get(key)]
    if missing:
        raise OutputsError(f"{path}: missing output(s) {missing}; found {sorted(outputs)}. "
                           "Was it written by `cdk deploy --all --outputs-file cdk-outputs.json`?")
    return InfraOutputs(outputs["ClusterName"], outputs["Namespace"], outputs["PvcName"], outputs["ImageUri"],
                        source=str(path))
