"""The training image's pins against the facts they depend on (infra/image_versions.py): the real files fit, and
a pin moved alone is refused with the source to read."""
from __future__ import annotations

import re

import pytest

from infra import image_versions
from infra.image_versions import (
    BaseImageFacts, EfaInstallerFacts, ImagePinError, check_pins, parse_version, read_pins,
)


@pytest.fixture(scope="module")
def dockerfile(repo_root) -> str:
    return (repo_root / "training" / "Dockerfile").read_text()


@pytest.fixture(scope="module")
def lock(repo_root) -> str:
    return (repo_root / "training" / "requirements-image.txt").read_text()


def _with_arg(dockerfile: str, name: str, value: str) -> str:
    changed, count = re.subn(rf"^ARG {name}=\S+$", f"ARG {name}={value}", dockerfile, flags=re.M)
    assert count == 1, name
    return changed


def _with_base_tag(dockerfile: str, tag: str) -> str:
    changed, count = re.subn(r"nvcr\.io/nvidia/pytorch:\d\d\.\d\d-py3@", f"nvcr.io/nvidia/pytorch:{tag}-py3@",
                             dockerfile)
    assert count == 1
    return changed


def test_the_image_pins_fit_together(dockerfile, lock):
    pins = read_pins(dockerfile, lock)
    assert check_pins(pins) == []
    # what the image is built from, as the facts know it
    base = image_versions.BASE_IMAGES[pins.base_tag]
    assert (base.cuda_major, base.python) == (13, "3.12")
    assert pins.aws_ofi_nccl >= parse_version("1.20.0")


def test_a_base_tag_without_recorded_facts_is_refused(dockerfile, lock):
    [problem] = check_pins(read_pins(_with_base_tag(dockerfile, "26.02"), lock))
    assert "NGC PyTorch tag 26.02: no facts recorded (known: 25.10)" in problem
    assert "NVIDIA PyTorch Release Notes" in problem


def test_a_plugin_pin_moved_alone_is_refused_naming_the_fix_it_lacks(dockerfile, lock):
    problems = check_pins(read_pins(_with_arg(dockerfile, "AWS_OFI_NCCL_VERSION", "1.16.3"), lock))
    assert len(problems) == 3, problems
    installer, cuda_13, broadcast = problems
    assert "EFA installer 1.50.0 bundles aws-ofi-nccl 1.21.1" in installer and "efa-changelog" in installer
    assert "below 1.17.0 for CUDA 13" in cuda_13 and "PR 998" in cuda_13
    assert "below 1.20.0" in broadcast and "deep-learning-containers PR 6551" in broadcast


def test_an_installer_that_bundles_the_hanging_plugin_is_refused(dockerfile, lock, monkeypatch):
    # EFA 1.47.0 bundles aws-ofi-nccl 1.18.0 (aws/deep-learning-containers PR 6551): both pins moved together,
    # the plugin compiles against CUDA 13 but hangs on broadcast.
    monkeypatch.setitem(image_versions.EFA_INSTALLERS, "1.47.0", EfaInstallerFacts(
        version="1.47.0", aws_ofi_nccl="1.18.0", plugin_dir="/opt/amazon/ofi-nccl/lib", source="test"))
    moved = _with_arg(_with_arg(dockerfile, "EFA_INSTALLER_VERSION", "1.47.0"), "AWS_OFI_NCCL_VERSION", "1.18.0")
    [problem] = check_pins(read_pins(moved, lock))
    assert problem.startswith("aws-ofi-nccl 1.18.0 is below 1.20.0, the first that does not hang on NCCL broadcast")


