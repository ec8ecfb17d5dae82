"""Shared by every test directory: the header says which NVRx the tests exercise; every test has a deadline."""
from __future__ import annotations

import importlib.metadata

import pytest

# A test past its deadline fails with every thread's stack (pytest-timeout), so one hang cannot hold the suite
# until CI's limit. Fast tests take seconds; the slowest local-cluster run (fifty faults) about two minutes.
FAST_TEST_DEADLINE_S = 300
SLOW_TEST_DEADLINE_S = 1200


def pytest_report_header() -> str:
    return f"nvidia-resiliency-ext {importlib.metadata.version('nvidia-resiliency-ext')} (training/Dockerfile pins the image's)"


def _slow(item: pytest.Item) -> bool:
    return item.get_closest_marker("slow") is not None


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(SLOW_TEST_DEADLINE_S if _slow(item) else FAST_TEST_DEADLINE_S))
    # The slow tests first: the fast ones fill the gaps they leave, and no minute-long run is
    # left to start when the rest is done. The sort is stable: files keep their order within each part.
    items.sort(key=lambda item: not _slow(item))
