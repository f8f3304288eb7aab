"""The device pipeline: the batcher's dispatches assembled, copied, launched and scattered, the device never idle.

Three stages in threads of their own, with bounded hand-offs between them
(JetStream's shape), so the event loop only submits jobs and awaits them:

- prepare: asks the batcher for the next dispatch, assembles its [4, B, S]
  inputs from the jobs' flat rows and copies them to the device (one
  transfer); at most one prepared batch waits for the device. With one
  stream and nothing prepared or on the device, the event loop does this
  itself at the end of the turn its jobs arrived in (`_kick`), as one batch:
  at light load every job is a batch of its own, and a thread hand-off per
  batch was the larger part of its host time;
- device: launches prepared batches, at most `max_inflight` on the device at
  once. JAX dispatch is asynchronous, so batch i+1 is queued on the device
  before anyone waits for batch i. With one stream (an accelerator) this is
  not a thread: the prepare thread launches the batch it prepared when a
  device slot is free, and the respond thread launches the best prepared
  batch when it frees one (a thread hand-off costs more host time than a
  launch). On a CPU, batches launched from one thread run one after another,
  but two threads that each launch and wait overlap (XLA's CPU fusions leave
  cores idle): there `streams` device threads each run their batch to the end;
- respond: waits for each launched batch in order, copies its output to the
  host, scatters it into its jobs, and hands finished jobs to the event loop
  (`call_soon_threadsafe`). A SPLADE model's batches are launched with their
  spill, and the full rows of sequences over the cap are copied back with
  them (`Engine.fetch_kept`) into their jobs: one pass, nothing run again.

The batcher and the jobs are shared with the event loop (submit, cancel)
under one lock, held only for bookkeeping. `run_jobs` runs the same steps in
the caller's thread for the Python API. See `jaxserve.scheduling.jobs` for the glossary.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import dataclasses
import functools
import itertools
import logging
import math
import operator
import queue
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

from jaxserve.runtime.buckets import BucketTable
from jaxserve.scheduling.batcher import BULK, CLASSES, Batcher, Classes, Dispatch, Interactive, plans, queue_tokens
from jaxserve.scheduling.explain import LiveTimings, explain
from jaxserve.scheduling.host_cost import HostCost
from jaxserve.scheduling.jobs import Job, assemble, keep, most_per_row, scatter, spanned
from jaxserve.scheduling.prepared import PreparedQueue, room
from jaxserve.scheduling.timeouts import Timeouts

if TYPE_CHECKING:  # the engine imports JAX; a front-end process reads this module's names without it
    from jaxserve.runtime.engine import Engine

log = logging.getLogger("jaxserve.scheduling.pipeline")

MAX_INFLIGHT = 2  # batches on the device at once: one running, the next already queued behind it
BULK_DISPATCH_MS = 100.0  # while queries are likely, bulk batches this long at most: a query waits for about one


def server_classes(bulk_dispatch_s: float = BULK_DISPATCH_MS / 1000) -> Classes:
    """The server's classes: a quarter of the queue kept for interactive requests, short bulk batches while
    they are likely: for 10 s after one arrived (users pause for seconds; a query that found a full-size bulk
    batch ahead would otherwise make the next one find another)."""
    return Classes(bulk_share=0.75, bulk_dispatch_s=bulk_dispatch_s, likely_s=10.0)


SERVER_CLASSES = server_classes()
MAX_CONSECUTIVE_FAILURES = 3  # device steps failing in a row before the service calls itself unhealthy


class Draining(Exception):
    """The service is shutting down (or broken) and takes no new work."""


class BatchError(Exception):
    """The batch holding some of this request's rows failed (assembling it, on the device, or scattering it)."""


