"""Fixtures shared by the training tests."""
from __future__ import annotations

from pathlib import Path

import pytest

from training_helpers import COMMON, ONE_NODE, completed, run_local


@pytest.fixture(scope="session")
def scratch(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("scratch")


@pytest.fixture(scope="session")
def reference(tmp_path_factory: pytest.TempPathFactory):
    """The uninterrupted run that every fault run of the COMMON shape must end equal to, bit for bit."""
    return completed(run_local(tmp_path_factory.mktemp("ref") / "run", *ONE_NODE, *COMMON, "checkpoint.mode=sync"))
