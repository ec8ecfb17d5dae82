"""The training image's version couplings, each fact with its public source, and the check that the pins in
training/Dockerfile and training/requirements-image.txt still fit together.

The pins move one at a time (a new NGC tag, a newer EFA installer, an NVRx release); what breaks is a pair:
a plugin that does not compile against the base's CUDA, a wheel without a tag for the base's Python.
`check_pins` names every broken pair and the source to read before fixing it. Torch-free: the
infra tests run it on the files' text.
"""
from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

Version = tuple[int, ...]


def parse_version(text: str) -> Version:
    """'1.21.1' -> (1, 21, 1); 'v2.16.9' -> (2, 16, 9)."""
    match = re.fullmatch(r"v?(\d+(?:\.\d+)*)", text)
    if not match:
        raise ValueError(f"not a dotted version: {text!r}")
    return tuple(int(part) for part in match[1].split("."))


def _dotted(version: Version) -> str:
    return ".".join(str(part) for part in version)


@dataclass(frozen=True)
class BaseImageFacts:
    """What an NGC PyTorch tag is built on."""

    tag: str                  # "25.10" of nvcr.io/nvidia/pytorch:25.10-py3
    cuda_major: int
    python: str               # "3.12"
    glibc: Version            # of its Ubuntu release
    pip_constraint_file: str  # PIP_CONSTRAINT's file: pip refuses other versions of what it lists
    source: str


@dataclass(frozen=True)
class PluginFloor:
    """The oldest aws-ofi-nccl that does the job; cuda_major None: whatever the CUDA."""

    minimum: Version
    reason: str
    source: str
    cuda_major: int | None = None


@dataclass(frozen=True)
class EfaInstallerFacts:
    """What an EFA installer release bundles: the image takes aws-ofi-nccl from it instead of building one."""

    version: str
    aws_ofi_nccl: str
    plugin_dir: str
    source: str


@dataclass(frozen=True)
class WheelFacts:
    """A binary-only distribution: the Pythons it has wheels for and the glibc its manylinux tag needs."""

    package: str
    version: str
    pythons: frozenset[str]
    glibc_floor: Version
    source: str


BASE_IMAGES = {facts.tag: facts for facts in (
    BaseImageFacts(
        tag="25.10",
        cuda_major=13,
        python="3.12",
        glibc=(2, 39),
        pip_constraint_file="/etc/pip/constraint.txt",
        source=(
            "NVIDIA PyTorch Release Notes (docs.nvidia.com/deeplearning/frameworks/pytorch-release-notes): 25.10 "
            "is built on CUDA 13 (issue 22; the 25.12 page: CUDA 13.1.0, Python 3.12 dist-packages); 'Starting from "
            "the 25.03 release, the PyTorch container has implemented a pip constraints file at "
            "/etc/pip/constraint.txt'. Ubuntu 24.04's glibc is 2.39 (Ubuntu archive, noble libc6; the ubuntu-devel "
            "post of 2024-07-31 brings 2.40 to the release after it). unverified here: the 25.10 page itself (not "
            "stored) and the image (nvcr.io cannot be reached from where this was written)"
        ),
    ),
)}

@dataclass(frozen=True)
class BasePythonPackages:
    """The Python distributions a base tag holds that requirements-image.txt leaves to it (a locked package
    needs them, the lock does not name them), with the interpreter's full version for environment markers.
    `infra.image_lock` installs exactly these, as metadata stubs, when it resolves the lock."""

    tag: str
    python_full_version: str
    packages: dict[str, str]  # distribution name -> the version the base holds
    source: str


BASE_PYTHON_PACKAGES = {facts.tag: facts for facts in (
    BasePythonPackages(
        tag="25.10",
        python_full_version="3.12.3",
        # torch and numpy are NGC's own builds (NGC's compiled extensions link them) and must stay; filelock
        # and fsspec come with torch. typing-extensions (4.15.0 here) and setuptools are locked instead: the
        # lock needs typing-extensions>=4.16.0 (anyio, pydantic, pydantic-core) and setuptools>=77.0.1
        # (grpcio-tools), which no source shows this base to hold.
        packages={
            "torch": "2.9.0a0+145a3a7bda.nv25.10",
            "numpy": "1.26.4",
            "filelock": "3.20.0",
            "fsspec": "2025.9.0",
        },
        source=(
            "NVIDIA PyTorch Release Notes, 25.10: 'based on 2.9.0a0+145a3a7'; the full torch version as "
            "ai-dynamo/dynamo's container Dockerfile copies it out of NGC PyTorch 25.10 (TORCH_VER); numpy, "
            "filelock, fsspec and typing_extensions 4.15.0 from a pip freeze of an environment on that torch build "
            "(rafaujo/weak-lensing-mass-mapping provenance/python_environment_original.txt: Python 3.12.3). "
            "unverified: the container's own package list (its /etc/pip/constraint.txt); the image build settles it"
        ),
    ),
)}

