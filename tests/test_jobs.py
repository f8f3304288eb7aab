"""Jobs to batches and back: assemble + a hand-computable fake device + scatter (numpy only, no JAX)."""

import pickle

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxserve.checkpoint.tokenize import from_sequences
from jaxserve.runtime import output_chunks
from jaxserve.runtime.buckets import fixed
from jaxserve.scheduling.batcher import Batcher
from jaxserve.scheduling.jobs import Job, assemble, joined, most_per_row, ragged_arange, scatter
from jaxserve.scheduling.planner import Rows, pack

TABLES = [fixed([(4, 16), (2, 64), (2, 128)], layout="packed"), fixed([(4, 16), (2, 64), (2, 128)]),
          fixed([(b, s) for s in (16, 64, 128) for b in (1, 4)], layout="packed")]


def fake_device(inputs, slots):
    """Per row and slot: [sum of its token ids, its token count, first position, last position + 1]."""
    ids, seg, pos, _ = inputs
    out = np.zeros((ids.shape[0], slots, 4))
    for k in range(1, slots + 1):
        mask = seg == k
        out[:, k - 1, 0] = (ids * mask).sum(1)
        out[:, k - 1, 1] = mask.sum(1)
        out[:, k - 1, 2] = np.where(mask, pos, 10**6).min(1) * mask.any(1)
        out[:, k - 1, 3] = np.where(mask, pos + 1, 0).max(1)
    return out


def test_ragged_arange():
    np.testing.assert_array_equal(ragged_arange([5, 0, 10], [2, 0, 3]), [5, 6, 10, 11, 12])
    assert len(ragged_arange([], [])) == 0


def shuffled(rows: Rows, rng) -> Rows:
    """The same rows in another order (pack puts them longest seqlen first; a caller need not)."""
    order = rng.permutation(rows.count)
    members = np.concatenate([rows.row_members(r) for r in order]) if rows.count else rows.members
    starts = np.concatenate([[0], np.cumsum(rows.docs[order])])
    return Rows(rows.lengths, members, starts, rows.seqlen[order], rows.width)


def crossed(job: Job) -> Job:
    """The job as the engine process receives it over the link (pickle protocol 5, arrays out of band)."""
    buffers = []
    head = pickle.dumps(job, protocol=5, buffer_callback=buffers.append)
    return pickle.loads(head, buffers=[b.raw() for b in buffers])


@settings(max_examples=150, deadline=None)
@given(st.lists(st.lists(st.integers(2, 128), min_size=1, max_size=30), min_size=1, max_size=4),
       st.sampled_from(range(len(TABLES))), st.integers(0, 3), st.booleans(), st.booleans())
