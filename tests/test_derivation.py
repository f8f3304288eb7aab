"""The lazy derivation as pure code: each seqlen's ladder climbed to its knee, with fake compilers and clocks."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxserve.dims import ModelDims
from jaxserve.runtime.buckets import Bucket, BucketTable, batch_fitter, batch_sizes, pays, throughput_knee
from jaxserve.runtime.derivation import Climb, TableOptions, climb, climbs, table_of

DIMS = ModelDims(hidden=64, intermediate=256, heads=4)
WEIGHTS = 10_000


def fake_bytes(batch, seqlen, slots):
    return WEIGHTS + DIMS.activation_bytes(batch, seqlen, slots)


def run(ladders, rate, bytes_of=fake_bytes):
    """Climb with a clock from `rate(batch, seqlen)` (tokens/s); returns (ladders, compiled shapes, timed shapes)."""
    compiled, timed = [], []

    def compile_many(shapes):
        compiled.extend(shapes)
        return [bytes_of(*s) for s in shapes]

    def time_one(bucket):
        timed.append(bucket.shape)
        return bucket.tokens / rate(bucket.batch, bucket.seqlen)

    return climb(ladders, compile_many, time_one), compiled, timed


rates = st.dictionaries(st.sampled_from([1, 4, 16, 64, 256]), st.floats(1.0, 1e6), min_size=5, max_size=5)


@settings(max_examples=200, deadline=None)
@given(rates=rates, seqlens=st.lists(st.sampled_from([16, 32, 64, 128]), min_size=1, max_size=4, unique=True))
def test_climb_keeps_what_the_knee_keeps_and_compiles_at_most_one_more(rates, seqlens):
    seqlens = sorted(seqlens)
    rate = lambda b, s: rates[b] * (1 + s / 1000)
    ladders = climbs(seqlens, DIMS, WEIGHTS, budget_bytes=2**40, max_batch_tokens=2**40, max_batch=256)
    ladders, compiled, timed = run(ladders, rate)
    table = table_of(ladders, DIMS, WEIGHTS, budget_bytes=2**40)
    # the knee of the whole ladder, every batch timed, is what the climb kept
    full = BucketTable(tuple(Bucket(b, s, run_s=b * s / rate(b, s)) for s in seqlens for b in batch_sizes(256)))
    assert [b.shape for b in table.buckets] == [b.shape for b in throughput_knee(full).buckets]
    for s in seqlens:
        kept = table.at(s)
        assert all(pays(big, small) for small, big in zip(kept, kept[1:]))
        built = [b for b, seqlen, _ in compiled if seqlen == s]
        assert built == sorted(built) and len(built) <= len(kept) + 1
        if len(built) > len(kept):  # stopped at the knee: the one compile past it is not kept
            assert kept[-1].limited_by == "throughput" and not pays(Bucket(built[-1], s, run_s=built[-1] * s / rate(built[-1], s)), kept[-1])
        else:
            assert kept[-1].batch == 256 and kept[-1].limited_by == "max_batch"
    assert sorted(timed) == sorted((b, s) for b, s, _ in compiled)  # nothing over budget here: all timed


@settings(max_examples=100, deadline=None)
@given(budget_rows=st.integers(0, 300), true_over_estimate=st.floats(0.5, 3.0))
def test_memory_bounds_the_climb_and_an_over_budget_batch_is_never_run(budget_rows, true_over_estimate):
    """The analytic estimate bounds the candidates, XLA's figure (here off by a factor) checks each one:
    a batch over the budget is never timed, and nothing kept is over it."""
    seqlen = 64
    per_row = DIMS.activation_bytes(1, seqlen, 8)
    budget = WEIGHTS + budget_rows * per_row
    bytes_of = lambda b, s, k: WEIGHTS + int(true_over_estimate * DIMS.activation_bytes(b, s, k))
    ladders = climbs([seqlen], DIMS, WEIGHTS, budget, max_batch_tokens=2**40, max_batch=2**20, layout="packed")
    (ladder,), compiled, timed = run(ladders, lambda b, s: float(b), bytes_of)  # throughput grows with the batch
    assert all(bytes_of(b, s, k) <= budget for b, s, k in compiled if (b, s) in timed)
    assert all(b.compiled_bytes <= budget for b in ladder.kept)
    if ladder.kept:
        # memory ends the climb; a batch shrunk to fit just above the last kept one may not pay for itself
        assert ladder.kept[-1].limited_by in ("memory", "throughput") and ladder.dropped_reason is None
        assert len([c for c in compiled if (c[0], c[1]) not in timed]) <= 2  # over budget once, shrunk once at most
    else:
        assert "batch 1 needs more than the budget" in ladder.dropped_reason


def test_the_same_timings_give_the_same_table():
    rate = lambda b, s: {1: 1.0, 4: 3.9, 16: 4.0, 64: 4.1, 256: 4.2}[b]
    tables = [table_of(run(climbs([16, 64], DIMS, WEIGHTS, 2**40, 2**40, 256), rate)[0], DIMS, WEIGHTS)
              for _ in range(2)]
    assert tables[0] == tables[1] and [b.batch for b in tables[0].at(16)] == [1, 4]


def test_climb_state_machine_by_hand():
    c = Climb(32, 4, [1, 4, 16], "tokens", budget_bytes=1000, fit=lambda n: n)
    assert c.next() == 1 and c.measured(1, 100)
    c.timed(0.001)
    assert c.next() == 4 and c.measured(4, 400)
    c.timed(0.002)  # 2x the rate: pays
    assert c.next() == 16 and not c.measured(16, 1600)  # over: the line through (4, 400), (16, 1600) meets 1000 at 10
    assert c.next() == 10 and c.measured(10, 990)
    c.timed(0.004)  # 10 rows in 4 ms (2500 rows/s) against 4 in 2 ms (2000): pays
    assert c.done and [b.batch for b in c.kept] == [1, 4, 10] and c.kept[-1].limited_by == "memory"
    assert c.compiled == [1, 4, 16, 10]


def climb_linear(weights, fixed, per_row, budget, multiple=1, ladder=True, max_batch=2**40, max_batch_tokens=2**40):
    """One seqlen's climb (no knee) against memory linear in the batch, `weights + fixed + per_row * batch` bytes,
    above the analytic estimate."""
    (c,) = climbs([16], DIMS, weights, budget, max_batch_tokens, max_batch, multiple, batch_ladder=ladder, knee=False)
    climb([c], lambda shapes: [weights + fixed + per_row * b for b, _, _ in shapes], lambda bucket: 1.0)
    return c


@settings(max_examples=300, deadline=None)
@given(weights=st.integers(0, 10**11), fixed=st.integers(0, 10**10), rows_per_estimate=st.integers(16, 2000),
       fits=st.integers(1, 20_000), over=st.floats(1.0, 8.0), slack=st.floats(0.0, 0.999),
       multiple=st.sampled_from([1, 8]), ladder=st.booleans())
def test_one_retry_lands_within_the_budget_when_memory_is_linear(weights, fixed, rows_per_estimate, fits, over, slack,
                                                                 multiple, ladder):
    """A candidate over the budget is retried once, at the largest batch within it (rounded by the batch multiple),
    however large a share the weights and the compiler's fixed bytes take: the retry's line runs through the last
    kept batch, or through the weights at batch 0 where none is kept (then the rule sees no fixed bytes beyond
    the weights)."""
    fixed = fixed if ladder else 0
    per_row = rows_per_estimate * DIMS.activation_bytes(1, 16)  # the estimate bounds no candidate below the cap
    fit = batch_fitter(multiple, 1)
    budget = weights + fixed + per_row * fits + int(slack * per_row)  # `fits` rows is the most within it
    top = fit(max(int(fits * over), fits + multiple))  # over the budget
    c = climb_linear(weights, fixed, per_row, budget, multiple, ladder, max_batch=top)
    candidates = sorted({fit(b) for b in batch_sizes(top)} - {0}) if ladder else [top]
    first_over = next(i for i, b in enumerate(candidates) if weights + fixed + per_row * b > budget)
    floor = candidates[first_over - 1] if first_over else 0
    retry = [fit(fits)] if fit(fits) > floor else []
    assert c.compiled == candidates[: first_over + 1] + retry
    assert c.done and c.kept[-1].batch == (retry or [floor])[0] and c.kept[-1].limited_by == "memory"
    assert all(b.compiled_bytes <= budget for b in c.kept)


def test_an_8b_model_over_the_budget_compiles_its_largest_bucket_once_more():
    """XLA's figures for Qwen3-Embedding-8B at seqlen 16 (`results/memory-tables-qwen3-embedding-8b-cache.json`, the
    compiler's fixed temporaries taken off): weights about a quarter of an H100's budget, then about linear per
    row. The token cap's batch is over the budget; one retry fits. Shrinking the whole figure in proportion,
    weights included, compiled batch after batch of about that size, each over the budget, before one fit."""
    weights, per_row, budget = 15_134_591_168, 2_624_000, 54_000_000_000
    c = climb_linear(weights, 0, per_row, budget, multiple=8, max_batch_tokens=2**18)
    candidates = [1, 4, 16, 64, 256, 1024, 4096, 16384]  # the token cap's batch last
    assert c.compiled == candidates + [14808] and [b.batch for b in c.kept] == candidates[:-1] + [14808]
    assert c.kept[-1].compiled_bytes <= budget < weights + per_row * 14816


def test_table_options_sort_seqlens_and_refuse_non_positive_ones():
    """Seqlens are put in order without repeats, and one below 1 refused, when the options are made: before, an
    unsorted list climbed and compiled every bucket before the table refused its order, and 0 divided by zero."""
    assert TableOptions(seqlens=(64, 16, 16, 32)).seqlens == (16, 32, 64)
    for bad in ((0, 64), (16, -32), (16.5,), ("16",)):
        with pytest.raises(ValueError, match="positive integers"):
            TableOptions(seqlens=bad)
