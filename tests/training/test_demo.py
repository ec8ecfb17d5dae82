"""What `make demo` shows (`python -m training.local --demo`): the product at its best. A crashed rank, a lost node
and a killed rank each cost at most peer state's interval of one step, usually none (the hot spare takes the lost
node's place), where the newest checkpoint was 19 steps back, and the report's last lines say so."""
from __future__ import annotations

import math

import pytest

from training.contract.config import load_train_config
from training.contract.events import read_events
from training.contract.launcher import NVRX_LAST_CALL_S, rendezvous_last_call_s
from training.local.cli import DEMO_FAULTS, DEMO_OVERRIDES, parse_args
from training.local.cluster import WORKERS_STOP_TIMEOUT_S
from training.report.goodput import build_report
from training_helpers import completed, events_named, run_local


def test_the_demo_runs_peer_state_and_a_hot_spare_through_a_lost_node():
    args = parse_args(["--demo"])
    assert (args.spares, args.steps, args.faults) == (1, 160, list(DEMO_FAULTS))
    assert [spec.split("@")[0] for spec in DEMO_FAULTS] == ["exception", "node-loss", "sigkill"]
    cfg = load_train_config(None, list(DEMO_OVERRIDES))
    assert cfg.peer_state.enabled and cfg.peer_state.interval == 1
    # the replacement joins after the survivors: a restart round waits for no lost node longer than NVRx's 1 s
    assert rendezvous_last_call_s(cfg.fault_tolerance, args.spares, args.replacement_delay,
                                  WORKERS_STOP_TIMEOUT_S) == NVRX_LAST_CALL_S
    plain = parse_args([])
    assert (plain.spares, plain.replacement_delay) == (0, 0.0)


@pytest.mark.slow
def test_the_demo_loses_no_completed_step_and_its_report_says_so(tmp_path):
    run = completed(run_local(tmp_path / "run", "--demo", timeout=420))
    faults = build_report(read_events(run.run_dir)).faults
    assert [(f.kind, f.checkpoint_steps_lost) for f in faults] == [("exception", 19), ("node-loss", 19), ("sigkill", 19)]
    # peer state's promise: at most its interval per fault. A kill right after a step can land before that step's
    # copy is committed (PeerState._replicate), and then costs the step; any more would be a broken promise.
    interval = load_train_config(None, list(DEMO_OVERRIDES)).peer_state.interval
    assert all(f.steps_lost is not None and f.steps_lost <= interval for f in faults), faults
    assert [f.restart_kind for f in faults] == ["injob", "node", "injob"]
    assert all(f.recovery_s is not None and math.isfinite(f.recovery_s) for f in faults)
    # every restart resumed from node memory, the lost node's ranks from their partner's copies
    assert [e["source_kind"] for e in events_named(run.run_dir, "resume")] == ["none", "peer", "peer", "peer"]
    lines = run.output.splitlines()  # stdout, then stderr: the report ends stdout
    lost = lines.index(f"Lost: {sum(f.steps_lost for f in faults)} completed step(s) to 3 fault(s); a resume from the "
                       "newest checkpoint would have lost 19 + 19 + 19")
    assert lines[lost + 1].startswith("Recovered in ") and lines[lost + 1].count(" s (") == 3
