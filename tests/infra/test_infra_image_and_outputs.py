"""The training image (Dockerfile, asset wiring, URI path) and the outputs the k8s layer reads."""
from __future__ import annotations

import importlib.metadata
import json
import re

from infra.config import NAMESPACE, PVC_NAME
from k8s.charts.preflight import ALL_REDUCE_PERF

OUTPUT_KEYS = {
    "ClusterName", "UpdateKubeconfigCommand", "Namespace", "PvcName",
    "FsxFileSystemId", "FsxDnsName", "FsxMountName", "ImageUri",
}


def _instructions(dockerfile: str) -> list[str]:
    return [line.strip() for line in dockerfile.splitlines() if line.strip() and not line.lstrip().startswith("#")]


def test_dockerfile_builds_on_ngc_pytorch_with_pinned_nvrx_and_the_training_package(repo_root):
    lines = _instructions((repo_root / "training" / "Dockerfile").read_text())
    [base] = [line for line in lines if line.startswith("ARG BASE_IMAGE=")]
    assert re.fullmatch(r"ARG BASE_IMAGE=nvcr\.io/nvidia/pytorch:25\.\d\d-py3", base)
    assert "FROM ${BASE_IMAGE}" in lines
    [install] = [line for line in lines if line.startswith("RUN pip install")]
    assert "nvidia-resiliency-ext==0.7.0" in install.split()
    # the tests exercise the NVRx the image ships
    assert f"nvidia-resiliency-ext=={importlib.metadata.version('nvidia-resiliency-ext')}" in install.split()
    assert "COPY training/ /workspace/training/" in lines
    # what the metrics endpoint and `training.data prepare` import, at the versions tested here
    for package in ("prometheus-client", "tokenizers", "pyyaml", "matplotlib"):
        assert f"{package}=={importlib.metadata.version(package)}" in install.split(), package


def test_image_has_the_maintained_nvml_binding_not_the_warning_pynvml_shim(repo_root):
    lines = _instructions((repo_root / "training" / "Dockerfile").read_text())
    [nvml] = [line for line in lines if "nvidia-ml-py==" in line]
    assert nvml.startswith("RUN pip uninstall --yes pynvml && ")
    assert f"nvidia-ml-py=={importlib.metadata.version('nvidia-ml-py')}" in nvml.split()


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
    assert f"test -x {ALL_REDUCE_PERF}" in dockerfile and "MPI=1" in dockerfile
    assert "openssh-server" in dockerfile  # the MPIJob's workers run sshd