@dataclasses.dataclass
class RequestTiming:
    """Where one request's time went (seconds, monotonic clock)."""

    submitted: float
    first_dispatch: float | None = None
    done: float | None = None
    batches: list = dataclasses.field(default_factory=list)  # (bucket shape, rows of this request, reason, device s)
    cls: int = BULK  # its request class (batcher.CLASSES)
    deadline_s: float | None = None  # its latency budget, if it gave one
    behind: dict | None = None  # tokens waiting per class when it was queued (what it waited behind)
    requests: int = 1  # the requests it answers: a job of joined queries (`jobs.joined`) is several

    def __reduce__(self):
        """Pickled as its fields' values, in order: the engine sends one with every reply, and a dataclass's own
        pickling (its class rebuilt, then its __dict__ set) takes twice as long each way."""
        return RequestTiming, _timing_fields(self)

    @property
    def queue_s(self) -> float:
        return (self.first_dispatch or self.submitted) - self.submitted

    @property
    def total_s(self) -> float:
        return (self.done or self.submitted) - self.submitted

    def deadline_outcome(self, how: str) -> str | None:
        """Whether a request that ended `how` (answered, failed, withdrawn) met its deadline: met if answered within
        it; missed if answered later, failed, or withdrawn (its client gone, its timeout) at or after it; None
        without a deadline, or withdrawn before it (its client left while the server still had time)."""
        if self.deadline_s is None or (how == "withdrawn" and self.total_s < self.deadline_s):
            return None
        return "met" if how == "answered" and self.total_s <= self.deadline_s else "missed"


_timing_fields = operator.attrgetter(*(f.name for f in dataclasses.fields(RequestTiming)))  # -> __init__'s args


class Metrics:
    """What the service reports, O(1) per dispatch; the server's Prometheus metrics implement it."""

    def dispatched(self, d: Dispatch, real_tokens: int, oldest_wait_s: float) -> None: ...

    def phase(self, name: str, seconds: float) -> None: ...

    def device_busy(self, seconds: float) -> None:
        """The device was busy this much longer (`jaxserve_device_busy_seconds_total`)."""

    def sequences(self, outcome: str, n: int) -> None:
        """Every sequence submitted is, in the end, dispatched (with its job still waiting for it) or dropped
        (its client left while it waited): submitted = dispatched + dropped + waiting."""

    def watch_queue(self, queued: Callable[[], int]) -> None:
        """Where the tokens waiting are read, whenever the metrics are shown (not written per job)."""

    def class_sequences(self, cls: int, n: int) -> None:
        """`n` sequences of class `cls` dispatched: a class's goodput (bulk docs/s) is the rate of these."""

    def dispatch_time(self, cls: int, seconds: float) -> None:
        """One batch's device time, by the class that led it (`Dispatch.lead`): what a query may wait behind."""

    def finished(self, timing: RequestTiming, how: str = "answered") -> None:
        """A request ended `how` (answered, failed or withdrawn: `Pipeline._end`): if answered, its class's queue
        wait and latency; whichever way, its deadline's outcome (`RequestTiming.deadline_outcome`)."""


@dataclasses.dataclass
class _Entry:
    job: Job
    future: asyncio.Future
    timing: RequestTiming


