"""Where the pipeline prepares a batch: a turn's jobs reaching an idle pipeline (one stream, nothing prepared or
on the device) are prepared and launched on the event loop at the end of that turn, as one batch; a job that
arrives behind a batch in flight is the prepare thread's. On the simulated device, whose steps here end only when
the test lets them (no wall-clock timing)."""

from __future__ import annotations

import asyncio
import threading

import numpy as np
import pytest
from conftest import until

from jaxserve.http.metrics import EngineMetrics, ServerMetrics
from jaxserve.runtime.simulated import SimDevice, SimSpec, simulated_engine
from jaxserve.scheduling.batcher import INTERACTIVE
from jaxserve.scheduling.jobs import Job
from jaxserve.scheduling.pipeline import BatchError, Pipeline
from jaxserve.scheduling.planner import pack


class HeldDevice(SimDevice):
    """A simulated device whose steps finish only once `release` is set (and then at once)."""

    def __init__(self):
        super().__init__()
        self.release = threading.Event()

    def wait_until(self, t: float) -> None:
        self.release.wait(60)


def _engine(tiny_checkpoint, device):
    from jaxserve import Encoder

    enc = Encoder.from_pretrained(str(tiny_checkpoint(max_seq_length=64)))
    sim = simulated_engine(enc.engine, enc.model_config, 64, enc.out_dim, SimSpec(tflops=400), device)
    put, threads = sim.put, []

    def recorded_put(*args, **kw):
        threads.append(threading.current_thread().name)
        return put(*args, **kw)

    sim.put = recorded_put
    return sim, threads


def _job(sim, n: int = 1) -> Job:
    return Job(pack(np.full(n, 10), sim.table), np.arange(10 * n, dtype=np.int32) % 50 + 5,
               np.arange(0, 10 * n + 1, 10), None, sim.out_dim)


async def test_a_turns_jobs_on_an_idle_pipeline_are_one_batch_prepared_on_the_loop(tiny_checkpoint):
    device = HeldDevice()
    device.release.set()
    sim, threads = _engine(tiny_checkpoint, device)
    pipeline = Pipeline(sim, sim.table, 0.001, None, streams=1)
    await pipeline.start()
    try:
        submitted = [pipeline.submit(_job(sim)) for _ in range(3)]  # one turn: no await between them
        await asyncio.gather(*(future for _, future, _ in submitted))
    finally:
        await pipeline.stop()
    assert threads == [threading.current_thread().name]  # one batch, prepared by the loop's own thread
    assert pipeline.device_batches == 1
    assert all(len(timing.batches) == 1 and timing.batches[0][1] == 1 for _, _, timing in submitted)


async def test_a_job_behind_a_batch_in_flight_is_the_prepare_threads(tiny_checkpoint):
    device = HeldDevice()
    sim, threads = _engine(tiny_checkpoint, device)
    pipeline = Pipeline(sim, sim.table, 0.001, None, streams=1)
    await pipeline.start()
    try:
        _, first, _ = pipeline.submit(_job(sim))
        await asyncio.sleep(0)  # the turn ends: the first job's batch is launched and held on the device
        assert threads == [threading.current_thread().name] and pipeline.batches_in_flight == 1
        _, second, _ = pipeline.submit(_job(sim, 2))
        await until(lambda: len(threads) == 2, "the prepare thread took the job while the first batch was held")
        device.release.set()
        await asyncio.gather(first, second)
    finally:
        device.release.set()
        await pipeline.stop()
    assert threads[1] == "jaxserve-prepare_loop"
    assert pipeline.device_batches == 2


async def test_rows_the_loops_batch_leaves_are_prepared_behind_it(tiny_checkpoint):
    """A turn's job larger than one batch: the loop launches the first, and the prepare thread prepares the rest
    while the first is on the device (it once slept until the first came back: the device then idled while the
    host prepared)."""
    from jaxserve.runtime.buckets import fixed

    device = HeldDevice()
    sim, threads = _engine(tiny_checkpoint, device)
    table = fixed([(1, 16)], layout="packed")  # one row a batch: three documents of 10 tokens, three batches
    pipeline = Pipeline(sim, table, 0.001, None, streams=1)
    await pipeline.start()
    try:
        job = Job(pack(np.full(3, 10), table), np.arange(30, dtype=np.int32) % 50 + 5, np.arange(0, 31, 10), None,
                  sim.out_dim)
        _, future, _ = pipeline.submit(job)
        # (bounded well inside HeldDevice's own 60 s, after which the held batch would return and free the rest)
        await until(lambda: len(threads) == 3, "the others prepared while the first was held on the device", 20.0)
        assert threads == [threading.current_thread().name] + ["jaxserve-prepare_loop"] * 2
        device.release.set()
        await future
    finally:
        device.release.set()
        await pipeline.stop()
    assert pipeline.device_batches == 3


