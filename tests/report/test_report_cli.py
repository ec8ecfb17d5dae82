"""`python -m training.report RUN_DIR [--plot]`: outputs, and clear errors on bad input."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from training.report.cli import main

from synthetic_log import FakeRun

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def test_cli_prints_writes_json_and_plots(faulty_run: FakeRun, capsys: pytest.CaptureFixture) -> None:
    run_dir = faulty_run.run_dir
    assert main([str(run_dir), "--plot"]) == 0
    out = capsys.readouterr().out
    assert "Training goodput" in out and f"wrote {run_dir / 'timeline.png'}" in out
    assert out.splitlines()[-1].startswith("Recovered in ")  # the report last, after what it wrote
    data = json.loads((run_dir / "report.json").read_text())
    assert data["useful_steps"] == 120 and len(data["faults"]) == 3
    assert data["checkpoints"]["blocking_max_s"] == pytest.approx(1.5)
    assert (run_dir / "timeline.png").read_bytes().startswith(PNG_SIGNATURE)


def test_cli_plot_to_a_given_path(faulty_run: FakeRun, tmp_path: Path) -> None:
    png = tmp_path / "pictures" / "run.png"
    assert main([str(faulty_run.run_dir), "--plot", str(png)]) == 0
    assert png.read_bytes().startswith(PNG_SIGNATURE)


def _no_steps(run_dir: Path) -> None:
    (run_dir / "events").mkdir(parents=True)
    (run_dir / "events" / "rank0.jsonl").write_text('{"t": 1.0, "event": "run_start", "source": "rank0"}\n')


@pytest.mark.parametrize("prepare, where, expected", [
    (lambda d: None, "", "no such run directory (expected one holding events/*.jsonl)"),
    (lambda d: d.mkdir(), "events", "missing (expected the run's event log, events/*.jsonl)"),
    (lambda d: (d / "events").mkdir(parents=True), "events", "no events"),
    (_no_steps, "events", "no 'step' event (expected rank 0 to log"),
])
def test_cli_bad_input_names_the_path_and_what_was_expected(
        tmp_path: Path, capsys: pytest.CaptureFixture, prepare, where: str, expected: str) -> None:
    run_dir = tmp_path / "run"
    prepare(run_dir)
    assert main([str(run_dir)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {run_dir / where if where else run_dir}: ") and expected in err
    assert not (run_dir / "report.json").exists()


def test_cli_error_has_no_traceback(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "training.report", str(tmp_path / "absent")],
                          capture_output=True, text=True, cwd=Path(__file__).parents[2])
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr and "no such run directory" in proc.stderr
