"""Warming an engine's table: compile every bucket, then time each at the device's working clock.

`given` warms a table as it is; `climb` derives one, climbing each seqlen's batch ladder to its
throughput knee (`jaxserve.runtime.derivation`). Both compile in parallel (XLA compiles release the
GIL), then time one bucket at a time after a spin-up on an accelerator (`jaxserve.runtime.timing`),
and measure the host's own cost per dispatch, which the knee and the planner weigh. The engine only
compiles and runs; what these take is added to its `spent` (start-up's compile and timing phases).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import statistics
import time
from typing import Callable

import jax
import numpy as np
from tqdm import tqdm

from jaxserve.runtime import derivation, host, timing
from jaxserve.runtime.buckets import INPUT_NAMES, Bucket, BucketTable
from jaxserve.runtime.engine import Engine, compiled_bytes

HOST_RUNS = 5  # dispatches of the smallest bucket timed for the host's cost per dispatch (their median)


def given(engine: Engine, table: BucketTable, progress: bool = False, output: str = "pooled",
          check: Callable[[list[Bucket]], None] | None = None) -> BucketTable:
    """Warm up one output's table as given: compile every bucket (in parallel), then run each, one at a
    time, recording compile and run times. Returns the table with the timings filled in, installed. `check`
    gets the buckets with their compiled bytes before anything runs (it raises to refuse the table)."""
    keys = sorted({(b.batch, b.seqlen, b.slots) for b in table.buckets})
    start = time.perf_counter()
    with _compile_pool() as pool:
        jobs = [pool.submit(engine.compile, *key, output) for key in keys]
        for job in tqdm(concurrent.futures.as_completed(jobs), total=len(jobs), desc="compile",
                        unit="bucket", disable=not progress):
            job.result()
    engine.spent["compile"] += time.perf_counter() - start
    if check is not None:
        check([dataclasses.replace(b, compiled_bytes=compiled_bytes(engine.compile(b.batch, b.seqlen, b.slots, output)))
               for b in table.buckets])
    spin_up(engine, table.buckets, output)
    host_s = host_dispatch_s(engine, table.buckets[0], output)
    timed = [time_bucket(engine, b, output) for b in tqdm(table.buckets, desc="run", unit="bucket", disable=not progress)]
    return engine.install(dataclasses.replace(table, buckets=tuple(timed), host_dispatch_s=host_s), output)


def climb(engine: Engine, ladders: list[derivation.Climb], progress: bool = False, output: str = "pooled",
          check: Callable[[list[Bucket]], None] | None = None) -> None:
    """Climb each seqlen's batch ladder to its knee (`jaxserve.runtime.derivation`), the engine compiling (each
    round's candidates in parallel) and this module timing; the caller installs the table made of the result.
    `check` gets each candidate within the climb's budget, with its compiled bytes, before it runs (it raises to
    refuse it: one over the live pool, where the budget is another device's)."""
    if ladders and not ladders[0].done:  # the knee weighs each batch against the host's cost per dispatch
        first = ladders[0]
        host_s = host_dispatch_s(engine, Bucket(first.next(), first.seqlen, first.slots), output)
        for c in ladders:
            c.host_s = host_s
    ran: list[Bucket] = []  # buckets timed so far: within the budget, safe to spin the device up with
    round_begins = [False]

    with _compile_pool() as pool, tqdm(desc="derive", unit="compile", disable=not progress) as bar:
        def compile_many(shapes):
            start = time.perf_counter()
            jobs = [pool.submit(engine.compile, *shape, output) for shape in shapes]
            sizes = [compiled_bytes(job.result()) for job in jobs]
            engine.spent["compile"] += time.perf_counter() - start
            round_begins[0] = True  # the device idled through the compiles: its clock is down
            return sizes

        def time_one(bucket: Bucket) -> float:  # the climb times only candidates within the budget
            if check is not None:
                check([bucket])
            # A round's spin-up: the largest of its first bucket and those timed in earlier rounds.
            if round_begins[0]:
                round_begins[0] = False
                spin_up(engine, [bucket, *ran], output)
            ran.append(bucket)
            return time_bucket(engine, bucket, output).run_s

        def on_round(compiled: int, active: int):
            bar.update(compiled - bar.n)
            bar.set_postfix(seqlens_climbing=active)

        derivation.climb(ladders, compile_many, time_one, lambda shape: engine.compile_s(*shape, output), on_round)