def test_every_sequence_comes_back_to_its_place(requests, t, cancelled, shuffle, across):
    """Also with a job's rows in any order: a batch takes a job's rows at several seqlens as one part. `across`:
    the batches run on the jobs as the engine process receives them (`crossed`), which gather their outputs, and
    the front-end's jobs place them when read."""
    table = TABLES[t]
    rng = np.random.default_rng(len(requests))
    batcher = Batcher(table, max_wait_s=0.0, max_queued=10_000_000)
    jobs, seqs = {}, {}
    for jid, lengths in enumerate(requests):
        seqs[jid] = [rng.integers(1, 1000, n).astype(np.int32) for n in lengths]
        pieces = from_sequences(seqs[jid], np.arange(len(lengths)), np.ones(len(lengths)))
        rows = pack(pieces.lengths, table)
        rows = shuffled(rows, rng) if shuffle else rows
        jobs[jid] = Job(rows, pieces.ids, pieces.offsets, None, 4)
        batcher.submit(jid, rows.seqlen, rows.docs, 0.0)
    if cancelled < len(requests):
        batcher.cancel(cancelled)
        gone = jobs.pop(cancelled)
    engine = {jid: crossed(job) for jid, job in jobs.items()} if across else jobs
    finished = []
    while (d := batcher.next_dispatch(0.0, device_idle=True)) is not None:
        inputs, real = assemble(d.bucket, d.parts, engine)
        assert inputs.shape == (4, *d.bucket.shape) and inputs.dtype == np.int32
        assert real == (inputs[1] > 0).sum()
        most = most_per_row(d.parts, engine)
        assert most == inputs[1].max()  # the fullest row, without reading the batch
        # only the output chunks that hold the fullest row's slots come back, as from the engine
        shipped = output_chunks.ends(d.bucket.slots)[output_chunks.needed(d.bucket.slots, most) - 1]
        finished += scatter(d.parts, fake_device(inputs, d.bucket.slots)[:, :shipped], engine)
    assert sorted(finished) == sorted(jobs)  # each live job finishes exactly once
    for jid, job in jobs.items():
        if across:
            assert engine[jid].remaining == 0 and job.remaining == len(seqs[jid]) and not job.out.any()
            job.receive(engine[jid].gathered, engine[jid].kept)
        assert job.remaining == 0
        want = np.array([[s.sum(), len(s), 0, len(s)] for s in seqs[jid]])
        np.testing.assert_array_equal(job.out, want)  # positions restart at 0 in every slot
    if cancelled < len(requests):
        assert gone.remaining == len(requests[cancelled])  # never ran


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(1, 128), min_size=0, max_size=30), st.sampled_from(range(len(TABLES))), st.booleans(),
       st.booleans())
def test_each_row_lies_in_flat_padded_to_its_seqlen(lengths, t, typed, shuffle):
    """The layout `assemble` copies blocks of: row r at `pad_start[r]`, `seqlen[r]` wide, its sequences' tokens
    side by side (segment k, positions from 0) and then zeros; `row_start` and `seq_start` count real tokens."""
    rng = np.random.default_rng(len(lengths))
    seqs = [rng.integers(1, 1000, n).astype(np.int32) for n in lengths]
    types = [rng.integers(0, 2, n).astype(np.int32) for n in lengths] if typed else None
    pieces = from_sequences(seqs, np.arange(len(lengths)), np.ones(len(lengths)), types)
    rows = pack(pieces.lengths, TABLES[t])
    rows = shuffled(rows, rng) if shuffle else rows
    job = Job(rows, pieces.ids, pieces.offsets, pieces.types, 4)
    assert job.pad_start.tolist() == [0, *np.cumsum(rows.seqlen).tolist()] and job.flat.shape[1] == job.pad_start[-1]
    assert job.row_start.tolist() == [0, *np.cumsum(rows.tokens).tolist()]
    for r in range(rows.count):
        members = rows.row_members(r).tolist()
        block = job.flat[:, job.pad_start[r] : job.pad_start[r + 1]]
        planes = [np.concatenate([seqs[p] for p in members]),
                  np.concatenate([np.full(len(seqs[p]), k + 1) for k, p in enumerate(members)]),
                  np.concatenate([np.arange(len(seqs[p])) for p in members]),
                  np.concatenate([types[p] if typed else np.zeros(len(seqs[p])) for p in members])]
        n = int(rows.tokens[r])
        np.testing.assert_array_equal(block[:, :n], planes)
        assert not block[:, n:].any()
        before = job.row_start[r]  # each of its sequences' first token among the job's real tokens
        for p in members:
            assert job.seq_start[p] == before
            before += len(seqs[p])
    for p, s in enumerate(seqs):
        np.testing.assert_array_equal(job.inputs_of(p)[0], s)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 120), min_size=1, max_size=40), st.sampled_from(range(len(TABLES))), st.booleans())
