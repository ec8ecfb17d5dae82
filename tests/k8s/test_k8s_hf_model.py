"""The Job for a Hugging Face model (k8s/train-hf.yaml): its directory on FSx, its sizes from its config.json."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from infra.config import PlatformConfig
from k8s.job_config import JobConfig, JobConfigError
from k8s.outputs import load_infra_outputs
from training.contract.config import load_train_config

REPO = Path(__file__).resolve().parents[2]
TRAIN_HF = str(REPO / "k8s" / "train-hf.yaml")
# Meta-Llama-3.1-8B's config.json, the fields that size it (huggingface.co/meta-llama/Llama-3.1-8B)
LLAMA_31_8B = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
               "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
               "num_key_value_heads": 8, "vocab_size": 128256, "tie_word_embeddings": False}
# Mixtral-8x7B's (huggingface.co/mistralai/Mixtral-8x7B-v0.1): Mistral's attention, 8 experts per layer, 2 per token
MIXTRAL_8X7B = {**LLAMA_31_8B, "architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "vocab_size": 32000,
                "num_local_experts": 8, "num_experts_per_tok": 2}


def _local_copy(tmp_path: Path, config: dict) -> str:
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text(json.dumps(config))
    return str(tmp_path / "model")


def test_a_hf_model_job_reads_the_model_from_fsx_and_is_sized_from_its_config(render, render_error, tmp_path):
    small = _local_copy(tmp_path, {**LLAMA_31_8B, "num_hidden_layers": 2})
    r = render("--train-config", TRAIN_HF, "--model-dir", small)
    (train_yaml,) = r.config_map("fsdp-train-config").values()
    model = yaml.safe_load(train_yaml)["model"]
    assert model == {"source": "huggingface", "preset": "tiny", "path": "/fsx/datasets/models/Meta-Llama-3.1-8B"}


def test_llama_31_8b_is_sized_as_the_8b_preset(tmp_path):
    """The same shape, one from config.json, the other from the preset table: the same /dev/shm, the same
    capacity figures."""
    platform = PlatformConfig()
    infra = load_infra_outputs(platform, tmp_path / "no-outputs.json")
    hf = JobConfig(platform=platform, train=load_train_config(TRAIN_HF), infra=infra,
                   model_dir=_local_copy(tmp_path, LLAMA_31_8B))
    preset = JobConfig(platform=platform, train=load_train_config(REPO / "k8s" / "train.yaml"), infra=infra)
    assert hf.model_shape.parameters == preset.model_shape.parameters == 8030261248
    assert hf.peer_state_gib == preset.peer_state_gib > 0
    # the capacity model (training/contract/capacity.py) is fed the same: state bytes, FLOPs, save times
    assert (hf.capacity.model.parameters, hf.capacity.model.flops_per_token) == \
        (preset.capacity.model.parameters, preset.capacity.model.flops_per_token)
    assert hf.capacity.problems() == preset.capacity.problems()


def test_mixtral_is_sized_by_every_expert_and_computes_with_the_routed_ones(tmp_path):
    """Checkpoints, FSx and node memory hold all 8 experts of each layer; a token's FLOPs go through 2. Mistral
    AI's "Mixtral of experts": 46.7 B parameters, 12.9 B used per token (test_models.py checks the count
    exactly against the tiny Mixtral that transformers builds)."""
    platform = PlatformConfig()
    infra, model_dir = load_infra_outputs(platform, tmp_path / "no-outputs.json"), _local_copy(tmp_path, MIXTRAL_8X7B)
    refusals = {"must hold peer state 1044 GiB": [],  # counted as one dense MLP per layer: 162 GiB
                "an async save of 560.4 GB to FSx": ["peer_state.enabled=false"]}  # 12 bytes x 46.7 B
    for refusal, overrides in refusals.items():
        with pytest.raises(JobConfigError, match=refusal):
            JobConfig(platform=platform, train=load_train_config(TRAIN_HF, overrides), infra=infra, model_dir=model_dir)
    fits = ["peer_state.enabled=false", "checkpoint.interval=500", "checkpoint.keep=1",
            "fault_tolerance.drain_timeout_s=1500"]
    job = JobConfig(platform=platform, train=load_train_config(TRAIN_HF, fits), infra=infra, model_dir=model_dir)
    shape = job.model_shape
    assert (round(shape.parameters / 1e9, 1), round(shape.active_parameters / 1e9, 1)) == (46.7, 12.9)
    assert job.capacity.model.state_bytes == 12 * shape.parameters  # fp32 weights and two AdamW moments
    attention = 12 * 32 * 32 * 128 * job.train.training.seq_len
    assert job.capacity.model.flops_per_token == 6 * (shape.active_parameters - 32000 * 4096) + attention


def test_a_hf_model_job_needs_its_config_and_a_path_on_fsx(render_error, tmp_path):
    assert "pass --model-dir with a local copy of /fsx/datasets/models/Meta-Llama-3.1-8B" in render_error(
        "--train-config", TRAIN_HF)
    err = render_error("--train-config", TRAIN_HF, "--set", "model.path=/opt/models/x",
                       "--model-dir", _local_copy(tmp_path, LLAMA_31_8B))
    assert "model.path='/opt/models/x' is not allowed on the cluster: the pods read the model from FSx" in err
