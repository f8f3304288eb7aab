"""Prometheus metrics of one server: the HTTP layer's (`ServerMetrics`) and the pipeline's (`EngineMetrics`).

Everything is a counter, gauge or histogram updated in O(1) per dispatch or
request; rates (tokens per second, ...) are PromQL's job: `rate(jaxserve_tokens_total[1m])`.
Each process keeps its own in a `Tally` (plain numbers: prometheus_client's own values, with several processes
a write to a memory-mapped file each, were a measurable share of a front-end's work per one-document request:
docs/benchmarks.md).
/metrics is one view of them all, added up when scraped: the answering process's, and over the link the
engine's with every other front-end's (`scheduling.link.LinkServer` asks each for its snapshot then).
"""

from __future__ import annotations

from jaxserve.http.tally import Spec, Tally, combined, exposition, families
from jaxserve.runtime import compiles
from jaxserve.scheduling.batcher import CLASSES, Dispatch
from jaxserve.scheduling.pipeline import Metrics

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
# A query waits about one bulk dispatch: finer steps (x1.25, 1 ms to ~70 s) so its median can be read off them.
DISPATCH_BUCKETS = tuple(round(0.001 * 1.25**k, 6) for k in range(51))
RATIO_BUCKETS = (0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 1.0)
PHASES_DOC = ("Host and device time per phase: per request (parse, tokenize, plan, queue, encode) or per batch "
              "(assemble, copy, device, scatter)")


def _spec(name: str, kind: str, doc: str, labels: tuple[str, ...] = (), bounds: tuple = (), zeros: tuple = ()) -> Spec:
    return Spec(name, kind, doc, labels, tuple(float(b) for b in bounds), zeros)


BATCH_WAIT = _spec("jaxserve_batch_wait_seconds", "histogram", "How long a batch's oldest row waited for it",
                   bounds=LATENCY_BUCKETS)
CLASS_WAIT = _spec("jaxserve_class_queue_wait_seconds", "histogram", "Queue wait of a request, by request class",
                   ("class",), LATENCY_BUCKETS)
CLASS_LATENCY = _spec("jaxserve_class_request_seconds", "histogram", "Service latency (queued to answered) of a "
                      "request, by request class", ("class",), LATENCY_BUCKETS)
DEADLINES = _spec("jaxserve_deadlines", "counter", "Requests that gave a deadline, by class and outcome (met, "
                  "missed: late, failed, or given up after it): the share met is met / (met + missed)",
                  ("class", "outcome"))
CLASS_SEQUENCES = _spec("jaxserve_class_sequences", "counter", "Sequences dispatched, by request class: rate() of "
                        "bulk is the indexing goodput", ("class",), zeros=tuple((c,) for c in CLASSES))
DISPATCH_SECONDS = _spec("jaxserve_dispatch_seconds", "histogram", "Device time of one batch, by the class that "
                         "led it", ("class",), DISPATCH_BUCKETS)
DEPTH = _spec("jaxserve_queue_depth", "gauge", "Tokens waiting for the device (each row at its seqlen)")
BATCH_FILL = _spec("jaxserve_batch_fill_ratio", "histogram", "Rows used / rows of the bucket", ("bucket",),
                   RATIO_BUCKETS)
PADDING = _spec("jaxserve_padding_ratio", "histogram", "Padding tokens / computed tokens", ("bucket",), RATIO_BUCKETS)
BATCHES = _spec("jaxserve_batches", "counter", "Dispatches by bucket and reason", ("bucket", "reason"))
DEVICE_SECONDS = _spec("jaxserve_device_busy_seconds", "counter", "Time the device was busy: batches one after "
                       "another, each from its launch (or the end of the one before) to its outputs' arrival")
TOKENS = _spec("jaxserve_tokens", "counter", "Real (unpadded) tokens run through the model")
SEQUENCES = _spec("jaxserve_sequences", "counter", "Model sequences by outcome: submitted, dispatched (to the "
                  "device, for a waiting request) or dropped (its client left first)", ("outcome",),
                  zeros=(("submitted",), ("dispatched",), ("dropped",)))
STARTUP = _spec("jaxserve_startup_seconds", "gauge", "Start-up time by phase (jaxserve.runtime.startup): import, "
                "weights, deserialize, table, compile, timing, save", ("phase",))
COMPILES = _spec("jaxserve_xla_compiles", "counter", "XLA executables built since process start")
PHASES = _spec("jaxserve_phase_seconds", "histogram", PHASES_DOC, ("phase",), LATENCY_BUCKETS)
ENGINE_SPECS = (BATCH_WAIT, CLASS_WAIT, CLASS_LATENCY, DEADLINES, CLASS_SEQUENCES, DISPATCH_SECONDS, DEPTH,
                BATCH_FILL, PADDING, BATCHES, DEVICE_SECONDS, TOKENS, SEQUENCES, STARTUP, COMPILES, PHASES)

