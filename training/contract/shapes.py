"""Model shapes and the sizes that follow from them, torch-free: the chart, the planner and the data checks
read them without building a model. training.models builds the modules these shapes describe; a Hugging Face
model's shape comes from its config.json (`model_source`).
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelArgs:
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    vocab_size: int
    ffn_hidden: int
    max_seq_len: int = 8192
    rope_theta: float = 500000.0
    norm_eps: float = 1e-5


# tiny: seconds per step on a CPU core; 1b and 8b: the Llama-3.2-1B and Llama-3.1-8B shapes.
PRESETS: dict[str, ModelArgs] = {
    "tiny": ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=256, ffn_hidden=192,
                      max_seq_len=1024, rope_theta=10000.0),
    "small": ModelArgs(dim=512, n_layers=8, n_heads=8, n_kv_heads=4, vocab_size=32000, ffn_hidden=1536),
    "1b": ModelArgs(dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, vocab_size=128256, ffn_hidden=8192),
    "8b": ModelArgs(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, vocab_size=128256, ffn_hidden=14336),
}
# Shapes the capacity model (`capacity`) projects but no config trains: 70b is the Llama-3.1-70B shape
# (Hugging Face meta-llama/Llama-3.1-70B config.json: hidden_size 8192, 80 layers, 64 heads, 8 KV heads,
# intermediate_size 28672, vocab 128256).
PROJECTED: dict[str, ModelArgs] = {
    "70b": ModelArgs(dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, vocab_size=128256, ffn_hidden=28672),
}


def shape(name: str) -> ModelArgs:
    """A preset's shape, or a projected one's."""
    return PRESETS[name] if name in PRESETS else PROJECTED[name]


# Bytes per parameter of the training state: fp32 weights, and AdamW's two fp32 moments.
PARAMETER_BYTES = 4
OPTIMIZER_BYTES = 8


@dataclass(frozen=True)
class ModelShape:
    """What every room needs to know of a model, preset or Hugging Face, without building it: FLOPs
    (`flops`), the data checks (vocabulary), the chart's and the capacity model's sizes."""
    name: str  # the preset's name, or the model directory
    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    head_dim: int
    parameters: int  # every parameter: what weights, gradients, optimizer state and checkpoints hold
    embedding_parameters: int  # the token embedding table: a lookup, not a matmul
    # the parameters one token's forward and backward go through, what FLOPs count: all of them in a dense
    # model; in a mixture of experts only the experts its router picks (num_experts_per_tok of each layer's)
    active_parameters: int
    tied_embeddings: bool = False  # the output projection is the embedding table: counted once, used twice

    @property
    def parameter_bytes(self) -> int:
        return PARAMETER_BYTES * self.parameters

    @property
    def optimizer_bytes(self) -> int:
        return OPTIMIZER_BYTES * self.parameters


def preset_shape(preset: str) -> ModelShape:
    """A preset's shape, or a projected one's."""
    a = shape(preset)
    return ModelShape(name=preset, vocab_size=a.vocab_size, dim=a.dim, n_layers=a.n_layers, n_heads=a.n_heads,
                      head_dim=a.dim // a.n_heads, parameters=parameter_count(preset),
                      embedding_parameters=a.vocab_size * a.dim, active_parameters=parameter_count(preset))


def parameter_count(preset: str) -> int:
    """The preset's parameters, counted from its shape (the same as summing the built model's: a test
    checks every preset): embedding, per block the attention projections, the SwiGLU feed-forward and two
    norms, then the final norm and the output projection."""
    a = shape(preset)
    head_dim = a.dim // a.n_heads
    attention = 2 * a.dim * a.n_heads * head_dim + 2 * a.dim * a.n_kv_heads * head_dim
    block = attention + 3 * a.dim * a.ffn_hidden + 2 * a.dim
    return a.vocab_size * a.dim + a.n_layers * block + a.dim + a.dim * a.vocab_size


# Peer state (training.train.peer_state): a rank's copy holds per parameter of its shard fp32 weights and
# AdamW's two fp32 moments; each node keeps SLOTS copies (the newest complete step and the one in flight).
PEER_STATE_SLOTS = 2
STATE_BYTES_PER_PARAMETER = PARAMETER_BYTES + OPTIMIZER_BYTES


def node_memory_bytes(parameters: int, nodes: int, replicas: int) -> int:
    """A node's memory for peer state: its share of the model, PEER_STATE_SLOTS copies of it and of each
    source's."""
    return PEER_STATE_SLOTS * (1 + min(replicas, nodes - 1)) * STATE_BYTES_PER_PARAMETER * parameters // nodes
