"""The engine: one ahead-of-time compiled executable per bucket, weights on device once.

Nothing compiles once the table is warm: a batch at a shape outside the table
raises instead of compiling. A dispatch is three steps, so that callers can
overlap them: `put` (one host-to-device copy of the batch's [4, B, S] inputs),
`launch` (enqueue on the device; returns at once, as JAX dispatch is
asynchronous) and `fetch` (wait for the result and copy it to the host). A
pooled result comes back in slot chunks (`jaxserve.runtime.output_chunks`): only those
that hold the batch's sequences are copied. A pooled forward may return a second output,
its spill (SPLADE's full rows), copied back in the same pass only for a batch whose out says it is
needed (`launch(spill=True)`, then `fetch_kept`: the engine's `Spill` decides). Compiling
a whole table and timing its buckets is `jaxserve.runtime.warm`'s job; the engine compiles one
shape at a time.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import threading
import time
from typing import Callable, NamedTuple, Protocol

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxserve.models import attention
from jaxserve.models.attention import Plan, xla_impl
from jaxserve.runtime import compiles, output_chunks
from jaxserve.runtime.buckets import INPUT_NAMES, Bucket, BucketTable, ShapeError

compiles.install()  # every compile from here on is counted (`jaxserve_xla_compiles_total`)
log = logging.getLogger("jaxserve.runtime.engine")

Forward = Callable[[dict, dict], jax.Array]  # (params, {name: [B, S] int32}) -> [B, K, D] (or with a spill)


class Spill(Protocol):
    """What a pooled forward's second output (its spill) is read for: SPLADE's `heads.sparse.SparseConfig`."""

    def needed(self, out: np.ndarray) -> np.ndarray:
        """A batch's fetched out [B, k, D] -> [B, k] bool: the sequences whose spill rows are needed."""

    def keep(self, row: np.ndarray) -> object:
        """One such sequence's spill row -> what its job keeps of it."""


class Attention(NamedTuple):
    """Which attention implementation a bucket's executable runs, and why the ones before it were not used."""

    implementation: str
    fallback: tuple[str, ...] = ()


def xla_plan(seqlen: int) -> Plan:
    """The default candidates: XLA's attention (dense or blockwise by seqlen), no fallback."""
    return Plan((xla_impl(seqlen),))


def batch_struct(batch: int, seqlen: int) -> jax.ShapeDtypeStruct:
    """A batch's inputs: token ids, segment ids, positions and type ids stacked as [4, B, S] int32."""
    return jax.ShapeDtypeStruct((len(INPUT_NAMES), batch, seqlen), jnp.int32)


def unstacked(forward: Forward, output: str, slots: int):
    """The forward over one stacked [4, B, S] input array (one transfer per batch) -> a tuple of outputs: a pooled
    [B, K, D] cut into its slot chunks, a [B, S, D] of tokens whole. A pooled forward may return a pair
    (out, spill): the spill's chunks follow the out's (`Engine.launch`)."""
    def run(params, stacked):
        out = forward(params, dict(zip(INPUT_NAMES, stacked)))
        if output != "pooled":
            return (out,)
        parts = out if isinstance(out, tuple) else (out,)
        return tuple(chunk for part in parts for chunk in output_chunks.split(part, slots))
    return run


class Prepared(NamedTuple):
    """A batch on its way: the bucket, its executable, its inputs already on the device, and how many of the
    executable's output chunks hold its sequences (the ones `launch` copies)."""

    bucket: Bucket
    exe: jax.stages.Compiled
    inputs: jax.Array
    chunks: int = 1  # leading output chunks holding its sequences (output_chunks.needed)


def compiled_bytes(compiled: jax.stages.Compiled) -> int:
    """Arguments (weights included) + outputs + temporaries, from XLA's own analysis."""
    m = compiled.memory_analysis()
    return int(m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes - m.alias_size_in_bytes)


