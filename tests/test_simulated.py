"""The simulated device (`jaxserve.runtime.simulated`): its step time, its clock, its checks and its outputs.

Every clock here is the test's own (`FakeClock`): nothing sleeps, nothing depends on how long anything takes.
"""

import dataclasses

import numpy as np
import pytest

from jaxserve.dims import ModelDims
from jaxserve.runtime import output_chunks
from jaxserve.runtime.buckets import Bucket, fixed
from jaxserve.runtime.device import ACCELERATOR_MAX_BATCH_TOKENS
from jaxserve.runtime.engine import ShapeError
from jaxserve.runtime.simulated import (
    DEVICE,
    SimDevice,
    SimEngine,
    SimSpec,
    h200_table,
    sim_dims,
    simulated_engine,
    step_seconds,
)


class FakeClock:
    """A clock that moves only when slept on (or set)."""

    def __init__(self, now=100.0):
        self.now = now
        self.slept = []

    def __call__(self):
        return self.now

    def sleep(self, seconds):
        self.slept.append(seconds)
        self.now += seconds


class Weights:
    """What the simulated engine reads of the real one: its weights and their bytes."""

    def __init__(self, params):
        self.params = params
        self.weights_bytes = sum(x.nbytes for x in params.values())


DIMS = ModelDims(hidden=4, intermediate=8, heads=1, layers=1)


def test_step_time_is_overhead_plus_padded_flops_over_the_rate():
    # by hand: per token 2 x (QKV 3x4x4 + out 4x4 + MLP 2x4x8) = 256 FLOPs; attention 2 x (2 x 4 x 3 x 3) = 144 per
    # row of 3 tokens; two rows padded to 3 -> 2 x (128 x 6 + 2 x 72) = 1824
    bucket = Bucket(batch=2, seqlen=3)
    assert DIMS.forward_flops([3, 3]) == 1824
    assert step_seconds(DIMS, bucket, rate_flops=1824.0, overhead_s=0.5) == pytest.approx(1.5)
    assert step_seconds(DIMS, bucket, rate_flops=3648.0, overhead_s=0.0) == pytest.approx(0.5)


def test_sim_dims_costs_the_same_flops_as_any_split_into_heads():
    """A model given by its sizes: the FLOPs see heads x head_dim only; the heads follow BERT's width of 64."""
    d = sim_dims(768, 3072, 12)
    assert (d.heads, d.hidden, d.intermediate, d.layers) == (12, 768, 3072, 12)
    one_head = ModelDims(768, 3072, heads=1, layers=12)
    assert d.forward_flops([128] * 4) == one_head.forward_flops([128] * 4)


def test_device_clock_queues_steps_back_to_back():
    clock = FakeClock(now=10.0)
    dev = SimDevice(clock=clock, sleep=clock.sleep)
    assert dev.launch(0.25) == pytest.approx(10.25)
    assert dev.launch(0.5) == pytest.approx(10.75)  # queued behind the first: ends at the sum
    assert dev.steps == 2
    assert dev.busy_s == pytest.approx(0.0)  # both still ahead of the clock
    clock.now = 10.5
    assert dev.busy_s == pytest.approx(0.5)  # the first done, half the second
    clock.now = 20.0
    assert dev.busy_s == pytest.approx(0.75)
    assert dev.launch(0.125) == pytest.approx(20.125)  # an idle device starts a step at once
    assert dev.busy_s == pytest.approx(0.75)


def test_wait_until_sleeps_only_what_is_left():
    clock = FakeClock(now=1.0)
    dev = SimDevice(clock=clock, sleep=clock.sleep)
    dev.wait_until(1.25)
    dev.wait_until(1.0)  # past: no sleep
    assert clock.slept == [pytest.approx(0.25)]


SLOW = SimSpec(tflops=1e-9, step_overhead_us=0.0, d2h_gbps=1e-9)  # a FLOP takes a millisecond, a byte a second


def make_engine(table, clock, out_dim=3, spec=SLOW):
    return SimEngine(Weights({"w": np.zeros((2, 2), np.float32)}), table, DIMS, out_dim, spec,
                     SimDevice(clock=clock, sleep=clock.sleep))


def batch(bucket, sequences):
    """[4, B, S] inputs whose fullest row holds `sequences` sequences."""
    inputs = np.zeros((4, *bucket.shape), np.int32)
    inputs[1, 0, :sequences] = np.arange(1, sequences + 1)
    return inputs