REQUESTS = _spec("jaxserve_requests", "counter", "HTTP requests", ("route", "status"))
ERRORS = _spec("jaxserve_errors", "counter", "Error responses by kind", ("type",))
REQUEST_DURATION = _spec("jaxserve_request_duration_seconds", "histogram", "Request duration", ("route",),
                         LATENCY_BUCKETS)
INPUTS = _spec("jaxserve_inputs", "counter", "Documents embedded")
SERVER_SPECS = (REQUESTS, ERRORS, REQUEST_DURATION, PHASES, INPUTS)  # the per-request phases share PHASES
ALL_SPECS = (*SERVER_SPECS, *(spec for spec in ENGINE_SPECS if spec not in SERVER_SPECS))


class ServerMetrics:
    """The HTTP layer's metrics: requests, errors, their latency, the per-request phases, documents embedded."""

    def __init__(self):
        self.tally = Tally(SERVER_SPECS, one_thread=True)  # updated on the event loop only

    def request(self, route: str, status: int, seconds: float, error: str | None = None) -> None:
        """A response sent (`error`: its kind, for an error response)."""
        t = self.tally
        t.add(REQUESTS, 1, (route, str(status)))
        t.observe(REQUEST_DURATION, seconds, (route,))
        if error is not None:
            t.add(ERRORS, 1, (error,))

    def phase(self, name: str, seconds: float) -> None:
        self.tally.observe(PHASES, seconds, (name,))

    def inputs(self, n: int) -> None:
        self.tally.add(INPUTS, n)

    def snapshot(self) -> dict:
        """Every value now (plain data: what this front-end reports to the engine when another is scraped)."""
        return self.tally.snapshot()

    def render(self, rest: dict | None) -> bytes:
        """The exposition of these metrics added to `rest`, a snapshot of everyone else's (the engine's, and with
        several front-ends theirs: `EngineMetrics.snapshot`, `LinkServer`); None: the engine is unreachable, and
        only this process's are shown."""
        if rest is None:
            return exposition(families(SERVER_SPECS, self.tally.snapshot()))
        return exposition(families(ALL_SPECS, combined(self.tally.snapshot(), rest)))


class EngineMetrics(Metrics):
    """The pipeline's metrics (batches, sequences, device time, classes, queue, start-up), in a `Tally`."""

    def __init__(self):
        self.tally = Tally(ENGINE_SPECS)
        self._queued = lambda: 0  # the pipeline's tokens waiting, read when shown (`watch_queue`)

    def dispatched(self, d: Dispatch, real_tokens: int, oldest_wait_s: float) -> None:
        t, label = self.tally, f"{d.bucket.batch}x{d.bucket.seqlen}"
        t.add(BATCHES, 1, (label, d.reason))
        t.observe(BATCH_FILL, d.rows / d.bucket.batch, (label,))
        t.observe(PADDING, 1 - real_tokens / d.bucket.tokens, (label,))
        t.observe(BATCH_WAIT, oldest_wait_s)
        t.add(TOKENS, real_tokens)

    def sequences(self, outcome: str, n: int) -> None:
        self.tally.add(SEQUENCES, n, (outcome,))

    def phase(self, name: str, seconds: float) -> None:
        self.tally.observe(PHASES, seconds, (name,))

    def device_busy(self, seconds: float) -> None:
        self.tally.add(DEVICE_SECONDS, seconds)

    def startup(self, phases: dict[str, float]) -> None:
        for name, seconds in phases.items():
            self.tally.set(STARTUP, seconds, (name,))

    def class_sequences(self, cls: int, n: int) -> None:
        self.tally.add(CLASS_SEQUENCES, n, (CLASSES[cls],))

    def dispatch_time(self, cls: int, seconds: float) -> None:
        self.tally.observe(DISPATCH_SECONDS, seconds, (CLASSES[cls],))

    def watch_queue(self, queued) -> None:
        self._queued = queued

    def finished(self, timing, how: str = "answered") -> None:
        t, cls, n = self.tally, (CLASSES[timing.cls],), timing.requests
        if how == "answered":
            t.observe(CLASS_WAIT, timing.queue_s, cls, n)
            t.observe(CLASS_LATENCY, timing.total_s, cls, n)
        if (outcome := timing.deadline_outcome(how)) is not None:
            t.add(DEADLINES, n, (*cls, outcome))

    def snapshot(self) -> dict:
        """Every value now (plain data, for `ServerMetrics.render`, across the engine's link when it has one), the
        XLA compiles of this process so far and the tokens waiting with them."""
        self.tally.set(COMPILES, compiles.xla_compiles_total())
        self.tally.set(DEPTH, self._queued())
        return self.tally.snapshot()
