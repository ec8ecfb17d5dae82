"""The image lock resolves on its base as `pip install --require-hashes` will in the build: every
requirement of every locked package is either locked with a hash or held by the base (infra.image_lock).
Needs the package registry (index pages and metadata only)."""
from __future__ import annotations

import ast
import importlib.metadata
import re
import sys
from pathlib import Path

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


def _imported_distributions(package: Path) -> set[str]:
    """The distributions that the modules under `package` import, by the top-level names their imports use."""
    modules = set()
    for path in package.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                modules |= {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                modules.add(node.module.split(".")[0])
    providers = importlib.metadata.packages_distributions()
    local = modules - set(sys.stdlib_module_names) - {package.name}
    unknown = sorted(m for m in local if m not in providers)
    assert not unknown, f"imported by {package.name}/ but installed by no distribution here: {unknown}"
    return {_pep503(dist) for m in local for dist in providers[m]}


def test_every_distribution_the_training_package_imports_is_in_the_image(repo_root):
    # a package the venv has but the image lacks fails in the pods only (model.source=huggingface needed
    # transformers and safetensors, which the lock once left out)
    locked = _locked((repo_root / "training" / "requirements-image.txt").read_text())
    base = {_pep503(name) for name in BASE_PYTHON_PACKAGES["25.10"].packages}
    missing = sorted(_imported_distributions(repo_root / "training") - locked.keys() - base)
    assert not missing, f"the training package imports {missing}, which training/requirements-image.txt does not lock"
