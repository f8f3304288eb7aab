"""A simulated device: the real host path over a device that costs `overhead + FLOPs / rate` per dispatch.

A capacity-planning tool (`jaxserve serve --simulate-device TFLOPS`, `scripts/bench_host.py`): on a CPU a
forward hides the host path; on an H200 a MiniLM dispatch takes a fraction of a millisecond and the host
path (HTTP, JSON, tokenizing, packing, assembling, scattering, encoding) is the whole cost. `SimEngine`
speaks the engine's interface (`put` / `launch` / `fetch`, as `runtime.engine.Engine` and the device
pipeline use it) with the same shape checks, and computes nothing:

- a step at bucket (B, S) takes `step_seconds`: the padded forward's FLOPs (`dims.forward_flops`, every
  row at its full seqlen, as the executable runs it) at the spec's rate, plus its overhead per dispatch;
- steps queue on one device clock (`SimDevice`), as batches do on one GPU; `launch` returns at once, as
  JAX's dispatch does;
- the output chunks a batch fills (`runtime.output_chunks`) arrive `bytes / d2h rate` after its step
  ends (the copy overlaps the next step, as `copy_to_host_async` does); `fetch` waits for them and
  returns zeros of the real shape.

The table is the one `jaxserve serve` derives on an H200 (`h200_table`): the default ladder, packed rows,
each seqlen's batch ladder climbed to its throughput knee on the simulated step times, batches bounded
by the analytic memory estimate and the accelerator's token cap, at the served weights' bytes per
parameter (float32 on a CPU unless served with `--dtype bfloat16`, as an H200 would).

Only pooled outputs are simulated: a simulated server serves with token outputs off (`--no-embed-all`;
a multi-vector model, whose outputs are all per token, cannot be simulated), and `put` refuses any
other output.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import threading
import time
from collections.abc import Callable
from typing import NamedTuple

import numpy as np

from jaxserve.dims import ModelDims
from jaxserve.runtime import derivation, output_chunks
from jaxserve.runtime.buckets import Bucket, BucketTable, ShapeError, ladder
from jaxserve.runtime.device import ACCELERATOR_MAX_BATCH_TOKENS, UNCAPPED, budget_bytes

DEVICE = "simulated H200"
DEVICE_MEMORY = int(141e9)  # an H200's HBM
BATCH_MULTIPLE = 8  # an accelerator's batch rounding (`device.describe`)
HEAD_DIM = 64  # heads of a model given by `SimSpec.sizes`: hidden // this, as BERT-base and its kin


@dataclasses.dataclass(frozen=True)
class SimSpec:
    """What the simulated device costs."""

    tflops: float  # achieved dense rate of the simulated device
    step_overhead_us: float = 30.0  # launch + sync per dispatch
    d2h_gbps: float = 25.0  # device-to-host copy
    # (hidden, intermediate, layers) of another model's size; None: the checkpoint's
    sizes: tuple[int, int, int] | None = None

    def __post_init__(self):
        for name, value in (("tflops", self.tflops), ("d2h_gbps", self.d2h_gbps)):  # each divides a step's work
            if not 0 < value < math.inf:
                raise ValueError(f"a simulated device's {name} must be a finite number above 0, not {value}")
        if not 0 <= self.step_overhead_us < math.inf:
            raise ValueError(f"a simulated device's step_overhead_us must be a finite number, 0 or more, "
                             f"not {self.step_overhead_us}")


def sim_dims(hidden: int, intermediate: int, layers: int, dtype_bytes: int = 4) -> ModelDims:
    """A BERT-shaped model of these sizes (heads of `HEAD_DIM`: the FLOPs see only heads x head_dim, the
    memory estimate the heads' score matrices)."""
    return ModelDims(hidden, intermediate, heads=max(1, hidden // HEAD_DIM), dtype_bytes=dtype_bytes, layers=layers)


def step_seconds(dims: ModelDims, bucket: Bucket, rate_flops: float, overhead_s: float) -> float:
    """The simulated device's time for one step at `bucket`: its padded forward's FLOPs at `rate_flops`."""
    return overhead_s + dims.forward_flops([bucket.seqlen] * bucket.batch) / rate_flops


class SimDevice:
    """One device clock shared by every step: a step starts when the device is free and takes its time.

    `clock` and `sleep` are injectable (tests run it on a clock of their own)."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter, sleep: Callable[[float], None] = time.sleep):
        self.clock, self._sleep = clock, sleep
        self._free_at = 0.0
        self._launched_s = 0.0  # every step's time, the queued ones' included
        self._lock = threading.Lock()
        self.steps = 0

    def launch(self, step_s: float) -> float:
        """Queue a step; returns the clock time it will be done."""
        with self._lock:
            start = max(self.clock(), self._free_at)
            self._free_at = start + step_s
            self._launched_s += step_s
            self.steps += 1
            return self._free_at

    def wait_until(self, t: float) -> None:
        """Block until the clock reads `t`."""
        left = t - self.clock()
        if left > 0:
            self._sleep(left)

    @property
    def busy_s(self) -> float:
        """Seconds the device has been busy so far: the queued steps ahead of the clock are not yet spent (the
        device runs them back to back until it is free)."""
        with self._lock:
            return self._launched_s - max(0.0, self._free_at - self.clock())


class SimPrepared(NamedTuple):
    bucket: Bucket
    inputs: np.ndarray  # the host side of a host-to-device copy
    widths: tuple[int, ...]  # the slot chunks to copy back


class SimLaunched(NamedTuple):
    bucket: Bucket
    widths: tuple[int, ...]
    arrives: float  # clock time its output is on the host


class SimEngine:
    """The engine's interface over a `SimDevice`: the same shapes and checks, no computation.

    `table` (and `tables`, pooled only) is warm from the start; `params` and `weights_bytes` are the real
    engine's; `busy_s` and `steps` are the device clock's own counts."""

    devices = 1

    def __init__(self, real_engine, table: BucketTable, dims: ModelDims, out_dim: int, spec: SimSpec,
                 device: SimDevice | None = None):
        self.spec = spec
        self.params = real_engine.params
        self.weights_bytes = real_engine.weights_bytes
        self.out_dim = out_dim
        self.device = device or SimDevice()
        self._d2h_bps = spec.d2h_gbps * 1e9
        self._step_s = {(b.batch, b.seqlen, b.slots): step_seconds(dims, b, spec.tflops * 1e12,
                                                                   spec.step_overhead_us * 1e-6)
                        for b in table.buckets}
        self.table = dataclasses.replace(table, buckets=tuple(
            dataclasses.replace(b, run_s=self._step_s[(b.batch, b.seqlen, b.slots)], compile_s=0.0)
            for b in table.buckets))
        self.tables = {"pooled": self.table}
        self.shipped_bytes = 0  # output copied to the host so far

    @property
    def busy_s(self) -> float:
        return self.device.busy_s

    @property
    def steps(self) -> int:
        return self.device.steps

    def put(self, bucket: Bucket, inputs: np.ndarray, output: str = "pooled",
            sequences: int | None = None) -> SimPrepared:
        """Check the shape as the engine does and copy the [4, B, S] inputs (the host side of the copy to the
        device); `sequences` (else read from the segment ids) decides the output chunks to copy back."""
        key = (bucket.batch, bucket.seqlen, bucket.slots)
        if output != "pooled" or key not in self._step_s or inputs.shape[1:] != bucket.shape:
            raise ShapeError(f"batch {inputs.shape[1:]} (slots {bucket.slots}) is not a warmed {output} bucket "
                             "of this simulated engine (it serves pooled outputs only)")
        if sequences is None:
            sequences = int(np.abs(inputs[1]).max())
        ends = output_chunks.ends(bucket.slots)[: output_chunks.needed(bucket.slots, sequences)]
        return SimPrepared(bucket, np.array(inputs), tuple(b - a for a, b in itertools.pairwise((0, *ends))))

    def launch(self, prepared: SimPrepared) -> SimLaunched:
        """Queue the step on the device clock; returns at once with the time its output chunks arrive."""
        bucket, _, widths = prepared
        done = self.device.launch(self._step_s[(bucket.batch, bucket.seqlen, bucket.slots)])
        nbytes = bucket.batch * sum(widths) * self.out_dim * 4
        self.shipped_bytes += nbytes
        return SimLaunched(bucket, widths, done + nbytes / self._d2h_bps)

    def fetch(self, launched: SimLaunched) -> np.ndarray:
        """Wait for the output to arrive -> [B, k, D] zeros, k the slots of the chunks copied."""
        bucket, widths, arrives = launched
        self.device.wait_until(arrives)
        return output_chunks.join([np.zeros((bucket.batch, w, self.out_dim), np.float32) for w in widths])

    def describe(self) -> dict:
        """What /info says of the simulated device (beside its warning): the spec, the device, the table it serves
        and its clock (busy seconds, steps)."""
        steps = [b.run_s for b in self.table.buckets]
        return {
            "simulated": True,
            "device": DEVICE,
            "busy_s": self.busy_s,
            "steps": self.steps,
            "spec": dataclasses.asdict(self.spec),
            "table": {"buckets": len(self.table.buckets), "seqlens": self.table.seqlens,
                      "largest_batch_tokens": max(b.tokens for b in self.table.buckets),
                      "step_ms": {"min": 1e3 * min(steps), "max": 1e3 * max(steps)}},
        }


def described(engine) -> dict | None:
    """A simulated engine's `describe()` (for /info); None for a real one."""
    return engine.describe() if isinstance(engine, SimEngine) else None


def h200_table(dims: ModelDims, weights_bytes: int, max_seq_length: int,
               step_s: Callable[[Bucket], float], host_s: float | None = None) -> BucketTable:
    """The table `jaxserve serve` derives on an H200 (`Encoder.climb_table` with an accelerator's defaults):
    each seqlen's batch ladder, bounded by the analytic memory estimate (no GPU compiler here) and the token
    cap, climbed to its throughput knee on `step_s`. `host_s`: the host's time per dispatch, as warm-up
    measures it on a real device (`warm.host_dispatch_s`); the batcher's costs and the knee use it."""
    budget = budget_bytes(DEVICE_MEMORY)
    ladders = derivation.climbs(ladder("default", max_seq_length), dims, weights_bytes, budget,
                                ACCELERATOR_MAX_BATCH_TOKENS, UNCAPPED, multiple=BATCH_MULTIPLE, layout="packed")
    for c in ladders:
        c.host_s = host_s
    derivation.climb(ladders, lambda shapes: [weights_bytes + dims.activation_bytes(*s) for s in shapes], step_s)
    return derivation.table_of(ladders, dims, weights_bytes, budget_bytes=budget,
                               max_batch_tokens=ACCELERATOR_MAX_BATCH_TOKENS, layout="packed", ladder="default",
                               device=DEVICE, device_memory=DEVICE_MEMORY, host_dispatch_s=host_s)


def sized_weights_bytes(hidden: int, intermediate: int, layers: int, vocab: int, dtype_bytes: int) -> int:
    """A BERT-shaped model's weights: per layer the attention's four projections and the MLP's two, and the
    token embeddings (biases and norms left out)."""
    return dtype_bytes * (layers * (4 * hidden * hidden + 2 * hidden * intermediate) + vocab * hidden)


def simulated_engine(real_engine, model_config, max_seq_length: int, out_dim: int, spec: SimSpec,
                     device: SimDevice | None = None) -> SimEngine:
    """A warm `SimEngine` in place of `real_engine` (whose weights it keeps, unused): the H200 table of the
    checkpoint (`model_config`, at the real weights' bytes per parameter) or of a model of `spec.sizes` (its
    weights estimated, `sized_weights_bytes`, at the checkpoint's vocabulary), its buckets timed by the
    simulated step. `out_dim`: the width of one pooled output."""
    import jax  # the real engine's params (a process with an engine has JAX loaded)

    leaves = jax.tree.leaves(real_engine.params)
    dtype_bytes = max(1, round(real_engine.weights_bytes / max(1, sum(int(x.size) for x in leaves))))
    if spec.sizes is None:
        dims, weights = model_config.dims(dtype_bytes), real_engine.weights_bytes
    else:
        dims = sim_dims(*spec.sizes, dtype_bytes=dtype_bytes)
        weights = sized_weights_bytes(*spec.sizes, model_config.vocab_size, dtype_bytes)
    return SimEngine(real_engine, simulated_table(dims, weights, max_seq_length, spec), dims, out_dim, spec, device)


def simulated_table(dims: ModelDims, weights_bytes: int, max_seq_length: int, spec: SimSpec) -> BucketTable:
    """The H200 table a simulated device of `spec` serves for a model of `dims` (`h200_table`), its buckets timed
    by the simulated step."""
    step_s = lambda b: step_seconds(dims, b, spec.tflops * 1e12, spec.step_overhead_us * 1e-6)
    # the host's own time per dispatch: the spec's launch overhead stands for it (without it, the batcher's cost
    # floor, HOST_DISPATCH_S, would make every bucket under it look free, and a query would take a 256-row one)
    return h200_table(dims, weights_bytes, max_seq_length, step_s, host_s=spec.step_overhead_us * 1e-6)