def test_put_refuses_what_is_not_a_bucket():
    table = fixed([(2, 64)], layout="packed")
    sim = make_engine(table, FakeClock())
    bucket = table.buckets[0]
    with pytest.raises(ShapeError):
        sim.put(bucket, np.zeros((4, 3, 64), np.int32))  # a batch of 3 at a bucket of 2
    with pytest.raises(ShapeError):
        sim.put(Bucket(batch=4, seqlen=64, slots=bucket.slots), np.zeros((4, 4, 64), np.int32))  # not in the table
    with pytest.raises(ShapeError):
        sim.put(bucket, batch(bucket, 1), output="tokens")  # pooled outputs only


@pytest.mark.parametrize("sequences", [1, 2, 4, 5, 16, 17, 32])
def test_output_chunk_widths_follow_the_fullest_row(sequences):
    table = fixed([(2, 256)], layout="packed")
    sim = make_engine(table, FakeClock(), out_dim=3)
    bucket = table.buckets[0]
    assert bucket.slots == 32
    ends = output_chunks.ends(32)[: output_chunks.needed(32, sequences)]
    prepared = sim.put(bucket, batch(bucket, sequences))
    assert prepared.widths == tuple(np.diff((0, *ends)))
    assert sim.put(bucket, batch(bucket, 1), sequences=sequences).widths == prepared.widths  # as the caller says
    out = sim.fetch(sim.launch(prepared))
    assert out.shape == (2, ends[-1], 3) and out.dtype == np.float32 and not out.any()
    assert sim.shipped_bytes == 2 * ends[-1] * 3 * 4


def test_fetch_waits_for_the_step_and_the_copy():
    table = fixed([(1, 16), (2, 16)], layout="packed")
    clock = FakeClock(now=0.0)
    sim = make_engine(table, clock, out_dim=2)
    small, large = table.buckets
    a = sim.launch(sim.put(small, batch(small, 1)))
    b = sim.launch(sim.put(large, batch(large, 1)))  # queued behind a
    step = lambda bk: 1e-3 * DIMS.forward_flops([bk.seqlen] * bk.batch)  # a FLOP a millisecond
    assert a.arrives == pytest.approx(step(small) + 1 * 1 * 2 * 4)  # then its one chunk, a byte a second
    assert b.arrives == pytest.approx(step(small) + step(large) + 2 * 1 * 2 * 4)
    sim.fetch(a)
    assert clock.now == pytest.approx(a.arrives)
    sim.fetch(b)
    assert clock.now == pytest.approx(b.arrives)
    assert (sim.steps, sim.busy_s) == (2, pytest.approx(step(small) + step(large)))


def test_h200_table_stops_each_seqlen_at_its_throughput_knee():
    """A step that costs the same up to 16 rows and grows with them past it: 16 rows is the knee."""
    step_s = lambda b: 1e-3 * max(1.0, b.batch / 16)
    table = h200_table(DIMS, 1000, 64, step_s)
    assert table.seqlens == [16, 32, 64] and table.device == DEVICE
    for s in table.seqlens:
        assert [b.batch for b in table.at(s)] == [1, 4, 16]
        assert table.at(s)[-1].limited_by == "throughput"
        assert all(b.run_s == step_s(b) for b in table.at(s))


