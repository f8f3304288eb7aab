"""Bucket table logic without JAX: routing, ladders, and the memory derivation (fake measure)."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from jaxserve.dims import ModelDims
from jaxserve.runtime.buckets import (
    Bucket,
    BucketTable,
    derive,
    fine_ladder,
    fixed,
    format_table,
    geometric_ladder,
    ladder,
    pow2_ladder,
)

DIMS = ModelDims(hidden=384, intermediate=1536, heads=12)
WEIGHTS = 90 * 2**20


def fake_measure(factor=1.3):
    """A compiled figure that disagrees with the estimate (as XLA's does), by a fixed factor."""
    calls = []

    def measure(batch, seqlen, slots):
        calls.append((batch, seqlen))
        return WEIGHTS + int(factor * DIMS.activation_bytes(batch, seqlen, slots))

    measure.calls = calls
    return measure


@given(st.integers(2, 4096), st.sampled_from(["default", "max", "pow2", "fine"]))
def test_ladders_ascend_and_end_at_max(max_len, name):
    seqlens = ladder(name, max_len)
    assert seqlens == sorted(set(seqlens))
    assert seqlens[-1] == max_len and seqlens[0] >= 1


def test_ladder_shapes():
    assert pow2_ladder(256) == [16, 32, 64, 128, 256]
    assert geometric_ladder(256) == [16, 32, 64, 96, 128, 192, 256]
    assert fine_ladder(64) == [16, 32, 48, 64]
    assert ladder("max", 256) == [256]
    with pytest.raises(ValueError, match="unknown ladder"):
        ladder("zigzag", 256)


@given(st.lists(st.integers(1, 512), min_size=1, max_size=8, unique=True), st.integers(1, 512))
def test_pick_is_smallest_fitting(seqlens, length):
    table = fixed([(4, s) for s in seqlens])
    fitting = [s for s in sorted(seqlens) if s >= length]
    if not fitting:
        with pytest.raises(ValueError, match="no bucket holds"):
            table.pick(length)
    else:
        assert table.pick(length).seqlen == fitting[0]


@given(st.integers(100, 20_000), st.sampled_from([1, 8]), st.floats(0.7, 1.6))
def test_derived_buckets_fit_budget(budget_mib, multiple, factor):
    budget = budget_mib * 2**20
    try:
        table = derive(pow2_ladder(512), DIMS, WEIGHTS, budget, fake_measure(factor), max_batch_tokens=10**9,
                       max_batch=10**6, multiple=multiple)
    except ValueError as err:
        assert "fits no bucket" in str(err)
        return
    for b in table.buckets:
        assert b.compiled_bytes <= budget
        assert b.batch >= 1
        assert b.batch % multiple == 0 or b.batch < multiple
        assert b.compiled_bytes == WEIGHTS + int(factor * DIMS.activation_bytes(b.batch, b.seqlen))
    assert {b.seqlen for b in table.buckets} | {s for s, _ in table.dropped} == set(pow2_ladder(512))


@given(st.integers(200, 5000), st.integers(200, 5000))
def test_smaller_budget_gives_smaller_batches(a, b):
    small, big = sorted((a * 2**20, b * 2**20))
    kw = dict(max_batch_tokens=10**9, max_batch=10**6)
    t_small = derive(pow2_ladder(256), DIMS, WEIGHTS, small, fake_measure(), **kw)
    t_big = derive(pow2_ladder(256), DIMS, WEIGHTS, big, fake_measure(), **kw)
    big_by_len = {x.seqlen: x.batch for x in t_big.buckets}
    for x in t_small.buckets:
        assert x.batch <= big_by_len[x.seqlen]


def test_memory_limit_is_reported_and_verified_by_compiled_figure():
    measure = fake_measure(1.3)
    table = derive([256], DIMS, WEIGHTS, 2**30, measure, max_batch_tokens=10**9, max_batch=10**6)
    (b,) = table.buckets
    assert b.limited_by == "memory"
    assert len(measure.calls) >= 2  # the estimate's candidate was over budget and was shrunk
    assert b.compiled_bytes <= 2**30 < WEIGHTS + int(1.3 * DIMS.activation_bytes(b.batch + 1, 256))


def test_token_and_row_caps():
    t = derive([16, 256], DIMS, WEIGHTS, 2**34, fake_measure(), max_batch_tokens=4096, max_batch=128)
    assert [(b.batch, b.limited_by) for b in t.buckets] == [(128, "max_batch"), (16, "tokens")]


def test_budget_too_small_for_long_seqlen_drops_it():
    one_row_256 = WEIGHTS + int(1.3 * DIMS.activation_bytes(1, 256))
    budget = one_row_256 - 1
    t = derive([16, 64, 256], DIMS, WEIGHTS, budget, fake_measure(), max_batch_tokens=10**9)
    assert t.seqlens == [16, 64]
    assert t.dropped[0][0] == 256 and "batch 1 needs more than the budget" in t.dropped[0][1]
    assert "256 dropped" in format_table(t)


def test_the_printed_table_says_which_memory_figures_xla_measured():
    """A bucket the derivation compiled shows XLA's bytes and its share of the budget; one it did not (the ladder's
    smaller batches, estimated only) shows "-", not 0.0 MiB and 0.0% as if XLA had measured nothing."""
    t = BucketTable(buckets=(Bucket(1, 16, 1, estimated_bytes=2**20), Bucket(8, 16, 1, compiled_bytes=3 * 2**20)),
                    budget_bytes=30 * 2**20)
    lines = format_table(t).splitlines()[2:]
    assert lines[0].split()[5:7] == ["-", "-"]
    assert lines[1].split()[5:7] == ["3.0", "10.0%"]


def test_budget_below_weights_is_a_clear_error():
    with pytest.raises(ValueError, match="fits no bucket"):
        derive([16, 32], DIMS, WEIGHTS, WEIGHTS // 2, fake_measure(), max_batch_tokens=4096)


def test_json_round_trip(tmp_path):
    t = derive(pow2_ladder(128), DIMS, WEIGHTS, 2**31, fake_measure(), max_batch_tokens=8192, device="cpu")
    t.save(tmp_path / "t.json")
    assert BucketTable.load(tmp_path / "t.json") == t


def test_table_rejects_unsorted_or_duplicate_shapes():
    with pytest.raises(ValueError, match="distinct and sorted"):
        BucketTable(buckets=(Bucket(4, 32), Bucket(4, 16)))
    with pytest.raises(ValueError, match="distinct and sorted"):
        BucketTable(buckets=(Bucket(4, 16), Bucket(4, 16)))
    with pytest.raises(ValueError, match="disagree on slots"):
        BucketTable(buckets=(Bucket(2, 16, slots=1), Bucket(4, 16, slots=2)))


@pytest.mark.parametrize("bucket", [Bucket(0, 16), Bucket(4, 0), Bucket(4, 16, slots=0), Bucket(-1, 16)])
def test_table_rejects_a_bucket_without_rows_tokens_or_slots(bucket):
    """A table file's bucket of batch, seqlen or slots below 1 is refused when read (before: it loaded, and a
    batch of 0 rows or a row of 0 slots failed at warmup or on the first request)."""
    with pytest.raises(ValueError, match="at least 1"):
        BucketTable(buckets=(bucket,))


def test_table_rejects_slots_that_shrink_as_the_seqlen_grows():
    """Routing takes the smallest seqlen whose rows hold a row's sequences, searching the slots as sorted: fewer
    slots at a longer seqlen sent two sequences to a one-slot row (then the batcher failed forming its batch)."""
    with pytest.raises(ValueError, match="must not decrease"):
        BucketTable((Bucket(4, 16, 2), Bucket(4, 32, 1), Bucket(4, 64, 8)), layout="packed")
    BucketTable((Bucket(4, 16, 2), Bucket(4, 32, 2), Bucket(4, 64, 8)), layout="packed")


def test_batch_ladder_adds_halvings_that_fit():
    from jaxserve.runtime.buckets import batch_sizes

    assert batch_sizes(16) == [1, 4, 16] and batch_sizes(21) == [1, 4, 16, 21] and batch_sizes(1) == [1]
    t = derive([16, 256], DIMS, WEIGHTS, 2**34, fake_measure(), max_batch_tokens=4096, batch_ladder=True)
    assert [b.batch for b in t.at(256)] == [1, 4, 16]
    assert [b.batch for b in t.at(16)] == [1, 4, 16, 64, 256]
    assert t.pick(200).shape == (16, 256)
    assert all(b.compiled_bytes <= t.budget_bytes for b in t.buckets)
    assert {b.limited_by for b in t.at(256)[:-1]} == {"ladder"}
    with pytest.raises(ValueError, match="at least one"):
        BucketTable(buckets=())


def test_throughput_knee_keeps_batches_until_a_larger_one_stops_paying():
    from jaxserve.runtime.buckets import Bucket, BucketTable, throughput_knee

    def timed(seqlen, rates):  # batch -> tokens per second
        return [Bucket(b, seqlen, 1, run_s=b * seqlen / r) for b, r in rates.items()]

    cpu = timed(256, {1: 12_300, 4: 14_500, 16: 11_100})  # measured on this project's CPU: 16 rows fall out of cache
    gpu = timed(16, {1: 1e4, 4: 4e4, 16: 1.5e5, 64: 4e5, 256: 6e5, 1024: 6.2e5, 4096: 6.3e5})  # plateau past 256
    table = throughput_knee(BucketTable(buckets=tuple(gpu + cpu)))
    assert [(b.seqlen, b.batch) for b in table.buckets] == [(16, 1), (16, 4), (16, 16), (16, 64), (16, 256),
                                                            (256, 1), (256, 4)]
    assert table.at(16)[-1].limited_by == table.at(256)[-1].limited_by == "throughput"
    untimed = BucketTable(buckets=(Bucket(1, 16), Bucket(4, 16)))
    with pytest.raises(ValueError, match="never timed"):
        throughput_knee(untimed)


def test_shipped_tables_load_and_fit_jaxs_default_pool():
    """Every table in buckets/ loads and stays within its budget; the H100/H200 ones are sized for JAX's default
    pool (75% of the 80 / 141 GB card), not the whole card."""
    from pathlib import Path

    pools = {"h100": 60_000_000_000, "h200": 105_750_000_000}
    files = sorted((Path(__file__).parents[1] / "buckets").glob("*.json"))
    assert len(files) >= 10
    for f in files:
        t = BucketTable.load(f)
        assert t.buckets and all(b.compiled_bytes is None or b.compiled_bytes <= t.budget_bytes for b in t.buckets), f
        for card, pool in pools.items():
            if f"-{card}-" in f.name:
                assert t.device_memory == pool and t.budget_bytes <= 0.9 * pool, f
