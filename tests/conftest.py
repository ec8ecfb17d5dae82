"""Shared by every test directory: the header says which NVRx the tests exercise."""
from __future__ import annotations

import importlib.metadata


def pytest_report_header() -> str:
    return f"nvidia-resiliency-ext {importlib.metadata.version('nvidia-resiliency-ext')} (training/Dockerfile pins the image's)"