def test_simulated_engine_is_warm_with_the_h200_table(tiny_checkpoint):
    from jaxserve import Encoder

    enc = Encoder.from_pretrained(str(tiny_checkpoint()))
    spec = SimSpec(tflops=400)
    sim = simulated_engine(enc.engine, enc.model_config, enc.embedding_config.max_seq_length, enc.out_dim, spec)
    table = sim.table
    assert sim.tables == {"pooled": table}
    assert (sim.params, sim.weights_bytes, sim.devices) == (enc.engine.params, enc.engine.weights_bytes, 1)
    assert (table.device, table.layout, table.max_seqlen) == (DEVICE, "packed", enc.embedding_config.max_seq_length)
    dims = enc.model_config.dims(4)  # float32 weights on this CPU
    for b in table.buckets:
        assert b.run_s == pytest.approx(step_seconds(dims, b, 400e12, 30e-6))
        assert b.batch < 8 or b.batch % 8 == 0  # an accelerator's batch rounding (`buckets.batch_fitter`)
        assert b.tokens <= ACCELERATOR_MAX_BATCH_TOKENS
    bigger = simulated_engine(enc.engine, enc.model_config, enc.embedding_config.max_seq_length, enc.out_dim,
                              dataclasses.replace(spec, sizes=(768, 3072, 12)))
    b = bigger.table.buckets[-1]
    assert b.run_s == pytest.approx(step_seconds(sim_dims(768, 3072, 12), b, 400e12, 30e-6))
    # the table is derived for a model of that size: its weights (a bge-base's ~110M parameters) in the budget
    assert bigger.table.weights_bytes == 4 * (12 * (4 * 768 * 768 + 2 * 768 * 3072) + enc.model_config.vocab_size * 768)
    assert bigger.weights_bytes == enc.engine.weights_bytes  # what is really held: the checkpoint's
    # the host's time per dispatch is the spec's overhead, not the untimed floor: a query's one row takes the
    # smallest batch, not the largest one the floor would make look as cheap (before: 256 rows for one query)
    from jaxserve.scheduling.batcher import covers

    assert table.host_dispatch_s == pytest.approx(30e-6)
    assert all(covers(table)[s][1].shape == table.at(s)[0].shape for s in table.seqlens)  # (cached by value)
    info = sim.describe()
    assert info["simulated"] is True and info["device"] == DEVICE and info["spec"]["tflops"] == 400
    assert info["table"]["buckets"] == len(table.buckets) and (sim.busy_s, sim.steps) == (0.0, 0)


def test_the_encoder_runs_its_batches_on_the_simulated_device(tiny_checkpoint):
    """The pipeline's own steps (`run_jobs`: put, launch, fetch, scatter) over the simulated engine: every
    document answered, every batch a step on the device clock."""
    from jaxserve import Encoder

    enc = Encoder.from_pretrained(str(tiny_checkpoint()))
    clock = FakeClock()
    sim = simulated_engine(enc.engine, enc.model_config, enc.embedding_config.max_seq_length, enc.out_dim,
                           SimSpec(tflops=400), SimDevice(clock=clock, sleep=clock.sleep))
    enc = dataclasses.replace(enc, engine=sim)
    texts = ["the jax model", "a batch of the document " * 20] + ["query"] * 30
    out = enc.embed(texts, normalize=False)
    assert out.shape == (len(texts), enc.out_dim) and not out.any()
    ran = enc.last_dispatches
    assert sim.steps == len(ran) > 0
    assert clock.now > 100.0  # every fetch waited on the device clock, not the wall
    assert sim.busy_s == pytest.approx(sum(sim._step_s[(d.bucket.batch, d.bucket.seqlen, d.bucket.slots)]
                                           for d in ran))


async def test_a_server_over_the_simulated_engine_serves_pooled_outputs(tiny_checkpoint, make_server):
    """With token outputs off, the real server runs on it as is; /embed_all says it is not served."""
    from jaxserve import Encoder

    enc = Encoder.from_pretrained(str(tiny_checkpoint()))
    sim = simulated_engine(enc.engine, enc.model_config, enc.embedding_config.max_seq_length, enc.out_dim,
                           SimSpec(tflops=400))
    client = await make_server(dataclasses.replace(enc, engine=sim), embed_all=False, use_cache=False, streams=1)
    resp = await client.post("/v1/embeddings", json={"input": ["the jax model", "a query"] * 3})
    assert resp.status == 200, await resp.text()
    body = await resp.json()
    assert len(body["data"]) == 6 and len(body["data"][0]["embedding"]) == enc.out_dim
    assert sim.steps >= 1
    resp = await client.post("/embed_all", json={"inputs": "the jax model"})
    assert 400 <= resp.status < 500
    # the busy counter is the simulated device's own clock (every step done by now), not the host's view of it
    metrics = await (await client.get("/metrics")).text()
    busy = float(next(line.split()[-1] for line in metrics.splitlines()
                      if line.startswith("jaxserve_device_busy_seconds_total ")))
    assert busy == pytest.approx(sim.busy_s, rel=1e-9) and sim.busy_s > 0
    info = await (await client.get("/info")).json()
    assert info["SIMULATED_DEVICE"]["steps"] == sim.steps and "NO MODEL" in info["SIMULATED_DEVICE"]["warning"]
