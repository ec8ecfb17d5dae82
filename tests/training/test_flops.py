"""MFU arithmetic against hand computations, and the progress line that shows it (GPU) or not (CPU)."""
from __future__ import annotations

import logging

import pytest

from training.contract.config import LoggingConfig, TrainingConfig
from training.contract.flops import flops_per_token, mfu
from training.contract.shapes import preset_shape
from training.train.progress import Progress


def test_flops_per_token_of_the_tiny_preset_by_hand():
    # dim 64, 2 layers, 4 heads (head dim 16), 2 kv heads, ffn 192, vocab 256. Per layer: wq 64·64 + wo 64·64
    # + wk 64·32 + wv 64·32 = 12288, w1/w2/w3 3·64·192 = 36864, two norms 128: 49280. Non-embedding N =
    # 2·49280 + final norm 64 + output 64·256 = 115008. Attention at T = 64: 12·2·4·16·64 = 98304.
    assert flops_per_token(preset_shape("tiny"), 64) == 6 * 115008 + 98304 == 788352


def test_flops_per_token_of_the_8b_preset_by_hand():
    # Llama 3.1 8B shapes: per layer 4096·128·(2·32 + 2·8) + 3·4096·14336 + 2·4096 = 218112000; N = 32 of
    # them + 4096 + 4096·128256 (output) = 7504924672 (8.03 B with the 525 M embedding table, as Meta
    # states). Attention at T = 4096: 12·32·32·128·4096 = 6442450944.
    assert flops_per_token(preset_shape("8b"), 4096) == 6 * 7504924672 + 6442450944


def test_mfu_is_model_flops_over_the_gpus_peak():
    # 8 H100 (989 TFLOPs dense bf16 each) at 3000 tokens/s per GPU on the 8b preset:
    # 24000 · 51471998976 / (8 · 989e12) = 0.156134
    assert mfu(24000, 51471998976, gpus=8, gpu_peak_tflops=989.0) == pytest.approx(0.156134, abs=1e-6)


@pytest.mark.parametrize("gpu_peak, shown", [(989.0, True), (None, False)])
def test_progress_line_shows_mfu_only_against_a_gpu_peak(caplog, gpu_peak, shown):
    progress = Progress(TrainingConfig(steps=10), LoggingConfig(log_interval=1), enabled=True,
                        flops_per_token=flops_per_token(preset_shape("tiny"), 64), gpus=2, gpu_peak_tflops=gpu_peak)
    with caplog.at_level(logging.INFO, logger="training.train.progress"):
        progress.update(1, loss=2.0, step_time_s=0.1, tokens=512)
    (line,) = caplog.messages
    assert "tok/s" in line
    assert ("MFU" in line) is shown
