"""Where a run's model comes from, torch-free: a built-in preset, or a Hugging Face causal LM in a local
directory (config.json, optional *.safetensors and tokenizer files), e.g. /fsx/models/<name> put there by
the FSx import from S3. What can be judged from the directory's JSON files is judged here, before any rank
starts (training.local, training.train's start, the chart): a directory without config.json, an
architecture that is not a causal LM, a tokenizer whose vocabulary exceeds the model's. The weights'
names and shapes need the model itself (training.models.huggingface).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from training.contract.config import ModelConfig
from training.contract.shapes import ModelShape, preset_shape

HF_CONFIG = "config.json"
HF_TOKENIZER = "tokenizer.json"
# transformers names every causal LM class <Family>ForCausalLM (LlamaForCausalLM, Qwen2ForCausalLM, ...).
CAUSAL_LM_SUFFIX = "ForCausalLM"


class ModelSourceError(ValueError):
    """A model directory cannot be trained; the message names the directory, the file and what is wrong."""


def model_shape(model: ModelConfig) -> ModelShape:
    """The model's shape from its preset or its config.json (the chart's and the planner's sizes)."""
    if model.source == "preset":
        return preset_shape(model.preset)
    return hf_shape(read_hf_config(model.path), model.path)


def read_hf_config(directory: str | Path) -> dict[str, Any]:
    """The directory's config.json, refused unless it declares (or may be) a causal LM."""
    path = Path(directory) / HF_CONFIG
    if not Path(directory).is_dir():
        raise ModelSourceError(f"model.path={str(directory)!r}: no such directory (a Hugging Face model directory "
                               "with config.json; nothing is downloaded)")
    if not path.is_file():
        raise ModelSourceError(f"model.path={str(directory)!r} has no {HF_CONFIG}: a Hugging Face model directory "
                               "holds config.json (and optionally *.safetensors and tokenizer files)")
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise ModelSourceError(f"{path}: not a readable JSON file ({err})") from None
    if not isinstance(config, dict) or "model_type" not in config:
        raise ModelSourceError(f"{path}: not a transformers config (no model_type)")
    architectures = config.get("architectures") or []
    if architectures and not any(a.endswith(CAUSAL_LM_SUFFIX) for a in architectures):
        raise ModelSourceError(f"{path}: architectures {architectures} holds no causal LM (a class named "
                               f"*{CAUSAL_LM_SUFFIX}); only decoder language models train here")
    return config


def hf_shape(config: dict[str, Any], name: str) -> ModelShape:
    """A decoder's shape from its config: dense (Llama, Mistral, Qwen2 and their kin) or Mixtral's mixture
    of experts. Per layer the q/k/v/o projections (with the biases the family carries), the feed-forward
    (moe_feed_forward) and two norms; then the final norm and the output projection, unless tied to the
    embedding. The trainer counts the built model instead (training.models.huggingface); a test checks
    that both agree for each family the tests build."""
    dim, layers, heads = config["hidden_size"], config["num_hidden_layers"], config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads") or heads
    head_dim = config.get("head_dim") or dim // heads
    vocab, ffn = config["vocab_size"], config["intermediate_size"]
    q, kv = heads * head_dim, kv_heads * head_dim
    attention = 2 * dim * q + 2 * dim * kv
    if config["model_type"] == "qwen2":  # Qwen2 always has q/k/v biases
        attention += q + 2 * kv
    elif config.get("attention_bias"):  # Llama's and Mistral's optional biases, o_proj's included
        attention += q + 2 * kv + dim
    mlp = 3 * dim * ffn + (2 * ffn + dim if config.get("mlp_bias") else 0)  # gate, up and down projections
    total_mlp, active_mlp = moe_feed_forward(config, name, dim, mlp)
    embedding = vocab * dim
    tied = bool(config.get("tie_word_embeddings", False))
    output = 0 if tied else vocab * dim
    dense = embedding + layers * (attention + 2 * dim) + dim + output
    return ModelShape(name=name, vocab_size=vocab, dim=dim, n_layers=layers, n_heads=heads, head_dim=head_dim,
                      parameters=dense + layers * total_mlp, embedding_parameters=embedding,
                      active_parameters=dense + layers * active_mlp, tied_embeddings=tied)


# config.json keys by which transformers' mixture-of-experts families declare their experts (Mixtral's
# num_local_experts, Qwen2-MoE's num_experts, DeepSeek's n_routed_experts, ...)
MOE_KEYS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_intermediate_size")


def moe_feed_forward(config: dict[str, Any], name: str, dim: int, expert: int) -> tuple[int, int]:
    """One layer's feed-forward parameters, all of them and those a token goes through: the dense MLP's
    `expert` for both; in Mixtral's sparse MoE block (transformers MixtralSparseMoeBlock) a router without
    bias (dim x num_local_experts) and num_local_experts gated MLPs of intermediate_size, of which each token
    goes through num_experts_per_tok (Mixtral-8x7B: 46.7 B parameters, 12.9 B per token, as Mistral AI's
    "Mixtral of experts" announcement states; 47 B and 13 B in Jiang et al., arXiv:2401.04088). Other
    families' experts (shared experts, their own sizes, dense layers between) are refused rather than counted
    wrong: the chart's and the capacity model's memory and FSx figures would follow."""
    moe = [key for key in MOE_KEYS if config.get(key)]
    if not moe:
        return expert, expert
    if config["model_type"] != "mixtral":
        raise ModelSourceError(f"{name}: model_type {config['model_type']!r} is a mixture of experts ({moe[0]}="
                               f"{config[moe[0]]}) whose parameters are not counted here: only dense decoders and "
                               "Mixtral's experts (num_local_experts, num_experts_per_tok) size the checkpoints, "
                               "memory and FLOPs")
    experts, per_token = config["num_local_experts"], config["num_experts_per_tok"]
    router = dim * experts
    return router + experts * expert, router + per_token * expert


def tokenizer_vocab_size(directory: str | Path) -> int | None:
    """Ids a model directory's tokenizer.json can emit (the highest id of its vocabulary and added tokens,
    plus one), or None without one."""
    path = Path(directory) / HF_TOKENIZER
    if not path.is_file():
        return None
    try:
        tokenizer = json.loads(path.read_text())
        vocab = tokenizer["model"]["vocab"]
        ids = list(vocab.values()) if isinstance(vocab, dict) else list(range(len(vocab)))  # Unigram: a list
        ids += [t["id"] for t in tokenizer.get("added_tokens", [])]
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise ModelSourceError(f"{path}: not a tokenizers file ({err})") from None
    return max(ids) + 1 if ids else 0


def check_model_source(model: ModelConfig) -> ModelShape:
    """What the directory's JSON files can refuse, before any rank starts; the model's shape."""
    shape = model_shape(model)
    if model.source == "huggingface":
        ids = tokenizer_vocab_size(model.path)
        if ids is not None and ids > shape.vocab_size:
            raise ModelSourceError(f"{Path(model.path) / HF_TOKENIZER} emits ids up to {ids - 1}, beyond the model's "
                                   f"vocabulary of {shape.vocab_size} (config.json vocab_size): its tokens would "
                                   "index past the embedding table")
    return shape