class Pipeline:
    """The device pipeline a server runs every model request through (embeddings, classifier logits, SPLADE
    weights, token outputs alike): the batchers, then prepare, device and respond threads (module docstring)."""

    def __init__(self, engine: Engine, table: BucketTable, max_wait_s: float, max_queued: int | None,
                 metrics: Metrics | None = None, max_inflight: int = MAX_INFLIGHT,
                 max_failures: int = MAX_CONSECUTIVE_FAILURES, streams: int = 1, classes: Classes = SERVER_CLASSES,
                 host_dispatch_s: float | None = None):
        self.engine = engine
        # One batcher per output: pooled vectors, and token vectors (/embed_all) where the engine has them;
        # each queue holds `max_queued` tokens (None: `queue_tokens` of its table, a few seconds of device work).
        # They share one device, so a query on either cuts both outputs' bulk batches (`Interactive`).
        tables = {"pooled": table, **({"tokens": engine.tables["tokens"]} if "tokens" in engine.tables else {})}
        interactive = Interactive()
        self.batchers = {lane: Batcher(t, max_wait_s, queue_tokens(t) if max_queued is None else max_queued, classes,
                                       interactive) for lane, t in tables.items()}
        # per output, device time per bucket, refreshed from every device step (a token-output bucket of the same
        # shape as a pooled one runs a different executable)
        self.timings = {lane: LiveTimings(t) for lane, t in tables.items()}
        self.tables = tables
        self.spills = {lane: _spills(engine, lane) for lane in tables}
        self.metrics = metrics or Metrics()
        self.metrics.watch_queue(lambda: self.queued)
        self.max_inflight = max_inflight
        self.streams = streams  # 1: launches as batches and slots come (`_launch_ready`); >1: device threads (CPU)
        self.max_failures = max_failures
        self._lock = threading.Condition()  # the batchers, jobs and counts; the prepared queue has its own
        self._ready_lock = threading.Condition()
        self._entries: dict[int, _Entry] = {}  # jobs submitted and not yet answered (guarded by _lock)
        self._ids = itertools.count()
        self._pipeline = 0  # batches being prepared, prepared, or on the device (guarded by _lock)
        # prepared batches (bounded by _pipeline): a device slot that frees takes the best one (prepared.PreparedQueue)
        self._ready = PreparedQueue(classes.max_bulk_wait_s)
        # launched batches for the respond thread, bounded by _on_device; SimpleQueue is C: a hand-off between two
        # threads costs less than half of queue.Queue's (whose Conditions are Python)
        self._launched: queue.SimpleQueue = queue.SimpleQueue()
        self._on_device = threading.Semaphore(max_inflight)
        self._threads: list[threading.Thread] = []
        self._stopping = False
        self._kick_pending = False  # a `_kick` is scheduled on the loop
        self._draining = False
        self.failures = 0  # device steps failed in a row
        self.broken: str | None = None  # why a pipeline thread died
        self.device_batches = 0
        self._busy_seen = 0.0  # the engine's own busy clock at the last batch (`_busy`)
        # the host's time per dispatch the batchers' covers assume: measured as batches run (`host_cost`), or given
        self.host_cost = HostCost(table.host_dispatch_s or 0.0, host_dispatch_s)
        if host_dispatch_s is not None:
            self._replan(host_dispatch_s)

    # ---- lifecycle ----

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._timeouts = Timeouts(self._loop)
        self._idle = asyncio.Event()
        self._idle.set()
        devices = [self._device_loop] * self.streams if self.streams > 1 else []  # one stream: `_launch_ready`
        stages = [self._prepare_loop, *devices, self._respond_loop]
        self._threads = [threading.Thread(target=self._guard, args=(f,), name=f"jaxserve-{f.__name__[1:]}", daemon=True)
                         for f in stages]
        for t in self._threads:
            t.start()

    async def drain(self, timeout: float) -> bool:
        """Say so on /health; wait for every accepted job (batches in flight included). True if all finished.

        Jobs still arrive while draining: the HTTP layer refuses new requests, but one it accepted before may be
        tokenizing still, and is owed its answer."""
        self._draining = True
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
            return True
        except TimeoutError:
            return False

    async def stop(self) -> None:
        """Stop the threads (each passes the stop on to the next stage) without blocking the event loop;
        fail what is still waiting."""
        with self._lock:
            self._stopping = True
            self._lock.notify_all()
        loop = asyncio.get_running_loop()
        for t in self._threads:
            await loop.run_in_executor(None, t.join, 5.0)
        for jid in list(self._entries):
            self._answer(jid, Draining("the server stopped before this request finished"))

    @property
    def draining(self) -> bool:
        return self._draining

    @property
    def healthy(self) -> str | None:
        """None when serving; else why not (a dead pipeline thread, or a device failing every step)."""
        if self.broken:
            return self.broken
        if self._threads and not all(t.is_alive() for t in self._threads):
            return "a device pipeline thread stopped"
        if self.failures >= self.max_failures:
            return f"the last {self.failures} device steps failed"
        return None

    @property
    def batcher(self) -> Batcher:
        """The batcher of pooled outputs (every route but /embed_all)."""
        return self.batchers["pooled"]

    @property
    def queued(self) -> int:
        """Tokens waiting (rows at their seqlens), all outputs."""
        return sum(b.queued for b in self.batchers.values())

    @property
    def in_flight(self) -> int:
        return len(self._entries)

    @property
    def batches_in_flight(self) -> int:
        """Batches on the device or prepared for it."""
        return self._pipeline

    def explain(self, rows, doc, output: str, max_wait_s: float, cls: int = BULK,
                timeout_s: float | None = None) -> dict:
        """The latency math of one request's rows (`scheduling.explain`) as a request of class `cls`, given what
        waits ahead of it now (of the classes it waits behind) and runs: its batches as the batchers would form them
        (a bulk request's capped while interactive work is likely), at the host time per dispatch they plan with.
        TooLarge for rows more than the whole queue holds, as `run` would refuse them. (`timeout_s`: the engine
        link's bound; here nothing waits on another process.)"""
        batcher = self.batchers[output]
        batcher.within(int(rows.seqlen.sum()))
        with self._lock:
            backlog = batcher.backlog(cls)
            likely = batcher.interactive_likely(time.monotonic())
        table = dataclasses.replace(self.tables[output], host_dispatch_s=self.host_cost.planned)
        return explain(rows, table, self.timings[output], doc, backlog, self.batches_in_flight, max_wait_s, cls,
                       batcher.classes, likely)

    def status(self) -> dict:
        """What a front-end process shows of this pipeline (`scheduling/link.py`)."""
        with self._lock:
            waiting = self.batcher.waiting()
        return {"draining": self.draining, "healthy": self.healthy, "queued": self.queued,
                "batches_in_flight": self.batches_in_flight, "max_queued": self.batcher.max_queued,
                "waiting": waiting, "host_dispatch": self.host_dispatch}

    @property
    def host_dispatch(self) -> dict:
        """The host's time per dispatch the batcher plans with, and where it comes from (/info)."""
        h = self.host_cost
        return {"planned_s": h.planned, "source": "measured" if h.measured else "given", "measured_s": h.estimate,
                "batches_measured": h.batches, "warmup_s": h.floor}

    # ---- requests (event loop) ----

    async def run(self, job: Job, cls: int = BULK, deadline_s: float | None = None,
                  timeout_s: float | None = None, join: bool = True) -> RequestTiming:
        """Run one request's job (its outputs then in `job.out`) -> its timing. Raises QueueFull, TooLarge, Draining,
        BatchError, and TimeoutError after `timeout_s`.

        `cls`: its request class; `deadline_s`: its latency budget (earliest deadline first within a class);
        `join`: as `EngineLink.run`'s (one process has no link whose per-job cost joining saves: no effect).

        If the caller is cancelled (client gone) or it times out, the job's waiting rows are dropped."""
        jid, future, timing = self.submit(job, cls, deadline_s)
        self._timeouts.add(future, timeout_s)
        try:
            await future
        finally:
            self._timeouts.discard(future)
            if jid in self._entries:  # not answered: the caller went away, or it timed out
                self.cancel(jid)
        return timing

    def submit(self, job: Job, cls: int = BULK, deadline_s: float | None = None,
               requests: int = 1) -> tuple[int, asyncio.Future, RequestTiming]:
        """`run` without a coroutine of its own, for a caller with many jobs in flight (the engine process's link):
        queue the job's rows -> (its id for `cancel`, a future resolved once `job.out` holds its outputs, or failed
        with BatchError or Draining, and its timing). Raises QueueFull, TooLarge and Draining at once. `requests`:
        how many requests the job answers (joined queries), as the metrics count them."""
        now = time.monotonic()
        timing = RequestTiming(submitted=now, cls=cls, deadline_s=deadline_s, requests=requests)
        if self._stopping or self.broken:  # broken: a thread died, and nothing would ever take its rows
            raise Draining(self.broken or "the server stopped and takes no new requests")
        future = self._loop.create_future()
        if job.remaining == 0:
            timing.done = now
            future.set_result(None)
            return -1, future, timing
        if job.output not in self.batchers:
            raise ValueError(f"this server computes no {job.output} outputs")
        with self._lock:
            jid = next(self._ids)
            batcher = self.batchers[job.output]
            timing.behind = {c: n for c, n in batcher.waiting().items() if c == CLASSES[0] or cls == BULK}
            batcher.submit(jid, job.rows.seqlen, job.rows.docs, now, cls,
                           math.inf if deadline_s is None else now + deadline_s)
            self._entries[jid] = _Entry(job, future, timing)
            if self.streams == 1 and not self._pipeline:  # the device idles: dispatch at the end of this turn
                if not self._kick_pending:
                    self._kick_pending = True
                    self._loop.call_soon(self._kick)
            else:
                self._lock.notify()
        self.metrics.sequences("submitted", job.remaining)
        self._idle.clear()
        return jid, future, timing

    def _kick(self) -> None:
        """On the loop, once a turn's jobs are submitted to an idle pipeline (one stream, nothing prepared or on
        the device): the dispatch they make, prepared and launched here rather than by the prepare thread. At light
        load every job is a batch of its own, and each thread it crosses wakes on a cold core: one crossing less
        is a measurable share of the engine's CPU per job (docs/benchmarks.md). Waiting for the turn's end keeps
        the jobs that arrived together in one batch."""
        with self._lock:
            self._kick_pending = False
            taken = None if self._pipeline or self._stopping else self._take(time.monotonic())
            if taken is None:
                self._lock.notify()  # the prepare thread decides (a batch went ahead meanwhile, or a window)
                return
        self._prepare(*taken)
        with self._lock:
            if any(b.queued for b in self.batchers.values()):  # the rows this batch left: prepared behind it,
                self._lock.notify()  # once it is on the device (first in line, as the batcher formed it)

    def cancel(self, jid: int) -> None:
        """Drop a job: its waiting rows never reach the device; rows already prepared or launched still run (as real
        rows of their batch), and their outputs are discarded when the batch returns."""
        with self._lock:
            dropped = self._drop_waiting((jid,))
            entry = self._entries.pop(jid, None)
        self.metrics.sequences("dropped", dropped)
        if entry is not None:
            self._end(entry, "withdrawn")
        self._check_idle()

    def _drop_waiting(self, jids) -> int:
        """Under the lock: the waiting rows of jobs `jids` out of every batcher; the sequences that drops."""
        return sum(b.cancel(jid) for jid in jids for b in self.batchers.values())

    def _answer(self, jid: int, exc: Exception | None = None) -> None:
        """On the loop: resolve a finished (or failed) job's future."""
        with self._lock:
            entry = self._entries.pop(jid, None)
        if entry is not None:
            if entry.future.done():  # its caller went away, or its timeout failed it, before this
                self._end(entry, "withdrawn")
            elif exc is None:
                self._end(entry, "answered")
                entry.future.set_result(None)
            else:
                self._end(entry, "failed")
                entry.future.set_exception(exc)
        self._check_idle()

    def _end(self, entry: _Entry, how: str) -> None:
        """The one end of every job taken out of `_entries` (by `_answer` or `cancel`): answered, failed (its
        batch, a dead thread, the server stopping) or withdrawn (its caller gone or timed out), counted in the
        metrics, so a deadline missed by a request that got no answer is counted too."""
        entry.timing.done = time.monotonic()
        self.metrics.finished(entry.timing, how)

    def _answer_all(self, jids: list[int]) -> None:
        for jid in jids:
            self._answer(jid)

    def _check_idle(self) -> None:
        if not self._entries:
            self._idle.set()

    # ---- the threads ----

    def _guard(self, loop_fn) -> None:
        """A pipeline thread that dies makes the service unhealthy and fails what is waiting."""
        try:
            loop_fn()
        except BaseException as exc:
            self.broken = f"the {loop_fn.__name__[1:]} thread died: {type(exc).__name__}: {exc}"
            log.exception(self.broken)
            with self._lock:
                jids = list(self._entries)
                self._drop_waiting(jids)  # their rows too: none will be taken, and the queue counts them till dropped
            for jid in jids:
                self._loop.call_soon_threadsafe(self._answer, jid, Draining(self.broken))
            self._pass_stop_on(loop_fn)

    def _pass_stop_on(self, loop_fn) -> None:
        """A dead stage still ends its stream, so the stages after it stop too and `stop` need not wait them out."""
        if loop_fn == self._prepare_loop:
            self._end_ready()
        elif loop_fn == self._device_loop:
            self._launched.put(None)
        else:  # the respond thread: device threads may wait for a slot it would have freed
            for _ in range(self.streams):
                self._on_device.release()

    def _dispatch(self, now: float, interactive_only: bool = False) -> tuple[str, Dispatch] | None:
        """The next dispatch of any output, the batcher with the oldest waiting row asked first (`interactive_only`:
        of the batchers with interactive rows waiting, which lead with them)."""
        waiting = sorted((t, lane) for lane, b in self.batchers.items()
                         if (t := b.oldest()) is not None and (b.has_interactive() or not interactive_only))
        for _, lane in waiting:
            d = self.batchers[lane].next_dispatch(now, device_idle=self._pipeline < self.max_inflight,
                                                  interactive_only=interactive_only)
            if d is not None:
                return lane, d
        return None

    def _next(self) -> tuple[str, Dispatch, dict[int, Job], float] | None:
        """Block until a batcher gives a dispatch the pipeline has room for (None: stopping); with it, the CPU
        time that forming it took."""
        with self._lock:
            while not self._stopping:
                now = time.monotonic()
                if (space := room(self._pipeline, self.max_inflight)) is not None:
                    if (taken := self._take(now, interactive_only=space == "interactive")) is not None:
                        return taken
                    deadlines = [t for b in self.batchers.values() if (t := b.next_wakeup()) is not None]
                    # without room only an arrival (submit) or a finished batch (respond) changes anything
                    timeout = max(0.0, min(deadlines) - now) if deadlines and space == "any" else None
                else:
                    timeout = None
                self._lock.wait(timeout)
        return None

    def _take(self, now: float, interactive_only: bool = False) -> tuple[str, Dispatch, dict[int, Job], float] | None:
        """Under the lock: the next dispatch (`_dispatch`), taken from its batcher and counted in the pipeline ->
        (its lane, it, its jobs by id, the CPU time forming it took), or None when none is due."""
        cpu = time.thread_time()
        picked = self._dispatch(now, interactive_only=interactive_only)
        if picked is None:
            return None
        lane, d = picked
        self._pipeline += 1
        jobs, sequences = {}, [0] * len(CLASSES)
        for jid, rows in d.parts:
            if (entry := self._entries.get(jid)) is not None:
                jobs[jid] = entry.job
                sequences[entry.timing.cls] += spanned(entry.job.rows.starts, rows)
                if entry.timing.first_dispatch is None:
                    entry.timing.first_dispatch = now
        self.metrics.sequences("dispatched", sum(sequences))
        for cls, n in enumerate(sequences):
            if n:
                self.metrics.class_sequences(cls, n)
        return lane, d, jobs, time.thread_time() - cpu

    def _prepare_loop(self) -> None:
        while (nxt := self._next()) is not None:
            self._prepare(*nxt)
        self._end_ready()

    def _prepare(self, lane: str, d: Dispatch, jobs: dict[int, Job], formed: float) -> None:
        """Assemble a taken dispatch, copy it to the device and queue it for a device slot (one stream: launch it
        when a slot is free)."""
        cpu = time.thread_time()
        start = time.perf_counter()
        stage = "assembled"
        try:
            inputs, real_tokens = assemble(d.bucket, d.parts, jobs)
            assembled, stage = time.perf_counter(), "copied"
            prepared = self.engine.put(d.bucket, inputs, lane, most_per_row(d.parts, jobs))
        except Exception as exc:
            self._fail(d, jobs, exc, stage)
            return
        copied = time.perf_counter()
        self.metrics.phase("assemble", assembled - start)
        self.metrics.phase("copy", copied - assembled)
        self.metrics.dispatched(d, real_tokens, time.monotonic() - d.oldest)
        host = formed + time.thread_time() - cpu  # this thread's part of the batch's host time
        with self._ready_lock:
            self._ready.put(d, (lane, jobs, prepared, host))
            self._ready_lock.notify()
        if self.streams == 1:
            self._launch_ready()

    def _end_ready(self) -> None:
        """One stop per device thread, after every prepared batch (those still run)."""
        with self._ready_lock:
            for _ in range(self.streams):
                self._ready.put(None, None)
            self._ready_lock.notify_all()
        if self.streams == 1:
            self._launch_ready()

    def _launch_ready(self) -> None:
        """One stream: while a device slot is free and a batch is prepared, launch the best one (or pass the stop
        on, after every batch). Called by the thread that made it possible: prepare (a batch ready) or respond (a
        slot free). Under the ready lock, so launches reach `_launched` in the order they reach the device."""
        with self._ready_lock:
            while len(self._ready) and self._on_device.acquire(blocking=False):
                d, item = self._ready.take(time.monotonic())
                if d is None:
                    self._on_device.release()
                    self._launched.put(None)
                    return
                self._launched.put(self._launch_one(d, item))

    def _take_ready(self):
        """The best prepared batch once one waits: (dispatch, (lane, jobs, prepared, host s)), or (None, None) to stop."""
        with self._ready_lock:
            while not len(self._ready):
                self._ready_lock.wait()
            return self._ready.take(time.monotonic())

    def _device_loop(self) -> None:
        while True:
            self._on_device.acquire()  # a slot first, then the best prepared batch at that moment
            d, item = self._take_ready()
            if d is None:
                self._on_device.release()
                break
            self._launched.put(self._launch_one(d, item))
        self._launched.put(None)

    def _launch_one(self, d: Dispatch, item) -> tuple:
        """Launch a prepared batch (a device thread of several streams also waits for it and fetches it) -> what
        the respond thread takes."""
        lane, jobs, prepared, host = item
        launched = time.perf_counter()
        try:
            result, error = _launch(self.engine, prepared, self.spills[lane]), None
            if self.streams > 1:
                result = _fetch(self.engine, result, self.spills[lane])
        except Exception as exc:
            result, error = None, exc
        return d, lane, jobs, result, error, launched, host

    def _respond_loop(self) -> None:
        previous_done = 0.0
        running = self.streams  # device threads not yet stopped: each ends its stream with None
        while running:
            if (item := self._launched.get()) is None:
                running -= 1
                continue
            d, lane, jobs, result, error, launched, host = item
            try:
                if error is not None:
                    raise error
                # waits for the device, then copies to the host (device threads that ran their batch fetched it)
                out, kept = _fetch(self.engine, result, self.spills[lane]) if self.streams == 1 else result
            except Exception as exc:
                self._free_slot()
                self._fail(d, jobs, exc, "launched" if error is not None else "fetched")
                continue
            cpu = time.thread_time()  # the wait for the device is not the host's time
            self._free_slot()
            done = time.perf_counter()
            # one stream: batches run one after another, each from its launch or the previous one's end; several
            # (a CPU's): a batch launched before the previous one ended ran beside it, and this is only its share
            # of the device's time, not its own run time (what predicts the bucket's next runs)
            alone = self.streams == 1 or launched >= previous_done
            device_s = done - max(launched, previous_done)
            previous_done = done
            with self._lock:
                self._pipeline -= 1
                if self.queued:  # room (or an idle device) matters to the prepare thread only while rows wait
                    self._lock.notify()
            self.failures = 0
            self.device_batches += 1
            if alone:
                self.timings[lane].observe(d.bucket, device_s)
            self.metrics.phase("device", device_s)
            self.metrics.device_busy(self._busy(device_s))
            self.metrics.dispatch_time(d.lead, device_s)
            try:
                keep(d.parts, kept, jobs)
                finished = scatter(d.parts, out, jobs)
            except Exception as exc:
                self._fail(d, jobs, exc, "scattered")
                continue
            self.metrics.phase("scatter", time.perf_counter() - done)
            for jid, rows in d.parts:
                if (entry := self._entries.get(jid)) is not None:
                    entry.timing.batches.append((d.bucket.shape, len(rows), d.reason, device_s))
            planned = self.host_cost.observe(host + time.thread_time() - cpu)  # counted before its jobs are answered
            if finished:  # one wake-up of the loop for the batch, however many requests it finishes
                self._loop.call_soon_threadsafe(self._answer_all, finished)
            if planned is not None:
                self._replan(planned)

    def _replan(self, host_s: float) -> None:
        """The batchers' covers for a host time per dispatch of `host_s` (derived outside the lock: milliseconds)."""
        log.info("batch sizes planned for a host time of %.0f us per dispatch (%s)", host_s * 1e6,
                 "measured" if self.host_cost.measured else "given")
        planned = {lane: plans(dataclasses.replace(t, host_dispatch_s=host_s)) for lane, t in self.tables.items()}
        with self._lock:
            for lane, plan in planned.items():
                self.batchers[lane].plan = plan

    def _free_slot(self) -> None:
        """A batch left the device: its slot to the device threads, or (one stream) to the best prepared batch."""
        self._on_device.release()
        if self.streams == 1:
            self._launch_ready()

    def _busy(self, device_s: float) -> float:
        """The device's busy time since the last batch: its own clock where it keeps one (a simulated device),
        else this batch's time from its launch or the previous batch's end (the host's view: an upper bound)."""
        clock = getattr(self.engine, "busy_s", None)
        if clock is None:
            return device_s
        busy, self._busy_seen = clock - self._busy_seen, clock
        return busy

    def _fail(self, d: Dispatch, jobs: dict[int, Job], exc: Exception, stage: str) -> None:
        """Fail exactly the requests with rows in this batch, which failed being `stage` (assembled, copied,
        launched, fetched or scattered); everyone else carries on. Only device steps count towards unhealthy
        (MAX_CONSECUTIVE_FAILURES); a host step failing is a bug, logged with its traceback."""
        device = stage in ("copied", "launched", "fetched")
        log.error("a batch at %s failed being %s: %s: %s", d.bucket.shape, stage, type(exc).__name__, exc,
                  exc_info=not device)
        self.failures += device
        with self._lock:
            self._pipeline -= stage != "scattered"  # a scattered batch has left the pipeline already
            self._drop_waiting(jobs)
            self._lock.notify()
        error = BatchError(f"the batch at {d.bucket.shape} failed being {stage}: {type(exc).__name__}: {exc}")
        for jid in jobs:
            self._loop.call_soon_threadsafe(self._answer, jid, error)


