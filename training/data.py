"""A deterministic, resumable token stream.

Sample `i` is a pure function of (source, seed, i): from a pre-tokenized file (sample i is the
window of `seq_len + 1` tokens at i * seq_len, wrapping around the file) or synthetic (a noisy
affine recurrence over the vocabulary, learnable so the loss drops). At step `s` (1-based) the
global batch holds samples [(s-1)·B·W, s·B·W); data-parallel rank `r` reads the contiguous slice
[(s-1)·B·W + r·B, … + B). The position (`consumed_samples`) is part of the checkpoint, so a
resumed run neither skips nor repeats a sample.

A token file made by `python -m training.data prepare` (training/data_prepare.py) has a JSON sidecar,
FILE.json, that names its token width and vocabulary: the loader takes the width from it, and refuses a
model whose vocabulary is smaller than the tokenizer's.
"""
from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from training.model import PRESETS

# Synthetic structure: next = (MULT * prev + ADD) mod vocab, replaced by a random token with
# probability NOISE. A model that learns the recurrence gets well under the uniform loss.
_MULT, _ADD, _NOISE = 5, 3, 0.1


class DataError(ValueError):
    """A token file cannot serve this run; the message names the file and what is wrong."""


def sidecar_path(token_file: str | Path) -> Path:
    return Path(f"{token_file}.json")


def read_sidecar(token_file: str | Path) -> dict[str, Any] | None:
    """The token file's sidecar written by `prepare`, or None for a file without one."""
    path = sidecar_path(token_file)
    if not path.exists():
        return None
    try:
        info = json.loads(path.read_text())
        info["dtype"], info["vocab_size"], info["tokens"]  # noqa: B018  (the fields the loader relies on)
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise DataError(f"{path}: not a token file sidecar written by `python -m training.data prepare` ({err})")
    return info


def token_dtype(token_file: str | Path, configured: str | None, vocab_size: int) -> str:
    """The file's token width: the sidecar's (a configured one must agree), else `configured` or uint16.
    A tokenizer vocabulary larger than the model's (`vocab_size`) is refused: its ids would not fit."""
    info = read_sidecar(token_file)
    if info is None:
        return configured or "uint16"
    if configured is not None and configured != info["dtype"]:
        raise DataError(f"data.dtype={configured!r} contradicts {sidecar_path(token_file)}, which says "
                        f"{info['dtype']!r}: leave data.dtype unset to take the file's")
    if info["vocab_size"] > vocab_size:
        raise DataError(f"{token_file} was tokenized with a vocabulary of {info['vocab_size']} "
                        f"({info.get('tokenizer', {}).get('path', 'its tokenizer')}), larger than the model's "
                        f"{vocab_size}: choose a model.preset whose vocabulary holds at least {info['vocab_size']}")
    expected = info["tokens"] * np.dtype(info["dtype"]).itemsize
    if Path(token_file).stat().st_size != expected:
        raise DataError(f"{token_file}: {Path(token_file).stat().st_size} bytes, but its sidecar says "
                        f"{info['tokens']} {info['dtype']} tokens ({expected} bytes): prepare it again")
    return info["dtype"]


def check_token_file(path: str | None, dtype: str | None, preset: str) -> None:
    """What `token_dtype` refuses, before any rank starts (training.train, training.local)."""
    if path is not None:
        if not Path(path).is_file():
            raise DataError(f"data.path={path!r}: no such file (a .bin from `python -m training.data prepare`)")
        token_dtype(path, dtype, PRESETS[preset].vocab_size)


@dataclass
class Batch:
    inputs: torch.Tensor  # (B, seq_len) int64
    targets: torch.Tensor  # (B, seq_len) int64
    indices: list[int]  # global sample indices of the rows


class TokenStream:
    def __init__(self, *, seq_len: int, batch_size: int, rank: int, world_size: int, vocab_size: int,
                 seed: int, path: str | None = None, dtype: str | None = None) -> None:
        self.seq_len, self.batch_size = seq_len, batch_size
        self.rank, self.world_size = rank, world_size
        self.vocab_size, self.seed = vocab_size, seed
        self.consumed_samples = 0  # global: samples of all ranks in all completed steps
        self._tokens: np.ndarray | None = None
        if path is not None:
            self._tokens = np.memmap(path, dtype=np.dtype(token_dtype(path, dtype, vocab_size)), mode="r")
            if len(self._tokens) < seq_len + 1:
                raise ValueError(f"{path}: {len(self._tokens)} tokens, need at least seq_len+1 = {seq_len + 1}")

    def sample(self, index: int) -> np.ndarray:
        n = self.seq_len + 1
        if self._tokens is not None:
            start = (index * self.seq_len) % (len(self._tokens) - n + 1)
            window = np.asarray(self._tokens[start:start + n], dtype=np.int64)
            if window.max(initial=0) >= self.vocab_size:
                raise ValueError(f"token {int(window.max())} in sample {index} is outside the vocabulary ({self.vocab_size})")
            return window
        rng = np.random.default_rng([self.seed, index])
        noise = rng.random(n) < _NOISE
        random_tokens = rng.integers(0, self.vocab_size, n)
        out = np.empty(n, dtype=np.int64)
        out[0] = random_tokens[0]
        for t in range(1, n):
            out[t] = random_tokens[t] if noise[t] else (_MULT * out[t - 1] + _ADD) % self.vocab_size
        return out

    def next_batch(self) -> Batch:
        first = self.consumed_samples + self.rank * self.batch_size
        indices = list(range(first, first + self.batch_size))
        rows = torch.from_numpy(np.stack([self.sample(i) for i in indices]))
        self.consumed_samples += self.batch_size * self.world_size
        return Batch(inputs=rows[:, :-1].contiguous(), targets=rows[:, 1:].contiguous(), indices=indices)

    def state_dict(self) -> dict[str, int]:
        return {"consumed_samples": self.consumed_samples}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.consumed_samples = int(state["consumed_samples"])


def write_token_file(path: str | Path, n_tokens: int, vocab_size: int, seed: int = 0, dtype: str = "uint16") -> Path:
    """A small pre-tokenized corpus with the synthetic structure (tests, local runs)."""
    stream = TokenStream(seq_len=n_tokens - 1, batch_size=1, rank=0, world_size=1, vocab_size=vocab_size, seed=seed)
    path = Path(path)
    stream.sample(0).astype(dtype).tofile(path)
    return path


if __name__ == "__main__":
    from training.data_prepare import main  # tokenizers only when preparing

    sys.exit(main())
