"""Render `python k8s/main.py` in-process into a directory and parse what it wrote (used by conftest.py)."""
from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

# The jsii runtime under cdk8s prints a Node 20 end-of-life banner on every start: known noise.
os.environ.setdefault("JSII_SILENCE_WARNING_END_OF_LIFE_NODE_VERSION", "20")

from k8s.main import main  # noqa: E402

IMAGE = "123456789012.dkr.ecr.us-east-1.amazonaws.com/cdk-hnb659fds-container-assets-123456789012-us-east-1:4f1c0de5"
# The shape `cdk deploy --outputs-file` writes for infra/platform.py: every output on the cluster stack.
CDK_OUTPUTS = {
    "ft-training-network": {},
    "ft-training-storage": {},
    "ft-training-cluster": {
        "ClusterName": "ft-training",
        "UpdateKubeconfigCommand": "aws eks update-kubeconfig --name ft-training --region us-east-1",
        "Namespace": "training",
        "PvcName": "fsx-checkpoints",
        "FsxFileSystemId": "fs-0123456789abcdef0",
        "FsxDnsName": "fs-0123456789abcdef0.fsx.us-east-1.amazonaws.com",
        "FsxMountName": "abcdefgh",
        "ImageUri": IMAGE,
    },
}



def fitting(instance_type: str) -> tuple[str, ...]:
    """Overrides that make k8s/train.yaml fit the instance type: its 8b preset's peer state does not fit
    the 12 GiB of a g6.xlarge pod (a single L4 trains the small preset); on 2 p4d nodes peer state and async
    staging together overfill /dev/shm (a quarter of 1000 GiB), peer state alone fits."""
    if instance_type == "g6.xlarge":
        return ("--set", "model.preset=small")
    if instance_type == "p4d.24xlarge":
        return ("--set", "checkpoint.mode=sync")
    return ()


@dataclass
class Rendered:
    outdir: Path
    stdout: str
    files: dict[str, list[dict[str, Any]]]  # file name -> its objects

    def objects(self) -> list[dict[str, Any]]:
        return [obj for docs in self.files.values() for obj in docs]

    def one(self, kind: str) -> dict[str, Any]:
        found = [obj for obj in self.objects() if obj["kind"] == kind]
        assert len(found) == 1, f"expected one {kind}, got {len(found)}"
        return found[0]

    @property
    def store(self) -> dict[str, Any]:
        """The rendezvous store's Deployment (the hung-node marker is the other one)."""
        (found,) = [o for o in self.objects() if o["kind"] == "Deployment" and o["metadata"]["name"].endswith("-rendezvous")]
        return found

    def config_map_object(self, prefix: str) -> dict[str, Any]:
        """The ConfigMap named `<prefix>-<content hash>`, e.g. prefix fsdp-train-config."""
        (found,) = [o for o in self.objects() if o["kind"] == "ConfigMap"
                    and re.fullmatch(rf"{re.escape(prefix)}-[0-9a-f]{{10}}", o["metadata"]["name"])]
        return found

    def config_map(self, prefix: str) -> dict[str, str]:
        return self.config_map_object(prefix)["data"]

    @property
    def pod(self) -> dict[str, Any]:
        return self.one("Job")["spec"]["template"]["spec"]

    @property
    def container(self) -> dict[str, Any]:
        (container,) = self.pod["containers"]
        return container

    @property
    def pod_volumes(self) -> dict[str, dict[str, Any]]:
        return {v["name"]: v for v in self.pod["volumes"]}

    @property
    def env(self) -> dict[str, str]:
        return {e["name"]: e["value"] for e in self.container["env"]}


def run_main(workdir: Path, *args: str, context: dict[str, Any] | None = None,
             outputs: dict[str, Any] | None = CDK_OUTPUTS) -> tuple[int, Path]:
    """main() with a cdk.json holding `context` and, unless None, a cdk-outputs.json; -> (rc, outdir)."""
    inputs = workdir / "in"
    inputs.mkdir(parents=True, exist_ok=True)
    cdk_json = inputs / "cdk.json"
    # CDK's own keys sit beside the platform's in a real cdk.json: they must be ignored.
    cdk_json.write_text(json.dumps({"app": "python app.py",
                                    "context": {"@aws-cdk/core:newStyleStackSynthesis": True, **(context or {})}}))
    outputs_path = inputs / "cdk-outputs.json"
    if outputs is not None:
        outputs_path.write_text(json.dumps(outputs))
    outdir = workdir / "dist"
    rc = main(["--outdir", str(outdir), "--cdk-json", str(cdk_json), "--outputs", str(outputs_path), *args])
    return rc, outdir


def render_into(workdir: Path, capsys: pytest.CaptureFixture[str], *args: str, **inputs: Any) -> Rendered:
    rc, outdir = run_main(workdir, *args, **inputs)
    out, err = capsys.readouterr()
    assert rc == 0, err
    files = {p.name: [d for d in yaml.safe_load_all(p.read_text()) if d] for p in sorted(outdir.glob("*.k8s.yaml"))}
    return Rendered(outdir, out, files)
