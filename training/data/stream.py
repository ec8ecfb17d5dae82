"""A deterministic, resumable token stream.

Sample `i` is a pure function of (source, seed, i): from a pre-tokenized file or synthetic
(`TokenStream.sample`). The position (`consumed_samples`, part of the checkpoint) counts samples in the
order of their index, whatever the world size, so a run resumed at another world size continues at the same
sample, neither skipping nor repeating one, and with the same global batch size
(training.global_batch_size) its steps hold the same samples (`TokenStream.next_step`, `TokenStream.share`).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from training.contract.config import DataConfig, TrainingConfig
from training.data.token_file import token_dtype

# Synthetic structure: next = (MULT * prev + ADD) mod vocab, replaced by a random token with
# probability NOISE. A model that learns the recurrence gets well under the uniform loss.
_MULT, _ADD, _NOISE = 5, 3, 0.1


@dataclass
class Batch:
    inputs: torch.Tensor  # (B, seq_len) int64
    targets: torch.Tensor  # (B, seq_len) int64
    indices: list[int]  # global sample indices of the rows


class TokenStream:
    """One rank's view of the stream. A token file (training.data.token_file) is read through its sidecar:
    the loader takes the width from it, and refuses a model whose vocabulary is smaller than the tokenizer's.

    Args:
        training: the samples' shape (seq_len, batch_size) and the synthetic tokens' seed.
        data: the token file (path, dtype); no path: synthetic tokens.
        rank: this rank in the data-parallel world.
        world_size: the ranks that read the stream.
        vocab_size: the model's vocabulary (no token of the file may be outside it).
        rows: micro-batches per rank and step (TrainConfig.rows_per_step).
    """

    def __init__(self, training: TrainingConfig, data: DataConfig, *, rank: int, world_size: int, vocab_size: int,
                 rows: int = 1) -> None:
        self.seq_len, self.batch_size, self.accumulation_steps = training.seq_len, training.batch_size, rows
        self.rank, self.world_size = rank, world_size
        self.vocab_size, self.seed = vocab_size, training.seed
        self.consumed_samples = 0  # global: samples of all ranks in all completed steps
        self._tokens: np.ndarray | None = None
        if data.path is not None:
            self._tokens = np.memmap(data.path, dtype=np.dtype(token_dtype(data.path, data.dtype, vocab_size)),
                                     mode="r")
            if len(self._tokens) < self.seq_len + 1:
                raise ValueError(f"{data.path}: {len(self._tokens)} tokens, need at least seq_len+1 = "
                                 f"{self.seq_len + 1}")

    def sample(self, index: int) -> np.ndarray:
        """Sample `index`: from a token file, the window of `seq_len + 1` tokens at index * seq_len, wrapping
        around the file; synthetic, a noisy affine recurrence over the vocabulary, learnable so the loss drops."""
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

    @property
    def global_batch_size(self) -> int:
        """G = W·A·B: the samples of one optimizer step (W ranks, A micro-batches of B samples each)."""
        return self.world_size * self.accumulation_steps * self.batch_size

    def next_step(self) -> list[Batch]:
        """This rank's micro-batches of the next optimizer step, the position moved past the step. The step
        holds samples [consumed, consumed + G), of which rank `r` reads the contiguous A·B from
        consumed + r·A·B, micro-batch by micro-batch."""
        batches = self.share(0, self.accumulation_steps)
        self.advance()
        return batches

    def share(self, first_row: int, rows: int) -> list[Batch]:
        """This rank's micro-batches of the next step when its replica group trains `rows` of the step's rows
        from `first_row` on (a row: one micro-batch per rank; training.contract.replica_groups): the live
        groups split each step's samples by rows. The group's samples are contiguous, and each rank's within
        them; the position does not move, so a step that does not commit is run again from the same samples."""
        first = self.consumed_samples + (first_row * self.world_size + self.rank * rows) * self.batch_size
        return [self._batch(range(start, start + self.batch_size))
                for start in range(first, first + rows * self.batch_size, self.batch_size)]

    def advance(self) -> None:
        """Past the step: every row of it was trained, by whichever groups were live. With replica groups it
        is called only once the step committed, so a step run again holds the same samples."""
        self.consumed_samples += self.global_batch_size

    def _batch(self, indices: range) -> Batch:
        rows = torch.from_numpy(np.stack([self.sample(i) for i in indices]))
        return Batch(inputs=rows[:, :-1].contiguous(), targets=rows[:, 1:].contiguous(), indices=list(indices))

    def state_dict(self) -> dict[str, int]:
        return {"consumed_samples": self.consumed_samples}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.consumed_samples = int(state["consumed_samples"])


def write_token_file(path: str | Path, n_tokens: int, vocab_size: int, seed: int = 0, dtype: str = "uint16") -> Path:
    """A small pre-tokenized corpus with the synthetic structure (tests, local runs)."""
    stream = TokenStream(TrainingConfig(seq_len=n_tokens - 1, batch_size=1, seed=seed), DataConfig(), rank=0,
                         world_size=1, vocab_size=vocab_size)
    path = Path(path)
    stream.sample(0).astype(dtype).tofile(path)
    return path

