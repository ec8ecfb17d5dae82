"""One progress line every N steps (rank 0): step, loss, tokens/s, MFU (with a known GPU peak), step time, ETA."""
from __future__ import annotations

import time
from datetime import timedelta
from logging import getLogger

from training.contract.config import LoggingConfig, TrainingConfig
from training.contract.flops import mfu

log = getLogger("training.train.progress")


class Progress:
    """Rank 0's progress line: `update` after every step.

    Args:
        training: training.steps, the last step (its line is always written).
        logging: logging.log_interval, the steps between lines.
        enabled: whether this process writes the lines (rank 0).
        flops_per_token: the model's training FLOPs per token (MFU's numerator).
        gpus: the GPUs of the run (MFU's denominator, with the peak).
        gpu_peak_tflops: one GPU's peak; None: no MFU (a CPU run).
    """

    def __init__(self, training: TrainingConfig, logging: LoggingConfig, *, enabled: bool, flops_per_token: int = 0,
                 gpus: int = 1, gpu_peak_tflops: float | None = None) -> None:
        self.total, self.interval, self.enabled = training.steps, logging.log_interval, enabled
        self.flops_per_token, self.gpus, self.gpu_peak_tflops = flops_per_token, gpus, gpu_peak_tflops
        self._t_last = time.monotonic()
        self._tokens = 0
        self._steps = 0

    def update(self, step: int, loss: float, step_time_s: float, tokens: int) -> None:
        self._tokens += tokens
        self._steps += 1
        if not self.enabled or (step % self.interval and step != self.total):
            return
        now = time.monotonic()
        elapsed = max(now - self._t_last, 1e-9)
        per_step = elapsed / self._steps
        eta = timedelta(seconds=round(per_step * (self.total - step)))
        tokens_per_s = self._tokens / elapsed
        # MFU only against a GPU's peak: a CPU has no comparable figure
        utilization = (f" | MFU {mfu(tokens_per_s, self.flops_per_token, self.gpus, self.gpu_peak_tflops):.1%}"
                       if self.gpu_peak_tflops else "")
        log.info("step %d/%d | loss %.4f | %.0f tok/s%s | step %.3f s | ETA %s",
                 step, self.total, loss, tokens_per_s, utilization, step_time_s, eta)
        self._t_last, self._tokens, self._steps = now, 0, 0
