"""Where the pipeline prepares a batch: a turn's jobs reaching an idle pipeline (one stream, nothing prepared or
on the device) are prepared and launched on the event loop at the end of that turn, as one batch; a job that
arrives behind a batch in flight is the prepare thread's. On the simulated device, whose steps here end only when
the test lets them (no wall-clock timing)."""

from __future__ import annotations

import asyncio
import threading

import numpy as np
from conftest import until

from jaxserve.runtime.simulated import SimDevice, SimSpec, simulated_engine
from jaxserve.scheduling.jobs import Job
from jaxserve.scheduling.pipeline import Pipeline
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
