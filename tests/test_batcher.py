"""The batching state machine, driven by hand with explicit clocks (no JAX, no asyncio, no HTTP)."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxserve.batcher import Batcher, QueueFull
from jaxserve.buckets import fixed

TABLE = fixed([(1, 16), (4, 16), (1, 64), (4, 64)], layout="packed")  # 16: 2 slots, 64: 8 slots


def rows(*tokens):
    """One single-sequence row per token count, pieces numbered from 0."""
    return [((i,), t) for i, t in enumerate(tokens)]


def test_full_bucket_leaves_even_when_device_busy():
    b = Batcher(TABLE, max_wait_s=1.0, max_queued=100)
    b.submit(1, rows(10, 10, 10), now=0.0)
    assert b.next_dispatch(now=0.0, device_idle=False) is None  # 3 of 4 rows: waits for the window
    b.submit(2, rows(12), now=0.1)
    d = b.next_dispatch(now=0.1, device_idle=False)
    assert d.reason == "full" and d.bucket.shape == (4, 16)
    assert [(r.request, r.pieces) for r in d.rows] == [(1, (0,)), (1, (1,)), (1, (2,)), (2, (0,))]
    assert b.queued == 0 and b.next_dispatch(now=5.0, device_idle=True) is None


def test_window_expiry_sends_a_partial_batch():
    b = Batcher(TABLE, max_wait_s=0.005, max_queued=100)
    b.submit(1, rows(10), now=0.0)
    assert b.next_deadline() == pytest.approx(0.005)
    assert b.next_dispatch(now=0.004, device_idle=False) is None
    d = b.next_dispatch(now=0.005, device_idle=False)
    assert d.reason == "window" and d.bucket.shape == (1, 16)


def test_idle_device_never_waits_for_the_window():
    b = Batcher(TABLE, max_wait_s=10.0, max_queued=100)
    b.submit(1, rows(10, 11), now=0.0)
    d = b.next_dispatch(now=0.0, device_idle=True)
    assert d.reason == "idle" and len(d.rows) == 2 and d.bucket.seqlen == 16


def test_oldest_first_across_seqlens():
    b = Batcher(TABLE, max_wait_s=10.0, max_queued=100)
    b.submit(1, rows(50), now=0.0)
    b.submit(2, rows(10), now=1.0)
    first = b.next_dispatch(now=1.0, device_idle=True)
    assert first.bucket.shape == (1, 64) and [r.request for r in first.rows] == [1]
    assert [r.request for r in b.next_dispatch(now=1.0, device_idle=True).rows] == [2]


def test_spare_rows_are_filled_from_smaller_seqlens():
    b = Batcher(fixed([(4, 16), (4, 64)], layout="packed"), max_wait_s=0.0, max_queued=100)
    b.submit(1, rows(50), now=0.0)
    b.submit(2, rows(10, 10), now=0.1)
    d = b.next_dispatch(now=0.2, device_idle=True)
    assert d.bucket.shape == (4, 64) and [r.request for r in d.rows] == [1, 2, 2]
    assert b.queued == 0


def test_cheapest_batch_size_for_the_rows_at_hand():
    b = Batcher(TABLE, max_wait_s=0.0, max_queued=100)
    b.submit(1, rows(10), now=0.0)
    assert b.next_dispatch(now=0.0, device_idle=True).bucket.shape == (1, 16)


def test_queue_limit_rejects_whole_request_and_recovers():
    b = Batcher(TABLE, max_wait_s=0.0, max_queued=3)
    b.submit(1, rows(10, 10), now=0.0)
    with pytest.raises(QueueFull, match="limit of 3"):
        b.submit(2, rows(10, 10), now=0.0)
    assert b.queued == 2  # nothing of the rejected request was queued
    b.next_dispatch(now=0.0, device_idle=True)
    b.submit(2, rows(10, 10), now=0.1)
    assert b.queued == 2


def test_cancel_drops_only_that_requests_rows():
    b = Batcher(TABLE, max_wait_s=1.0, max_queued=100)
    b.submit(1, rows(10, 50), now=0.0)
    b.submit(2, rows(10), now=0.0)
    assert b.cancel(1) == 2 and b.queued == 1
    d = b.next_dispatch(now=0.0, device_idle=True)
    assert [r.request for r in d.rows] == [2]


def test_packed_rows_keep_their_pieces():
    b = Batcher(TABLE, max_wait_s=0.0, max_queued=100)
    b.submit(7, [((0, 1, 2), 40), ((3,), 9)], now=0.0)
    assert b.queued == 4
    sent = [b.next_dispatch(now=0.0, device_idle=True) for _ in range(2)]
    assert sorted((d.bucket.seqlen, r.pieces) for d in sent for r in d.rows) == [(16, (3,)), (64, (0, 1, 2))]


@settings(max_examples=100, deadline=None)
@given(st.lists(st.lists(st.integers(2, 64), min_size=1, max_size=12), min_size=1, max_size=12),
       st.floats(0.0, 0.05), st.lists(st.booleans(), min_size=1, max_size=8))
def test_every_row_dispatched_once_and_in_fitting_buckets(requests, wait, idles):
    b = Batcher(TABLE, max_wait_s=wait, max_queued=10_000)
    now, sent = 0.0, []
    for rid, toks in enumerate(requests):
        b.submit(rid, rows(*toks), now=now)
        now += 0.01
        d = b.next_dispatch(now, device_idle=idles[rid % len(idles)])
        if d:
            sent.append(d)
    while (d := b.next_dispatch(now, device_idle=True)) is not None:
        sent.append(d)
    got = sorted((r.request, r.pieces) for d in sent for r in d.rows)
    assert got == sorted((rid, (i,)) for rid, toks in enumerate(requests) for i in range(len(toks)))
    for d in sent:
        assert d.bucket in TABLE.buckets and 1 <= len(d.rows) <= d.bucket.batch
        assert all(r.tokens <= d.bucket.seqlen and len(r.pieces) <= d.bucket.slots for r in d.rows)
    assert b.queued == 0
