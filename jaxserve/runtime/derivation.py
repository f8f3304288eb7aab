"""Deriving a bucket table lazily: each seqlen's batch ladder climbed from the smallest batch to its knee.

Per seqlen the candidates are batches 1, 4, 16, ... up to the largest the
analytic memory estimate and the caps allow (`buckets.upper_bound`). They are
compiled and timed in ascending order; XLA's memory analysis of each compiled
candidate checks it against the budget, and the climb stops at the first
batch that is not `THROUGHPUT_GAIN` faster per token than the one below it
(`buckets.pays`). So the only compiles the table then drops are that one step
past the knee, or one candidate over the memory budget: on a large device the
memory-filling batches, each seconds to compile and never worth their
latency, are never built. A candidate over the budget is retried at the batch
a line through its figure and the last kept one's (the weights at batch 0,
where none is kept) puts within the budget (`within_budget`): one retry, where
memory is linear in the batch, however much of it the weights take.

Pure logic (no JAX): `Climb` is one seqlen's state machine and `climb` the
driver, which gets the compiler and the clock as callables, so that tests
(and the start-up compile counts of `scripts/startup_compiles.py`) run it
with fake timings.
"""

from __future__ import annotations

import dataclasses
import operator
from typing import Callable

from jaxserve.dims import ModelDims
from jaxserve.errors import TableError
from jaxserve.runtime.buckets import (
    THROUGHPUT_GAIN,
    Bucket,
    BucketTable,
    batch_fitter,
    batch_sizes,
    pays,
    slots_for,
    upper_bound,
    within_budget,
)

Shape = tuple[int, int, int]  # (batch, seqlen, slots)
CompileMany = Callable[[list[Shape]], list[int]]  # compiles the shapes (in parallel) -> their compiled bytes
TimeOne = Callable[[Bucket], float]  # one compiled bucket's run time, seconds


class Climb:
    """One seqlen's ladder: `next()` names the batch to compile, `measured()` takes its compiled bytes
    (False: over the budget, not to be run), `timed()` its run time; `kept` is the result once `done`."""

    def __init__(self, seqlen: int, slots: int, candidates: list[int], top_limit: str, budget_bytes: int,
                 fit: Callable[[int], int], knee: bool = True, gain: float = THROUGHPUT_GAIN, weights_bytes: int = 0):
        self.seqlen, self.slots, self.budget, self.fit = seqlen, slots, budget_bytes, fit
        self.weights = weights_bytes  # what a batch of 0 would take: the arguments that do not grow with it
        self.knee, self.gain = knee, gain
        self.host_s: float | None = None  # the host's time per dispatch (the engine's measure; None: the constant)
        self._todo = list(candidates)  # ascending
        self._limit = top_limit  # what limits the last candidate: memory, tokens, max_batch
        self._bytes = 0
        self.kept: list[Bucket] = []
        self.compiled: list[int] = []  # every batch compiled, kept or not
        self.dropped_reason: str | None = None

    @property
    def done(self) -> bool:
        return not self._todo

    def next(self) -> int | None:
        return self._todo[0] if self._todo else None

    def measured(self, batch: int, compiled_bytes: int) -> bool:
        """The compiled figure of the batch `next()` named; False if it is over the budget (then the
        climb tries the batch `within_budget` puts under it, if that is above the last kept one, or ends)."""
        assert batch == self.next(), (batch, self.next())
        self.compiled.append(batch)
        if compiled_bytes <= self.budget:
            self._bytes = compiled_bytes
            return True
        self._limit = "memory"
        below = (self.kept[-1].batch, self.kept[-1].compiled_bytes) if self.kept else (0, self.weights)
        shrunk = self.fit(min(within_budget(batch, compiled_bytes, self.budget, below), batch - 1))
        floor = self.kept[-1].batch if self.kept else 0
        self._todo = [shrunk] if shrunk > floor else []
        if self.done:
            self._finish()
        return False

    def timed(self, run_s: float, compile_s: float | None = None) -> None:
        """The run time of the batch just measured: keep it, or stop at the knee below it."""
        batch = self._todo.pop(0)
        bucket = Bucket(batch=batch, seqlen=self.seqlen, slots=self.slots, compiled_bytes=self._bytes,
                        limited_by="ladder", compile_s=compile_s, run_s=run_s)
        if self.knee and self.kept and not pays(bucket, self.kept[-1], self.gain, self.host_s):
            self._todo = []
            self._limit = "throughput"
        else:
            self.kept.append(bucket)
        if self.done:
            self._finish()

    def _finish(self) -> None:
        if not self.kept:
            self.dropped_reason = f"batch 1 needs more than the budget of {self.budget} bytes"
            return
        self.kept[-1] = dataclasses.replace(self.kept[-1], limited_by=self._limit)


