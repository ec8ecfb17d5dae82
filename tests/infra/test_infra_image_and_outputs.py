"""The training image (Dockerfile, asset wiring, URI path) and the outputs the k8s layer reads."""
from __future__ import annotations

import importlib.metadata
import json
import re

from infra.config import NAMESPACE, PVC_NAME
from k8s.charts.preflight import PERF_BINARIES

OUTPUT_KEYS = {
    "ClusterName", "UpdateKubeconfigCommand", "Namespace", "PvcName",
    "FsxFileSystemId", "FsxDnsName", "FsxMountName", "ImageUri",
}


def _instructions(dockerfile: str) -> list[str]:
    """One string per instruction, its continuation lines joined, comments left out."""
    joined = re.sub(r"\s*\\\n\s*", " ", dockerfile)
    return [line.strip() for line in joined.splitlines() if line.strip() and not line.lstrip().startswith("#")]


def _image_lock(repo_root) -> dict[str, tuple[str, str]]:
    """training/requirements-image.txt: package -> (version, sha256); every line must be `name==version
    --hash=sha256:<64 hex>`, the one form pip's --require-hashes mode takes without a resolver's guess."""
    locked: dict[str, tuple[str, str]] = {}
    for line in (repo_root / "training" / "requirements-image.txt").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            match = re.fullmatch(r"([a-z0-9-]+)==(\S+) --hash=sha256:([0-9a-f]{64})", line)
            assert match, f"not a hash-locked pin: {line!r}"
            name, version, digest = match.groups()
            assert name not in locked, f"{name} locked twice"
            locked[name] = (version, digest)
    return locked


def _pins(requirements: str) -> dict[str, str]:
    return {name.lower().replace("_", "-"): version
            for name, version in re.findall(r"^([A-Za-z0-9_.-]+)==(\S+)", requirements, re.M)}


def test_dockerfile_builds_on_ngc_pytorch_pinned_by_digest_and_the_training_package(repo_root):
    dockerfile = (repo_root / "training" / "Dockerfile").read_text()
    lines = _instructions(dockerfile)
    [base] = [line for line in lines if line.startswith("ARG BASE_IMAGE=")]
    # A tag can be pushed again; the digest of the image index cannot change.
    match = re.fullmatch(r"ARG BASE_IMAGE=nvcr\.io/nvidia/pytorch:(25\.\d\d-py3)@sha256:[0-9a-f]{64}", base)
    assert match, base
    assert re.search(rf"^# nvcr\.io/nvidia/pytorch:{re.escape(match[1])},", dockerfile, re.M)  # the tag, readable
    assert "FROM ${BASE_IMAGE}" in lines
    assert "COPY training/ /workspace/training/" in lines


def test_image_pip_installs_only_hash_locked_packages(repo_root):
    lines = _instructions((repo_root / "training" / "Dockerfile").read_text())
    installs = [line for line in lines if "pip install" in line]
    assert len(installs) == 2
    for install in installs:
        assert "--require-hashes" in install.split() and "-r" in install.split(), install
    locked = _image_lock(repo_root)
    # the tests exercise the NVRx the image ships; the metrics endpoint and `training.data prepare` too
    for package in ("nvidia-resiliency-ext", "prometheus-client", "tokenizers", "pyyaml", "matplotlib", "nvidia-ml-py"):
        assert locked[package][0] == importlib.metadata.version(package), package
    # where requirements.txt pins a package too, the image runs the version tested here
    tested = _pins((repo_root / "requirements.txt").read_text())
    assert {name: version for name, (version, _) in locked.items() if tested.get(name, version) != version} == {}
    # torch (and what the base built against it) comes from the base image, never from PyPI
    assert not {"torch", "numpy"} & set(locked)


def test_image_has_the_maintained_nvml_binding_not_the_warning_pynvml_shim(repo_root):
    lines = _instructions((repo_root / "training" / "Dockerfile").read_text())
    [nvml] = [line for line in lines if "pip uninstall --yes pynvml" in line]
    assert nvml.startswith("RUN pip uninstall --yes pynvml && ")
    # the binding is written again after the shim's removal, from its locked file
    assert "grep '^nvidia-ml-py==' /tmp/requirements-image.txt" in nvml
    assert "--force-reinstall" in nvml.split() and "--no-deps" in nvml.split()
    assert _image_lock(repo_root)["nvidia-ml-py"][0] == importlib.metadata.version("nvidia-ml-py")


