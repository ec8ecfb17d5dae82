"""Resolves training/requirements-image.txt the way the image build's `pip install --require-hashes` will,
without the image: one `pip install --dry-run --report` for CPython 3.12 on manylinux x86_64, wheels only,
with nothing installed but the base's recorded packages (`BASE_PYTHON_PACKAGES`, as .dist-info stubs).

Why: in hash-checking mode pip refuses every requirement that is neither satisfied by an installed
distribution nor pinned and hashed in the file, so a locked package that needs something newer than the
base holds stops the build (a base NVIDIA never lets us run here). What it costs: the index pages and
PEP 658 metadata of each locked release (no wheel is downloaded), a few seconds with pip's HTTP cache warm.
What it cannot prove: that the base really holds those versions, or that the wheels' hashes match (pip
checks a hash when it downloads; the image build does).

    python -m infra.image_lock    # the resolution's outcome, pip's own error when it fails
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from infra.image_versions import BASE_IMAGES, BASE_PYTHON_PACKAGES, BasePythonPackages, ImagePinError, read_pins

REPO_ROOT = Path(__file__).resolve().parents[1]

# pip evaluates environment markers against the interpreter it runs in, not --python-version (pip's
# req_install.match_markers uses packaging's default_environment), so the runner sets the target's.
_PIP_FOR_TARGET = """
import json, sys
from pip._vendor.packaging import markers
target = json.loads(sys.argv[1])
environment = {**markers.default_environment(), **target}
markers.default_environment = lambda: dict(environment)
from pip._internal.cli.main import main
sys.exit(main(sys.argv[2:]))
"""

# What this machine's pip configuration may add that the image build does not have: local wheel folders,
# extra indexes, constraint files. The registry itself (PIP_INDEX_URL), certificates and timeouts stay.
_KEPT_PIP_VARIABLES = frozenset({"PIP_INDEX_URL", "PIP_CERT", "PIP_DEFAULT_TIMEOUT", "PIP_CACHE_DIR"})


@dataclass(frozen=True)
class Resolution:
    ok: bool
    to_install: dict[str, str]  # what pip would fetch: name (lower case) -> version
    pip_output: str


def manylinux_platforms(glibc: tuple[int, ...], arch: str = "x86_64") -> list[str]:
    """pip takes --platform literally (it widens only manylinux2014/2010), so every older glibc tag a base
    with this glibc runs is named, and the legacy aliases of 2_17, 2_12 and 2_5 (PEP 600)."""
    major, minor = glibc[:2]
    tags = [f"manylinux_{major}_{older}_{arch}" for older in range(minor, 4, -1)]
    return tags + [f"manylinux2014_{arch}", f"manylinux2010_{arch}", f"manylinux1_{arch}"]


def write_installed_stubs(site: Path, packages: dict[str, str]) -> None:
    """A .dist-info with only Name and Version: pip sees the distribution installed, with no requirements
    of its own to follow (the base's packages are never reinstalled)."""
    for name, version in packages.items():
        dist_info = site / f"{name.replace('-', '_')}-{version}.dist-info"
        dist_info.mkdir(parents=True)
        (dist_info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")


def _pip_environment(pythonpath: str) -> dict[str, str]:
    environment = {key: value for key, value in os.environ.items()
                   if not key.startswith("PIP_") or key in _KEPT_PIP_VARIABLES}
    environment.update(PIP_CONFIG_FILE=os.devnull, PIP_DISABLE_PIP_VERSION_CHECK="1", PYTHONPATH=pythonpath)
    return environment


def resolve(lock: Path, base: BasePythonPackages, python: str, glibc: tuple[int, ...]) -> Resolution:
    """Runs pip on `lock` with only `base` installed; `python` is the base's "3.12"."""
    import pip  # the running environment's pip; it runs in a child that sees no other distribution

    with tempfile.TemporaryDirectory(prefix="image-lock-") as scratch:
        root = Path(scratch)
        pip_only, site = root / "pip-only", root / "base-site"
        pip_only.mkdir()
        (pip_only / "pip").symlink_to(Path(pip.__file__).parent, target_is_directory=True)
        write_installed_stubs(site, base.packages)
        report = root / "report.json"
        nodot = python.replace(".", "")
        target = {"python_version": python, "python_full_version": base.python_full_version,
                  "implementation_version": base.python_full_version}
        command = [
            sys.executable, "-S", "-c", _PIP_FOR_TARGET, json.dumps(target),
            "install", "--dry-run", "--quiet", "--report", str(report), "--require-hashes",
            "--only-binary=:all:", "--implementation", "cp", "--python-version", python, "--abi", f"cp{nodot}",
            *(arg for platform in manylinux_platforms(glibc) for arg in ("--platform", platform)),
            "-r", str(lock),
        ]
        # -S: no site-packages on the path; PYTHONPATH holds pip (without its .dist-info) and the stubs.
        done = subprocess.run(command, cwd=root, env=_pip_environment(f"{pip_only}{os.pathsep}{site}"),
                              capture_output=True, text=True, timeout=600)
        to_install: dict[str, str] = {}
        if done.returncode == 0:
            for item in json.loads(report.read_text())["install"]:
                to_install[item["metadata"]["name"].lower()] = item["metadata"]["version"]
        return Resolution(ok=done.returncode == 0, to_install=to_install, pip_output=done.stdout + done.stderr)


def resolve_image_lock(repo_root: Path = REPO_ROOT) -> Resolution:
    """The repository's lock against the base tag training/Dockerfile names."""
    training = repo_root / "training"
    lock = training / "requirements-image.txt"
    pins = read_pins((training / "Dockerfile").read_text(), lock.read_text())
    image, packages = BASE_IMAGES.get(pins.base_tag), BASE_PYTHON_PACKAGES.get(pins.base_tag)
    if image is None or packages is None:
        raise ImagePinError(f"NGC PyTorch {pins.base_tag}: record its facts and the Python packages the lock leaves to "
                       "it (BASE_IMAGES, BASE_PYTHON_PACKAGES) before resolving the lock against it")
    return resolve(lock, packages, image.python, image.glibc)


if __name__ == "__main__":
    outcome = resolve_image_lock()
    print(outcome.pip_output.strip() or f"resolves: {len(outcome.to_install)} distributions to install")
    sys.exit(0 if outcome.ok else 1)