def _spills(engine: Engine, output: str) -> bool:
    """Whether `output`'s batches are launched with their spill (`Engine.spills`; engines without one, such as
    the tests' and benchmarks' stand-ins, never are)."""
    return hasattr(engine, "spills") and engine.spills(output)


def _launch(engine: Engine, prepared, spill: bool):
    return engine.launch(prepared, spill=True) if spill else engine.launch(prepared)


def _fetch(engine: Engine, launched, spill: bool) -> tuple[np.ndarray, dict | None]:
    """A launched batch -> (its out, what was kept of its spill: `Engine.fetch_kept`; None without one)."""
    return engine.fetch_kept(launched) if spill else (engine.fetch(launched), None)


def run_jobs(engine: Engine, table: BucketTable, jobs: list[Job], max_inflight: int = MAX_INFLIGHT,
             streams: int = 1) -> list[Dispatch]:
    """Run jobs (of one output, on its `table`) to completion, through a batcher of their own; returns the
    dispatches that ran.

    The same steps as the server's pipeline: batch i+1 is assembled and
    launched before batch i is waited on; with `streams` > 1 (a CPU) that many
    threads each run a batch to the end, as the server's device threads do."""
    output = jobs[0].output if jobs else "pooled"
    batcher = Batcher(table, math.inf, max(1, sum(int(j.rows.seqlen.sum()) for j in jobs)))
    by_id = dict(enumerate(jobs))
    for jid, job in by_id.items():
        batcher.submit(jid, job.rows.seqlen, job.rows.docs, 0.0)
    inflight: collections.deque = collections.deque()
    ran = []
    pool = _stream_pool(streams)
    spill = _spills(engine, output)
    run = lambda prepared: _fetch(engine, _launch(engine, prepared, spill), spill)
    # with threads of their own, one batch more than they run waits ready, so none idles while this one scatters
    most = streams + 1 if pool else max_inflight
    while True:
        d = batcher.next_dispatch(0.0, device_idle=True) if len(inflight) < most else None
        if d is not None:
            inputs, _ = assemble(d.bucket, d.parts, by_id)
            prepared = engine.put(d.bucket, inputs, output, most_per_row(d.parts, by_id))
            inflight.append((d, pool.submit(run, prepared) if pool else _launch(engine, prepared, spill)))
            ran.append(d)
        elif inflight:
            done, result = inflight.popleft()
            out, kept = result.result() if pool else _fetch(engine, result, spill)
            keep(done.parts, kept, by_id)
            scatter(done.parts, out, by_id)
        else:
            return ran


@functools.cache
def _stream_pool(streams: int) -> concurrent.futures.ThreadPoolExecutor | None:
    """Threads that each run a batch to the end (made once per count; None for one stream)."""
    return concurrent.futures.ThreadPoolExecutor(streams, thread_name_prefix="jaxserve-stream") if streams > 1 else None
