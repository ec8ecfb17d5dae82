"""One progress line every N steps (rank 0): step, loss, tokens/s, MFU (with a known GPU peak), step time, ETA."""
from __future__ import annotations

import logging
import time
from datetime import timedelta

from training.contract.config import TrainConfig
from training.contract.flops import mfu

log = logging.getLogger("training.train.progress")


class Progress:
    def __init__(self, total_steps: int, interval: int, enabled: bool, flops_per_token: int = 0, gpus: int = 1,
                 gpu_peak_tflops: float | None = None) -> None:
        self.total, self.interval, self.enabled = total_steps, interval, enabled
        self.flops_per_token, self.gpus, self.gpu_peak_tflops = flops_per_token, gpus, gpu_peak_tflops
        self._t_last = time.monotonic()
        self._tokens = 0
        self._steps = 0

    @classmethod
    def of(cls, cfg: TrainConfig, *, enabled: bool, flops_per_token: int, gpus: int,
           gpu_peak_tflops: float | None) -> Progress:
        """A line every logging.log_interval steps of training.steps (and at the last one) where `enabled`."""
        return cls(cfg.training.steps, cfg.logging.log_interval, enabled, flops_per_token, gpus, gpu_peak_tflops)

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
