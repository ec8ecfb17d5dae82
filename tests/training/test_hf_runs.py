"""Every fault-tolerance mechanism with a Hugging Face model, in the local cluster: the model is a tiny
Llama (and a Qwen2) written here from a config, trained from its safetensors (Llama) or from the seed
(Qwen2). The mechanisms see state dicts, not models: each run must end bitwise equal to an uninterrupted
run of the same model, as the preset's fault matrix does (test_fault_matrix.py)."""
from __future__ import annotations

import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM

from training.contract.events import read_events
from training.export.export import export
from training.models.tiny import write_tiny_model
from training.report.goodput import build_report
from training_helpers import (COMMON, ONE_NODE, TWO_NODES, assert_bitwise_equal, completed, events_named,
                              load_final_state, run_local)

pytestmark = pytest.mark.slow
PEER_STATE = ("peer_state.enabled=true", "peer_state.interval=1")
# the Wrapper's timeouts as test_fault_matrix's "both" mode
IN_PROCESS = ("fault_tolerance.restart=both", "fault_tolerance.timeout_safety_factor=5",
              "fault_tolerance.inprocess_soft_timeout=4", "fault_tolerance.inprocess_hard_timeout=15")


def hf(model_dir) -> tuple[str, ...]:
    return ("model.source=huggingface", f"model.path={model_dir}")


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("llama"), "llama")


@pytest.fixture(scope="module")
def llama_reference(tmp_path_factory, llama):
    return completed(run_local(tmp_path_factory.mktemp("ref") / "run", *ONE_NODE, *COMMON, "checkpoint.mode=sync",
                               *hf(llama)))


def test_peer_state_onto_a_spare_and_a_drain_resume_a_hf_model_exactly(llama, llama_reference, tmp_path, scratch):
    """Node 1 is lost (its rank's state from node 0's memory onto the spare), then node 0 is drained (it
    commits the step reached). The pretrained weights are read once, at the start."""
    faults = "node-loss@8:node=1,drain@14:node=0"
    run = completed(run_local(tmp_path / "run", *TWO_NODES, "--spares", "1", *COMMON, "checkpoint.mode=sync",
                              *PEER_STATE, *hf(llama), "--faults", faults))
    assert [e["spec"] for e in events_named(run.run_dir, "fault_injected")] == faults.split(",")
    [drained] = events_named(run.run_dir, "drained")
    resumes = [(e["step"], e["source_kind"]) for e in events_named(run.run_dir, "resume")]
    assert resumes in ([(0, "none"), (7, "peer"), (drained["step"], "disk")],
                       [(0, "none"), (8, "peer"), (drained["step"], "disk")])  # not the checkpoint of step 5
    assert all(f.steps_lost == 0 for f in build_report(read_events(run.run_dir)).faults)
    assert run.output.count("from its pretrained weights") == 1  # every resume loaded the run's own state
    assert_bitwise_equal(load_final_state(run.run_dir, scratch), load_final_state(llama_reference.run_dir, scratch))


def test_a_hf_model_rolls_back_in_memory_exactly(llama, llama_reference, tmp_path, scratch):
    run = completed(run_local(tmp_path / "run", *ONE_NODE, *COMMON, "checkpoint.mode=sync", *IN_PROCESS, *hf(llama),
                              "--faults", "exception@6:rank=1"))
    assert [(e["step"], e["source_kind"]) for e in events_named(run.run_dir, "resume")] == [(0, "none"), (5, "memory")]
    assert_bitwise_equal(load_final_state(run.run_dir, scratch), load_final_state(llama_reference.run_dir, scratch))


def test_a_hf_checkpoint_reshards_to_another_world_size_and_exports(llama_reference, tmp_path):
    checkpoints = tmp_path / "run" / "checkpoints"
    shutil.copytree(llama_reference.run_dir / "checkpoints" / "step_00000010", checkpoints / "step_00000010")
    run = completed(run_local(tmp_path / "run", "--nodes", "1", "--nproc-per-node", "1", *COMMON,
                              "checkpoint.mode=sync", *hf(llama_reference_model(llama_reference))))
    assert [(e["step"], e["saved_world_size"]) for e in events_named(run.run_dir, "resume")] == [(10, 2)]
    # the finished run's model, exported, loads with transformers and computes what the run's final state does
    export(run.run_dir, tmp_path / "export")
    tokens = torch.randint(0, 256, (2, 16))
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "export")
    final = load_final_state(run.run_dir, tmp_path)["model"]
    trained = AutoModelForCausalLM.from_pretrained(llama_reference_model(llama_reference))
    trained.load_state_dict(final)
    torch.testing.assert_close(exported(tokens).logits, trained(tokens).logits, rtol=0, atol=0)


def llama_reference_model(reference) -> str:
    return next(e for e in read_events(reference.run_dir) if e["event"] == "run_start")["config"]["model"]["path"]


def test_a_second_family_resumes_exactly_after_a_fault(tmp_path, scratch):
    """Qwen2 (attention biases), from its seeded initialisation: a rank's exception, back to step 5."""
    qwen2 = write_tiny_model(tmp_path / "qwen2", "qwen2", weights=False)
    args = (*ONE_NODE, *COMMON, "--steps", "10", "checkpoint.mode=sync", *hf(qwen2))
    reference = completed(run_local(tmp_path / "ref", *args))
    run = completed(run_local(tmp_path / "run", *args, "--faults", "exception@7:rank=1"))
    assert [e["step"] for e in events_named(run.run_dir, "resume")] == [0, 5]
    assert_bitwise_equal(load_final_state(run.run_dir, scratch), load_final_state(reference.run_dir, scratch))
