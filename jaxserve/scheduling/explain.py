"""The latency math of a request: its rows, the batches they make, padding, memory, predicted vs measured time.

The batches are the batcher's own (`simulate` drains a private batcher with
the request alone); a request that ran reports the batches that actually
carried its rows beside this. Predictions come from per-bucket run times:
measured at warmup, then refreshed from live device timings (`LiveTimings`); a
dispatch is predicted at the cost the batcher plans with, `max(its run time, the
host's time per dispatch)`, since on a fast device the host's part is the longer.
Pure Python and numpy: nothing here runs the model or compiles.
"""

from __future__ import annotations

import math
import threading

import numpy as np

from jaxserve.runtime.buckets import Bucket, BucketTable, host_time
from jaxserve.scheduling.batcher import BULK, Batcher, Classes, Dispatch, covers
from jaxserve.scheduling.jobs import ragged_arange
from jaxserve.scheduling.planner import Rows, route

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

    def dispatch_s(self, bucket: Bucket, host_s: float | None) -> float | None:
        """A dispatch's predicted time as the batcher costs it (`runtime.buckets.dispatch_s`), from the live run time
        and the table's host time per dispatch (None: the bucket was never timed)."""
        run = self.seconds(bucket)
        return None if run is None else max(run, host_time(host_s))


def simulate(rows: Rows, table: BucketTable, cls: int = BULK, classes: Classes = Classes(),
             likely: bool = False) -> list[Dispatch]:
    """The dispatches the batcher forms for these rows alone, on an idle device (runs nothing), as a request of
    class `cls` under the server's `classes`; `likely`: interactive work is likely (a query arrived within
    `Classes.likely_s`), which caps a bulk request's batches."""
    batcher = Batcher(table, math.inf, max(1, int(rows.seqlen.sum())), classes)
    batcher.interactive.last = 0.0 if likely else -math.inf
    batcher.submit(0, rows.seqlen, rows.docs, 0.0, cls)
    out = []
    while (d := batcher.next_dispatch(0.0, device_idle=True)) is not None:
        out.append(d)
    return out


def explain(rows: Rows, table: BucketTable, timings: LiveTimings, doc_of=None, backlog: list | None = None,
            batches_in_flight: int = 0, max_wait_s: float = 0.0, cls: int = BULK, classes: Classes = Classes(),
            likely: bool = False) -> dict:
    """The request's rows as the batcher would run them alone, with memory and predicted times per
    batch, and the alternatives it is compared with.

    `doc_of` maps each sequence to its document (chunked documents have several);
    `backlog`: (seqlen, rows) waiting in front of this request, for the queueing term;
    `cls`, `classes`, `likely`: its class and the server's, as `simulate` takes them.
    """
    doc_of = np.arange(len(rows.lengths)) if doc_of is None else np.asarray(doc_of)
    host = table.host_dispatch_s  # warm-up's, or the pipeline's live figure
    row_tokens = rows.tokens
    batches = []
    for d in simulate(rows, table, cls, classes, likely):
        r = np.concatenate([rows_of_part for _, rows_of_part in d.parts])
        b = d.bucket
        members = rows.members[ragged_arange(rows.starts[r], rows.docs[r])]
        batches.append({
            "bucket": {"batch": b.batch, "seqlen": b.seqlen, "slots": b.slots},
            "rows_used": len(r),
            "documents": np.unique(doc_of[members]).tolist(),
            "real_tokens": int(row_tokens[r].sum()),
            "padded_tokens": b.tokens,
            "device_s": timings.seconds(b),
            "predicted_s": timings.dispatch_s(b, host),
            "memory": {"compiled_bytes": b.compiled_bytes, "budget_bytes": table.budget_bytes,
                       "device_bytes": table.device_memory,
                       "share_of_budget": b.compiled_bytes / table.budget_bytes if table.budget_bytes else None},
        })
    padded = sum(b["padded_tokens"] for b in batches)
    alone = sequential(rows.lengths, table, timings)
    ahead = [(table.at(s)[-1], math.ceil(n / table.at(s)[-1].batch)) for s, n in (backlog or [])]
    return {
        "layout": rows.layout,
        "pack_seqlen": rows.width,
        "batches": batches,
        "real_tokens": rows.real_tokens,
        "padded_tokens": padded,
        "padding_ratio": 1 - rows.real_tokens / padded if padded else 0.0,
        "dispatches": len(batches),
        "host_dispatch_s": host_time(host),
        "predicted_s": _sum_or_none(b["predicted_s"] for b in batches),
        "predicted_sequential_s": alone,
        "sequential_dispatches": len(rows.lengths),
        "one_max_batch": one_max_batch(len(rows.lengths), table, timings),
        "queueing": {
            "rows_ahead": sum(n for _, n in (backlog or [])),
            "batches_in_flight": batches_in_flight,
            "predicted_wait_ahead_s": _sum_or_none(
                None if (t := timings.dispatch_s(b, host)) is None else k * t for b, k in ahead),
            "window_worst_case_s": max_wait_s,
        },
    }


def sequential(lengths: np.ndarray, table: BucketTable, timings: LiveTimings) -> float | None:
    """Predicted time of one dispatch per sequence, each at the cheapest bucket of its seqlen that holds one row."""
    seqlens = route(np.asarray(lengths), np.ones(len(lengths), np.int64), table)
    first = covers(table)
    return _sum_or_none(timings.dispatch_s(first[s][1], table.host_dispatch_s) for s in seqlens.tolist())


def one_max_batch(n: int, table: BucketTable, timings: LiveTimings) -> dict:
    """The naive alternative: every sequence padded to the longest shape, in the largest batch there."""
    if n == 0:
        return {"shape": None, "dispatches": 0, "predicted_s": 0.0}
    largest = table.at(table.max_seqlen)[-1]
    dispatches = math.ceil(n / largest.batch)
    t = timings.dispatch_s(largest, table.host_dispatch_s)
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
        f"predicted: jaxserve {ms(e['predicted_s'])} | sequential (one call per sequence, "
        f"{e['sequential_dispatches']} dispatches) {ms(e['predicted_sequential_s'])} | one padded max-shape batch "
        f"({om['dispatches']} x {om['shape']}) {ms(om['predicted_s'])}",
        f"queueing: {e['queueing']['rows_ahead']} rows waiting and {e['queueing']['batches_in_flight']} batches in "
        f"flight ahead, predicted {ms(e['queueing']['predicted_wait_ahead_s'])} for the waiting rows; "
        f"batch window adds at most {ms(e['queueing']['window_worst_case_s'])}",
        f"each dispatch predicted at max(its device time, the host's {ms(e['host_dispatch_s'])} per dispatch)",
    ]
    if measured:
        lines.append("measured: " + ", ".join(f"{k} {ms(v)}" for k, v in measured.items()))
        took = measured.get("run_s") or measured.get("service_s")
        if e["predicted_s"] and took:
            lines.append(f"measured vs prediction: {took / e['predicted_s'] - 1:+.1%}")
    return "\n".join(lines)
