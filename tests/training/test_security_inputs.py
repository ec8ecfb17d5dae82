"""Issue 16.6 in the training package: the chaos switch for destructive faults in a pod, and report
outputs that never follow a symlink planted in the (pod-writable) run directory."""
from __future__ import annotations

import time

import pytest

from training.train import trainer as train
from training.contract.events import EventLog
from training.contract.exit_codes import CONFIG_ERROR
from training.contract.faults import (DESTRUCTIVE_KINDS, ENV_VAR, POD_ENV, FaultSpecError, check_chaos_switch,
                                      parse_faults)
from training.report.cli import write_report
from training_helpers import exit_code

DESTRUCTIVE = ["corrupt-ckpt@5", "disk-full@5", "fs-eio@5:duration=5", "lighthouse-loss@5", "node-hang@5:node=0",
               "node-loss@5:node=0", "partition@5:node=0"]


def test_every_destructive_kind_is_refused_in_a_pod_without_the_switch(monkeypatch):
    monkeypatch.setenv(POD_ENV, "172.20.0.1")
    assert {spec.kind for spec in parse_faults(DESTRUCTIVE)} == DESTRUCTIVE_KINDS
    for text in DESTRUCTIVE:
        with pytest.raises(FaultSpecError, match="allow_destructive_faults=true"):
            check_chaos_switch(parse_faults([text]), allowed=False)
        check_chaos_switch(parse_faults([text]), allowed=True)
    check_chaos_switch(parse_faults(["exception@5:rank=0", "sigkill@6", "hang@7", "drain@8:node=0"]), allowed=False)


def test_outside_a_pod_the_local_cluster_needs_no_switch(monkeypatch):
    monkeypatch.delenv(POD_ENV, raising=False)
    check_chaos_switch(parse_faults(DESTRUCTIVE), allowed=False)


def test_training_faults_alone_cannot_turn_them_on_in_a_pod(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv(POD_ENV, "172.20.0.1")
    monkeypatch.setenv(ENV_VAR, "corrupt-ckpt@3")
    assert exit_code(train.main, [f"run_dir={tmp_path}"]) == CONFIG_ERROR
    assert "corrupt-ckpt@3" in capsys.readouterr().err


def _run_with_events(run_dir):
    events = EventLog(run_dir, "rank0")
    events.emit("attempt_start", attempt=0, world_size=1)
    for step in (1, 2):
        events.emit("step", step=step, loss=1.0 / step, step_time_s=0.1)
        time.sleep(0.01)


def test_report_outputs_replace_a_planted_symlink_and_leave_its_target_alone(tmp_path):
    run_dir, victim = tmp_path / "run", tmp_path / "victim"
    run_dir.mkdir()
    _run_with_events(run_dir)
    victim.write_text("precious")
    for name in ("report.json", "timeline.png"):
        (run_dir / name).symlink_to(victim)
    write_report(run_dir, plot=True)
    assert victim.read_text() == "precious"
    for name in ("report.json", "timeline.png"):
        assert not (run_dir / name).is_symlink() and (run_dir / name).stat().st_size > 0
    assert (run_dir / "timeline.png").read_bytes().startswith(b"\x89PNG")
    assert sorted(p.name for p in run_dir.iterdir() if p.name.startswith(".")) == []  # no temp file left