def climbs(seqlens: list[int], dims: ModelDims, weights_bytes: int, budget_bytes: int, max_batch_tokens: int,
           max_batch: int, multiple: int = 1, layout: str = "padded", batch_ladder: bool = True, devices: int = 1,
           knee: bool = True, gain: float = THROUGHPUT_GAIN) -> list[Climb]:
    """Each seqlen's climb, its candidates bounded by the analytic estimate and the caps (nothing compiled yet)."""
    fit = batch_fitter(multiple, devices)
    out = []
    for seqlen in seqlens:
        slots = slots_for(seqlen, layout)
        top, limited_by = upper_bound(seqlen, slots, dims, weights_bytes, budget_bytes, max_batch_tokens, max_batch,
                                      devices)
        top = fit(top)
        candidates = sorted({fit(b) for b in batch_sizes(top)} - {0}) if batch_ladder and top else ([top] if top else [])
        climb = Climb(seqlen, slots, candidates, limited_by, budget_bytes, fit, knee, gain, weights_bytes)
        if climb.done:
            climb._finish()
        out.append(climb)
    return out


def climb(ladders: list[Climb], compile_many: CompileMany, time_one: TimeOne,
          compile_s: Callable[[Shape], float | None] = lambda shape: None,
          on_round: Callable[[int, int], None] = lambda compiled, active: None) -> list[Climb]:
    """Run the climbs in rounds: each round compiles every unfinished seqlen's next batch at once (compiles
    run in parallel), then times them one at a time (nothing else runs while a bucket is timed)."""
    while active := [c for c in ladders if not c.done]:
        shapes = [(c.next(), c.seqlen, c.slots) for c in active]
        for c, shape, size in zip(active, shapes, compile_many(shapes)):
            if c.measured(shape[0], size):
                c.timed(time_one(Bucket(*shape, compiled_bytes=size)), compile_s(shape))
        on_round(sum(len(c.compiled) for c in ladders), len(active))
    return ladders


def table_of(ladders: list[Climb], dims: ModelDims, weights_bytes: int, devices: int = 1,
             **table_fields) -> BucketTable:
    """The climbed table: every kept bucket with its analytic estimate beside XLA's figure."""
    buckets = tuple(
        dataclasses.replace(b, estimated_bytes=weights_bytes + dims.activation_bytes(b.batch // devices, b.seqlen, b.slots))
        for c in ladders for b in c.kept
    )
    dropped = tuple((c.seqlen, c.dropped_reason) for c in ladders if c.dropped_reason)
    if not buckets:
        raise ValueError(f"the memory budget ({table_fields.get('budget_bytes')} bytes, weights {weights_bytes}) "
                         f"fits no bucket at seqlens {[c.seqlen for c in ladders]}")
    return BucketTable(buckets=buckets, dropped=dropped, weights_bytes=weights_bytes, **table_fields)


@dataclasses.dataclass(frozen=True)
class TableOptions:
    """What a derived table is derived from (besides the model and the device): the command line's table flags.
    None leaves the device's default (`jaxserve.runtime.device.describe`)."""

    ladder: str = "default"
    layout: str = "packed"
    seqlens: tuple[int, ...] | None = None  # explicit seqlen ladder (overrides `ladder`)
    device_memory: int | None = None  # derive for a device of this many bytes
    headroom: float | None = None  # share of the device memory the buckets may fill
    max_batch_tokens: int | None = None
    max_batch: int | None = None
    batch_multiple: int | None = None
    batch_ladder: bool = True  # batches 1, 4, 16, ... below each seqlen's largest
    knee: bool = True  # stop each seqlen's climb at its throughput knee

    def __post_init__(self):
        """`seqlens` sorted and without repeats, each a positive int: checked here, before anything compiles (a
        climb over unsorted seqlens compiled every bucket, then the table refused them)."""
        if self.seqlens is not None:
            try:
                seqlens = tuple(sorted({operator.index(s) for s in self.seqlens}))
            except TypeError:
                seqlens = (0,)
            if seqlens and seqlens[0] < 1:
                raise TableError(f"seqlens must be positive integers, got {tuple(self.seqlens)}")
            object.__setattr__(self, "seqlens", seqlens)
