"""Model FLOPs utilization (MFU): the FLOPs a step must do, over what the GPUs could do at peak.

FLOPs per token of a training step (forward and backward) are 6·N + 12·L·H·Q·T, as in PaLM (Chowdhery et
al. 2022, appendix B) and torchtitan's get_nparams_and_flops (`flops_per_token`). By convention neither
causal masking (half of it is skipped) nor activation recomputation is counted, so figures compare across
codebases.
"""
from __future__ import annotations

from training.contract.shapes import ModelShape


def flops_per_token(shape: ModelShape, seq_len: int) -> int:
    """6·N + 12·L·H·Q·T, of any model, preset or Hugging Face: its shape carries the counts (training.models
    spec.shape).

    N: the parameters a token goes through less the embedding table (a lookup, no matmul; the output
    projection is a matmul and counts, tied to the table or not); in a mixture of experts only the experts
    the router picks per token (torchtitan's get_moe_model_nparams_and_flops counts them alike). L layers,
    H query heads, Q = dim / H the head dimension, T the sequence length (`seq_len`). 6·N: one multiply-add
    per parameter forward, two backward. 12·L·H·Q·T: the two attention matmuls (QKᵀ, and the scores times V),
    forward and backward; neither causal masking nor activation recomputation is counted."""
    # a tied table is counted once, and its use as the output projection is a matmul (as torchtitan counts it)
    non_embedding = shape.active_parameters - (0 if shape.tied_embeddings else shape.embedding_parameters)
    return 6 * non_embedding + 12 * shape.n_layers * shape.n_heads * shape.head_dim * seq_len


def mfu(tokens_per_s: float, flops_per_token: int, gpus: int, gpu_peak_tflops: float) -> float:
    """The share of the GPUs' dense bf16 peak that the model's FLOPs at this throughput use."""
    return tokens_per_s * flops_per_token / (gpus * gpu_peak_tflops * 1e12)
