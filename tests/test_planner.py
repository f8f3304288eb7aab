"""Packing properties (hypothesis), pure numpy: which sequences share a row, and where each row goes."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxserve.errors import TooLongError
from jaxserve.runtime.buckets import Bucket, BucketTable, fixed, geometric_ladder, slots_for
from jaxserve.scheduling.planner import UNTIMED_PACK_WIDTH, cheapest_cover, pack, pack_width

TABLES = {
    "padded": fixed([(8, 16), (4, 32), (4, 64), (2, 128)]),
    "packed": fixed([(8, 16), (4, 32), (4, 64), (2, 128)], layout="packed"),
    "packed-cpu": fixed([(256, 16), (128, 32), (64, 64), (42, 96), (32, 128), (21, 192), (16, 256)], layout="packed"),
    "packed-one-shape": fixed([(4, 128)], layout="packed"),
    "packed-batch-ladder": fixed([(b, s) for s in (16, 64, 256) for b in (1, 2, 4, 8)], layout="packed"),
}

lengths_st = st.lists(st.integers(2, 128), min_size=0, max_size=120)  # every table holds 128


@settings(max_examples=200, deadline=None)
@given(lengths_st, st.sampled_from(sorted(TABLES)))
def test_every_sequence_once_in_the_smallest_row_that_holds_it(lengths, name):
    table = TABLES[name]
    rows = pack(lengths, table)
    assert sorted(rows.members.tolist()) == list(range(len(lengths)))  # each exactly once
    assert (np.diff(rows.seqlen) <= 0).all()  # longest first: a seqlen's rows are consecutive
    seqlens = table.seqlens
    for r in range(rows.count):
        members = rows.row_members(r)
        tokens = sum(lengths[i] for i in members)
        s = int(rows.seqlen[r])
        assert tokens == rows.tokens[r] and tokens <= s and len(members) <= table.at(s)[-1].slots
        smaller = [t for t in seqlens if t < s]
        assert not any(tokens <= t and len(members) <= table.at(t)[-1].slots for t in smaller)
    if table.layout == "padded":
        assert rows.layout == "padded" and (rows.docs == 1).all()
    assert rows.real_tokens == sum(lengths) and int(rows.docs.sum()) == len(lengths)


def test_padded_routes_each_to_smallest_fitting_seqlen():
    rows = pack([3, 16, 17, 64, 65, 128], fixed([(1, 16), (1, 32), (1, 64), (1, 128)]))
    assert dict(zip(rows.members.tolist(), rows.seqlen.tolist())) == {0: 16, 1: 16, 2: 32, 3: 64, 4: 128, 5: 128}


def test_short_documents_share_rows_when_packed():
    rows = pack([10] * 40, TABLES["packed-one-shape"])
    assert rows.layout == "packed" and rows.width == 128
    assert rows.count == 4 and rows.docs.max() == 12  # 12 x 10 tokens in a 128-token row, 16 slots
    assert pack([10] * 40, TABLES["packed-one-shape"], layout="padded").count == 40


def test_long_sequences_open_their_own_rows_and_short_ones_join_them():
    table = fixed([(4, 32), (4, 64), (4, 128)], layout="packed")
    rows = pack([100, 20, 5], table)
    assert rows.width == 128 and rows.count == 1 and rows.docs.tolist() == [3] and rows.seqlen.tolist() == [128]


def test_pack_width_is_the_cheapest_seqlen_per_token_once_timed():
    def timed(run_16, run_128):
        return BucketTable(buckets=(Bucket(8, 16, slots_for(16, "packed"), run_s=run_16),
                                    Bucket(1, 128, slots_for(128, "packed"), run_s=run_128)), layout="packed")
    assert pack_width(timed(0.001, 1.0)) == 16  # 128 tokens in 1 ms vs 128 tokens in 1 s
    assert pack_width(timed(1.0, 0.001)) == 128
    assert pack_width(TABLES["packed-cpu"]) == UNTIMED_PACK_WIDTH
    assert pack_width(TABLES["padded"]) is None
    assert pack([14] * 8, timed(0.001, 1.0)).seqlen.tolist() == [16] * 8  # one 14-token sequence per 16-token row


def test_batch_ladder_covers_rows_cheaply():
    options = fixed([(1, 64), (2, 64), (4, 64), (8, 64), (16, 64)]).at(64)
    cost = lambda b: b.tokens + 64  # the untimed cost model
    assert [b.batch for b in cheapest_cover(17, options, cost)] == [16, 1]
    # 7 rows: one batch of 8 (512 tokens + 64 overhead) beats 4 + 2 + 1 (448 + 3 x 64)
    assert [b.batch for b in cheapest_cover(23, options, cost)] == [16, 8]


def test_too_long_sequence_is_an_error():
    """The input's error (a request's 400, 422 on TEI's routes), not a bug's 500."""
    for lengths in ([129], [129, 3]):
        with pytest.raises(TooLongError, match="no bucket holds 129 tokens"):
            pack(lengths, TABLES["padded"])


def test_slots_grow_with_seqlen():
    assert [slots_for(s, "packed") for s in geometric_ladder(512)] == [2, 4, 8, 12, 16, 24, 32, 32, 32]
    assert slots_for(256, "padded") == 1


def test_packing_a_corpus_leaves_little_padding():
    """Many short documents: rows nearly full (per-row padding only at each request's last row)."""
    rng = np.random.default_rng(0)
    lengths = np.minimum(rng.lognormal(3.2, 0.8, 1024).astype(int) + 2, 256)
    rows = pack(lengths, TABLES["packed-cpu"])
    padded = int(rows.seqlen.sum())
    assert 1 - rows.real_tokens / padded < 0.08


@pytest.mark.parametrize("name", sorted(TABLES))
def test_one_sequence_rows_are_made_once_per_length_and_read_only(name):
    """A query's Rows are shared by every query of its length on its table: equal to what packing computes,
    never written."""
    table = TABLES[name]
    for n in (2, 17, 128):
        rows = pack([n], table)
        assert pack(np.array([n]), table) is rows
        assert rows.lengths.tolist() == [n] and rows.members.tolist() == [0] and rows.starts.tolist() == [0, 1]
        assert rows.seqlen.tolist() == [min(s for s in table.seqlens if s >= n)]
        assert rows.width == pack([n, n], table).width
        with pytest.raises(ValueError, match="read-only"):
            rows.seqlen[0] = 1
    assert pack([5], TABLES["padded"]) is not pack([5], TABLES["packed"])  # by table
