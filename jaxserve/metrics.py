"""Prometheus metrics of one server (own registry, so several apps can live in one process)."""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily

from jaxserve import compiles
from jaxserve.batcher import Dispatch
from jaxserve.service import Metrics

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
RATIO_BUCKETS = (0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 1.0)


class _Compiles:
    """`jaxserve_xla_compiles_total`, read from the process-wide counter at scrape time."""

    def collect(self):
        c = CounterMetricFamily("jaxserve_xla_compiles", "XLA executables built since process start")
        c.add_metric([], compiles.xla_compiles_total())
        yield c


class ServerMetrics(Metrics):
    def __init__(self):
        r = self.registry = CollectorRegistry()
        self.requests = Counter("jaxserve_requests", "HTTP requests", ["route", "status"], registry=r)
        self.errors = Counter("jaxserve_errors", "Error responses by kind", ["type"], registry=r)
        self.request_duration = Histogram("jaxserve_request_duration_seconds", "Request duration", ["route"],
                                          buckets=LATENCY_BUCKETS, registry=r)
        self.phase = Histogram("jaxserve_phase_seconds", "Time per request phase", ["phase"],
                               buckets=LATENCY_BUCKETS, registry=r)
        self.queue_wait = Histogram("jaxserve_queue_wait_seconds", "Time a row waited for its batch",
                                    buckets=LATENCY_BUCKETS, registry=r)
        self.depth = Gauge("jaxserve_queue_depth", "Sequences waiting for the device", registry=r)
        self.batch_fill = Histogram("jaxserve_batch_fill_ratio", "Rows used / rows of the bucket", ["bucket"],
                                    buckets=RATIO_BUCKETS, registry=r)
        self.padding = Histogram("jaxserve_padding_ratio", "Padding tokens / computed tokens", ["bucket"],
                                 buckets=RATIO_BUCKETS, registry=r)
        self.batches = Counter("jaxserve_batches", "Dispatches by bucket and reason", ["bucket", "reason"], registry=r)
        self.device_seconds = Counter("jaxserve_device_seconds", "Device busy time", registry=r)
        self.tokens = Counter("jaxserve_tokens", "Real (unpadded) tokens run through the model", registry=r)
        self.tokens_per_second = Gauge("jaxserve_tokens_per_second", "Real tokens per second over the last minute",
                                       registry=r)
        self.inputs = Counter("jaxserve_inputs", "Documents embedded", registry=r)
        r.register(_Compiles())
        self._recent: list[tuple[float, int]] = []

    def dispatched(self, d: Dispatch, real_tokens: int, waits: list[float]) -> None:
        label = f"{d.bucket.batch}x{d.bucket.seqlen}"
        self.batches.labels(label, d.reason).inc()
        self.batch_fill.labels(label).observe(len(d.rows) / d.bucket.batch)
        self.padding.labels(label).observe(1 - real_tokens / d.bucket.tokens)
        for w in waits:
            self.queue_wait.observe(w)
        self.tokens.inc(real_tokens)
        now = time.monotonic()
        self._recent = [(t, n) for t, n in self._recent if now - t < 60] + [(now, real_tokens)]
        span = max(now - self._recent[0][0], 1.0)
        self.tokens_per_second.set(sum(n for _, n in self._recent) / span)

    def device_time(self, d: Dispatch, seconds: float) -> None:
        self.device_seconds.inc(seconds)

    def queue_depth(self, sequences: int) -> None:
        self.depth.set(sequences)

    def render(self) -> bytes:
        return generate_latest(self.registry)
