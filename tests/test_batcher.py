"""The batching state machine, driven by hand with explicit clocks (no JAX, no asyncio, no HTTP)."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxserve.runtime.buckets import fixed
from jaxserve.scheduling.batcher import Batcher, QueueFull, TooLarge

TABLE = fixed([(1, 16), (4, 16), (1, 64), (4, 64)], layout="packed")  # 16: 2 slots, 64: 8 slots


def submit(b, job, seqlens, now, docs=None):
    """Rows of one job: the seqlen of each row, and sequences per row (default 1)."""
    seqlens = np.asarray(seqlens)
    b.submit(job, seqlens, np.ones(len(seqlens), np.int64) if docs is None else np.asarray(docs), now)


def rows_of(d):
    return [(job, int(r)) for job, rows in d.parts for r in rows]


def test_full_bucket_leaves_even_when_device_busy():
    b = Batcher(TABLE, max_wait_s=1.0, max_queued=100_000)
    submit(b, 1, [16, 16, 16], now=0.0)
    assert b.next_dispatch(now=0.0, device_idle=False) is None  # 3 of 4 rows: waits for the window
    submit(b, 2, [16], now=0.1)
    d = b.next_dispatch(now=0.1, device_idle=False)
    assert d.reason == "full" and d.bucket.shape == (4, 16)
    assert rows_of(d) == [(1, 0), (1, 1), (1, 2), (2, 0)]
    assert b.queued == 0 and b.next_dispatch(now=5.0, device_idle=True) is None


def test_window_expiry_sends_a_partial_batch():
    b = Batcher(TABLE, max_wait_s=0.005, max_queued=100_000)
    submit(b, 1, [16], now=0.0)
    assert b.next_wakeup() == pytest.approx(0.005)
    assert b.next_dispatch(now=0.004, device_idle=False) is None
    d = b.next_dispatch(now=0.005, device_idle=False)
    assert d.reason == "window" and d.bucket.shape == (1, 16) and d.oldest == 0.0


def test_idle_device_never_waits_for_the_window():
    b = Batcher(TABLE, max_wait_s=10.0, max_queued=100_000)
    submit(b, 1, [16, 16], now=0.0)
    d = b.next_dispatch(now=0.0, device_idle=True)
    assert d.reason == "idle" and d.rows == 2 and d.bucket.seqlen == 16


def test_oldest_first_across_seqlens():
    b = Batcher(TABLE, max_wait_s=10.0, max_queued=100_000)
    submit(b, 1, [64], now=0.0)
    submit(b, 2, [16], now=1.0)
    first = b.next_dispatch(now=1.0, device_idle=True)
    assert first.bucket.shape == (1, 64) and first.jobs == [1]
    assert b.next_dispatch(now=1.0, device_idle=True).jobs == [2]


def test_spare_rows_are_filled_from_smaller_seqlens():
    b = Batcher(fixed([(4, 16), (4, 64)], layout="packed"), max_wait_s=0.0, max_queued=100_000)
    submit(b, 1, [64], now=0.0)
    submit(b, 2, [16, 16], now=0.1)
    d = b.next_dispatch(now=0.2, device_idle=True)
    assert d.bucket.shape == (4, 64) and rows_of(d) == [(1, 0), (2, 0), (2, 1)]
    assert b.queued == 0


def test_a_row_of_another_seqlen_waits_a_bounded_time_under_sustained_load():
    """A seqlen that is always full must not starve an expired row of another seqlen."""
    b = Batcher(TABLE, max_wait_s=0.005, max_queued=10_000_000)
    submit(b, 0, [64], now=0.0)
    now, job = 0.0, 1
    for step in range(20):
        submit(b, job, [16] * 8, now=now)  # a full batch at seqlen 16 arrives every step
        job += 1
        d = b.next_dispatch(now, device_idle=False)
        if d is not None and 0 in d.jobs:
            break
        now += 0.002  # a dispatch's worth of device time
    assert 0 in d.jobs and d.reason == "window"
    assert now <= 0.005 + 0.002  # served at the first decision after its window closed


def test_cheapest_batch_size_for_the_rows_at_hand():
    b = Batcher(TABLE, max_wait_s=0.0, max_queued=100_000)
    submit(b, 1, [16], now=0.0)
    assert b.next_dispatch(now=0.0, device_idle=True).bucket.shape == (1, 16)


def test_queue_limit_rejects_whole_request_and_recovers():
    b = Batcher(TABLE, max_wait_s=0.0, max_queued=48)  # tokens: three rows of 16
    submit(b, 1, [16, 16], now=0.0)
    with pytest.raises(QueueFull, match="limit of 48"):
        submit(b, 2, [16, 16], now=0.0)
    assert b.queued == 32  # nothing of the rejected request was queued
    b.next_dispatch(now=0.0, device_idle=True)
    submit(b, 2, [16, 16], now=0.1)
    assert b.queued == 32


def test_a_job_larger_than_the_whole_queue_is_too_large_not_full():
    b = Batcher(TABLE, max_wait_s=0.0, max_queued=79)
    with pytest.raises(TooLarge, match="needs 80 tokens.*at most 79"):
        submit(b, 1, [16, 64], now=0.0, docs=[2, 2])
    assert b.queued == 0
    submit(b, 2, [64], now=0.0, docs=[8])  # the bound is device work: 8 sequences in one row are 64 tokens
    assert b.queued == 64


def test_the_queue_counts_rows_at_their_seqlen_not_sequences():
    """One row of 64 tokens costs the device the same with 1 sequence or 8: both count 64 against the bound."""
    b = Batcher(TABLE, max_wait_s=0.0, max_queued=128)
    submit(b, 1, [64], now=0.0, docs=[8])
    submit(b, 2, [64], now=0.0, docs=[1])
    with pytest.raises(QueueFull):
        submit(b, 3, [16], now=0.0)
    assert b.waiting() == {"interactive": 0, "bulk": 128}


def test_cancel_drops_only_that_jobs_rows():
    b = Batcher(TABLE, max_wait_s=1.0, max_queued=100_000)
    submit(b, 1, [16, 64], now=0.0)
    submit(b, 2, [16], now=0.0)
    assert b.cancel(1) == 2 and b.queued == 16 and b.queued_rows == 1  # 2 sequences dropped, 16 tokens left
    d = b.next_dispatch(now=0.0, device_idle=True)
    assert d.jobs == [2]
    assert b.next_dispatch(now=0.0, device_idle=True) is None


def test_packed_rows_count_their_sequences():
    b = Batcher(TABLE, max_wait_s=0.0, max_queued=100_000)
    submit(b, 7, [64, 16], now=0.0, docs=[3, 1])
    assert b.queued == 80 and b.queued_rows == 2
    sent = [b.next_dispatch(now=0.0, device_idle=True) for _ in range(2)]
    assert b.queued == 0
    assert [(d.bucket.seqlen, r) for d in sent for _, r in rows_of(d)] == [(64, 0), (16, 1)]  # larger first on ties


def test_a_run_larger_than_the_batch_is_split():
    b = Batcher(TABLE, max_wait_s=0.0, max_queued=100_000)
    submit(b, 1, [16] * 6, now=0.0)
    first = b.next_dispatch(now=0.0, device_idle=True)
    second = b.next_dispatch(now=0.0, device_idle=True)
    assert rows_of(first) == [(1, i) for i in range(4)]
    assert rows_of(second) == [(1, 4), (1, 5)]


@settings(max_examples=100, deadline=None)
@given(st.lists(st.lists(st.sampled_from([16, 64]), min_size=1, max_size=12), min_size=1, max_size=12),
       st.floats(0.0, 0.05), st.lists(st.booleans(), min_size=1, max_size=8), st.sets(st.integers(0, 11)))
def test_every_row_dispatched_once_unless_cancelled(jobs, wait, idles, cancelled):
    b = Batcher(TABLE, max_wait_s=wait, max_queued=10_000_000)
    now, sent = 0.0, []
    for job, seqlens in enumerate(jobs):
        submit(b, job, seqlens, now=now)
        now += 0.01
        if job - 1 in cancelled:
            b.cancel(job - 1)
        d = b.next_dispatch(now, device_idle=idles[job % len(idles)])
        if d:
            sent.append(d)
    while (d := b.next_dispatch(now, device_idle=True)) is not None:
        sent.append(d)
    got = sorted(rows_of_d for d in sent for rows_of_d in rows_of(d))
    assert len(got) == len(set(got))  # at most once
    dropped = {j for j in cancelled if j + 1 < len(jobs)}  # cancelled after its submit
    for job, seqlens in enumerate(jobs):
        mine = [r for j, r in got if j == job]
        if job not in dropped:
            assert mine == list(range(len(seqlens)))
    for d in sent:
        assert d.bucket in TABLE.buckets and 1 <= d.rows <= d.bucket.batch
        assert len(d.jobs) == len(d.parts)  # a job's runs at several seqlens: one part (assembled, scattered once)
        assert all((np.diff(rows) > 0).all() for _, rows in d.parts)  # its rows ascending
        for job, rows in d.parts:
            assert all(jobs[job][r] <= d.bucket.seqlen for r in rows)
    assert b.queued == 0 and b.queued_rows == 0


def _scanned(b: Batcher, now: float) -> tuple:
    """oldest(), next_wakeup() and the runs due to age, by scanning every waiting run (what they once did)."""
    runs = [r for queues in b._queues for q in queues.values() for r in q]
    oldest = min((r.enqueued for r in runs), default=None)
    young = [r.enqueued for q in b._queues[1].values() for r in q if not r.aged]
    wakeup = None if oldest is None else min([oldest + b.max_wait_s, *(t + b.classes.max_bulk_wait_s for t in young)])
    due = sorted((r.job, int(r.rows[0])) for r in runs
                 if r.cls == 1 and not r.aged and now - r.enqueued >= b.classes.max_bulk_wait_s)
    return oldest, wakeup, due


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["submit", "submit", "dispatch", "cancel"]), st.lists(
    st.sampled_from([16, 64]), min_size=1, max_size=6), st.sampled_from([0, 1]), st.booleans()), min_size=1,
    max_size=40))
def test_the_oldest_run_found_without_a_scan_is_the_scanned_one(ops):
    """A queue without deadlines is in arrival order, so the batcher reads its oldest run off its head; with
    deadlines (EDF order), it scans. Either way: what a scan of every run says, after any mix of arrivals with and
    without deadlines, partial takes, cancels and aging."""
    from jaxserve.scheduling.batcher import Classes

    b = Batcher(TABLE, max_wait_s=0.05, max_queued=10**6, classes=Classes(max_bulk_wait_s=0.1))
    now = 0.0
    for job, (op, seqlens, cls, timed) in enumerate(ops):
        now += 0.02
        if op == "submit":
            b.submit(job, np.asarray(seqlens), np.ones(len(seqlens), np.int64), now, cls,
                     now + 0.03 * len(seqlens) if timed else float("inf"))
        elif op == "cancel":
            b.cancel(job - 1 - len(seqlens))
        else:
            b.next_dispatch(now, device_idle=timed)
        oldest, wakeup, due = _scanned(b, now)
        assert b.oldest() == oldest and b.next_wakeup() == wakeup
        aged = {(r.job, int(r.rows[0])) for q in b._queues[1].values() for r in q if r.aged}
        b._age(now)
        assert sorted({(r.job, int(r.rows[0])) for q in b._queues[1].values() for r in q if r.aged} - aged) == due


@settings(max_examples=100, deadline=None)
@given(st.lists(st.sampled_from([16, 64, 128]), min_size=0, max_size=12), st.booleans())
def test_a_jobs_rows_are_grouped_by_seqlen_in_any_order(seqlens, packed):
    """pack's order (each seqlen's rows one range) takes slices; any other order is grouped by value. Either way,
    each seqlen once, with exactly its rows and their sequences per row."""
    from jaxserve.scheduling.batcher import _by_seqlen

    seqlens = np.array(sorted(seqlens, reverse=True) if packed else seqlens, np.int64)
    docs = np.arange(len(seqlens)) + 1
    groups = _by_seqlen(seqlens, docs)
    assert sorted(s for s, _, _ in groups) == sorted(set(seqlens.tolist()))
    for s, rows, run_docs in groups:
        np.testing.assert_array_equal(rows, np.flatnonzero(seqlens == s))
        np.testing.assert_array_equal(run_docs, docs[rows])
