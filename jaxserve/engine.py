"""The engine: one ahead-of-time compiled executable per bucket, weights on device once.

Nothing compiles once the table is warm: a batch at a shape outside the table
raises instead of compiling.
"""

from __future__ import annotations

import dataclasses
import statistics
import threading
import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve import compiles  # noqa: F401  (installs the compile counter)
from jaxserve.buckets import Bucket, BucketTable

INPUT_NAMES = ("token_ids", "segment_ids", "positions", "type_ids")
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
    def __init__(self, make_forward: Callable[[int], Forward], params: dict):
        """`make_forward(slots)` gives the pure forward for rows of up to `slots` documents."""
        self._make_forward = make_forward
        self.params = params
        self._params_struct = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)
        self._compiled: dict[tuple[int, int, int], jax.stages.Compiled] = {}
        self._compile_s: dict[tuple[int, int, int], float] = {}
        self._lock = threading.Lock()
        self.table: BucketTable | None = None
        self._table_keys: frozenset = frozenset()

    @property
    def weights_bytes(self) -> int:
        return int(sum(x.nbytes for x in jax.tree.leaves(self.params)))

    def compile(self, batch: int, seqlen: int, slots: int = 1) -> jax.stages.Compiled:
        key = (batch, seqlen, slots)
        with self._lock:
            if key not in self._compiled:
                start = time.perf_counter()
                fn = jax.jit(self._make_forward(slots))
                self._compiled[key] = fn.lower(self._params_struct, batch_struct(batch, seqlen)).compile()
                self._compile_s[key] = time.perf_counter() - start
            return self._compiled[key]

    def measure(self, batch: int, seqlen: int, slots: int = 1) -> int:
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
        warmed = []
        for bucket in tqdm(table.buckets, desc="warmup", unit="bucket", disable=not progress):
            exe = self.compile(bucket.batch, bucket.seqlen, bucket.slots)
            key = (bucket.batch, bucket.seqlen, bucket.slots)
            inputs = jax.device_put(_dummy_batch(bucket))
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

    def run(self, bucket: Bucket, batch: dict[str, np.ndarray]) -> np.ndarray:
        """One dispatch at `bucket`'s shape -> host array [B, K, D]."""
        key = (bucket.batch, bucket.seqlen, bucket.slots)
        exe = self._compiled.get(key) if key in self._table_keys else None
        shape = batch["token_ids"].shape
        if exe is None or shape != bucket.shape:
            raise ShapeError(f"batch {shape} (slots {bucket.slots}) is not a warmed bucket of this engine")
        return np.asarray(exe(self.params, jax.device_put(batch)))


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