def test_joined_queries_each_get_their_own_output(lengths, t, typed):
    """`joined` makes one-sequence jobs (queries) one job's sequences, sequence i being job i's, each in its own row:
    run through the batcher on the engine's copy, each query's output is its own tokens', placed at i."""
    table = TABLES[t]
    rng = np.random.default_rng(len(lengths))
    seqs = [rng.integers(1, 1000, n).astype(np.int32) for n in lengths]
    types = [rng.integers(0, 2, n).astype(np.int32) if typed else None for n in lengths]
    queries = []
    for s, ty in zip(seqs, types):
        pieces = from_sequences([s], np.arange(1), np.ones(1), None if ty is None else [ty])
        queries.append(Job(pack(pieces.lengths, table), pieces.ids, pieces.offsets, pieces.types, 4))
    job = joined(queries)
    assert list(job.lengths) == lengths and job.rows.count == len(lengths)  # each query its own row
    assert sorted(job.rows.seqlen.tolist(), reverse=True) == job.rows.seqlen.tolist()  # longest seqlen first
    assert sorted(job.rows.seqlen.tolist()) == sorted(q.rows.seqlen[0] for q in queries)
    for i, (s, ty) in enumerate(zip(seqs, types)):  # sequence i: query i's tokens and types
        np.testing.assert_array_equal(job.inputs_of(i)[0], s)
        np.testing.assert_array_equal(job.inputs_of(i)[3], 0 if ty is None else ty)
    engine = {0: crossed(job)}
    batcher = Batcher(table, max_wait_s=0.0, max_queued=10_000_000)
    batcher.submit(0, job.rows.seqlen, job.rows.docs, 0.0)
    while (d := batcher.next_dispatch(0.0, device_idle=True)) is not None:
        inputs, _ = assemble(d.bucket, d.parts, engine)
        scatter(d.parts, fake_device(inputs, d.bucket.slots), engine)
    job.receive(engine[0].gathered, engine[0].kept)
    np.testing.assert_array_equal(job.out, [[s.sum(), len(s), 0, len(s)] for s in seqs])


def test_only_one_sequence_jobs_of_pooled_outputs_are_joined():
    table = TABLES[0]
    two = from_sequences([np.arange(1, 4, dtype=np.int32), np.arange(1, 3, dtype=np.int32)], np.arange(2), np.ones(2))
    one = from_sequences([np.arange(1, 4, dtype=np.int32)], np.arange(1), np.ones(1))
    query = Job(pack(one.lengths, table), one.ids, one.offsets, None, 4)
    for other in (Job(pack(two.lengths, table), two.ids, two.offsets, None, 4),
                  Job(pack(one.lengths, table), one.ids, one.offsets, None, 4, "tokens")):
        with pytest.raises(ValueError, match="one-sequence"):
            joined([query, other])


@pytest.mark.parametrize("n", [2, 1])  # one sequence takes Job's own short path
def test_types_travel_with_their_tokens(n):
    seqs = [np.array([5, 6, 7], np.int32), np.array([8, 9], np.int32)][:n]
    types = [np.array([0, 1, 1], np.int32), np.array([0, 1], np.int32)][:n]
    pieces = from_sequences(seqs, np.arange(n), np.ones(n), types)
    table = fixed([(1, 16)], layout="packed")
    job = Job(pack(pieces.lengths, table), pieces.ids, pieces.offsets, pieces.types, 1)
    inputs, _ = assemble(table.buckets[0], ((0, np.array([0])),), {0: job})
    ids, seg, pos, typ = inputs[:, 0]
    for k, (s, t) in enumerate(zip(seqs, types), start=1):
        np.testing.assert_array_equal(ids[seg == k], s)
        np.testing.assert_array_equal(typ[seg == k], t)
        np.testing.assert_array_equal(pos[seg == k], np.arange(len(s)))


