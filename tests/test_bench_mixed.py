"""scripts/bench_mixed.py's arithmetic: metrics parsing, the median dispatch off histogram buckets, the summary."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "scripts"))

from bench_mixed import bulk_sequences, dispatch_buckets, median_between, summary  # noqa: E402

METRICS = """\
# TYPE jaxserve_class_sequences_total counter
jaxserve_class_sequences_total{class="interactive"} 7.0
jaxserve_class_sequences_total{class="bulk"} 1200.0
jaxserve_dispatch_seconds_bucket{class="bulk",le="0.1"} 2.0
jaxserve_dispatch_seconds_bucket{class="bulk",le="0.2"} 6.0
jaxserve_dispatch_seconds_bucket{class="bulk",le="+Inf"} 10.0
jaxserve_dispatch_seconds_bucket{class="interactive",le="0.1"} 9.0
"""


def test_bulk_counts_and_buckets_are_read_by_class():
    assert bulk_sequences(METRICS) == 1200.0
    assert dispatch_buckets(METRICS) == [(0.1, 2.0), (0.2, 6.0), (float("inf"), 10.0)]


def test_median_is_interpolated_in_the_window_between_scrapes():
    before = [(0.1, 2.0), (0.2, 2.0), (float("inf"), 2.0)]  # two fast dispatches before the window
    after = [(0.1, 2.0), (0.2, 6.0), (float("inf"), 6.0)]  # then four in (0.1, 0.2]
    assert median_between(before, after) == pytest.approx(0.15)
    assert median_between(after, after) is None
    assert median_between([], [(0.1, 0.0), (0.2, 4.0), (float("inf"), 4.0)]) == pytest.approx(0.15)


def _result(mode, p99, docs_s, dispatch_ms, lost=0):
    idle = {"query_p50_ms": 10.0, "query_p99_ms": 20.0, "queries": 50, "bulk_docs_per_s": 0.0,
            "median_bulk_dispatch_ms": None}
    loaded = {"query_p50_ms": p99 / 2, "query_p99_ms": p99, "query_max_ms": p99 * 2, "queries": 100,
              "queries_lost": lost, "bulk_docs_per_s": docs_s, "median_bulk_dispatch_ms": dispatch_ms}
    return {"mode": mode, "idle": idle, "loaded": loaded}


def test_summary_checks_the_target_against_the_median_dispatch_and_the_fifo_ratio():
    met = summary([_result("fifo", 30_000.0, 100.0, 400.0), _result("classes", 700.0, 95.0, 400.0)])
    assert "target of 800.0 ms (met; 0 queries lost)" in met[-1] and "0.95x FIFO (within 10%)" in met[-1]
    missed = summary([_result("fifo", 30_000.0, 100.0, 50.0), _result("classes", 300.0, 80.0, 50.0)])
    assert "target of 250.0 ms (NOT met" in missed[-1] and "NOT within" in missed[-1]
    lost = summary([_result("fifo", 30_000.0, 100.0, 400.0), _result("classes", 700.0, 95.0, 400.0, lost=1)])
    assert "(NOT met; 1 queries lost)" in lost[-1]  # a query that timed out is not within any p99
