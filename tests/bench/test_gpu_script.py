"""bench/gpu.sh: valid bash, and without CUDA a clear 'no CUDA' message and exit code 2 (nothing measured)."""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

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
