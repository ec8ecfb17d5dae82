"""The image lock resolves on its base as `pip install --require-hashes` will in the build: every
requirement of every locked package is either locked with a hash or held by the base (infra.image_lock).
Needs the package registry (index pages and metadata only)."""
from __future__ import annotations

import re

from infra.image_lock import resolve, resolve_image_lock
from infra.image_versions import BASE_IMAGES, BASE_PYTHON_PACKAGES, BasePythonPackages


def _pep503(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _locked(lock: str) -> dict[str, str]:
    return {_pep503(name): version for name, version in re.findall(r"^([A-Za-z0-9_.-]+)==(\S+)", lock, re.M)}


def test_the_image_lock_resolves_on_its_base_in_hash_mode(repo_root):
    resolution = resolve_image_lock(repo_root)
    assert resolution.ok, resolution.pip_output
    to_install = {_pep503(name): version for name, version in resolution.to_install.items()}
    # pip installs exactly what is locked, at the locked versions, and replaces nothing the base keeps
    assert to_install == _locked((repo_root / "training" / "requirements-image.txt").read_text())
    assert not to_install.keys() & {_pep503(name) for name in BASE_PYTHON_PACKAGES["25.10"].packages}


def test_a_requirement_neither_locked_nor_provided_stops_the_resolution(repo_root, tmp_path):
    # anyio needs idna and typing-extensions>=4.16.0: the lock names idna, the base holds only 4.15.0
    lock = (repo_root / "training" / "requirements-image.txt").read_text()
    lines = [line for line in lock.splitlines() if line.startswith(("anyio==", "idna=="))]
    (tmp_path / "lock.txt").write_text("\n".join(lines) + "\n")
    base = BasePythonPackages(tag="test", python_full_version="3.12.3",
                              packages={"typing-extensions": "4.15.0"}, source="test")
    image = BASE_IMAGES["25.10"]
    resolution = resolve(tmp_path / "lock.txt", base, image.python, image.glibc)
    assert not resolution.ok
    assert "In --require-hashes mode, all requirements must have their versions pinned" in resolution.pip_output
    assert "typing_extensions>=4.16.0" in resolution.pip_output
