"""The device worker: one owner of the device, fed by the batcher, one batch prepared ahead.

Two asyncio tasks share the event loop with the HTTP handlers (so the batcher
needs no lock): the scheduler asks the batcher for the next dispatch and
prepares it on a host thread (assembling the arrays, starting the copy to the
device) while the device thread runs the current one; the device task runs
prepared batches one at a time and scatters each row's vectors back to its
request. A request's future resolves once all its sequences are done.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import itertools
import logging
import time

import numpy as np

from jaxserve.batcher import Batcher, Dispatch
from jaxserve.buckets import BucketTable
from jaxserve.engine import Engine
from jaxserve.explain import LiveTimings
from jaxserve.planner import PlannedBatch, assemble

log = logging.getLogger("jaxserve.service")


class Draining(Exception):
    """The service is shutting down and takes no new work."""


class DeviceError(Exception):
    """The batch holding some of this request's rows failed on the device."""


@dataclasses.dataclass
class RequestTiming:
    """Where one request's time went (seconds)."""

    submitted: float
    first_dispatch: float | None = None
    done: float | None = None
    host_prepare_s: float = 0.0  # assembling + copying its batches
    device_s: float = 0.0  # device time of the batches its rows ran in (they may overlap: streams > 1)
    batches: list = dataclasses.field(default_factory=list)  # (bucket shape, rows of this request, reason)

    @property
    def queue_s(self) -> float:
        return (self.first_dispatch or self.submitted) - self.submitted

    @property
    def total_s(self) -> float:
        return (self.done or self.submitted) - self.submitted


@dataclasses.dataclass
class _Pending:
    future: asyncio.Future
    seqs: list[np.ndarray]
    types: list[np.ndarray] | None  # token type ids (sentence pairs), or None for zeros
    out: np.ndarray  # [P, D] filled as rows finish
    remaining: int
    timing: RequestTiming


class Metrics:
    """What the service reports; the server's Prometheus metrics implement it, tests may pass None."""

    def dispatched(self, d: Dispatch, real_tokens: int, waits: list[float]) -> None: ...

    def device_time(self, d: Dispatch, seconds: float) -> None: ...

    def queue_depth(self, sequences: int) -> None: ...


