"""The training's first worker attempt in a pod asks NCCL for its transport line (training/train/distributed.py)."""
from __future__ import annotations

import os

import pytest

from training.contract.launcher import FIRST_ATTEMPT_NCCL_DEBUG_ENV
from training.train.distributed import first_attempt_nccl_debug


@pytest.mark.parametrize(("restart_count", "expected"), [(None, "INFO"), ("0", "INFO"), ("1", "WARN")])
def test_nccl_debug_is_raised_on_the_first_attempt_only(monkeypatch, restart_count, expected):
    monkeypatch.setenv("NCCL_DEBUG", "WARN")
    monkeypatch.setenv(FIRST_ATTEMPT_NCCL_DEBUG_ENV, "INFO")
    if restart_count is None:
        monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    else:
        monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", restart_count)
    first_attempt_nccl_debug()
    assert os.environ["NCCL_DEBUG"] == expected


def test_without_the_chart_setting_nccl_debug_is_left_alone(monkeypatch):
    monkeypatch.setenv("NCCL_DEBUG", "WARN")
    monkeypatch.delenv(FIRST_ATTEMPT_NCCL_DEBUG_ENV, raising=False)
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    first_attempt_nccl_debug()
    assert os.environ["NCCL_DEBUG"] == "WARN"
