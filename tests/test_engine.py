"""The AOT engine on a tiny model: zero compiles after warmup, shapes outside the table raise."""

import numpy as np
import pytest

from jaxserve import Encoder
from jaxserve.runtime import compiles
from jaxserve.runtime.buckets import BucketTable, fixed
from jaxserve.runtime.engine import ShapeError
from jaxserve.scheduling.jobs import Job, assemble
from jaxserve.scheduling.planner import pack


@pytest.fixture
def warm(tiny_checkpoint):
    enc = Encoder.from_pretrained(str(tiny_checkpoint()))
    table = enc.warmup(fixed([(8, 16), (4, 32), (2, 64)]))
    return enc, table


def texts_of_length(n):
    """A text the tiny tokenizer turns into exactly n tokens ([CLS] + n-2 words + [SEP])."""
    return "the " * (n - 2)


def test_no_compile_after_warmup_for_every_length_and_batch_size(warm):
    enc, table = warm
    assert all(b.compile_s is not None and b.run_s > 0 and b.compiled_bytes > 0 for b in table.buckets)
    before = compiles.xla_compiles_total()
    for n in range(2, 65):  # every sequence length the model takes (specials included)
        (ids,) = enc.tokenizer.encode([texts_of_length(n)])
        assert len(ids) == n
        enc.embed([texts_of_length(n)])
    for size in range(1, 20):  # batch sizes up to more than two full buckets
        enc.embed([texts_of_length(2 + (7 * i) % 63) for i in range(size)], normalize=bool(size % 2))
    enc.embed(["the " * 500])  # truncated to the largest bucket
    assert compiles.xla_compiles_total() == before


def test_shape_outside_table_raises(warm):
    enc, table = warm
    odd = fixed([(3, 16)]).buckets[0]
    pieces = enc.tokenizer.documents(["the model"])
    jobs = {0: Job(pack(pieces.lengths, table), pieces.ids, pieces.offsets, None, enc.out_dim)}
    with pytest.raises(ShapeError, match=r"not a warmed pooled bucket"):
        enc.engine.run(odd, assemble(odd, ((0, np.array([0])),), jobs)[0])
    before = compiles.xla_compiles_total()
    bucket = table.buckets[0]
    wrong = assemble(table.buckets[1], ((0, np.array([0])),), jobs)[0]  # arrays of another bucket's shape
    with pytest.raises(ShapeError):
        enc.engine.run(bucket, wrong)
    assert compiles.xla_compiles_total() == before


def test_warmup_rejects_table_shorter_than_model(tiny_checkpoint):
    enc = Encoder.from_pretrained(str(tiny_checkpoint()))
    with pytest.raises(ValueError, match="below the model's max_seq_length 64"):
        enc.warmup(fixed([(4, 32)]))


def test_a_derived_table_shorter_than_the_model_truncates_however_it_is_installed(tiny_checkpoint, tmp_path):
    """`--seqlens` below the model's 64 tokens: long inputs are cut to the longest seqlen whichever way the table
    came, `warmup` (as `Encoder.embed`'s first use and `jaxserve explain`), a cold `start` or a warm artifact's
    (before: only `start` and the server fitted the tokenizer; `warmup` left it at 64, and a long input fit no
    bucket: ValueError)."""
    from jaxserve.errors import TooLongError
    from jaxserve.runtime.derivation import TableOptions

    path = tiny_checkpoint()
    options = TableOptions(seqlens=(16, 32), max_batch=4, batch_ladder=False)
    long = "the " * 100
    for start in ("warmup", "cold", "artifact"):
        enc = Encoder.from_pretrained(str(path))
        if start == "warmup":
            enc.warmup(options)
        else:
            enc.start(options, cache=tmp_path)
        assert enc.tokenizer.max_length == enc.embedding_config.max_seq_length == 32, start
        np.testing.assert_allclose(enc.embed([long, "a"])[:1], enc.embed([texts_of_length(32)]), atol=1e-5)
        with pytest.raises(TooLongError):
            enc.embed([long], long="error")


