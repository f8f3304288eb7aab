"""Prometheus metrics of one server (own registry, so several apps can live in one process).

Everything is a counter, gauge or histogram updated in O(1) per dispatch or
request; rates (tokens per second, ...) are PromQL's job: `rate(jaxserve_tokens_total[1m])`.
Served by several processes (`--workers N`), each writes its values to files in
$PROMETHEUS_MULTIPROC_DIR (prometheus_client's multiprocess mode) and any
front-end's /metrics adds them up: one view of the front-ends and the engine.
"""

from __future__ import annotations

import os

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest, multiprocess
from prometheus_client.core import CounterMetricFamily

from jaxserve.runtime import compiles
from jaxserve.scheduling.batcher import CLASSES, Dispatch
from jaxserve.scheduling.pipeline import Metrics

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
# A query waits about one bulk dispatch: finer steps (x1.25, 1 ms to ~70 s) so its median can be read off them.
DISPATCH_BUCKETS = tuple(round(0.001 * 1.25**k, 6) for k in range(51))
RATIO_BUCKETS = (0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 1.0)


class _Compiles:
    """`jaxserve_xla_compiles_total`, read from the process-wide counter at scrape time."""

    def collect(self):
        c = CounterMetricFamily("jaxserve_xla_compiles", "XLA executables built since process start")
        c.add_metric([], compiles.xla_compiles_total())
        yield c


def multiprocess_dir() -> str | None:
    """Where this process's metric values go when several processes serve (None: one process)."""
    return os.environ.get("PROMETHEUS_MULTIPROC_DIR")