@pytest.mark.parametrize("tag, python, message", [
    # A hypothetical base on Python 3.13: NVRx 0.7.0 has cp312 and cp314 wheels only.
    ("99.01", "3.13", "nvidia-resiliency-ext 0.7.0 has wheels for Python 3.12, 3.14 only, NGC PyTorch 99.01 runs "
                      "Python 3.13"),
    # A hypothetical base on Python 3.14: NVRx 0.7.0 has a cp314 wheel, torchft 0.2.0 stops at cp313.
    ("99.04", "3.14", "torchft 0.2.0 has wheels for Python 3.9, 3.10, 3.11, 3.12, 3.13 only, NGC PyTorch 99.04 runs "
                      "Python 3.14"),
])
def test_a_base_on_a_python_a_locked_wheel_lacks_is_refused(dockerfile, lock, monkeypatch, tag, python, message):
    monkeypatch.setitem(image_versions.BASE_IMAGES, tag, BaseImageFacts(
        tag=tag, cuda_major=13, python=python, glibc=(2, 39), pip_constraint_file="/etc/pip/constraint.txt",
        source="test"))
    [problem] = check_pins(read_pins(_with_base_tag(dockerfile, tag), lock))
    assert problem.startswith(message)
    assert f"PyPI files of {message.split()[0]} {message.split()[1]}" in problem


def test_a_base_older_than_nvrx_glibc_floor_is_refused(dockerfile, lock, monkeypatch):
    # A hypothetical base on Ubuntu 22.04 (glibc 2.35): NVRx 0.7.0's wheels are manylinux_2_39.
    monkeypatch.setitem(image_versions.BASE_IMAGES, "99.02", BaseImageFacts(
        tag="99.02", cuda_major=13, python="3.12", glibc=(2, 35), pip_constraint_file="/etc/pip/constraint.txt",
        source="test"))
    [problem] = check_pins(read_pins(_with_base_tag(dockerfile, "99.02"), lock))
    assert problem.startswith("nvidia-resiliency-ext 0.7.0 needs glibc 2.39 (its manylinux tag), NGC PyTorch 99.02 "
                              "has 2.35")


def test_a_cuda_without_a_recorded_plugin_floor_is_refused(dockerfile, lock, monkeypatch):
    monkeypatch.setitem(image_versions.BASE_IMAGES, "99.03", BaseImageFacts(
        tag="99.03", cuda_major=14, python="3.12", glibc=(2, 39), pip_constraint_file="/etc/pip/constraint.txt",
        source="test"))
    [problem] = check_pins(read_pins(_with_base_tag(dockerfile, "99.03"), lock))
    assert "built on CUDA 14: no aws-ofi-nccl floor is recorded" in problem


def test_an_nvrx_release_without_recorded_wheel_tags_is_refused(dockerfile, lock):
    bumped = re.sub(r"^nvidia-resiliency-ext==\S+", "nvidia-resiliency-ext==0.8.0", lock, flags=re.M)
    [problem] = check_pins(read_pins(dockerfile, bumped))
    assert "nvidia-resiliency-ext 0.8.0: no facts recorded (known: 0.7.0)" in problem and "PyPI" in problem


@pytest.mark.parametrize("name", ["EFA_INSTALLER_VERSION", "AWS_OFI_NCCL_VERSION"])
def test_a_missing_pin_names_the_arg(dockerfile, lock, name):
    without = re.sub(rf"^ARG {name}=\S+\n", "", dockerfile, flags=re.M)
    with pytest.raises(ImagePinError, match=f"expected one 'ARG {name}=<value>', found 0"):
        read_pins(without, lock)


def test_a_base_image_without_a_digest_is_not_read_as_a_pin(dockerfile, lock):
    unpinned = re.sub(r"@sha256:[0-9a-f]{64}", "", dockerfile)
    with pytest.raises(ImagePinError, match="BASE_IMAGE=nvcr.io/nvidia/pytorch:<YY.MM>-py3@sha256:<digest>"):
        read_pins(unpinned, lock)


def test_a_plugin_pin_that_is_not_a_version_names_the_value(dockerfile, lock):
    with pytest.raises(ImagePinError, match="AWS_OFI_NCCL_VERSION='latest' is not a dotted version"):
        read_pins(_with_arg(dockerfile, "AWS_OFI_NCCL_VERSION", "latest"), lock)
