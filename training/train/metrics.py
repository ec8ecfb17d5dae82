"""Rank 0's live metrics in the Prometheus text format, at http://<rank 0>:<metrics.port>/metrics.

Two sources, so that nothing is counted twice: the step just completed, set by the training loop (with a
known GPU peak, MFU: training.contract.flops), and the run so far, from the event log by the report's own
definitions (training.report.tally), so a scrape and `python -m training.report` agree. Cost: a read of what
the log appended since the last refresh, at most every metrics.event_log_refresh_s, in the HTTP server's
thread, never the training loop's; a new rank 0 catches up from the saved tally (training.report.saved_tally).
The server binds in the background (a rank 0 restarted in-job may find the port still held for a moment by
the process it replaces), and training never waits for it. docs/observability.md, "Live metrics".
"""
from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any, Iterator

from prometheus_client import CollectorRegistry, Gauge, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from training.contract.config import MetricsConfig
from training.contract.events import EventTail
from training.contract.flops import mfu
from training.report import saved_tally
from training.report.tally import BelowFloor, RunTally

log = logging.getLogger("training.train.metrics")
PREFIX = "training_"
BIND_RETRY_S = 1.0
READ_CHUNK_BYTES = 4 << 20  # of each event file per fold: a new process catches up on a long log in pieces
TALLY_SAVE_S = 300.0  # a new rank 0 reads at most this long's events beyond the saved tally


class RunCollector(Collector):
    """The run-so-far figures, from the event log of `run_dir`."""

    def __init__(self, run_dir: str | os.PathLike, refresh_s: float) -> None:
        self.run_dir, self.refresh_s = run_dir, refresh_s
        saved = saved_tally.load(run_dir)
        self._tally, self._log = (saved[0], EventTail.from_offsets(run_dir, saved[1])) if saved else self._whole_log()
        self._families: list[GaugeMetricFamily | CounterMetricFamily] = []
        self._read_at = -float("inf")
        self._saved_at = -float("inf")
        self._lock = threading.Lock()

    def _whole_log(self) -> tuple[RunTally, EventTail]:
        return RunTally(), EventTail(self.run_dir)

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        with self._lock:
            if time.monotonic() - self._read_at >= self.refresh_s:
                self._families = self._read()
                self._read_at = time.monotonic()
            families, committed_at = self._families, self._tally.committed_at
        yield from families
        # the age moves on between reads of the log
        if committed_at is not None:
            yield GaugeMetricFamily(PREFIX + "checkpoint_commit_age_seconds",
                                    "Seconds since the newest checkpoint was committed",
                                    value=time.time() - committed_at)

    def _read(self) -> list[GaugeMetricFamily | CounterMetricFamily]:
        try:
            self._fold_new()
        except BelowFloor as err:  # the saved tally cannot say: the whole log, once
            log.info("metrics tally: %s; reading the whole event log", err)
            self._tally, self._log = self._whole_log()
            self._fold_new()
        except FileNotFoundError:  # before the first event: nothing to say yet
            return []
        self._save()
        if self._log.unreadable:  # e.g. an FSx client eviction: those files are read on a later refresh
            log.warning("event log: %s; the run figures leave them out until they can be read",
                        "; ".join(self._log.unreadable.values()))
        tally = self._tally
        if not tally.steps:  # the report too has nothing to say before the first step
            return []
        restarts = CounterMetricFamily(PREFIX + "restarts", "Restarts of the run by kind (injob, inprocess, node)",
                                       labels=["kind"])
        for kind, count in sorted(tally.restarts.items()):
            restarts.add_metric([kind], count)
        gauges: dict[str, tuple[str, Any]] = {
            "goodput_ratio": ("Training goodput so far: productive step time / wall time (training.report)",
                              tally.training_goodput),
            "infra_goodput_ratio": ("Infra goodput so far: time inside steps, lost ones too / wall time",
                                    tally.infra_goodput),
            "wall_seconds": ("Wall time of the run so far, as the report counts it", tally.wall_s),
            "report_as_of_timestamp_seconds": ("Time of the newest event the run figures include", tally.last_t),
            "checkpoint_blocking_seconds_total": ("Training time blocked by checkpoint saves",
                                                  tally.blocking_total_s),
            "checkpoint_blocking_max_seconds": ("Longest block of training by one checkpoint save",
                                                tally.blocking_max_s),
            "checkpoints_committed": ("Checkpoints committed so far", tally.ckpt_committed),
            "checkpoints_failed": ("Checkpoint saves that failed so far", tally.ckpt_failed),
            "checkpoints_failed_no_space": ("Checkpoint saves that failed so far because the checkpoint file system "
                                            "was full (ENOSPC/EDQUOT)", tally.ckpt_no_space),
            "checkpoint_writers_replaced": ("Async checkpoint writers (a rank's writer process, its zygote, NVRx's "
                                            "worker) found dead or stuck and replaced so far", tally.ckpt_writer_replaced),
            "events_dropped": ("Events the run's log lacks because their writer could not write them (a full or "
                               "failing file system), as counted once writing resumed", tally.events_dropped),
        }
        return [restarts, *(GaugeMetricFamily(PREFIX + name, text, value=value)
                            for name, (text, value) in gauges.items())]


    def _fold_new(self) -> None:
        self._tally.add(self._log.read_new(READ_CHUNK_BYTES))
        while self._log.behind:
            self._tally.add(self._log.read_new(READ_CHUNK_BYTES))

    def _save(self) -> None:
        """The tally, for the next process's catch-up, at most every TALLY_SAVE_S (and after the first read)."""
        if time.monotonic() - self._saved_at < TALLY_SAVE_S or not self._tally.steps:
            return
        self._saved_at = time.monotonic()
        try:
            saved_tally.save(self.run_dir, self._tally, self._log.offsets())
        except OSError as err:  # the next process reads more of the log, nothing worse
            log.warning("metrics tally not saved (%s: %s)", type(err).__name__, err)