class ServerMetrics(Metrics):
    def __init__(self):
        r = self.registry = CollectorRegistry()
        self.shared = multiprocess_dir() is not None
        self.requests = Counter("jaxserve_requests", "HTTP requests", ["route", "status"], registry=r)
        self.errors = Counter("jaxserve_errors", "Error responses by kind", ["type"], registry=r)
        self.request_duration = Histogram("jaxserve_request_duration_seconds", "Request duration", ["route"],
                                          buckets=LATENCY_BUCKETS, registry=r)
        self.phases = Histogram("jaxserve_phase_seconds", "Host and device time per phase: per request (parse, "
                                "tokenize, plan, queue, encode) or per batch (assemble, copy, device, scatter)",
                                ["phase"], buckets=LATENCY_BUCKETS, registry=r)
        self.batch_wait = Histogram("jaxserve_batch_wait_seconds", "How long a batch's oldest row waited for it",
                                    buckets=LATENCY_BUCKETS, registry=r)
        self.class_wait = Histogram("jaxserve_class_queue_wait_seconds", "Queue wait of a request, by request "
                                    "class", ["class"], buckets=LATENCY_BUCKETS, registry=r)
        self.class_latency = Histogram("jaxserve_class_request_seconds", "Service latency (queued to answered) of "
                                       "a request, by request class", ["class"], buckets=LATENCY_BUCKETS, registry=r)
        self.deadlines = Counter("jaxserve_deadlines", "Requests that gave a deadline, by class and outcome (met, "
                                 "missed): the share met is met / (met + missed)", ["class", "outcome"], registry=r)
        self.class_sequences_total = Counter("jaxserve_class_sequences", "Sequences dispatched, by request class: "
                                             "rate() of bulk is the indexing goodput", ["class"], registry=r)
        self.dispatch_seconds = Histogram("jaxserve_dispatch_seconds", "Device time of one batch, by the class "
                                          "that led it", ["class"], buckets=DISPATCH_BUCKETS, registry=r)
        for cls in CLASSES:
            self.class_sequences_total.labels(cls)
        self.depth = Gauge("jaxserve_queue_depth", "Tokens waiting for the device (each row at its seqlen)", registry=r,
                           multiprocess_mode="livemostrecent")
        self.batch_fill = Histogram("jaxserve_batch_fill_ratio", "Rows used / rows of the bucket", ["bucket"],
                                    buckets=RATIO_BUCKETS, registry=r)
        self.padding = Histogram("jaxserve_padding_ratio", "Padding tokens / computed tokens", ["bucket"],
                                 buckets=RATIO_BUCKETS, registry=r)
        self.batches = Counter("jaxserve_batches", "Dispatches by bucket and reason", ["bucket", "reason"], registry=r)
        self.device_seconds = Counter("jaxserve_device_busy_seconds", "Time the device was busy: batches one after "
                                      "another, each from its launch (or the end of the one before) to its outputs' "
                                      "arrival", registry=r)
        self.tokens = Counter("jaxserve_tokens", "Real (unpadded) tokens run through the model", registry=r)
        self.inputs = Counter("jaxserve_inputs", "Documents embedded", registry=r)
        self.sequence_outcomes = Counter("jaxserve_sequences", "Model sequences by outcome: submitted, dispatched "
                                         "(to the device, for a waiting request) or dropped (its client left first)",
                                         ["outcome"], registry=r)
        for outcome in ("submitted", "dispatched", "dropped"):
            self.sequence_outcomes.labels(outcome)  # present from the start, zero until counted
        self.startup_seconds = Gauge("jaxserve_startup_seconds", "Start-up time by phase (jaxserve.runtime.startup): "
                                     "import, weights, deserialize, table, compile, timing, save", ["phase"],
                                     registry=r, multiprocess_mode="livemax")
        if self.shared:  # the engine process adds its compiles as they happen (`sync_compiles`)
            self.compiles = Counter("jaxserve_xla_compiles", "XLA executables built since process start", registry=r)
            self._compiles_seen = 0
        else:
            r.register(_Compiles())
        self._children: dict[tuple, object] = {}

    def child(self, metric, *labels):
        """A labelled child, looked up once (prometheus_client's `labels()` costs more than the update)."""
        key = (id(metric), labels)
        if (c := self._children.get(key)) is None:
            c = self._children[key] = metric.labels(*labels)
        return c

    def dispatched(self, d: Dispatch, real_tokens: int, oldest_wait_s: float) -> None:
        label = f"{d.bucket.batch}x{d.bucket.seqlen}"
        self.child(self.batches, label, d.reason).inc()
        self.child(self.batch_fill, label).observe(d.rows / d.bucket.batch)
        self.child(self.padding, label).observe(1 - real_tokens / d.bucket.tokens)
        self.batch_wait.observe(oldest_wait_s)
        self.tokens.inc(real_tokens)

    def sequences(self, outcome: str, n: int) -> None:
        self.child(self.sequence_outcomes, outcome).inc(n)

    def phase(self, name: str, seconds: float) -> None:
        self.child(self.phases, name).observe(seconds)

    def device_busy(self, seconds: float) -> None:
        self.device_seconds.inc(seconds)

    def startup(self, phases: dict[str, float]) -> None:
        for name, seconds in phases.items():
            self.startup_seconds.labels(name).set(seconds)

    def class_sequences(self, cls: int, n: int) -> None:
        self.child(self.class_sequences_total, CLASSES[cls]).inc(n)

    def dispatch_time(self, cls: int, seconds: float) -> None:
        self.child(self.dispatch_seconds, CLASSES[cls]).observe(seconds)

    def queue_depth(self, tokens: int) -> None:
        self.depth.set(tokens)

    def finished(self, timing) -> None:
        cls = CLASSES[timing.cls]
        self.child(self.class_wait, cls).observe(timing.queue_s)
        self.child(self.class_latency, cls).observe(timing.total_s)
        if timing.deadline_s is not None:
            self.child(self.deadlines, cls, "met" if timing.total_s <= timing.deadline_s else "missed").inc()

    def sync_compiles(self) -> int:
        """Several processes: count the XLA compiles of this one (the engine) since the last call; -> all so far."""
        now = compiles.xla_compiles_total()
        self.compiles.inc(now - self._compiles_seen)
        self._compiles_seen = now
        return now

    def render(self) -> bytes:
        if not self.shared:
            return generate_latest(self.registry)
        every = CollectorRegistry()
        multiprocess.MultiProcessCollector(every)
        return generate_latest(every)
