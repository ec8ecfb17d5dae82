"""Rank 0's live metrics in the Prometheus text format, at http://<rank 0>:<metrics.port>/metrics.

Two sources, so that nothing is counted twice:
- the step just completed, set by the training loop: step, loss, step time, tokens/s and, with a known
  GPU peak, MFU (training/contract/flops.py);
- the run so far, from the event log through the report's own functions (training/report/goodput.py), so a
  scrape and `python -m training.report` agree: training and infra goodput, restarts by kind, checkpoint
  blocking and the age of the newest committed checkpoint. The log is re-read at most every
  metrics.event_log_refresh_s seconds, in the HTTP server's thread, never in the training loop's.

The server binds in the background: a rank 0 restarted in-job may find the port still held for a moment
by the process it replaces (being killed), and retries until it is free; training never waits for it.
"""
from __future__ import annotations

import logging
import os
import threading
import time
from collections import Counter
from typing import Any, Iterator

from prometheus_client import CollectorRegistry, Gauge, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from training.contract.events import read_events
from training.contract.flops import mfu
from training.report.goodput import ReportError, build_report

log = logging.getLogger("training.train.metrics")
PREFIX = "training_"
BIND_RETRY_S = 1.0


class RunCollector(Collector):
    """The run-so-far figures, from the event log of `run_dir`."""

    def __init__(self, run_dir: str | os.PathLike, refresh_s: float) -> None:
        self.run_dir, self.refresh_s = run_dir, refresh_s
        self._families: list[GaugeMetricFamily | CounterMetricFamily] = []
        self._read_at = -float("inf")
        self._committed_at: float | None = None
        self._lock = threading.Lock()

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        with self._lock:
            if time.monotonic() - self._read_at >= self.refresh_s:
                self._families = self._read()
                self._read_at = time.monotonic()
            families = self._families
        yield from families
        # the age moves on between reads of the log
        if self._committed_at is not None:
            yield GaugeMetricFamily(PREFIX + "checkpoint_commit_age_seconds",
                                    "Seconds since the newest checkpoint was committed",
                                    value=time.time() - self._committed_at)

    def _read(self) -> list[GaugeMetricFamily | CounterMetricFamily]:
        self._committed_at = None
        try:
            events = read_events(self.run_dir)
            report = build_report(events)
        except (FileNotFoundError, ReportError):  # before the first step: nothing to say yet
            return []
        committed = [e for e in events if e["event"] == "ckpt_committed"]
        self._committed_at = committed[-1]["t"] if committed else None
        ck = report.checkpoints
        restarts = CounterMetricFamily(PREFIX + "restarts", "Restarts of the run by kind (injob, inprocess, node)",
                                       labels=["kind"])
        for kind, count in sorted(Counter(str(e.get("restart_kind")) for e in events
                                          if e["event"] == "restart").items()):
            restarts.add_metric([kind], count)
        gauges: dict[str, tuple[str, Any]] = {
            "goodput_ratio": ("Training goodput so far: productive step time / wall time (training.report)",
                              report.training_goodput),
            "infra_goodput_ratio": ("Infra goodput so far: time inside steps, lost ones too / wall time",
                                    report.infra_goodput),
            "wall_seconds": ("Wall time of the run so far, as the report counts it", report.wall_s),
            "report_as_of_timestamp_seconds": ("Time of the newest event the run figures include",
                                               events[-1]["t"]),
            "checkpoint_blocking_seconds_total": ("Training time blocked by checkpoint saves",
                                                  ck.blocking_total_s),
            "checkpoint_blocking_max_seconds": ("Longest block of training by one checkpoint save",
                                                ck.blocking_max_s or 0.0),
            "checkpoints_committed": ("Checkpoints committed so far", ck.committed),
            "checkpoints_failed": ("Checkpoint saves that failed so far", ck.failed),
        }
        return [restarts, *(GaugeMetricFamily(PREFIX + name, text, value=value)
                            for name, (text, value) in gauges.items())]


class TrainingMetrics:
    """The endpoint of one training process (rank 0): `update` after every step, `close` at the end."""

    def __init__(self, port: int, run_dir: str | os.PathLike, refresh_s: float, world_size: int,
                 flops_per_token: int, gpu_peak_tflops: float | None) -> None:
        self.port, self.world_size = port, world_size
        self.flops_per_token, self.gpu_peak_tflops = flops_per_token, gpu_peak_tflops
        self.registry = CollectorRegistry()
        self.registry.register(RunCollector(run_dir, refresh_s))

        def gauge(name: str, text: str) -> Gauge:
            return Gauge(PREFIX + name, text, registry=self.registry)

        self.step = gauge("step", "Last optimizer step completed")
        self.loss = gauge("loss", "Loss of the last step, averaged over the ranks")
        self.step_time = gauge("step_time_seconds", "Time of the last step")
        self.tokens_per_s = gauge("tokens_per_second", "Tokens of the last step (all ranks) / its step time")
        self.mfu = gauge("mfu_ratio", "Model FLOPs utilization of the last step") if gpu_peak_tflops else None
        self._server: Any = None
        self._closed = threading.Event()
        self._binder = threading.Thread(target=self._bind, name="metrics-bind", daemon=True)
        self._binder.start()

    def _bind(self) -> None:
        warned = False
        while not self._closed.is_set():
            try:
                self._server, _ = start_http_server(self.port, registry=self.registry)
                log.info("metrics: http://%s:%d/metrics", os.environ.get("HOSTNAME", "0.0.0.0"), self.port)
                return
            except OSError as err:  # the previous rank 0 of this pod may still be on its way out
                if not warned:
                    log.warning("metrics port %d: %s; retrying every %.0f s", self.port, err, BIND_RETRY_S)
                    warned = True
            self._closed.wait(BIND_RETRY_S)

    def update(self, step: int, loss: float, step_time_s: float, tokens: int) -> None:
        self.step.set(step)
        self.loss.set(loss)
        self.step_time.set(step_time_s)
        tokens_per_s = tokens / step_time_s if step_time_s > 0 else 0.0
        self.tokens_per_s.set(tokens_per_s)
        if self.mfu is not None:
            self.mfu.set(mfu(tokens_per_s, self.flops_per_token, self.world_size, self.gpu_peak_tflops))

    def close(self) -> None:
        """Stop serving and free the port (an in-process restart binds it again)."""
        self._closed.set()
        self._binder.join()
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
