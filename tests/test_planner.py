"""Planner properties (hypothesis) with a hand-computable fake engine: no JAX here."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxserve.buckets import Bucket, BucketTable, fixed, geometric_ladder, slots_for
from jaxserve.planner import assemble, plan, scatter

TABLES = {
    "padded": fixed([(8, 16), (4, 32), (4, 64), (2, 128)]),
    "packed": fixed([(8, 16), (4, 32), (4, 64), (2, 128)], layout="packed"),
    "packed-cpu": fixed([(256, 16), (128, 32), (64, 64), (42, 96), (32, 128), (21, 192), (16, 256)], layout="packed"),
    "packed-one-shape": fixed([(4, 128)], layout="packed"),
    "packed-batch-ladder": fixed([(b, s) for s in (16, 64, 256) for b in (1, 2, 4, 8)], layout="packed"),
}

lengths_st = st.lists(st.integers(2, 128), min_size=0, max_size=120)  # every table holds 128


def fake_run(batch_arrays, bucket):
    """Per row and slot: [sum of the segment's token ids, its token count] (what a pooling would see)."""
    ids, seg = batch_arrays["token_ids"], batch_arrays["segment_ids"]
    out = np.zeros((bucket.batch, bucket.slots, 2))
    for k in range(1, bucket.slots + 1):
        mask = seg == k
        out[:, k - 1, 0] = (ids * mask).sum(1)
        out[:, k - 1, 1] = mask.sum(1)
    return out


def sequences(lengths, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(1, 1000, size=n).astype(np.int32) for n in lengths]


@settings(max_examples=150, deadline=None)
@given(lengths_st, st.sampled_from(sorted(TABLES)))
def test_every_sequence_once_rows_fit_results_in_order(lengths, name):
    table = TABLES[name]
    p = plan(lengths, table)
    seen = [i for b in p.batches for i in b.members]
    assert sorted(seen) == list(range(len(lengths)))  # each exactly once
    for b in p.batches:
        assert b.bucket in table.buckets
        assert 1 <= len(b.rows) <= b.bucket.batch
        for row in b.rows:
            assert 1 <= len(row) <= b.bucket.slots
            assert sum(lengths[i] for i in row) <= b.bucket.seqlen
    assert p.real_tokens == sum(lengths) and p.padded_tokens >= p.real_tokens
    # assemble + fake engine + scatter give each sequence its own values, in input order
    seqs = sequences(lengths)
    out = np.zeros((len(lengths), 2))
    for b in p.batches:
        arrays = assemble(b, seqs)
        for r, row in enumerate(b.rows):
            segs = arrays["segment_ids"][r]
            for slot, i in enumerate(row, start=1):
                np.testing.assert_array_equal(arrays["positions"][r][segs == slot], np.arange(lengths[i]))
        scatter(b, fake_run(arrays, b.bucket), out)
    np.testing.assert_array_equal(out[:, 0], [s.sum() for s in seqs])
    np.testing.assert_array_equal(out[:, 1], lengths)


@settings(max_examples=150, deadline=None)
@given(lengths_st, st.sampled_from(["packed", "packed-cpu", "packed-one-shape", "packed-batch-ladder"]))
def test_packing_never_uses_more_dispatches_than_padding(lengths, name):
    table = TABLES[name]
    packed, padded = plan(lengths, table), plan(lengths, table, layout="padded")
    assert padded.layout == "padded"
    assert packed.dispatches <= padded.dispatches
    assert packed.cost() <= padded.cost()


def test_padded_routes_each_to_smallest_fitting_bucket():
    table = fixed([(1, 16), (1, 32), (1, 64), (1, 128)])  # full batches: nothing to merge
    p = plan([3, 16, 17, 64, 65, 128], table)
    where = {i: b.bucket.seqlen for b in p.batches for i in b.members}
    assert where == {0: 16, 1: 16, 2: 32, 3: 64, 4: 128, 5: 128}


def test_short_documents_share_rows_when_packed():
    lengths = [10] * 40
    padded = plan(lengths, TABLES["packed-one-shape"], layout="padded")
    packed = plan(lengths, TABLES["packed-one-shape"])
    assert padded.dispatches == 10 and padded.padding_ratio > 0.9
    assert packed.layout == "packed" and packed.dispatches == 1
    assert max(len(r) for b in packed.batches for r in b.rows) == 12  # 12 x 10 tokens in a 128-token row
    assert packed.padding_ratio < padded.padding_ratio


def test_partial_batch_merged_into_larger_buckets_spare_rows():
    table = fixed([(8, 16), (4, 64)])
    p = plan([10, 50], table, layout="padded")
    assert p.dispatches == 1 and p.batches[0].bucket.seqlen == 64


def test_batch_ladder_covers_the_last_rows_cheaply():
    table = fixed([(1, 64), (2, 64), (4, 64), (8, 64), (16, 64)])
    p = plan([60] * 17, table)  # 16 + 1 rows, no padding rows
    assert sorted(b.bucket.batch for b in p.batches) == [1, 16]
    assert p.padding_ratio == pytest.approx(1 - 60 / 64)
    # 7 rows left: one batch of 8 (512 tokens + 64 overhead) beats 4 + 2 + 1 (448 + 3 x 64)
    assert sorted(b.bucket.batch for b in plan([60] * 23, table).batches) == [8, 16]
    packed = plan([30] * 40, fixed([(1, 64), (2, 64), (4, 64), (8, 64), (16, 64)], layout="packed"))
    assert packed.layout == "packed" and packed.padding_ratio == pytest.approx(1 - 60 / 64)


def test_measured_times_drive_the_choice():
    """With run times known, the plan minimises predicted time, not padded tokens."""
    def timed(run_16, run_128):
        return BucketTable(buckets=(Bucket(8, 16, slots_for(16, "packed"), run_s=run_16),
                                    Bucket(1, 128, slots_for(128, "packed"), run_s=run_128)), layout="packed")
    lengths = [14] * 8
    assert plan(lengths, timed(0.001, 1.0)).layout == "padded"  # 1 cheap dispatch beats a packed row at 128
    assert plan(lengths, timed(1.0, 0.001)).batches[0].bucket.seqlen == 128


def test_summary_names_documents_and_tokens():
    p = plan([10, 20, 100], TABLES["padded"])
    s = p.summary(doc_of=[0, 1, 1])
    assert s["dispatches"] == p.dispatches and s["real_tokens"] == 130
    assert sorted({d for b in s["batches"] for d in b["documents"]}) == [0, 1]
    assert s["padding_ratio"] == pytest.approx(1 - 130 / p.padded_tokens)


def test_too_long_sequence_is_an_error():
    with pytest.raises(ValueError, match="no bucket holds 129 tokens"):
        plan([129], TABLES["padded"])


def test_slots_grow_with_seqlen():
    assert [slots_for(s, "packed") for s in geometric_ladder(512)] == [2, 4, 8, 12, 16, 24, 32, 32, 32]
    assert slots_for(256, "padded") == 1
