"""A Llama-style decoder in plain torch: RMSNorm, rotary embeddings, SwiGLU, grouped-query causal
attention through scaled_dot_product_attention. No weights or tokenizers come from a hub."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from training.contract.shapes import PRESETS, ModelArgs


def rope_tables(head_dim: int, seq_len: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    freqs = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float32), freqs)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: (batch, seq, heads, head_dim); rotate interleaved pairs
    x1, x2 = x.float().unflatten(-1, (-1, 2)).unbind(-1)
    cos, sin = cos[None, :, None, :], sin[None, :, None, :]
    out = torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)
    return out.type_as(x)


class Attention(nn.Module):
    def __init__(self, a: ModelArgs) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = a.n_heads, a.n_kv_heads, a.dim // a.n_heads
        self.wq = nn.Linear(a.dim, a.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(a.dim, a.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(a.dim, a.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(a.n_heads * self.head_dim, a.dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q = apply_rope(self.wq(x).view(b, s, self.n_heads, self.head_dim), cos, sin)
        k = apply_rope(self.wk(x).view(b, s, self.n_kv_heads, self.head_dim), cos, sin)
        v = self.wv(x).view(b, s, self.n_kv_heads, self.head_dim)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.n_kv_heads != self.n_heads)
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))


class FeedForward(nn.Module):
    def __init__(self, a: ModelArgs) -> None:
        super().__init__()
        self.w1 = nn.Linear(a.dim, a.ffn_hidden, bias=False)
        self.w2 = nn.Linear(a.ffn_hidden, a.dim, bias=False)
        self.w3 = nn.Linear(a.dim, a.ffn_hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, a: ModelArgs) -> None:
        super().__init__()
        self.attention_norm = nn.RMSNorm(a.dim, eps=a.norm_eps)
        self.attention = Attention(a)
        self.ffn_norm = nn.RMSNorm(a.dim, eps=a.norm_eps)
        self.feed_forward = FeedForward(a)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), cos, sin)
        return x + self.feed_forward(self.ffn_norm(x))


class Transformer(nn.Module):
    def __init__(self, a: ModelArgs) -> None:
        super().__init__()
        self.args = a
        self.tok_embeddings = nn.Embedding(a.vocab_size, a.dim)
        # ModuleDict with string keys, as torchtitan: stable FQNs for checkpoints
        self.layers = nn.ModuleDict({str(i): Block(a) for i in range(a.n_layers)})
        self.norm = nn.RMSNorm(a.dim, eps=a.norm_eps)
        self.output = nn.Linear(a.dim, a.vocab_size, bias=False)
        cos, sin = rope_tables(a.dim // a.n_heads, a.max_seq_len, a.rope_theta)
        # not persistent: recomputed on construction, so never part of a checkpoint
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def init_weights(self, seed: int) -> None:
        """Deterministic init from `seed`. Works on plain tensors (CPU: init, then shard) and on
        DTensor shards after `to_empty` (CUDA: build on meta, shard, materialise, init)."""
        cos, sin = rope_tables(self.args.dim // self.args.n_heads, self.args.max_seq_len, self.args.rope_theta)
        self.rope_cos.copy_(cos)
        self.rope_sin.copy_(sin)
        torch.manual_seed(seed)
        residual_std = 0.02 / math.sqrt(2 * self.args.n_layers)  # scale residual projections with depth
        with torch.no_grad():
            for name, p in self.named_parameters():
                if p.dim() == 1:  # norm weights
                    nn.init.ones_(p)
                else:
                    nn.init.normal_(p, std=residual_std if name.endswith(("wo.weight", "w2.weight")) else 0.02)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        s = tokens.shape[1]
        cos, sin = self.rope_cos[:s], self.rope_sin[:s]
        h = self.tok_embeddings(tokens)
        for layer in self.layers.values():
            h = layer(h, cos, sin)
        return self.output(self.norm(h)).float()


def build_model(preset: str, device: torch.device | str = "meta") -> Transformer:
    """The preset's model, uninitialised on `device` (meta by default: big presets are only
    materialised shard by shard, after fully_shard). Call `init_weights` once it is materialised."""
    with torch.device(device):
        return Transformer(PRESETS[preset])