AWS_OFI_NCCL_FLOORS = (
    PluginFloor(
        minimum=(1, 17, 0),
        cuda_major=13,
        reason="compiles against CUDA 13 (cudaGetDriverEntryPointByVersion)",
        source=(
            "aws/aws-ofi-nccl issue 984 'Compilation is failing with new CUDA 13'; fixed by PR 998 'cuda: Update "
            "CUDA APIs to work with CUDA 13.0', first released in v1.17.0 (RELEASENOTES.md v1.17.0: 'Updated CUDA "
            "APIs to work with CUDA 13.0'; git tag --contains 0ecdc995)"
        ),
    ),
    PluginFloor(
        minimum=(1, 20, 0),
        reason="does not hang on NCCL broadcast between nodes (1.18.0 does, while all-reduce passes)",
        source=(
            "aws/deep-learning-containers PR 6551 (aws-ofi-nccl 1.18.0 in EFA 1.47.0 hangs on NCCL broadcast, "
            "fixed in 1.20.0 / EFA 1.49.0) and PR 6668 (EFA 1.49.0 for aws-ofi-nccl 1.20.0)"
        ),
    ),
)

EFA_INSTALLERS = {facts.version: facts for facts in (
    EfaInstallerFacts(
        version="1.50.0",
        aws_ofi_nccl="1.21.1",
        plugin_dir="/opt/amazon/ofi-nccl/lib",
        source=(
            "EC2 user guide, 'Elastic Fabric Adapter release notes' (efa-changelog): 1.50.0, August 21, 2026, "
            "'Upgrade to Amazon OFI NCCL Plugin 1.21.1'; the plugin directory as awslabs/awsome-distributed-ai "
            "micro-benchmarks/nccl-tests/nccl-tests.Dockerfile finds it with this installer ('EFA 1.50 ships the "
            "OFI NCCL plugin at /opt/amazon/ofi-nccl/lib/')"
        ),
    ),
)}

WHEELS = {facts.package: facts for facts in (
    WheelFacts(
        package="nvidia-resiliency-ext",
        version="0.7.0",
        pythons=frozenset({"3.12", "3.14"}),
        glibc_floor=(2, 39),
        source=(
            "PyPI files of nvidia-resiliency-ext 0.7.0: cp312 and cp314 manylinux_2_39_x86_64 wheels, no sdist "
            "(the cp312 wheel's WHEEL: 'Tag: cp312-cp312-manylinux_2_39_x86_64'; pip finds none for cp313)"
        ),
    ),
    WheelFacts(
        package="torchft",
        version="0.2.0",
        pythons=frozenset({"3.9", "3.10", "3.11", "3.12", "3.13"}),
        glibc_floor=(2, 17),
        source=(
            "PyPI files of torchft 0.2.0: cp39 to cp313 manylinux_2_17_x86_64 wheels (a Rust extension, "
            "torchft/_torchft.*.so), no sdist; pip finds none for cp314 (`pip download --python-version 3.14`)"
        ),
    ),
)}


# Where to read the facts for a pin the tables do not know yet.
WHERE_TO_LOOK = {
    "base": "NVIDIA PyTorch Release Notes, the tag's page (CUDA, Python, Ubuntu)",
    "installer": "EC2 user guide, 'Elastic Fabric Adapter release notes' (the Amazon OFI NCCL Plugin it bundles)",
    "wheel": "the package's files on PyPI (their wheel tags)",
}


@dataclass(frozen=True)
class ImagePins:
    """The pins as training/Dockerfile and training/requirements-image.txt spell them."""

    base_tag: str
    efa_installer: str
    aws_ofi_nccl: Version
    locked: dict[str, str]  # requirements-image.txt: package -> version


class ImagePinError(ValueError):
    """A pin is missing or malformed in the files themselves."""


_BASE_IMAGE = re.compile(r"^ARG BASE_IMAGE=nvcr\.io/nvidia/pytorch:(\d\d\.\d\d)-py3@sha256:[0-9a-f]{64}$", re.M)


def _arg(dockerfile: str, name: str) -> str:
    values = re.findall(rf"^ARG {name}=(\S+)$", dockerfile, re.M)
    if len(values) != 1:
        raise ImagePinError(f"training/Dockerfile: expected one 'ARG {name}=<value>', found {len(values)}")
    return values[0]