def spin_up(engine: Engine, buckets, output: str) -> int:
    """Run the largest of `buckets` (compiled, within the memory budget) back to back for
    `timing.spin_up_s` (none on a CPU), so that the timings after it see the device at its working
    clock -> the runs made."""
    seconds = timing.spin_up_s(engine.platform)
    if not seconds or not buckets:
        return 0
    began = time.perf_counter()
    largest = max(buckets, key=lambda b: b.tokens)
    exe = engine.compile(largest.batch, largest.seqlen, largest.slots, output)
    inputs = engine.place(dummy_batch(largest))
    runs = timing.spin_up(lambda: jax.block_until_ready(exe(engine.params, inputs)), seconds)
    engine.spent["timing"] += time.perf_counter() - began
    return runs


def time_bucket(engine: Engine, bucket: Bucket, output: str) -> Bucket:
    """A compiled bucket with its run time: the median of `timing.timed_runs` back-to-back runs after a burn-in."""
    began = time.perf_counter()
    exe = engine.compile(bucket.batch, bucket.seqlen, bucket.slots, output)
    inputs = engine.place(dummy_batch(bucket))
    run_s = timing.median_run_s(lambda: jax.block_until_ready(exe(engine.params, inputs)),
                                timing.timed_runs(engine.platform))
    engine.spent["timing"] += time.perf_counter() - began
    return dataclasses.replace(bucket, compiled_bytes=compiled_bytes(exe),
                               compile_s=engine.compile_s(bucket.batch, bucket.seqlen, bucket.slots, output),
                               run_s=run_s)


def host_dispatch_s(engine: Engine, bucket: Bucket, output: str = "pooled") -> float:
    """The host's own time per dispatch, measured on `bucket` (the smallest: least device work): the
    median over HOST_RUNS dispatches of the copy in, the launch call and the copy out (of the one chunk
    its one-sequence rows fill), each timed apart from the wait for the device. Recorded (the engine's
    `host_dispatch_s`, and by the caller in the table) for the throughput knee, the planner's costs and the
    queue's default bound."""
    exe = engine.compile(bucket.batch, bucket.seqlen, bucket.slots, output)
    inputs = dummy_batch(bucket)
    jax.block_until_ready(exe(engine.params, engine.place(inputs)))  # burn-in
    costs = []
    for _ in range(HOST_RUNS):
        t0 = time.perf_counter()
        placed = engine.place(inputs)
        t1 = time.perf_counter()
        result = exe(engine.params, placed)[:1]
        t2 = time.perf_counter()
        jax.block_until_ready(result)
        t3 = time.perf_counter()
        Engine.fetch(result)  # the engine's own copy-out (a test's wrapper may intercept `engine.fetch`)
        costs.append((t1 - t0) + (t2 - t1) + (time.perf_counter() - t3))
    engine.host_dispatch_s = statistics.median(costs)
    return engine.host_dispatch_s


def dummy_batch(bucket: Bucket) -> np.ndarray:
    """[4, B, S]: a full batch of one-document rows, for timing."""
    out = np.zeros((len(INPUT_NAMES), *bucket.shape), np.int32)
    out[0] = 1  # token ids
    out[1] = 1  # segment ids
    out[2] = np.arange(bucket.seqlen, dtype=np.int32)  # positions
    return out



def _compile_pool() -> concurrent.futures.ThreadPoolExecutor:
    """XLA compiles release the GIL: one per usable core at once."""
    return concurrent.futures.ThreadPoolExecutor(host.usable_cores())