class EmbeddingService:
    def __init__(self, engine: Engine, table: BucketTable, dim: int, max_wait_s: float, max_queued: int,
                 metrics: Metrics | None = None, streams: int = 1):
        """`streams`: batches executing at once. 1 on an accelerator; 2 on a CPU, where one XLA
        executable leaves cores idle in its single-threaded fusions (measured: +10-25% tokens/s)."""
        self.engine = engine
        self.batcher = Batcher(table, max_wait_s, max_queued)
        self.timings = LiveTimings(table)  # refreshed from every device step
        self.dim = dim
        self.metrics = metrics or Metrics()
        self._pending: dict[int, _Pending] = {}
        self._ids = itertools.count()
        self._host = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="jaxserve-host")
        self._device = concurrent.futures.ThreadPoolExecutor(streams, thread_name_prefix="jaxserve-device")
        self._streams = streams
        self._tasks: list[asyncio.Task] = []
        self._draining = False
        self._running = 0  # batches executing now
        self.device_batches = 0

    # ---- lifecycle ----

    async def start(self) -> None:
        self._wake = asyncio.Event()
        self._slot_free = asyncio.Event()
        self._slot_free.set()
        self._ready: asyncio.Queue = asyncio.Queue(maxsize=1)  # prefetch depth 1
        self._idle = asyncio.Event()
        self._idle.set()
        self._tasks = [asyncio.create_task(self._schedule(), name="jaxserve-scheduler"),
                       asyncio.create_task(self._run_device(), name="jaxserve-device")]

    async def drain(self, timeout: float) -> bool:
        """Take no new work; wait for every accepted request to finish. True if all did."""
        self._draining = True
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
            return True
        except asyncio.TimeoutError:
            return False

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for p in self._pending.values():
            if not p.future.done():
                p.future.set_exception(Draining("the server stopped before this request finished"))
        self._host.shutdown(wait=False)
        self._device.shutdown(wait=True)

    @property
    def draining(self) -> bool:
        return self._draining

    @property
    def in_flight(self) -> int:
        return len(self._pending)

    @property
    def batches_in_flight(self) -> int:
        """Batches on the device or prepared for it."""
        return self._running + self._ready.qsize()

    # ---- requests ----

    async def run(self, seqs: list[np.ndarray], rows: list[tuple[tuple[int, ...], int]],
                  types: list[np.ndarray] | None = None) -> tuple[np.ndarray, RequestTiming]:
        """Run one request's sequences, packed into `rows` ((sequence indices, tokens) each) -> [P, D].

        Raises QueueFull (queue limit), Draining (shutting down) or DeviceError.
        """
        now = time.monotonic()
        timing = RequestTiming(submitted=now)
        if self._draining:
            raise Draining("the server is draining and takes no new requests")
        if not seqs:
            timing.done = now
            return np.zeros((0, self.dim), np.float32), timing
        rid = next(self._ids)
        self.batcher.submit(rid, rows, now)
        future = asyncio.get_running_loop().create_future()
        self._pending[rid] = _Pending(future, seqs, types, np.zeros((len(seqs), self.dim), np.float32), len(seqs),
                                      timing)
        self._idle.clear()
        self.metrics.queue_depth(self.batcher.queued)
        self._wake.set()
        try:
            out = await future
        finally:
            if not future.done():  # the client went away: its waiting rows are dropped
                self.batcher.cancel(rid)
                self.metrics.queue_depth(self.batcher.queued)
            self._forget(rid)
        return out, timing

    def _forget(self, rid: int) -> None:
        self._pending.pop(rid, None)
        if not self._pending:
            self._idle.set()

    # ---- the two tasks ----

    async def _schedule(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await self._slot_free.wait()
            self._wake.clear()
            d = self.batcher.next_dispatch(time.monotonic(), device_idle=self._running < self._streams)
            if d is None:
                deadline = self.batcher.next_deadline()
                timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
                try:
                    await asyncio.wait_for(self._wake.wait(), timeout)
                except asyncio.TimeoutError:
                    pass
                continue
            self.metrics.queue_depth(self.batcher.queued)
            now = time.monotonic()
            flat, flat_types, planned = self._flatten(d)
            waits = [now - r.enqueued for r in d.rows]
            self.metrics.dispatched(d, sum(r.tokens for r in d.rows), waits)
            for rid in {r.request for r in d.rows}:
                if (p := self._pending.get(rid)) and p.timing.first_dispatch is None:
                    p.timing.first_dispatch = now
            start = time.perf_counter()
            try:
                prepared = await loop.run_in_executor(self._host, self._prepare, planned, flat, flat_types)
            except Exception as exc:
                log.exception("preparing a batch failed")
                self._fail(d, exc)
                continue
            self._slot_free.clear()
            self._ready.put_nowait((d, prepared, time.perf_counter() - start))

    def _flatten(self, d: Dispatch):
        """The dispatch's sequences (and token types) as lists, its rows as indices into them (cancelled: empty)."""
        flat, types, rows = [], [], []
        for r in d.rows:
            p = self._pending.get(r.request)
            idx = []
            for i in r.pieces if p else ():
                idx.append(len(flat))
                flat.append(p.seqs[i])
                types.append(p.types[i] if p.types is not None else np.zeros(len(p.seqs[i]), np.int32))
            rows.append(tuple(idx))
        return flat, types, PlannedBatch(d.bucket, tuple(rows))

    def _prepare(self, planned: PlannedBatch, flat: list[np.ndarray], types: list[np.ndarray]):
        return self.engine.put(planned.bucket, assemble(planned, flat, types))

    async def _run_device(self) -> None:
        free = asyncio.Semaphore(self._streams)
        running: set[asyncio.Task] = set()
        while True:
            await free.acquire()
            d, prepared, prepare_s = await self._ready.get()
            self._slot_free.set()
            self._running += 1
            task = asyncio.create_task(self._execute(d, prepared, prepare_s))
            running.add(task)
            task.add_done_callback(lambda t: (running.discard(t), free.release()))

    async def _execute(self, d: Dispatch, prepared, prepare_s: float) -> None:
        sharing = self._running  # batches on the device now, this one included
        start = time.perf_counter()
        try:
            out = await asyncio.get_running_loop().run_in_executor(self._device, self.engine.execute, prepared)
        except Exception as exc:
            log.error("device step failed for a batch at %s: %s", d.bucket.shape, exc)
            self._fail(d, exc)
            return
        finally:
            self._running -= 1
            self._wake.set()
        device_s = time.perf_counter() - start
        self.device_batches += 1
        # Batches sharing the device each take longer but overlap: their share of the
        # wall time is what a plan's prediction adds up.
        self.timings.observe(d.bucket, device_s / sharing)
        self.metrics.device_time(d, device_s)
        self._scatter(d, out, prepare_s, device_s)

    def _scatter(self, d: Dispatch, out: np.ndarray, prepare_s: float, device_s: float) -> None:
        now = time.monotonic()
        touched: dict[int, int] = {}
        for r, row in enumerate(d.rows):
            p = self._pending.get(row.request)
            if p is None or p.future.done():
                continue
            for slot, i in enumerate(row.pieces):
                p.out[i] = out[r, slot]
            p.remaining -= len(row.pieces)
            touched[row.request] = touched.get(row.request, 0) + 1
        for rid, n_rows in touched.items():
            p = self._pending[rid]
            p.timing.host_prepare_s += prepare_s
            p.timing.device_s += device_s
            p.timing.batches.append((d.bucket.shape, n_rows, d.reason))
            if p.remaining == 0:
                p.timing.done = now
                p.future.set_result(p.out)

    def _fail(self, d: Dispatch, exc: Exception) -> None:
        """Fail exactly the requests with rows in this batch; everyone else carries on."""
        for rid in {r.request for r in d.rows}:
            p = self._pending.get(rid)
            if p and not p.future.done():
                self.batcher.cancel(rid)
                p.future.set_exception(DeviceError(f"the batch at {d.bucket.shape} failed: {type(exc).__name__}: {exc}"))
