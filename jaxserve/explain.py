"""The latency math of a request: plan, padding, memory, and predicted vs measured time.

Predictions come from per-bucket run times: measured at warmup, then refreshed
from live device timings (`LiveTimings`). Pure Python: nothing here runs the
model or compiles.
"""

from __future__ import annotations

import math
import threading

from jaxserve.buckets import Bucket, BucketTable
from jaxserve.planner import Plan, plan

EWMA_WEIGHT = 0.2  # weight of each new device timing in the running estimate


class LiveTimings:
    """Per-bucket device time: the warmup figure, then an exponentially weighted mean of live runs."""

    def __init__(self, table: BucketTable):
        self._s = {b.shape: b.run_s for b in table.buckets if b.run_s is not None}
        self._n = {b.shape: 0 for b in table.buckets}
        self._lock = threading.Lock()

    def observe(self, bucket: Bucket, seconds: float) -> None:
        with self._lock:
            old = self._s.get(bucket.shape)
            self._s[bucket.shape] = seconds if old is None else (1 - EWMA_WEIGHT) * old + EWMA_WEIGHT * seconds
            self._n[bucket.shape] = self._n.get(bucket.shape, 0) + 1

    def seconds(self, bucket: Bucket) -> float | None:
        return self._s.get(bucket.shape)

    def live_runs(self, bucket: Bucket) -> int:
        return self._n.get(bucket.shape, 0)


def predict(p: Plan, timings: LiveTimings) -> float | None:
    times = [timings.seconds(b.bucket) for b in p.batches]
    return None if any(t is None for t in times) else float(sum(times))


def explain(p: Plan, table: BucketTable, timings: LiveTimings, doc_of=None, backlog: list | None = None,
            batches_in_flight: int = 0, max_wait_s: float = 0.0) -> dict:
    """The plan with memory and predicted times per batch, and the alternatives it is compared with.

    `backlog`: (seqlen, rows) waiting in front of this request, for the queueing term.
    """
    summary = p.summary(doc_of)
    for entry, batch in zip(summary["batches"], p.batches):
        b = batch.bucket
        entry["predicted_s"] = timings.seconds(b)
        entry["memory"] = {"compiled_bytes": b.compiled_bytes, "budget_bytes": table.budget_bytes,
                           "device_bytes": table.device_memory,
                           "share_of_budget": b.compiled_bytes / table.budget_bytes if table.budget_bytes else None}
    summary["predicted_s"] = predict(p, timings)
    sequential = [plan([n], table) for n in p.lengths]
    summary["predicted_sequential_s"] = _sum_or_none(predict(s, timings) for s in sequential)
    summary["sequential_dispatches"] = sum(s.dispatches for s in sequential)
    summary["one_max_batch"] = one_max_batch(len(p.lengths), table, timings)
    ahead = [(table.at(s)[-1], math.ceil(n / table.at(s)[-1].batch)) for s, n in (backlog or [])]
    summary["queueing"] = {
        "rows_ahead": sum(n for _, n in (backlog or [])),
        "batches_in_flight": batches_in_flight,
        "predicted_wait_ahead_s": _sum_or_none(
            None if timings.seconds(b) is None else k * timings.seconds(b) for b, k in ahead),
        "window_worst_case_s": max_wait_s,
    }
    return summary


def one_max_batch(n: int, table: BucketTable, timings: LiveTimings) -> dict:
    """The naive alternative: every sequence padded to the longest shape, in the largest batch there."""
    if n == 0:
        return {"shape": None, "dispatches": 0, "predicted_s": 0.0}
    largest = table.at(table.max_seqlen)[-1]
    dispatches = math.ceil(n / largest.batch)
    t = timings.seconds(largest)
    return {"shape": list(largest.shape), "dispatches": dispatches,
            "padded_tokens": dispatches * largest.tokens, "predicted_s": None if t is None else dispatches * t}


def _sum_or_none(values) -> float | None:
    values = list(values)
    return None if any(v is None for v in values) else float(sum(values))


def format_report(e: dict, measured: dict | None = None) -> str:
    """A person's reading of `explain()` (and, when given, of what was measured)."""
    ms = lambda s: "?" if s is None else f"{1e3 * s:,.1f} ms"
    lines = [
        f"{len(e['batches'])} dispatches, layout {e['layout']}"
        + (f" (rows of {e['pack_seqlen']} tokens)" if e["pack_seqlen"] else ""),
        f"tokens: {e['real_tokens']:,} real, {e['padded_tokens']:,} computed -> padding {e['padding_ratio']:.1%}",
        "",
        f"{'batch':>5} {'bucket':>10} {'slots':>5} {'rows':>5} {'docs':>5} {'real':>7} {'padded':>7} "
        f"{'memory':>12} {'predicted':>12}",
    ]
    for i, b in enumerate(e["batches"]):
        mem = b["memory"]
        share = "" if mem["share_of_budget"] is None else f" {mem['share_of_budget']:.0%}"
        lines.append(
            f"{i:>5} {b['bucket']['batch']:>4}x{b['bucket']['seqlen']:<5} {b['bucket']['slots']:>5} {b['rows_used']:>5} "
            f"{len(b['documents']):>5} {b['real_tokens']:>7} {b['padded_tokens']:>7} "
            f"{mem['compiled_bytes'] / 2**20:>7.0f} MiB{share:>4} {ms(b['predicted_s']):>12}"
        )
    om = e["one_max_batch"]
    lines += [
        "",
        f"predicted: jaxserve {ms(e['predicted_s'])} | sequential (one call per document, "
        f"{e['sequential_dispatches']} dispatches) {ms(e['predicted_sequential_s'])} | one padded max-shape batch "
        f"({om['dispatches']} x {om['shape']}) {ms(om['predicted_s'])}",
        f"queueing: {e['queueing']['rows_ahead']} rows waiting and {e['queueing']['batches_in_flight']} batches in "
        f"flight ahead, predicted {ms(e['queueing']['predicted_wait_ahead_s'])} for the waiting rows; "
        f"batch window adds at most {ms(e['queueing']['window_worst_case_s'])}",
    ]
    if measured:
        lines.append("measured: " + ", ".join(f"{k} {ms(v)}" for k, v in measured.items()))
        if e["predicted_s"] and measured.get("device_s"):
            lines.append(f"device time vs prediction: {measured['device_s'] / e['predicted_s'] - 1:+.1%}")
    return "\n".join(lines)
