"""The training image (Dockerfile, asset wiring, URI path) and the outputs the k8s layer reads."""
from __future__ import annotations

import importlib.metadata
import json
import re
import subprocess

from infra.config import NAMESPACE, PVC_NAME
from infra.image_versions import BASE_IMAGES, EFA_INSTALLERS, read_pins
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
    # the tests exercise the NVRx and the torchft the image ships; the metrics endpoint and `training.data prepare` too
    for package in ("nvidia-resiliency-ext", "torchft", "prometheus-client", "tokenizers", "pyyaml", "matplotlib",
                    "nvidia-ml-py"):
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


def test_image_installs_the_efa_stack_and_the_preflight_tools(repo_root):
    """NCCL must not fall back to TCP sockets unnoticed: libfabric's EFA provider and aws-ofi-nccl come from the
    pinned EFA installer, the build checks the plugin is the version the facts say it bundles, NCCL is pointed
    at it, and the preflight's binaries are built."""
    dockerfile = (repo_root / "training" / "Dockerfile").read_text()
    lines = _instructions(dockerfile)
    pins = read_pins(dockerfile, (repo_root / "training" / "requirements-image.txt").read_text())
    plugin_dir = EFA_INSTALLERS[pins.efa_installer].plugin_dir
    [installer] = [line for line in lines if "efa_installer.sh" in line]
    assert "aws-efa-installer-${EFA_INSTALLER_VERSION}.tar.gz" in installer
    flags = installer.split()
    assert {"-y", "--skip-kmod", "--disable-ngc", "--disable-build-ngc"} <= set(flags)  # user space, full install
    assert f'strings {plugin_dir}/libnccl-net-ofi.so | grep -F "aws-ofi-nccl ${{AWS_OFI_NCCL_VERSION}}"' in installer
    assert "aws-ofi-nccl-" not in dockerfile  # no second plugin built from source
    [env] = [line for line in lines if line.startswith("ENV PATH=")]
    assert re.search(r"LD_LIBRARY_PATH=(\S+)", env)[1].startswith(f"{plugin_dir}:")
    assert "NCCL_NET_PLUGIN=ofi" in env.split()
    for binary in PERF_BINARIES.values():  # every collective the preflight runs
        assert f"test -x {binary}" in dockerfile, binary
    assert "MPI=1" in dockerfile and "openssh-server" in dockerfile  # the MPIJob's workers run sshd


def test_image_drops_the_base_rdma_stack_and_hpcx_mpi_before_the_efa_installer(repo_root):
    """As AWS's NGC-based images do: the base's held ibverbs packages would block the installer's rdma-core,
    and HPC-X's Open MPI (OPAL_PREFIX) would be the mpirun the preflight resolves."""
    lines = _instructions((repo_root / "training" / "Dockerfile").read_text())
    installer = next(i for i, line in enumerate(lines) if "efa_installer.sh" in line)
    [remove] = [i for i, line in enumerate(lines) if "apt-get remove" in line]
    assert remove < installer
    assert "--allow-change-held-packages ibverbs-utils libibverbs-dev libibverbs1 libmlx5-1" in lines[remove]
    assert "libnccl" not in lines[remove]  # the NCCL PyTorch uses stays
    [hpcx] = [i for i, line in enumerate(lines) if "/opt/hpcx" in line]
    assert hpcx < installer
    removed = set(lines[hpcx].split())
    assert {"/opt/hpcx/ompi", "/opt/hpcx/nccl_rdma_sharp_plugin", "/usr/local/mpi"} <= removed
    assert "/opt/hpcx" not in removed  # `import torch` needs HPC-X's UCX/UCC
    assert lines.index("ENV OPAL_PREFIX=") < installer


def _constraint_filter(lines: list[str]) -> tuple[str, str, str]:
    """The awk program the image runs on the base's pip constraint file."""
    [rewrite] = [line for line in lines if line.startswith("RUN awk ")]
    return re.fullmatch(r"RUN awk '(.+?)' /tmp/requirements-image\.txt (\S+) > /tmp/constraint\.txt "
                        r"&& mv /tmp/constraint\.txt (\S+)", rewrite).group(1, 2, 3)