class Engine:
    def __init__(self, make_forward: Callable[[int, int, str, str], Forward], params: dict, devices: list | None = None,
                 plan: Callable[[int], Plan] = xla_plan, spill: Spill | None = None):
        """`make_forward(slots, seqlen, output, implementation)` gives the pure forward for rows of `seqlen`
        tokens and up to `slots` documents, its attention run by `implementation`; `output` is `pooled`
        ([B, K, D] per sequence) or `tokens` ([B, S, D] per token, TEI's /embed_all). Each output has
        its own table of warmed buckets.

        `plan(seqlen)` gives the implementations to try (`attention.Plan`): a bucket whose candidate
        fails to trace or compile is compiled with the next one, and the failure logged; which one
        it runs, and why, is `attention_of` (and each served bucket's `attention` fields).

        `spill`: the pooled forward returns (out, spill), and this says which spill rows a batch needs
        (`spills`, `fetch_kept`); None: it returns its out alone.

        With several `devices`: a 1-D mesh; weights replicated on each, every bucket's
        batch axis sharded across them, one compile per bucket for the whole mesh.
        """
        self._make_forward = make_forward
        self.spill = spill
        devices = devices or jax.devices()[:1]
        self.devices = len(devices)
        mesh = Mesh(np.array(devices), ("data",))
        self._replicated = NamedSharding(mesh, PartitionSpec())
        self._by_row = NamedSharding(mesh, PartitionSpec("data"))  # outputs [B, ...]
        self._inputs_by_row = NamedSharding(mesh, PartitionSpec(None, "data"))  # inputs [4, B, S]
        self.params = jax.device_put(params, self._replicated) if self.devices > 1 else params
        self._params_struct = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)
        self._compiled: dict[tuple[int, int, int, str], concurrent.futures.Future] = {}
        self._compile_s: dict[tuple[int, int, int, str], float] = {}
        self._plan = plan
        self._attention: dict[tuple[int, int, int, str], Attention] = {}
        self._lock = threading.Lock()
        self.tables: dict[str, BucketTable] = {}  # per output, the warmed table
        # told of every table installed, however it came (derived, given, a warm artifact's): the encoder fits
        # its tokenizer's limits to the pooled one (`ModelView.fit_to`)
        self.on_install: Callable[[BucketTable, str], None] = lambda table, output: None
        self.spent = {"compile": 0.0, "timing": 0.0}  # wall seconds of warming up (warm.py; start-up's phases)
        self.host_dispatch_s: float | None = None  # the host's time per dispatch (`warm.host_dispatch_s`)
        # Start each output's copy to the host as soon as it is launched, so it overlaps the next batch's work and
        # `fetch` finds it on the host. Not on a CPU, whose device buffers already are host memory.
        self.copy_ahead = devices[0].platform != "cpu"
        self._table_keys: frozenset = frozenset()

    @property
    def table(self) -> BucketTable | None:
        """The warmed table of pooled outputs (the one every request kind but /embed_all uses)."""
        return self.tables.get("pooled")

    @property
    def weights_bytes(self) -> int:
        """Bytes of one copy of the weights (each device holds one)."""
        return int(sum(x.nbytes for x in jax.tree.leaves(self.params)))

    def compile(self, batch: int, seqlen: int, slots: int = 1, output: str = "pooled") -> jax.stages.Compiled:
        """The executable for one shape and output, compiled once (safe to call from several threads)."""
        key = (batch, seqlen, slots, output)
        with self._lock:
            future = self._compiled.get(key)
            owner = future is None
            if owner:
                future = self._compiled[key] = concurrent.futures.Future()
        if owner:
            start = time.perf_counter()
            try:
                future.set_result(self._compile_first(key))
            except BaseException as exc:
                with self._lock:
                    del self._compiled[key]
                future.set_exception(exc)
            self._compile_s[key] = time.perf_counter() - start
        return future.result()

    def _compile_first(self, key: tuple[int, int, int, str]) -> jax.stages.Compiled:
        """Compile with the plan's first candidate that traces and compiles; the last one's failure is raised."""
        batch, seqlen, slots, output = key
        plan = self._plan(seqlen)
        reasons = list(plan.skipped)
        if reasons:
            log.info("bucket batch %d seqlen %d slots %d (%s): attention %s not tried: %s", batch, seqlen, slots, output,
                     ", ".join(r.split(":")[0] for r in reasons), "; ".join(reasons))
        for i, impl in enumerate(plan.candidates):
            try:
                forward = unstacked(self._make_forward(slots, seqlen, output, impl), output, slots)
                fn = jax.jit(forward, in_shardings=(self._replicated, self._inputs_by_row),
                             out_shardings=self._by_row) if self.devices > 1 else jax.jit(forward)
                with attention.recording() as used:  # what each layer runs (a fused kernel takes only some)
                    lowered = fn.lower(self._params_struct, batch_struct(batch, seqlen))
                exe = lowered.compile()
            except Exception as exc:
                if i == len(plan.candidates) - 1 or "RESOURCE_EXHAUSTED" in str(exc):
                    raise  # out of memory is the bucket's, not the kernel's: no slower kernel, recorded for good
                why = _reason(impl, exc)
                log.warning("bucket batch %d seqlen %d slots %d (%s): attention %s failed to compile, trying %s: %s",
                            batch, seqlen, slots, output, impl, plan.candidates[i + 1], why)
                reasons.append(why)
                continue
            if used and impl not in used:
                reasons.append(f"{impl}: takes none of this model's layers (a score bias or a window it cannot express)")
            with self._lock:
                self._attention[key] = Attention(attention.ran(impl, used), tuple(reasons))
            return exe
        raise AssertionError("a plan has at least one candidate")

    def attention_of(self, batch: int, seqlen: int, slots: int = 1, output: str = "pooled") -> Attention | None:
        """The implementation a compiled (or loaded) bucket runs, and its fallback reasons."""
        return self._attention.get((batch, seqlen, slots, output))

    def bucket_bytes(self, batch: int, seqlen: int, slots: int) -> int:
        """XLA's bytes for one pooled shape (compiled if it is not yet): what the derivation checks the budget with."""
        return compiled_bytes(self.compile(batch, seqlen, slots))

    def compile_s(self, batch: int, seqlen: int, slots: int, output: str = "pooled") -> float | None:
        """How long that shape's compile took here (None: not compiled here, e.g. loaded from a warm artifact)."""
        return self._compile_s.get((batch, seqlen, slots, output))

    def install(self, table: BucketTable, output: str = "pooled") -> BucketTable:
        """Serve `table` for `output`: its executables (compiled, or loaded from a warm artifact) stay,
        this output's others (the climb's rejected candidates, an older table's) are dropped."""
        kept = {(b.batch, b.seqlen, b.slots, output) for b in table.buckets}
        with self._lock:
            missing = kept - self._compiled.keys()
            if missing:
                raise ShapeError(f"no executable for {sorted(missing)}")
            self._compiled = {k: v for k, v in self._compiled.items() if k in kept or k[3] != output}
            self._attention = {k: v for k, v in self._attention.items() if k in kept or k[3] != output}
            table = _with(table, buckets=tuple(self._attended(b, output) for b in table.buckets))
        self.tables[output] = table
        self._table_keys = frozenset(k for k in self._table_keys if k[3] != output) | kept
        self.on_install(table, output)
        return table

    def _attended(self, bucket: Bucket, output: str) -> Bucket:
        """The bucket with its executable's attention implementation and fallback reasons filled in."""
        record = self._attention.get((bucket.batch, bucket.seqlen, bucket.slots, output))
        if record is None:
            return bucket
        return _with(bucket, attention=record.implementation, attention_fallback="; ".join(record.fallback))

    def executables(self, output: str = "pooled") -> dict[tuple[int, int, int], jax.stages.Compiled]:
        """The served table's executables of one output, by (batch, seqlen, slots)."""
        return {(b, s, k): self._compiled[(b, s, k, o)].result() for (b, s, k, o) in self._table_keys if o == output}

    def add_executable(self, batch: int, seqlen: int, slots: int, output: str, exe: jax.stages.Compiled,
                       attention: Attention | None = None) -> None:
        """An executable built elsewhere (a warm artifact's), with the attention it was compiled with, for `install`."""
        future = concurrent.futures.Future()
        future.set_result(exe)
        with self._lock:
            self._compiled[(batch, seqlen, slots, output)] = future
            if attention is not None:
                self._attention[(batch, seqlen, slots, output)] = attention

    @property
    def device_list(self) -> list:
        return list(self._replicated.mesh.devices.flat)

    @property
    def platform(self) -> str:
        return self.device_list[0].platform

    def put(self, bucket: Bucket, inputs: np.ndarray, output: str = "pooled", sequences: int | None = None) -> Prepared:
        """Check the shape and copy the [4, B, S] inputs to the device (the host part of a dispatch).

        `sequences`: the most any row holds (read from the segment ids when not given), which decides the
        output chunks to copy back."""
        key = (bucket.batch, bucket.seqlen, bucket.slots, output)
        future = self._compiled.get(key) if key in self._table_keys else None
        if future is None or inputs.shape[1:] != bucket.shape:
            raise ShapeError(f"batch {inputs.shape[1:]} (slots {bucket.slots}) is not a warmed {output} bucket "
                             "of this engine")
        chunks = 1
        if output == "pooled":
            if sequences is None:
                sequences = int(np.abs(inputs[1]).max())
            chunks = output_chunks.needed(bucket.slots, sequences)
        return Prepared(bucket, future.result(), self.place(inputs), chunks)

    def place(self, inputs: np.ndarray) -> jax.Array:
        """Host array -> device, already split by rows across the mesh (no resharding op to compile)."""
        return jax.device_put(inputs, self._inputs_by_row if self.devices > 1 else None)

    def launch(self, prepared: Prepared, spill: bool = False):
        """Enqueue the batch on the device, and the copy to the host of the output chunks it fills behind it
        (`copy_ahead`); returns at once with those chunks to come (the others are dropped unread).

        `spill`: the forward returned (out, spill) (SPLADE's full weights beside its compact rows) -> (the out's
        chunks, the spill's same chunks): the spill stays on the device, uncopied, until `fetch`ed (if ever).
        Without it a spill is dropped unread with the unfilled chunks."""
        outs = prepared.exe(self.params, prepared.inputs)
        result = outs[: prepared.chunks]
        if self.copy_ahead:
            for chunk in result:
                chunk.copy_to_host_async()
        if not spill:
            return result
        first = len(output_chunks.ends(prepared.bucket.slots))
        return result, outs[first : first + prepared.chunks]

    def spills(self, output: str) -> bool:
        """Whether a batch of `output` is launched with its spill (`launch(spill=True)`, then `fetch_kept`)."""
        return output == "pooled" and self.spill is not None

    def fetch_kept(self, launched) -> tuple[np.ndarray, dict]:
        """Wait for a batch launched with its spill -> (its out as `fetch` gives it, {(batch row, slot): kept}): the
        spill is copied back only when the out says a sequence needs it, and only those sequences' rows are kept
        (`Spill`), in the same pass."""
        result, spill = launched
        out = self.fetch(result)
        need = self.spill.needed(out)
        if not need.any():
            return out, {}
        full = self.fetch(spill)
        return out, {(int(b), int(k)): self.spill.keep(full[b, k]) for b, k in zip(*np.nonzero(need))}

    @staticmethod
    def fetch(result: tuple[jax.Array, ...]) -> np.ndarray:
        """Wait for a launched batch and copy its result to the host: [B, k, D], k >= the sequences of its
        fullest row (or [B, S, D] tokens)."""
        return output_chunks.join([np.asarray(chunk) for chunk in result])

    def run(self, bucket: Bucket, inputs: np.ndarray, output: str = "pooled") -> np.ndarray:
        """One dispatch at `bucket`'s shape, start to end -> host array [B, k, D] (or [B, S, D] tokens)."""
        return self.fetch(self.launch(self.put(bucket, inputs, output)))


def _reason(impl: str, exc: Exception) -> str:
    """One line naming the implementation and its error (the first line of the message, cut at 300 characters)."""
    lines = str(exc).strip().splitlines()
    return f"{impl}: {type(exc).__name__}: {lines[0][:300] if lines else ''}".rstrip(": ")


def _with(obj, **changes):
    return dataclasses.replace(obj, **changes)
