"""bench/gpu.sh: valid bash; without CUDA a clear 'no CUDA' message and exit code 2 (nothing measured);
with it, the exact-resume check (bench/resume.py) first and its PASS/FAIL verdict as the last line."""
from __future__ import annotations

import os
import stat
import subprocess
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from bench import resume
from training.contract.events import EventLog

REPO_ROOT = Path(__file__).resolve().parents[2]
SCRIPT = REPO_ROOT / "bench" / "gpu.sh"


def test_syntax() -> None:
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)


def test_without_cuda_it_says_so_and_exits_2(tmp_path: Path) -> None:
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}  # hides a GPU where there is one
    before = set((REPO_ROOT / "bench" / "results").glob("*"))
    proc = subprocess.run([str(SCRIPT)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "no CUDA device" in proc.stderr and "nothing measured" in proc.stderr
    assert set((REPO_ROOT / "bench" / "results").glob("*")) == before  # no result pretending to be GPU figures


def test_bench_run_gpu_refuses_without_cuda(monkeypatch, capsys) -> None:
    import torch

    from bench import run

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert run.main(["--gpu", "--results-dir", "/nonexistent"]) == run.NO_CUDA
    assert "no CUDA device" in capsys.readouterr().err


# A stand-in interpreter: the CUDA and NVRx probes (-c) succeed, `-m bench.resume` exits with
# $RESUME_STATUS, `-m bench.run` with 0; every call is logged to $CALLS.
_FAKE_PYTHON = """#!/usr/bin/env bash
echo "$*" >> "$CALLS"
if [[ "$1 $2" == "-m bench.resume" ]]; then echo "exact resume on CUDA (fake): check ran"; exit "$RESUME_STATUS"; fi
exit 0
"""


@pytest.mark.parametrize("resume_status, verdict, status", [(0, "PASS", 0), (1, "FAIL", 1)])
@pytest.mark.parametrize("args", [[], ["--resume-only"]])
def test_resume_check_runs_first_and_its_verdict_ends_the_output(tmp_path, resume_status, verdict, status, args):
    python = tmp_path / "python"
    python.write_text(_FAKE_PYTHON)
    python.chmod(python.stat().st_mode | stat.S_IEXEC)
    calls = tmp_path / "calls"
    env = {**os.environ, "PYTHON": str(python), "CALLS": str(calls), "RESUME_STATUS": str(resume_status)}
    proc = subprocess.run([str(SCRIPT), *args], env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == status, proc.stderr
    modules = [line for line in calls.read_text().splitlines() if line.startswith("-m ")]
    if args:
        assert modules == ["-m bench.resume"]
    else:
        assert modules == ["-m bench.resume", "-m bench.run --gpu"]
        assert proc.stdout.splitlines()[-1].startswith(f"bench/gpu.sh: exact resume on CUDA: {verdict}")


def _run_dir(root: Path, name: str, sources: list[str], weight: float) -> Path:
    run_dir = root / name
    events = EventLog(run_dir, "rank0")
    for source in sources:
        events.emit("resume", step=0, source_kind=source, path=None)
    events.close()
    dcp.save({"model": {"w": torch.full((3,), weight)}}, checkpoint_id=run_dir / "final")
    return run_dir


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")  # single-process DCP
def test_resume_check_verdicts(tmp_path):
    reference = _run_dir(tmp_path, "reference", ["none"], 1.0)
    assert resume.mismatch(reference, _run_dir(tmp_path, "same", ["none", "disk"], 1.0), tmp_path) is None
    assert resume.mismatch(reference, _run_dir(tmp_path, "off", ["none", "disk"], 1.5), tmp_path) == \
        "1 of 1 entries differ, e.g. ['model.w']"
    assert "not one from disk" in resume.mismatch(reference, _run_dir(tmp_path, "never", ["none"], 1.0), tmp_path)


def test_resume_check_refuses_without_cuda(monkeypatch, capsys):
    from bench import run

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resume.main(["--runs-dir", "/nonexistent"]) == run.NO_CUDA
    assert "no CUDA device" in capsys.readouterr().err