def test_image_lets_its_locked_versions_past_the_base_pip_constraints(repo_root, tmp_path):
    """NGC's PIP_CONSTRAINT file pins every package of the base: the image drops the lines of exactly the
    packages it locks (any spelling of their names), before the first pip install, and keeps the rest."""
    dockerfile = (repo_root / "training" / "Dockerfile").read_text()
    lines = _instructions(dockerfile)
    lock = (repo_root / "training" / "requirements-image.txt").read_text()
    program, source, target = _constraint_filter(lines)
    constraint_file = BASE_IMAGES[read_pins(dockerfile, lock).base_tag].pip_constraint_file
    assert source == target == constraint_file
    first_install = next(i for i, line in enumerate(lines) if "pip install" in line)
    assert next(i for i, line in enumerate(lines) if line.startswith("RUN awk ")) < first_install

    locked = _image_lock(repo_root)
    base_pins = ["# pinned when the base was built", "torch==2.9.0a0+nv25.10", "numpy==1.26.4", "PyYAML==6.0.2",
                 "nvidia_ml_py==13.580.82", "Packaging==25.0", "protobuf==4.25.8", "anyio==4.9.0", "pillow==11.3.0"]
    (tmp_path / "requirements-image.txt").write_text(
        (repo_root / "training" / "requirements-image.txt").read_text())
    (tmp_path / "constraint.txt").write_text("\n".join(base_pins) + "\n")
    kept = subprocess.run(["awk", program, "requirements-image.txt", "constraint.txt"], cwd=tmp_path,
                          capture_output=True, text=True, check=True).stdout.splitlines()
    assert kept == ["# pinned when the base was built", "torch==2.9.0a0+nv25.10", "numpy==1.26.4"]
    assert {"pyyaml", "nvidia-ml-py", "packaging", "protobuf", "anyio", "pillow"} <= set(locked)


# The lines of Ubuntu 24.04's stock files (openssh 9.6) that the image's SSH edit acts on.
STOCK_SSH_CONFIG = ("Include /etc/ssh/ssh_config.d/*.conf\n\nHost *\n#   CheckHostIP no\n"
                    "#   StrictHostKeyChecking ask\n    SendEnv LANG LC_*\n    HashKnownHosts yes\n")
STOCK_SSHD_CONFIG = ("Include /etc/ssh/sshd_config.d/*.conf\n#LoginGraceTime 2m\n"
                     "#PermitRootLogin prohibit-password\n#StrictModes yes\n#MaxAuthTries 6\n")


def test_image_ssh_trusts_the_mpi_operators_read_only_keys(repo_root, tmp_path):
    """The MPI Operator mounts ~/.ssh from a read-only Secret and each run's workers have new host keys: ssh
    must not ask about or record host keys, sshd must not refuse the mounted files' modes. The Dockerfile's
    own edit, run on the stock files."""
    lines = _instructions((repo_root / "training" / "Dockerfile").read_text())
    [edit] = [line for line in lines if "/etc/ssh/ssh_config" in line]
    (tmp_path / "ssh_config").write_text(STOCK_SSH_CONFIG)
    (tmp_path / "sshd_config").write_text(STOCK_SSHD_CONFIG)
    script = edit.removeprefix("RUN ").replace("/etc/ssh/", f"{tmp_path}/")
    subprocess.run(["sh", "-c", script], check=True)
    ssh = (tmp_path / "ssh_config").read_text().splitlines()
    host_block = ssh[ssh.index("Host *"):]
    assert "    StrictHostKeyChecking no" in host_block and "    UserKnownHostsFile /dev/null" in host_block
    sshd = (tmp_path / "sshd_config").read_text().splitlines()
    assert "StrictModes no" in sshd and "#StrictModes yes" not in sshd


def test_image_builds_nccl_tests_for_cuda_13_and_the_efa_gpus(repo_root):
    """nccl-tests compiles with C++17 on CUDA 13 from v2.17.0 (its src/common.mk); its kernels are built for
    the EFA instances' GPUs only: A100 (sm_80, p4d) and H100/H200 (sm_90, p5/p5en)."""
    dockerfile = (repo_root / "training" / "Dockerfile").read_text()
    version = re.search(r"^ARG NCCL_TESTS_VERSION=v(\S+)$", dockerfile, re.M)[1]
    assert tuple(int(part) for part in version.split(".")) >= (2, 17, 0)
    gencode = re.search(r'^ARG NVCC_GENCODE="(.+)"$', dockerfile, re.M)[1]
    assert set(re.findall(r"code=(sm_\d+)", gencode)) == {"sm_80", "sm_90"}
    [build] = [line for line in _instructions(dockerfile) if "make -C /opt/nccl-tests" in line]
    assert 'NVCC_GENCODE="${NVCC_GENCODE}"' in build