def test_a_longer_table_after_a_shorter_one_raises_the_limits_again(tiny_checkpoint):
    """The limits are the checkpoint's cut to each table (before: only ever lowered, so a text of 40 tokens stayed
    cut at 16 after a table reaching 64 was installed)."""
    from jaxserve.runtime.derivation import TableOptions

    path = tiny_checkpoint()
    table = fixed([(4, 16), (4, 64)])
    text = [texts_of_length(40)]
    enc = Encoder.from_pretrained(str(path))
    enc.warmup(TableOptions(seqlens=(16,), max_batch=4, batch_ladder=False))
    assert enc.tokenizer.max_length == enc.embedding_config.max_seq_length == 16
    enc.warmup(table)
    assert enc.tokenizer.max_length == enc.embedding_config.max_seq_length == 64
    np.testing.assert_allclose(enc.embed(text), Encoder.from_pretrained(str(path), buckets=table).embed(text),
                               atol=1e-5)


def test_two_threads_first_use_warms_once(tiny_checkpoint):
    """Two threads' first `embed` on a cold Encoder: the second waits for the first's warm-up and runs on its
    table (before: both climbed, and one's install dropped the other's executables: ShapeError)."""
    import threading

    enc = Encoder.from_pretrained(str(tiny_checkpoint()))
    texts = ["the model is jax", "a", "the " * 20, "the " * 50]
    start, got = threading.Barrier(2), {}

    def first_use(k):
        start.wait()
        got[k] = enc.embed(texts)

    threads = [threading.Thread(target=first_use, args=(k,)) for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    want = enc.embed(texts)
    assert sorted(got) == [0, 1]
    for out in got.values():
        np.testing.assert_array_equal(out, want)


def test_derived_table_uses_xla_memory_analysis(tiny_checkpoint):
    enc = Encoder.from_pretrained(str(tiny_checkpoint()))
    weights = enc.engine.weights_bytes
    kw = dict(ladder="pow2", layout="padded", batch_ladder=False, max_batch_tokens=10**7, max_batch=10**5)
    big = enc.derive_table(device_memory=64 * 2**20, **kw)
    small = enc.derive_table(device_memory=16 * 2**20, **kw)
    assert big.seqlens == small.seqlens == [16, 32, 64]
    for b, s in zip(big.buckets, small.buckets):
        assert s.batch < b.batch
        assert s.compiled_bytes <= small.budget_bytes and b.compiled_bytes <= big.budget_bytes
        assert s.limited_by == "memory"
        assert s.compiled_bytes == enc.engine.bucket_bytes(s.batch, s.seqlen, 1)
        assert s.compiled_bytes > weights
    one_row_64 = enc.engine.bucket_bytes(1, 64, 1)
    tight = enc.derive_table(device_memory=int((one_row_64 - 1) / 0.9), **kw)
    assert 64 not in tight.seqlens and tight.dropped[0][0] == 64
    with pytest.raises(ValueError, match="fits no bucket"):
        enc.derive_table(device_memory=weights, **kw)


def test_results_equal_across_buckets(tiny_checkpoint):
    """The same documents at their smallest bucket and all at the largest give the same vectors."""
    enc = Encoder.from_pretrained(str(tiny_checkpoint()))
    texts = ["the model is jax", "a", "the " * 20, "the " * 50]
    enc.warmup(fixed([(8, 16), (4, 32), (2, 64)]))
    ladder = enc.embed(texts)
    enc.warmup(fixed([(2, 64)]))
    assert enc.warm_table().seqlens == [64]
    np.testing.assert_allclose(enc.embed(texts), ladder, atol=1e-5)


def test_derived_table_climbs_each_ladder_and_compiles_one_step_past_its_knee(tiny_checkpoint, monkeypatch):
    """Batches above the knee's next step are never compiled; the one past it is dropped with its executable."""
    import dataclasses

    from jaxserve.runtime import compiles, warm
    from jaxserve.runtime.derivation import TableOptions

    enc = Encoder.from_pretrained(str(tiny_checkpoint()))
    rates = {1: 1e3, 4: 4e3, 16: 4.1e3, 64: 9e3}  # tokens/s: 16 rows gain < 5% over 4, so 64 is never compiled
    ran, built = [], []

    def fake_time(engine, bucket, output):  # the clock injected: the knee is decided from these, not from wall time
        ran.append(bucket.shape)
        return dataclasses.replace(bucket, run_s=bucket.tokens / rates[bucket.batch])

    compile = enc.engine.compile
    monkeypatch.setattr(warm, "time_bucket", fake_time)
    monkeypatch.setattr(enc.engine, "compile", lambda *key: built.append(key[:2]) or compile(*key))
    before = compiles.xla_compiles_total()
    table = enc.warmup(TableOptions(seqlens=(16, 64), max_batch=64))
    assert [b.shape for b in table.buckets] == [(1, 16), (4, 16), (1, 64), (4, 64)]
    assert sorted(set(built)) == [(1, 16), (1, 64), (4, 16), (4, 64), (16, 16), (16, 64)]
    assert compiles.xla_compiles_total() - before == 6
    assert sorted(ran) == sorted(set(built))
    assert table.at(16)[-1].limited_by == "throughput" and table.at(16)[0].limited_by == "ladder"
    assert all(0 < b.compiled_bytes <= table.budget_bytes for b in table.buckets)
    pieces = enc.tokenizer.documents(["the model"])
    with pytest.raises(ShapeError):
        enc.engine.put(fixed([(16, 16)], layout="packed").buckets[0], np.zeros((4, 16, 16), np.int32))
    assert enc.embed(["the model", "a query"]).shape == (2, 32) and pieces.count == 1


def test_warmup_measures_the_hosts_cost_per_dispatch_and_records_it_in_the_table(warm):
    """The knee, the planner and the queue bound use the table's measured figure, not the constant."""
    enc, table = warm
    assert table.host_dispatch_s is not None and table.host_dispatch_s > 0
    assert table.host_dispatch_s == enc.engine.host_dispatch_s
    assert BucketTable.from_json(table.to_json()).host_dispatch_s == table.host_dispatch_s  # kept by the artifact


def test_outputs_copied_ahead_of_fetch_are_the_same_vectors(warm):
    """copy_to_host_async right after launch (the accelerator path) changes nothing in what is fetched."""
    enc, table = warm
    bucket = table.at(16)[-1]
    inputs = np.zeros((4, *bucket.shape), np.int32)
    inputs[0, :, :5] = np.arange(1, 6)
    inputs[1, :, :5] = 1
    inputs[2, :, :5] = np.arange(5)
    assert enc.engine.copy_ahead is False  # a CPU's buffers are host memory already
    plain = enc.engine.run(bucket, inputs)
    enc.engine.copy_ahead = True
    try:
        ahead = enc.engine.run(bucket, inputs)
    finally:
        enc.engine.copy_ahead = False
    np.testing.assert_array_equal(plain, ahead)


def test_warmup_spins_an_accelerator_up_then_times_each_bucket_by_its_median(tiny_checkpoint, monkeypatch):
    """On an accelerator (the platform injected): one spin-up on the largest bucket, then per bucket the median
    of `timing.ACCELERATOR_TIMED_RUNS` runs (the runs and clock are timing's, tested with fake clocks)."""
    from jaxserve.runtime import timing, warm
    from jaxserve.runtime.engine import Engine

    enc = Encoder.from_pretrained(str(tiny_checkpoint()))
    monkeypatch.setattr(Engine, "platform", property(lambda self: "gpu"))
    monkeypatch.setattr(warm, "host_dispatch_s", lambda engine, bucket, output="pooled": 1e-4)  # its own test above
    placed, calls = [], []
    place = enc.engine.place
    monkeypatch.setattr(enc.engine, "place", lambda x: placed.append(x.shape[1:]) or place(x))
    monkeypatch.setattr(timing, "spin_up", lambda run, seconds: (calls.append(("spin", seconds)), run(), 1)[-1])
    monkeypatch.setattr(timing, "median_run_s", lambda run, runs: (calls.append(("median", runs)), run(), 1e-3)[-1])
    table = enc.warmup(fixed([(1, 16), (4, 16), (2, 64)]))
    assert placed == [(2, 64), (1, 16), (4, 16), (2, 64)]  # the largest (most tokens) spins, then each in turn
    assert calls == [("spin", timing.ACCELERATOR_SPIN_UP_S)] + [("median", timing.ACCELERATOR_TIMED_RUNS)] * 3
    assert [b.run_s for b in table.buckets] == [1e-3] * 3


def test_climb_spins_up_each_round_only_with_buckets_it_times(tiny_checkpoint, monkeypatch):
    """A derived table on an accelerator (injected): a spin-up per round of timings, each with a bucket the climb
    times (within the budget), never a candidate it has not checked."""
    import dataclasses

    from jaxserve.runtime import timing, warm
    from jaxserve.runtime.derivation import TableOptions
    from jaxserve.runtime.engine import Engine

    enc = Encoder.from_pretrained(str(tiny_checkpoint()))
    monkeypatch.setattr(Engine, "platform", property(lambda self: "gpu"))
    monkeypatch.setattr(warm, "host_dispatch_s", lambda engine, bucket, output="pooled": 1e-4)
    rates = {1: 1e3, 4: 4e3, 16: 4.1e3, 64: 9e3}
    ran, spun = [], []
    monkeypatch.setattr(warm, "time_bucket", lambda engine, b, output: ran.append(b.shape) or dataclasses.replace(
        b, run_s=b.tokens / rates[b.batch]))
    place = enc.engine.place
    monkeypatch.setattr(enc.engine, "place", lambda x: spun.append(x.shape[1:]) or place(x))
    monkeypatch.setattr(timing, "spin_up", lambda run, seconds: (run(), 1)[-1])
    enc.warmup(TableOptions(seqlens=(16, 64), max_batch=64))
    assert len(spun) == 3  # rounds: batch 1, 4, 16 of both seqlens
    # the largest of the round's first bucket and those timed before it (ties: the round's own)
    assert spun == [(1, 16), (4, 16), (16, 16)] and set(spun) <= set(ran)


@pytest.fixture
def packed(tiny_checkpoint):
    enc = Encoder.from_pretrained(str(tiny_checkpoint()))
    return enc, enc.warmup(fixed([(2, 64)], layout="packed"))


def rows_holding(bucket, counts):
    """[4, B, S]: row i holds counts[i] sequences of 4 tokens each."""
    inputs = np.zeros((4, *bucket.shape), np.int32)
    for row, n in enumerate(counts):
        inputs[0, row, : 4 * n] = np.arange(1, 4 * n + 1)
        inputs[1, row, : 4 * n] = np.repeat(np.arange(1, n + 1), 4)
        inputs[2, row, : 4 * n] = np.tile(np.arange(4), n)
    return inputs


def test_a_batch_copies_back_only_the_slot_chunks_its_fullest_row_fills(packed):
    """Rows of one sequence ship 1 of the bucket's 8 slots, rows of 3 ship 4; the vectors are the full output's."""
    from jaxserve.runtime import output_chunks

    enc, table = packed
    (bucket,) = table.buckets
    assert output_chunks.ends(bucket.slots) == (1, 4, 8)
    before = compiles.xla_compiles_total()
    for counts, shipped in (([1, 1], 1), ([1, 3], 4), ([2, 0], 4), ([8, 5], 8), ([0, 0], 1)):
        inputs = rows_holding(bucket, counts)
        full = enc.engine.fetch(enc.engine.launch(enc.engine.put(bucket, inputs, sequences=bucket.slots)))
        assert full.shape == (2, 8, enc.out_dim)
        prepared = enc.engine.put(bucket, inputs)  # the fullest row read from the segment ids
        assert prepared.chunks == output_chunks.needed(bucket.slots, max(counts))
        launched = enc.engine.launch(prepared)
        assert len(launched) == prepared.chunks  # only these are copied to the host
        out = enc.engine.fetch(launched)
        assert out.shape == (2, shipped, enc.out_dim)
        np.testing.assert_array_equal(out, full[:, :shipped])
        assert enc.engine.put(bucket, inputs, sequences=max(counts)).chunks == prepared.chunks  # the batcher's count
    assert compiles.xla_compiles_total() == before


def test_slot_chunks_take_no_more_device_memory_than_one_output(packed):
    """The chunks partition [B, K, D]: XLA's output bytes are the whole output's (plus the tuple's pointers), so
    tables sized by memory analysis before the chunks still hold."""
    from jaxserve.runtime import output_chunks

    enc, table = packed
    (bucket,) = table.buckets
    m = enc.engine.compile(bucket.batch, bucket.seqlen, bucket.slots).memory_analysis()
    whole = bucket.batch * bucket.slots * enc.out_dim * 4
    assert whole <= m.output_size_in_bytes <= whole + 8 * len(output_chunks.ends(bucket.slots))