class TrainingMetrics:
    """The endpoint of one training process (rank 0): `update` after every step, `close` at the end.

    Args:
        metrics: the metrics section: its port (not 0: the trainer makes none where it is off) and how often
            the event log's figures are re-read.
        run_dir: the run whose event log the goodput, restart and checkpoint figures read.
        world_size: the ranks of the run (tokens/s and MFU count all of them).
        flops_per_token: the model's training FLOPs per token (MFU's numerator).
        gpu_peak_tflops: one GPU's peak; None: no MFU gauge (a CPU run).
    """

    def __init__(self, metrics: MetricsConfig, run_dir: str | os.PathLike, *, world_size: int, flops_per_token: int,
                 gpu_peak_tflops: float | None) -> None:
        self.port, self.world_size = metrics.port, world_size
        self.flops_per_token, self.gpu_peak_tflops = flops_per_token, gpu_peak_tflops
        self.registry = CollectorRegistry()
        self.registry.register(RunCollector(run_dir, metrics.event_log_refresh_s))

        def gauge(name: str, text: str) -> Gauge:
            return Gauge(PREFIX + name, text, registry=self.registry)

        self.step = gauge("step", "Last optimizer step completed")
        self.loss = gauge("loss", "Loss of the last step, averaged over the ranks")
        self.step_time = gauge("step_time_seconds", "Time of the last step")
        self.tokens_per_s = gauge("tokens_per_second", "Tokens of the last step (all ranks) / its step time")
        self.mfu = gauge("mfu_ratio", "Model FLOPs utilization of the last step") if gpu_peak_tflops else None
        self.events_unwritten = gauge("events_unwritten", "Events this rank 0 could not write to the run's log and "
                                      "has not counted there yet (events_dropped): non-zero while the log fails")
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

    def update(self, step: int, loss: float, step_time_s: float, tokens: int, events_unwritten: int) -> None:
        self.step.set(step)
        self.events_unwritten.set(events_unwritten)
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
