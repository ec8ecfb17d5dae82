"""Fixtures for the cdk8s charts: render `python k8s/main.py` in-process into tmp_path."""
from __future__ import annotations

from itertools import count
from pathlib import Path
from typing import Any, Callable

import pytest
from k8s_render import Rendered, render_into, run_main


@pytest.fixture
def render(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> Callable[..., Rendered]:
    """render(*cli_args, context={cdk context}, outputs=CDK_OUTPUTS or None) -> Rendered."""
    runs = count()
    return lambda *args, **inputs: render_into(tmp_path / f"run{next(runs)}", capsys, *args, **inputs)


@pytest.fixture
def render_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> Callable[..., str]:
    """render_error(*cli_args, context=..., outputs=...) -> the message; asserts exit 2, nothing written."""
    def _run(*args: str, **inputs: Any) -> str:
        rc, outdir = run_main(tmp_path, *args, **inputs)
        out, err = capsys.readouterr()
        assert rc == 2, f"expected a config error, got rc={rc}: {out}{err}"
        assert not list(outdir.glob("*.k8s.yaml")), "nothing may be written on a config error"
        assert err.startswith("error: ") and "Traceback" not in err
        return err
    return _run
