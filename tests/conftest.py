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


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if item.get_closest_marker("timeout") is None:
            slow = item.get_closest_marker("slow") is not None
            item.add_marker(pytest.mark.timeout(SLOW_TEST_DEADLINE_S if slow else FAST_TEST_DEADLINE_S))