def test_dockerignore_sends_only_the_training_package(repo_root):
    lines = _instructions((repo_root / ".dockerignore").read_text())
    assert lines[:2] == ["*", "!training/"]


def test_without_image_uri_the_dockerfile_is_an_ecr_asset(defaults):
    manifest = json.loads((defaults.outdir / "Cluster.assets.json").read_text())
    [(asset_hash, image)] = manifest["dockerImages"].items()
    assert image["source"]["dockerFile"] == "training/Dockerfile"
    assert image["source"]["platform"] == "linux/amd64"
    # The staged build context holds the training package (and CDK's copy of .dockerignore) only.
    context = defaults.outdir / image["source"]["directory"]
    assert sorted(p.name for p in context.iterdir()) == [".dockerignore", "training"]
    assert (context / "training" / "Dockerfile").is_file()
    image_uri = json.dumps(defaults.outputs()["ImageUri"])
    assert "container-assets" in image_uri and asset_hash in image_uri


def test_with_image_uri_no_image_is_built(full):
    assert full.outputs()["ImageUri"] == full.config.image_uri
    assert json.loads((full.outdir / "Cluster.assets.json").read_text()).get("dockerImages", {}) == {}


def test_outputs_have_the_exact_keys_the_k8s_layer_reads(full, defaults):
    assert set(full.outputs()) == OUTPUT_KEYS
    assert set(defaults.outputs()) == OUTPUT_KEYS


def test_output_values(full):
    outputs = full.outputs()
    assert outputs["Namespace"] == NAMESPACE
    assert outputs["PvcName"] == PVC_NAME
    [cluster_id] = full.resources("Cluster", "AWS::EKS::Cluster")
    assert outputs["ClusterName"] == {"Ref": cluster_id}
    separator, parts = outputs["UpdateKubeconfigCommand"]["Fn::Join"]
    command = separator.join(p if isinstance(p, str) else json.dumps(p) for p in parts)
    assert command == (
        f'aws eks update-kubeconfig --name {{"Ref": "{cluster_id}"}} --region {{"Ref": "AWS::Region"}} '
        f"--role-arn {full.config.admin_role_arn}"
    )
    [fs_id] = full.resources("Storage", "AWS::FSx::FileSystem")
    assert outputs["FsxFileSystemId"] == {"Ref": fs_id}
    assert outputs["FsxDnsName"]["Fn::Join"][1][0] == {"Ref": fs_id}
    assert outputs["FsxMountName"] == {"Fn::GetAtt": [fs_id, "LustreMountName"]}


def test_image_installs_and_pins_the_efa_stack_and_the_preflight_tools(repo_root):
    """NCCL must not fall back to TCP sockets unnoticed: libfabric's EFA provider and aws-ofi-nccl are
    installed and pinned (as awsome-distributed-training's image does), and the preflight's binary is built."""
    dockerfile = (repo_root / "training" / "Dockerfile").read_text()
    pins = dict(re.findall(r"^ARG (EFA_INSTALLER_VERSION|AWS_OFI_NCCL_VERSION|NCCL_TESTS_VERSION)=(\S+)$", dockerfile, re.M))
    assert pins == {"EFA_INSTALLER_VERSION": "1.43.2", "AWS_OFI_NCCL_VERSION": "1.16.3", "NCCL_TESTS_VERSION": "v2.16.9"}
    installer = next(line for line in dockerfile.splitlines() if "efa_installer.sh" in line)
    assert "--skip-kmod" in installer and "-y" in installer.split()  # user space only: the AMI has the driver
    assert "aws-efa-installer-${EFA_INSTALLER_VERSION}.tar.gz" in dockerfile
    assert "aws-ofi-nccl-${AWS_OFI_NCCL_VERSION}.tar.gz" in dockerfile and "--enable-platform-aws" in dockerfile
    assert "--with-libfabric=/opt/amazon/efa" in dockerfile
    assert "/opt/aws-ofi-nccl/install/lib" in re.search(r"LD_LIBRARY_PATH=(\S+)", dockerfile)[1]
    assert f"test -x {PERF_BINARIES['all_reduce']}" in dockerfile and "MPI=1" in dockerfile
    assert "openssh-server" in dockerfile  # the MPIJob's workers run sshd
