"""The quick mode's machinery on tiny sizes: a real two-rank stall pass, each mechanism's faults, and
fault runs on the local cluster (plain Kubernetes restart: node 0 lost, every node's pod replaced; a drain)."""
from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from bench.mechanisms import (MECHANISMS, Mechanism, Unavailable, cluster_spec, fault_specs, measure_mechanism,
                              step_period)
from bench.profile import QUICK
from bench.stall import StallSpec, measure_stall
from training.contract.events import read_events

TINY = replace(QUICK, faults=1, first_fault=6, tail_steps=2, checkpoint_interval=4)


def test_a_mechanism_without_its_module_is_not_available(tmp_path: Path) -> None:
    missing = Mechanism("inprocess", "in-process", "inprocess", "exception", True, "inprocess",
                        needs_module="training.no_such_module")
    with pytest.raises(Unavailable, match="training.no_such_module does not exist"):
        measure_mechanism(missing, TINY, tmp_path / "run")
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_stall_saves_the_same_state_sync_and_async_in_two_ranks(tmp_path: Path) -> None:
    s = measure_stall(StallSpec(state_bytes=8 << 20, world=2, saves=2, matmuls_per_step=1), tmp_path)
    assert s.state_bytes >= 8 << 20  # measured on disk: both ranks' shards
    assert 5 <= s.interval_steps <= 100 and s.steps == 2 * s.interval_steps  # calibrated
    assert len(s.sync_blocking_per_save_s) == len(s.async_blocking_per_save_s) == 2
    assert s.sync_blocking_s > 0 and s.async_blocking_s > 0
    assert s.efficiency_sync > 0 and s.efficiency_async > 0
    assert s.cpu_per_save_sync_s is not None and s.cpu_per_save_async_s is not None  # measured on CPU
    assert s.writer_cpu_per_save_async_s > 0  # the async writer process's, measured apart from the rank's


def test_each_mechanism_gets_its_fault_on_the_right_rank_or_node() -> None:
    specs = {m.name: fault_specs(m, replace(QUICK, nodes=2, nproc_per_node=2, faults=2)) for m in MECHANISMS}
    assert specs == {"inprocess": ("exception@15:rank=3", "exception@55:rank=3"),
                     "injob": ("exception@15:rank=3", "exception@55:rank=3"),
                     "injob_hf": ("exception@15:rank=3", "exception@55:rank=3"),
                     "injob_fresh": ("exception@15:rank=3", "exception@55:rank=3"),
                     "node_replacement": ("node-loss@15:node=1", "node-loss@55:node=1"),
                     "node_zero": ("node-loss@15:node=0", "node-loss@55:node=0"),
                     # with a spare, the node that runs the last rank, wherever it is after a takeover, and
                     # room for the lost node's replacement to be on standby before the next fault
                     "hot_spare": ("node-loss@15:rank=3", "node-loss@265:rank=3"),
                     "peer_state": ("node-loss@15:rank=3", "node-loss@265:rank=3"),
                     "drain": ("drain@15:node=1", "drain@55:node=1"),
                     "partition": ("partition@15:rank=3", "partition@265:rank=3"),
                     "node_hang": ("node-hang@15:node=1", "node-hang@55:node=1"),
                     "k8s_restart": ("node-loss@15:node=0", "node-loss@55:node=0"),
                     "hang": ("hang@15:rank=3", "hang@55:rank=3"),
                     "node_zero_both": ("node-loss@15:node=0", "node-loss@55:node=0"),
                     "partition_both": ("partition@15:rank=3", "partition@265:rank=3"),
                     "hang_both": ("hang@15:rank=3", "hang@55:rank=3"),
                     # a group of one node each: the faulted group's node, healed past the other's steps
                     # before its next fault
                     "replica_groups": ("node-loss@15:node=0:group=1", "node-loss@265:node=0:group=1")}


def test_the_hugging_face_row_trains_a_tiny_model_it_writes_beside_the_run(tmp_path: Path) -> None:
    m = next(m for m in MECHANISMS if m.name == "injob_hf")
    spec = cluster_spec(m, QUICK, tmp_path / "runs" / m.name)
    model_dir = tmp_path / "runs" / "tiny-hf-llama"
    assert {"model.source=huggingface", f"model.path={model_dir}"} <= set(spec.overrides)
    assert not any(o.startswith("model.preset=") for o in spec.overrides)
    assert json.loads((model_dir / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
    assert (model_dir / "model.safetensors").is_file()


@pytest.mark.slow
def test_a_plain_restart_run_gives_its_recovery_figures(tmp_path: Path) -> None:
    m = next(m for m in MECHANISMS if m.name == "k8s_restart")
    r = measure_mechanism(m, TINY, tmp_path / m.name)
    assert (r.faults, r.recovered, r.status, r.restart_kinds) == (1, 1, "completed", ("node",))
    assert r.median_recovery_s > 0 and r.median_detection_s is not None
    assert r.training_goodput <= r.infra_goodput <= 1
    # without in-job restarts every launcher stopped: both nodes' pods were replaced (a replacement that
    # meets the store before it restarts fails once more)
    assert {e["node"] for e in read_events(r.run_dir) if e["event"] == "node_replaced"} == {0, 1}


@pytest.mark.slow
def test_a_drain_run_commits_the_step_reached_and_replaces_the_node(tmp_path: Path) -> None:
    m = next(m for m in MECHANISMS if m.name == "drain")
    r = measure_mechanism(m, replace(TINY, tail_steps=QUICK.tail_steps), tmp_path / m.name)
    assert (r.faults, r.recovered, r.status, r.restart_kinds) == (1, 1, "completed", ("node",))
    assert r.max_steps_lost == 0
    assert r.median_recovery_s > 0 and r.median_detection_s is not None


def test_the_step_period_counts_only_steps_in_a_row():
    # steps 1-4 at 0.1 s each, a restart (10 s) and step 4 run again, then step 5: the restart is no step
    times = [(1, 0.0), (2, 0.1), (3, 0.2), (4, 0.3), (4, 10.3), (5, 10.5)]
    events = [{"event": "step", "step": step, "t": t} for step, t in times]
    assert step_period(events) == pytest.approx(0.1)
    assert step_period([{"event": "step", "step": 1, "t": 0.0}]) is None