def test_rows_of_a_part_need_not_be_consecutive():
    """A part's rows are usually consecutive in their job (one slice of tokens); any rows assemble the same."""
    seqs = [np.arange(1, 1 + n, dtype=np.int32) * 10 + k for k, n in enumerate((9, 5, 12, 3))]
    pieces = from_sequences(seqs, np.arange(4), np.ones(4))
    table = fixed([(4, 16)])  # padded: one sequence per row, rows in the order pack puts them
    job = Job(pack(pieces.lengths, table), pieces.ids, pieces.offsets, None, 1)
    rows = np.array([0, 2, 3])
    inputs, real = assemble(table.buckets[0], ((0, rows),), {0: job})
    for i, r in enumerate(rows):
        want = seqs[int(job.rows.members[job.rows.starts[r]])]
        np.testing.assert_array_equal(inputs[0, i, : len(want)], want)
        assert (inputs[:, i, len(want) :] == 0).all() and (inputs[1, i, : len(want)] == 1).all()
    assert (inputs[:, 3] == 0).all() and real == sum(len(seqs[int(job.rows.members[r])]) for r in rows)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(2, 128), min_size=0, max_size=30), st.sampled_from(range(len(TABLES))),
       st.sampled_from(["pooled", "tokens"]))
def test_a_job_crosses_to_the_engine_whole(lengths, t, output):
    """As the link sends it (pickle protocol 5, arrays out of band): every array and field the same, the
    outputs made empty on arrival."""
    seqs = [np.arange(n, dtype=np.int32) for n in lengths]
    pieces = from_sequences(seqs, np.arange(len(lengths)), np.ones(len(lengths)))
    job = Job(pack(pieces.lengths, TABLES[t]), pieces.ids, pieces.offsets, None, 3, output)
    buffers = []
    head = pickle.dumps({"job": job}, protocol=5, buffer_callback=buffers.append)
    got = pickle.loads(head, buffers=[b.raw() for b in buffers])["job"]
    for name in ("flat", "row_start", "pad_start", "seq_start", "lengths", "row_of", "slot_of"):
        np.testing.assert_array_equal(getattr(got, name), getattr(job, name))
    for name in ("lengths", "members", "starts", "seqlen"):
        np.testing.assert_array_equal(getattr(got.rows, name), getattr(job.rows, name))
    np.testing.assert_array_equal(got.rows.docs, job.rows.docs)
    assert (got.rows.width, got.output, got.remaining, got.kept) == (job.rows.width, output, len(lengths), {})
    assert got.out_shape == job.out_shape and got.out is None and got.gathered == []  # outputs go back gathered


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 600), st.integers(0, 5), st.booleans())
def test_a_query_job_is_the_one_sequence_layout_and_owns_its_tokens(length, at, typed):
    """A one-sequence job (Job's short path, its constant parts shared per length up to QUERY_SHARED_TOKENS):
    every field as the layout says, whatever else was made before; the shared parts read-only, the tokens its
    own."""
    rng = np.random.default_rng(length)
    ids = rng.integers(1, 1000, at + length + 3).astype(np.int32)
    types = rng.integers(0, 2, len(ids)).astype(np.int32) if typed else None
    offsets = np.array([at, at + length])
    table = fixed([(4, 16), (2, 1024)])
    job = Job(pack([length], table), ids, offsets, types, 4)
    twin = Job(pack([length], table), ids[::-1].copy(), offsets, None, 4)  # same length, other tokens
    seqlen = int(job.rows.seqlen[0])  # its row: its tokens, then padding to the row's seqlen
    np.testing.assert_array_equal(job.flat[:, :length], [ids[at : at + length], np.ones(length), np.arange(length),
                                                         types[at : at + length] if typed else np.zeros(length)])
    assert job.flat.shape == (4, seqlen) and not job.flat[:, length:].any()
    np.testing.assert_array_equal(twin.flat[0, :length], ids[::-1][at : at + length])
    assert job.lengths.tolist() == [length] and job.row_start.tolist() == [0, length]
    assert job.pad_start.tolist() == [0, seqlen]
    assert job.seq_start.tolist() == job.row_of.tolist() == job.slot_of.tolist() == [0]
    for shared in (job.lengths, job.row_start, job.pad_start, job.seq_start, job.row_of, job.slot_of):
        with pytest.raises(ValueError, match="read-only"):
            shared[0] = 7
    job.flat[0, 0] = -1  # its own copy: the twin's and later jobs' tokens stay theirs
    assert twin.flat[0, 0] == ids[::-1][at] and Job(pack([length], table), ids, offsets, None, 4).flat[0, 0] == ids[at]
