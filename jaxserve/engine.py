"""The engine: one ahead-of-time compiled executable per bucket, weights on device once.

Nothing compiles once the table is warm: a batch at a shape outside the table
raises instead of compiling.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import os
import statistics
import threading
import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxserve import compiles  # noqa: F401  (installs the compile counter)
from jaxserve.buckets import Bucket, BucketTable
from jaxserve.planner import INPUT_NAMES
TIMED_RUNS = 1  # timed runs per bucket at warmup, after one burn-in (live timings refine it later)

Forward = Callable[[dict, dict], jax.Array]  # (params, batch of [B, S] int32 arrays) -> [B, K, D]


class ShapeError(ValueError):
    """A batch whose shape is not one of the table's buckets."""


def batch_struct(batch: int, seqlen: int) -> dict:
    return {k: jax.ShapeDtypeStruct((batch, seqlen), jnp.int32) for k in INPUT_NAMES}


def compiled_bytes(compiled: jax.stages.Compiled) -> int:
    """Arguments (weights included) + outputs + temporaries, from XLA's own analysis."""
    m = compiled.memory_analysis()
    return int(m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes - m.alias_size_in_bytes)


class Engine:
    def __init__(self, make_forward: Callable[[int, int], Forward], params: dict, devices: list | None = None):
        """`make_forward(slots, seqlen)` gives the pure forward for rows of `seqlen` tokens and up to
        `slots` documents (the seqlen picks the attention implementation).

        With several `devices`: a 1-D mesh; weights replicated on each, every bucket's
        batch axis sharded across them, one compile per bucket for the whole mesh.
        """
        self._make_forward = make_forward
        devices = devices or jax.devices()[:1]
        self.devices = len(devices)
        mesh = Mesh(np.array(devices), ("data",))
        self._replicated = NamedSharding(mesh, PartitionSpec())
        self._by_row = NamedSharding(mesh, PartitionSpec("data"))
        self.params = jax.device_put(params, self._replicated) if self.devices > 1 else params
        self._params_struct = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)
        self._compiled: dict[tuple[int, int, int], concurrent.futures.Future] = {}
        self._compile_s: dict[tuple[int, int, int], float] = {}
        self._lock = threading.Lock()
        self.table: BucketTable | None = None
        self._table_keys: frozenset = frozenset()

    @property
    def weights_bytes(self) -> int:
        """Bytes of one copy of the weights (each device holds one)."""
        return int(sum(x.nbytes for x in jax.tree.leaves(self.params)))

    def compile(self, batch: int, seqlen: int, slots: int = 1) -> jax.stages.Compiled:
        """The executable for one shape, compiled once (safe to call from several threads)."""
        key = (batch, seqlen, slots)
        with self._lock:
            future = self._compiled.get(key)
            owner = future is None
            if owner:
                future = self._compiled[key] = concurrent.futures.Future()
        if owner:
            start = time.perf_counter()
            try:
                forward = self._make_forward(slots, seqlen)
                fn = jax.jit(forward, in_shardings=(self._replicated, self._by_row),
                             out_shardings=self._by_row) if self.devices > 1 else jax.jit(forward)
                future.set_result(fn.lower(self._params_struct, batch_struct(batch, seqlen)).compile())
            except BaseException as exc:
                with self._lock:
                    del self._compiled[key]
                future.set_exception(exc)
            self._compile_s[key] = time.perf_counter() - start
        return future.result()

    def measure(self, batch: int, seqlen: int, slots: int) -> int:
        return compiled_bytes(self.compile(batch, seqlen, slots))

    def use(self, table: BucketTable, progress: bool = False) -> BucketTable:
        """Warm up: compile every bucket, run each, record compile and run times.

        Executables compiled for other shapes (rejected candidates of the
        derivation) are dropped. Returns the table with the timings filled in.
        """
        from tqdm import tqdm

        keep = {(b.batch, b.seqlen, b.slots) for b in table.buckets}
        with self._lock:
            self._compiled = {k: v for k, v in self._compiled.items() if k in keep}
        # XLA compiles release the GIL: compile on every core, then time one bucket at a time.
        with concurrent.futures.ThreadPoolExecutor(os.cpu_count() or 1) as pool:
            jobs = [pool.submit(self.compile, *key) for key in sorted(keep)]
            for job in tqdm(concurrent.futures.as_completed(jobs), total=len(jobs), desc="compile",
                            unit="bucket", disable=not progress):
                job.result()
        warmed = []
        for bucket in tqdm(table.buckets, desc="run", unit="bucket", disable=not progress):
            exe = self.compile(bucket.batch, bucket.seqlen, bucket.slots)
            key = (bucket.batch, bucket.seqlen, bucket.slots)
            inputs = self._place(_dummy_batch(bucket))
            times = []
            for _ in range(TIMED_RUNS + 1):
                start = time.perf_counter()
                exe(self.params, inputs).block_until_ready()
                times.append(time.perf_counter() - start)
            warmed.append(_with(bucket, compiled_bytes=compiled_bytes(exe), compile_s=self._compile_s[key],
                                run_s=statistics.median(times[1:])))
        self.table = _with(table, buckets=tuple(warmed))
        self._table_keys = frozenset(keep)
        return self.table

    def put(self, bucket: Bucket, batch: dict[str, np.ndarray]) -> tuple[jax.stages.Compiled, dict]:
        """Check the shape and start the host-to-device copy (the host part of a dispatch)."""
        key = (bucket.batch, bucket.seqlen, bucket.slots)
        future = self._compiled.get(key) if key in self._table_keys else None
        shape = batch["token_ids"].shape
        if future is None or shape != bucket.shape:
            raise ShapeError(f"batch {shape} (slots {bucket.slots}) is not a warmed bucket of this engine")
        return future.result(), self._place(batch)

    def _place(self, batch: dict[str, np.ndarray]) -> dict:
        """Host arrays -> device, already split by rows across the mesh (no resharding op to compile)."""
        return jax.device_put(batch, self._by_row if self.devices > 1 else None)

    def execute(self, prepared: tuple[jax.stages.Compiled, dict]) -> np.ndarray:
        """Run a prepared batch -> host array [B, K, D] (blocks until the device is done)."""
        exe, inputs = prepared
        return np.asarray(exe(self.params, inputs))

    def run(self, bucket: Bucket, batch: dict[str, np.ndarray]) -> np.ndarray:
        """One dispatch at `bucket`'s shape -> host array [B, K, D]."""
        return self.execute(self.put(bucket, batch))


def _dummy_batch(bucket: Bucket) -> dict[str, np.ndarray]:
    """A full batch of one-document rows, for timing."""
    shape = bucket.shape
    return {
        "token_ids": np.ones(shape, np.int32),
        "segment_ids": np.ones(shape, np.int32),
        "positions": np.broadcast_to(np.arange(bucket.seqlen, dtype=np.int32), shape).copy(),
        "type_ids": np.zeros(shape, np.int32),
    }


def _with(obj, **changes):
    return dataclasses.replace(obj, **changes)