async def test_every_deadline_request_counts_however_it_ends(tiny_checkpoint):
    """`jaxserve_deadlines_total` counted only answered requests: one that timed out (503), was given up by its
    client after its deadline, or failed in its batch was left out, so the share met was overstated. Every ending
    passes through `Pipeline._end` now: missed unless answered within the deadline; one withdrawn before its
    deadline is not counted. Deadlines of 0 s (past at once) and 10**6 s, not the clock, decide each outcome."""
    device = HeldDevice()
    sim, _ = _engine(tiny_checkpoint, device)
    failing, put = [], sim.put

    def faulty_put(*args, **kw):
        if failing:
            raise RuntimeError("injected device fault in put")
        return put(*args, **kw)

    sim.put = faulty_put
    metrics = EngineMetrics()
    pipeline = Pipeline(sim, sim.table, 0.001, None, metrics=metrics, max_inflight=1, streams=1)
    await pipeline.start()
    try:
        _, answered, _ = pipeline.submit(_job(sim), INTERACTIVE, 10**6)
        await until(lambda: pipeline.batches_in_flight, "the first job on the device (held)")
        early, _, _ = pipeline.submit(_job(sim, 2), INTERACTIVE, 10**6)
        pipeline.cancel(early)  # its client left while the server had time: no outcome
        late, _, _ = pipeline.submit(_job(sim, 2), INTERACTIVE, 0.0)
        pipeline.cancel(late)  # ... after its deadline: missed
        with pytest.raises(TimeoutError):  # a timeout (the HTTP layer's 503), the job still waiting: missed
            await pipeline.run(_job(sim, 2), INTERACTIVE, 0.0, timeout_s=0.01)
        device.release.set()
        await answered  # within its deadline: met
        failing.append(True)
        with pytest.raises(BatchError):  # failed in its batch, long before its deadline: missed
            await pipeline.run(_job(sim), INTERACTIVE, 10**6)
    finally:
        device.release.set()
        await pipeline.stop()
    text = ServerMetrics().render(metrics.snapshot()).decode()
    assert 'jaxserve_deadlines_total{class="interactive",outcome="met"} 1.0' in text
    assert 'jaxserve_deadlines_total{class="interactive",outcome="missed"} 3.0' in text
    assert 'jaxserve_class_request_seconds_count{class="interactive"} 1.0' in text  # latency: answered ones only


class GatedDevice(SimDevice):
    """A simulated device whose steps end when the test releases each (by the clock time it would arrive at)."""

    def __init__(self):
        super().__init__()
        self.waiting, self.released = [], set()
        self.changed = threading.Condition()

    def wait_until(self, t: float) -> None:
        with self.changed:
            self.waiting.append(t)
            self.changed.wait_for(lambda: t in self.released, 60)

    def release(self, t: float) -> None:
        with self.changed:
            self.released.add(t)
            self.changed.notify_all()


async def test_a_batch_that_ran_beside_another_does_not_set_its_buckets_predicted_time(tiny_checkpoint):
    """With several streams (a CPU) two batches run at once: the one that ends second was launched before the other
    ended, and the time since that end is its share of the device, not its run. Only a batch that ran alone
    refreshes its bucket's live time (`LiveTimings`, what explain predicts with); before, the second's share (a
    fraction of a millisecond where its run took tens) was taken for its run."""
    device = GatedDevice()
    sim, _ = _engine(tiny_checkpoint, device)
    pipeline = Pipeline(sim, sim.table, 0.001, None, streams=2)
    await pipeline.start()
    try:
        _, first, _ = pipeline.submit(_job(sim))
        await until(lambda: len(device.waiting) == 1, "the first batch on the device")
        _, second, _ = pipeline.submit(_job(sim))
        await until(lambda: len(device.waiting) == 2, "the second batch beside it")
        device.release(device.waiting[1])  # the second ends first: it ran alone since its launch
        await second
        device.release(device.waiting[0])  # the first ends after: launched before the second's end
        await first
    finally:
        for t in device.waiting:
            device.release(t)
        await pipeline.stop()
    live = pipeline.timings["pooled"]
    assert pipeline.device_batches == 2 and sum(live.live_runs(b) for b in sim.table.buckets) == 1