def read_pins(dockerfile: str, lock: str) -> ImagePins:
    bases = _BASE_IMAGE.findall(dockerfile)
    if len(bases) != 1:
        raise ImagePinError(
            "training/Dockerfile: expected one 'ARG BASE_IMAGE=nvcr.io/nvidia/pytorch:<YY.MM>-py3@sha256:<digest>', "
            f"found {len(bases)}"
        )
    plugin = _arg(dockerfile, "AWS_OFI_NCCL_VERSION")
    try:
        plugin_version = parse_version(plugin)
    except ValueError:
        raise ImagePinError(f"training/Dockerfile: AWS_OFI_NCCL_VERSION={plugin!r} is not a dotted version") from None
    return ImagePins(
        base_tag=bases[0],
        efa_installer=_arg(dockerfile, "EFA_INSTALLER_VERSION"),
        aws_ofi_nccl=plugin_version,
        locked={name.lower(): version for name, version in re.findall(r"^([A-Za-z0-9_.-]+)==(\S+)", lock, re.M)},
    )


def _unknown(what: str, value: str, known: Iterable[str], where: str) -> str:
    return (f"{what} {value}: no facts recorded (known: {', '.join(sorted(known))}); read them in "
            f"{WHERE_TO_LOOK[where]} and add them, with that source, to infra/image_versions.py")


def _plugin_problems(pins: ImagePins, base: BaseImageFacts | None, installer: EfaInstallerFacts | None) -> list[str]:
    problems: list[str] = []
    if installer is not None and pins.aws_ofi_nccl != parse_version(installer.aws_ofi_nccl):
        problems.append(
            f"AWS_OFI_NCCL_VERSION={_dotted(pins.aws_ofi_nccl)}, but EFA installer {installer.version} bundles "
            f"aws-ofi-nccl {installer.aws_ofi_nccl} (the image checks the plugin it installs against this ARG); "
            f"source: {installer.source}"
        )
    if base is not None and not any(floor.cuda_major == base.cuda_major for floor in AWS_OFI_NCCL_FLOORS):
        problems.append(
            f"NGC PyTorch {base.tag} is built on CUDA {base.cuda_major}: no aws-ofi-nccl floor is recorded for that "
            "CUDA; find the first release that compiles against it in aws/aws-ofi-nccl RELEASENOTES.md"
        )
    for floor in AWS_OFI_NCCL_FLOORS:
        if floor.cuda_major is not None and (base is None or floor.cuda_major != base.cuda_major):
            continue
        if pins.aws_ofi_nccl < floor.minimum:
            cuda = f" for CUDA {floor.cuda_major}" if floor.cuda_major is not None else ""
            problems.append(
                f"aws-ofi-nccl {_dotted(pins.aws_ofi_nccl)} is below {_dotted(floor.minimum)}{cuda}, the first that "
                f"{floor.reason}; source: {floor.source}"
            )
    return problems


def _wheel_problems(pins: ImagePins, base: BaseImageFacts | None) -> list[str]:
    problems: list[str] = []
    for package, wheel in WHEELS.items():
        version = pins.locked.get(package)
        if version is None:
            continue
        if version != wheel.version:
            problems.append(_unknown(package, version, [wheel.version], "wheel"))
        elif base is not None and base.python not in wheel.pythons:
            problems.append(
                f"{package} {version} has wheels for Python {', '.join(sorted(wheel.pythons, key=parse_version))} only, NGC PyTorch "
                f"{base.tag} runs Python {base.python}; source: {wheel.source}"
            )
        elif base is not None and base.glibc < wheel.glibc_floor:
            problems.append(
                f"{package} {version} needs glibc {_dotted(wheel.glibc_floor)} (its manylinux tag), NGC PyTorch "
                f"{base.tag} has {_dotted(base.glibc)}; source: {wheel.source}"
            )
    return problems


def check_pins(pins: ImagePins) -> list[str]:
    """Every coupling the pins break, each naming the source of the fact it breaks; empty when they fit."""
    base = BASE_IMAGES.get(pins.base_tag)
    installer = EFA_INSTALLERS.get(pins.efa_installer)
    problems = []
    if base is None:
        problems.append(_unknown("NGC PyTorch tag", pins.base_tag, BASE_IMAGES, "base"))
    if installer is None:
        problems.append(_unknown("EFA installer", pins.efa_installer, EFA_INSTALLERS, "installer"))
    return problems + _plugin_problems(pins, base, installer) + _wheel_problems(pins, base)
