"""The device pipeline across a process boundary: front-end processes send jobs, one engine process runs them.

With `jaxserve serve --workers N`, N front-end processes do HTTP, validation,
tokenizing, packing and response encoding; the engine process owns the device,
the batchers (cross-request batching over every front-end's rows) and the
pipeline threads. Each front-end holds one Unix socket to the engine:

    front-end                                   engine
    EngineLink.run(job) --- run {job} --------> LinkServer: Pipeline.submit(job)
                        <-- done {places, vectors, timing} --
                        --- cancel ------------> (client gone, timeout)
                        <-- status, card -------- (pushed: health, queue, the model and its tables)
                        --- loaded ------------> (the card is unpickled and in use: see `LinkServer.ready`)
                        --- explain, metrics --> (asked: the latency math of rows, the metrics of all)
                        <-- answer ------------
                        <-- report ------------ (another front-end's /metrics asked: this one's metrics)
                        --- report {snapshot} -> (and before it stops)

A message (`scheduling/wire.py`: a pickled header, numpy arrays out of band)
carries a job's token ids in and its outputs out as each batch gathered them
(`Job.put`: the vectors of a part, compact, and where they go), placed into
the front-end's own output array where they are first read. The engine, the
one serial process, thus copies each vector once and holds no request's
output array. Queries (one-sequence jobs) that
reach a front-end in one turn of its event loop go to the engine joined as one job (`EngineLink.run`), so
the engine's work per job is paid once for all of them. Only
jaxserve's own processes speak on the socket: it lives in a directory only this
user may open (`http/workers.py` makes it 0700).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import math
import os
import pickle
import socket
import time

import numpy as np

from jaxserve.scheduling.batcher import BULK, QueueFull
from jaxserve.scheduling.jobs import Job, joined, place
from jaxserve.scheduling.pipeline import BatchError, Draining, Pipeline
from jaxserve.scheduling.timeouts import Timeouts
from jaxserve.scheduling.wire import Wire

log = logging.getLogger("jaxserve.scheduling.link")

STATUS_EVERY_S = 0.25  # the engine's queue and health, pushed to each front-end this often (and on change)
STATUS_BEAT_S = 2.0  # ... and at least this often unchanged: a front-end hearing nothing for SILENT_S says why
SILENT_S = 10.0  # an engine silent this long is unhealthy (/health 503: stopped, or its event loop blocked)
REPORT_TIMEOUT_S = 2.0  # /metrics: a front-end that has not reported its metrics by then is shown as last reported
# an engine says it is ready once every front-end connected has loaded its card, or after this long without
LOADED_TIMEOUT_S = 30.0
PUSH_WAIT_S = 5.0  # the longest `LinkServer.push` waits on a front-end that does not read (the card is megabytes)
JOIN_MOST = 64  # one-sequence jobs of one turn of the event loop sent to the engine as one job, at most
# ... and at most this share of the engine's queue (its tokens at their rows' seqlens): the engine admits a job
# whole or not at all, so a joined job must not be refused as too large (413) where its queries alone would be
# taken (one refused for room, 429, goes again query by query: `_apart`)
JOIN_QUEUE_SHARE = 1 / 8




# ---- the engine's side ----

class LinkServer:
    """Serves a Pipeline to every front-end that connects. It listens before the model is loaded, so a front-end
    can say "warming" on /health; `ready` hands each front-end the card (the model view and its tables)."""

    def __init__(self, path: str, status, metrics=dict, add_up=lambda first, *rest: first,
                 beat_s: float = STATUS_BEAT_S):
        self.path = path
        self.beat_s = beat_s  # the status is pushed at least this often, changed or not (`EngineLink.silent_s`)
        self.status = status  # () -> dict: the engine's state (ready, draining, healthy, queue)
        self.metrics = metrics  # () -> plain data: the engine's metrics now (`EngineMetrics.snapshot`)
        self.add_up = add_up  # (*snapshots) -> one: the metrics of several processes as one (`tally.combined`)
        self._reports: dict[Wire, dict] = {}  # each front-end's metrics, as it last reported them
        self._report_waiters: dict[Wire, list[asyncio.Future]] = {}
        self._retired: dict = {}  # the last reports of front-ends gone (their counts stay counted)
        self.pipeline: Pipeline | None = None
        self.card: dict | None = None
        self._announced = False  # front-ends are told the engine is ready (`ready`)
        self._loaded: set[Wire] = set()  # front-ends that have loaded the card
        self._all_loaded: asyncio.Future | None = None
        self._wires: set[Wire] = set()
        self._server: asyncio.Task | None = None
        self._tasks: set[asyncio.Task] = set()

    async def start(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(self.path)
        listener.listen(64)
        listener.setblocking(False)
        self._listener = listener
        self._server = asyncio.create_task(self._accept())
        self._pusher = asyncio.create_task(self._push_status())

    async def stop(self) -> None:
        for task in (self._server, self._pusher, *self._tasks):
            if task is not None:
                task.cancel()
        self._listener.close()
        for wire in list(self._wires):
            wire.close()

    async def without_front_ends(self, timeout_s: float) -> bool:
        """Wait until no front-end is connected (True), or `timeout_s` (False). A SIGTERM to every process at once
        (systemd stopping the unit, Ctrl-C in a terminal) reaches the engine while the front-ends drain: requests
        they accepted may still be tokenizing, and their jobs must find the engine serving."""
        deadline = asyncio.get_running_loop().time() + timeout_s
        while self._wires:
            if asyncio.get_running_loop().time() > deadline:
                return False
            await asyncio.sleep(0.05)
        return True

    async def ready(self, pipeline: Pipeline, card: dict, loaded_timeout_s: float = LOADED_TIMEOUT_S) -> None:
        """Serve `pipeline`; hand every front-end the card, and say "ready" once each one connected has loaded it
        (unpickling the model view takes a front-end a fraction of a second): every front-end's /health then
        turns 200 together, so a load balancer that saw one answer 200 never meets another still saying 503
        "warming". A front-end that has not loaded it within `loaded_timeout_s` is not waited for."""
        self.pipeline, self.card = pipeline, card
        self._announced, self._loaded = False, set()
        self._all_loaded = asyncio.get_running_loop().create_future()
        await self.push({"op": "status", **self._status()})  # not ready yet: the card comes first
        await self.push({"op": "card", **card})
        self._check_loaded()
        try:
            await asyncio.wait_for(asyncio.shield(self._all_loaded), loaded_timeout_s)
        except TimeoutError:
            log.warning("%d front-end(s) had not loaded the engine's card after %.0f s; ready without them",
                        len(self._wires - self._loaded), loaded_timeout_s)
        self._announced = True
        await self.push({"op": "status", **self._status()})

    def _status(self) -> dict:
        """The engine's state as the front-ends are told it: not ready until each has loaded the card (`ready`)."""
        status = self.status()
        if status.get("ready") and not self._announced:
            return {**status, "ready": False, "doing": "front-ends loading the model"}
        return status

    def _check_loaded(self) -> None:
        if self._all_loaded is not None and not self._all_loaded.done() and self._wires <= self._loaded:
            self._all_loaded.set_result(None)

    async def push(self, message: dict) -> None:
        """`message` to every front-end at once. Each has it in its socket's buffer at once; the wait is for them
        to read it, and one that does not (stopped, hung: connected, not reading) holds the others' status and
        card back no longer than PUSH_WAIT_S."""
        async def send(wire: Wire) -> None:
            with contextlib.suppress(ConnectionError, OSError):
                await wire.send(message)

        sends = [asyncio.ensure_future(send(wire)) for wire in list(self._wires)]
        if sends:
            _, stuck = await asyncio.wait(sends, timeout=PUSH_WAIT_S)
            for task in stuck:  # the message stays buffered for it: only the wait for its reading ends
                task.cancel()

    async def _accept(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            sock, _ = await loop.sock_accept(self._listener)
            self._spawn(self._serve(await Wire.open(sock)))

    def _spawn(self, coro) -> asyncio.Task:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def _push_status(self) -> None:
        last, pushed = None, -math.inf
        while True:
            status = self._status()
            if status != last or time.monotonic() - pushed >= self.beat_s:
                last, pushed = status, time.monotonic()  # (before the push, which waits on a front-end not reading)
                await self.push({"op": "status", **status})
            await asyncio.sleep(STATUS_EVERY_S)

    async def _serve(self, wire: Wire) -> None:
        """One front-end: its jobs go to the pipeline; when it goes away, they are cancelled (their rows dropped)."""
        running: dict[int, int] = {}  # the front-end's request id -> the pipeline's job id, while it runs
        self._wires.add(wire)

        def on_message(received: dict) -> None:
            for message in received["messages"] if received["op"] == "many" else (received,):
                self._handle(wire, message, running)

        try:
            await wire.send({"op": "status", **self._status()})
            if self.card is not None:
                await wire.send({"op": "card", **self.card})
            wire.deliver_to(on_message)
            await wire.wait_closed()
        except (ConnectionError, OSError):
            pass
        finally:
            self._wires.discard(wire)
            self._loaded.discard(wire)
            self._check_loaded()  # a front-end gone is not waited for
            for jid in running.values():
                self.pipeline.cancel(jid)
            running.clear()
            wire.close()
            if (last := self._reports.pop(wire, None)) is not None:
                self._retired = self.add_up(self._retired, last)
            self._reported(wire)

    def _handle(self, wire: Wire, message: dict, running: dict) -> None:
        op = message["op"]
        if op == "run":
            self._run(wire, message, running)
        elif op == "cancel" and (jid := running.pop(message["id"], None)) is not None:
            self.pipeline.cancel(jid)
        elif op == "explain":
            self._spawn(self._answer_ask(wire, message["id"], lambda: self._explain(message)))
        elif op == "metrics":
            self._spawn(self._answer_ask(wire, message["id"], lambda: self._all_metrics(wire)))
        elif op == "report":
            self._reports[wire] = message["snapshot"]
            self._reported(wire)
        elif op == "loaded":
            self._loaded.add(wire)
            self._check_loaded()

    def _serving(self) -> Pipeline:
        """The pipeline; Draining while a restarted engine warms up (a front-end may send before it has heard that
        the engine it saw ready went away)."""
        if self.pipeline is None:
            raise Draining("the engine is still warming up")
        return self.pipeline

    def _explain(self, message: dict) -> dict:
        """A front-end's latency math (`Pipeline.explain`)."""
        return self._serving().explain(message["rows"], message["doc"], message["output"], message["max_wait_s"],
                                       message["cls"])

    def _run(self, wire: Wire, message: dict, running: dict) -> None:
        """Submit a job; its reply is posted when its future resolves (a callback: no task per request)."""
        rid, job = message["id"], message["job"]
        try:
            jid, future, timing = self._serving().submit(job, message["cls"], message["deadline_s"],
                                                         message.get("requests", 1))
        except Exception as exc:  # the request's own outcome (queue full, too large, draining)
            wire.post({"op": "error", "id": rid, "error": exc})
            return
        running[rid] = jid
        future.add_done_callback(lambda f: self._answer(wire, rid, job, timing, f, running))

    @staticmethod
    def _answer(wire: Wire, rid: int, job: Job, timing, future: asyncio.Future, running: dict) -> None:
        exc = None if future.cancelled() else future.exception()  # read even when unwanted: asyncio logs it if not
        if running.pop(rid, None) is None:  # cancelled: by its front-end, or the link went away
            return
        if exc is not None:  # its batch failed, or the pipeline stopped
            wire.post({"op": "error", "id": rid, "error": exc})
        else:
            # the outputs as the batches gathered them, (places, vectors) per part, for the front-end to place; raw
            # buffers of known dtypes (int64, float32): a pickled array's dtype is rebuilt from its name
            places, vectors = [], []
            for dst, values in job.gathered:
                places.append(pickle.PickleBuffer(np.ascontiguousarray(dst, np.int64)))
                vectors.append(pickle.PickleBuffer(np.ascontiguousarray(values, np.float32)))
            wire.post({"op": "done", "id": rid, "places": places, "vectors": vectors, "width": job.out_shape[1],
                       "kept": job.kept, "timing": timing}, job.out_size * 4)

    async def _all_metrics(self, asker: Wire) -> dict:
        """The engine's metrics added to every front-end's but `asker`'s (which adds its own): each is asked for its
        report now, and one that does not answer within `REPORT_TIMEOUT_S` counts as it last reported; front-ends
        gone count as they last reported."""
        loop = asyncio.get_running_loop()
        asked = []
        for wire in self._wires - {asker}:
            self._report_waiters.setdefault(wire, []).append(future := loop.create_future())
            wire.post({"op": "report"})
            asked.append(future)
        if asked:
            await asyncio.wait(asked, timeout=REPORT_TIMEOUT_S)
        others = [self._reports[w] for w in self._wires - {asker} if w in self._reports]
        return self.add_up(self.metrics(), self._retired, *others)

    def _reported(self, wire: Wire) -> None:
        for future in self._report_waiters.pop(wire, ()):
            if not future.done():
                future.set_result(None)

    @staticmethod
    async def _answer_ask(wire: Wire, rid: int, answer) -> None:
        """A front-end's question (explain, metrics): `answer()`'s value (awaited, where it is a coroutine), or the
        error it raised (the asker's error, not the link's)."""
        try:
            body = answer()
            reply = {"op": "answer", "id": rid, "body": await body if asyncio.iscoroutine(body) else body}
        except Exception as exc:
            reply = {"op": "error", "id": rid, "error": exc}
        with contextlib.suppress(ConnectionError, OSError):
            await wire.send(reply)


# ---- the front-end's side ----

_FIRST = np.zeros(1, np.int64)  # a joined query's one place in its own output


class _Ticket:
    """One request's job on its way to the engine: its future, the wire and id it went with (None while it waits
    for its turn to end), and the joined job it went in, if any."""

    __slots__ = ("future", "group", "job", "rid", "wire")

    def __init__(self, job: Job, wire: Wire | None, rid: int | None, future: asyncio.Future):
        self.job, self.wire, self.rid, self.future, self.group = job, wire, rid, future, None


class _Joined:
    """Queries sent as one job (`jobs.joined`) of class `cls`: sequence i is `tickets[i]`'s; `left`: those still
    waiting."""

    __slots__ = ("cls", "left", "rid", "tickets", "wire")

    def __init__(self, tickets: list[_Ticket], wire: Wire, rid: int, cls: int):
        self.tickets, self.wire, self.rid, self.cls, self.left = tickets, wire, rid, cls, len(tickets)


class RemoteBatcher:
    """What the HTTP layer reads of the engine's batcher, from its last status."""

    def __init__(self, link: EngineLink):
        self._link = link

    @property
    def max_queued(self) -> int | None:
        return self._link.status.get("max_queued")

    def waiting(self) -> dict:
        return dict(self._link.status.get("waiting", {}))


class EngineLink:
    """The engine process as a front-end's HTTP layer sees it: the Pipeline's interface (`run`, `drain`,
    `healthy`, ...) over the socket. It reconnects when the engine comes back (restarted by the supervisor);
    while it is gone, every waiting request fails with Draining (503) and `healthy` says why."""

    def __init__(self, path: str, on_card=None, on_status=None, retry_s: float = 0.1, report=dict,
                 silent_s: float = SILENT_S):
        self.path = path
        self.silent_s = silent_s  # an engine unheard from this long is unhealthy (it pushes its status every beat)
        self.on_card = on_card  # (card dict) -> None, on the loop, each time the engine hands one over
        self.on_status = on_status  # (status dict) -> None, on the loop, each status the engine pushes
        self.report = report  # () -> this front-end's metrics (`ServerMetrics.snapshot`), when the engine asks
        self.retry_s = retry_s
        self.status: dict = {"ready": False, "doing": "connecting to the engine process"}
        self.card: dict | None = None
        self.batcher = RemoteBatcher(self)
        self.gone: str | None = None  # why the engine is unreachable (None: connected, or not yet tried)
        self._heard = math.inf  # when the engine last sent anything (`healthy`: silent too long is unhealthy)
        self._wire: Wire | None = None
        self._pending: dict[int, asyncio.Future] = {}  # by request id: what the engine will answer
        self._ids = itertools.count()
        self._draining = False
        self._idle: asyncio.Event | None = None  # set while no job runs (what `drain` waits for; not an explain)
        self._running = 0
        self._task: asyncio.Task | None = None
        self._joining: dict[int, list[_Ticket]] = {}  # by class: queries of this turn of the loop, to send joined
        self._join_due = False

    # ---- lifecycle ----

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._timeouts = Timeouts(self._loop)
        self._idle = asyncio.Event()
        self._idle.set()
        self._settled = asyncio.Event()
        self._task = asyncio.create_task(self._connect_loop())

    async def settled(self, timeout: float) -> bool:
        """Wait, at most `timeout`, until the engine has said where it stands: warming (or failed), or ready with
        its card. A front-end starts serving after this, so a new one never answers 503 for an engine that is
        ready; without an engine it serves after `timeout`, saying why on /health. True if it was said."""
        try:
            await asyncio.wait_for(self._settled.wait(), timeout)
            return True
        except TimeoutError:
            return False

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
        if self._wire is not None:
            self._wire.post({"op": "report", "snapshot": self.report()})  # its counts outlive it
            self._wire.flush()
            self._wire.close()
        self._fail_all(Draining("the server stopped before this request finished"))

    async def drain(self, timeout: float) -> bool:
        """Say so on /health (the HTTP layer refuses new requests); wait for this front-end's jobs to finish (the
        engine serves the other front-ends)."""
        self._draining = True
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
            return True
        except TimeoutError:
            return False

    @property
    def draining(self) -> bool:
        return self._draining or bool(self.status.get("draining"))

    @property
    def healthy(self) -> str | None:
        if self._wire is None:
            return self.gone or "the engine process is not connected"
        if not self.status.get("ready"):
            return self.status.get("failed") or "the engine process is warming up"
        silent = time.monotonic() - self._heard
        if silent > self.silent_s:  # stopped, or its loop blocked: its last status no longer says anything
            return f"the engine process has not been heard from for {silent:.0f} s"
        return self.status.get("healthy")

    @property
    def queued(self) -> int:
        return int(self.status.get("queued", 0))

    @property
    def host_dispatch(self) -> dict | None:
        return self.status.get("host_dispatch")

    @property
    def batches_in_flight(self) -> int:
        return int(self.status.get("batches_in_flight", 0))

    # ---- requests ----

    async def run(self, job: Job, cls: int = BULK, deadline_s: float | None = None, timeout_s: float | None = None,
                  join: bool = True):
        """As `Pipeline.run`: the job's timing, its outputs then in `job.out`; cancelling, or its timeout, drops its
        rows. A one-sequence job without a deadline (a query; `join`: allowed) goes to the engine joined with the
        others of its class that arrive in the same turn of the event loop (`jobs.joined`): the engine's work per
        job is then done once for all of them. Its timing is then the joined job's, and its rows are dropped only
        when every request joined with it has gone. Jobs are taken while draining, as `Pipeline.run` takes them: the
        HTTP layer refuses new requests, and one it accepted before (tokenizing still) is owed its answer."""
        if join and deadline_s is None and len(job.lengths) == 1 and job.output == "pooled":
            ticket = self._join(job, cls)
        else:
            ticket = _Ticket(job, *self._expect())
            self._post_run(ticket.wire, ticket.rid, job, cls, deadline_s)
        self._timeouts.add(ticket.future, timeout_s)
        self._running += 1
        self._idle.clear()
        try:
            gathered, kept, timing = await ticket.future
        except (asyncio.CancelledError, TimeoutError):
            self._withdraw(ticket)
            raise
        finally:
            self._timeouts.discard(ticket.future)
            if ticket.group is None:
                self._pending.pop(ticket.rid, None)
            self._running -= 1
            if not self._running:
                self._idle.set()
        job.receive(gathered, kept)  # placed into job.out where it is first read
        return timing

    def _post_run(self, wire: Wire, rid: int, job: Job, cls: int, deadline_s: float | None, requests: int = 1) -> None:
        wire.post({"op": "run", "id": rid, "job": job, "cls": cls, "deadline_s": deadline_s, "requests": requests},
                  job.flat.nbytes)

    def _join(self, job: Job, cls: int) -> _Ticket:
        """Queue a query for the end of this turn of the loop (`_send_joined`)."""
        self._connected()
        ticket = _Ticket(job, None, None, self._loop.create_future())
        self._joining.setdefault(cls, []).append(ticket)
        if not self._join_due:
            self._join_due = True
            self._loop.call_soon(self._send_joined)
        return ticket

    def _send_joined(self) -> None:
        """The queries of this turn, by class: one alone as itself, several as one job (`_groups`)."""
        self._join_due = False
        waiting, self._joining = self._joining, {}
        for cls, tickets in waiting.items():
            tickets = [t for t in tickets if not t.future.done()]  # a request gone before its turn ended
            for group in self._groups(tickets):
                try:
                    if len(group) == 1:
                        self._send_alone(group[0], cls)
                        continue
                    wire, rid, future = self._expect()
                except Draining as exc:
                    for t in group:
                        t.future.set_exception(exc)
                    continue
                together = _Joined(group, wire, rid, cls)
                for t in group:
                    t.group = together
                future.add_done_callback(lambda f, g=together: self._split(g, f))
                self._post_run(wire, rid, joined([t.job for t in group]), cls, None, len(group))
        if self._wire is not None:
            self._wire.flush()  # now, not a turn later

    def _groups(self, tickets: list[_Ticket]):
        """`tickets` in order, as groups of at most `JOIN_MOST` whose tokens (at their rows' seqlens) stay within
        `JOIN_QUEUE_SHARE` of the engine's queue."""
        queued = self.status.get("max_queued")
        most = math.inf if queued is None else max(1.0, queued * JOIN_QUEUE_SHARE)
        group, tokens = [], 0
        for t in tickets:
            n = int(t.job.rows.seqlen[0])
            if group and (len(group) == JOIN_MOST or tokens + n > most):
                yield group
                group, tokens = [], 0
            group.append(t)
            tokens += n
        if group:
            yield group

    def _split(self, together: _Joined, future: asyncio.Future) -> None:
        """The joined job's reply (or error) -> each of its requests, its own vector (sequence i is ticket i's)."""
        self._pending.pop(together.rid, None)
        exc = Draining("the server stopped before this request finished") if future.cancelled() else future.exception()
        if isinstance(exc, (BatchError, QueueFull)):
            self._apart(together)
            return
        if exc is None:
            gathered, kept, timing = future.result()
            out = np.zeros((len(together.tickets), together.tickets[0].job.out_shape[1]), np.float32)
            place(out, gathered)
        for i, t in enumerate(together.tickets):
            if t.future.done():
                continue
            if exc is not None:
                t.future.set_exception(exc)
            else:
                t.future.set_result(([(_FIRST, out[i : i + 1])], {0: kept[i]} if i in kept else {}, timing))

    def _apart(self, together: _Joined) -> None:
        """A batch with rows of a joined job failed, or the engine's queue had no room for it, and the engine fails
        and admits a job whole: each query still waiting goes again as a job of its own, so that only those whose
        own rows fail get the error (one failing batch fails only its own requests; the others' device work is
        done twice, on this path only), and the queue takes the queries it has room for, as one process would."""
        for t in together.tickets:
            if t.future.done():
                continue
            t.group = None
            try:
                self._send_alone(t, together.cls)
            except Draining as exc:
                t.future.set_exception(exc)
        if self._wire is not None:
            self._wire.flush()

    def _send_alone(self, t: _Ticket, cls: int) -> None:
        """A query as a job of its own: its reply resolves its own future."""
        t.wire, t.rid, _ = self._expect(t.future)
        self._post_run(t.wire, t.rid, t.job, cls, None)

    def _withdraw(self, ticket: _Ticket) -> None:
        """A request went away (cancelled, timed out): its job's rows are dropped, a joined job's once all of its
        requests have gone. One not yet sent is left out when its turn ends."""
        wire, rid = ticket.wire, ticket.rid
        if ticket.group is not None:
            ticket.group.left -= 1
            if ticket.group.left:
                return
            wire, rid = ticket.group.wire, ticket.group.rid
        if rid is not None and rid in self._pending and self._wire is wire:
            self._pending.pop(rid, None)
            wire.post({"op": "cancel", "id": rid})

    def explain(self, rows, doc, output: str, max_wait_s: float, cls: int = BULK,
                timeout_s: float | None = None) -> dict:
        """The engine's latency math for these rows (blocking: called from a tokenizer thread); TimeoutError past
        `timeout_s` (a stalled engine held the thread, and the requests queued behind it, for as long as it stalled)."""
        ask = self._ask({"op": "explain", "rows": rows, "doc": doc, "output": output, "max_wait_s": max_wait_s,
                         "cls": cls})
        answer = asyncio.run_coroutine_threadsafe(ask, self._loop)
        try:
            return answer.result(timeout_s)
        except TimeoutError:
            answer.cancel()
            raise TimeoutError(f"the engine did not answer within {timeout_s:g} s") from None

    async def metrics(self) -> dict:
        """The engine's metrics now (`LinkServer.metrics`)."""
        return await self._ask({"op": "metrics"})

    async def _ask(self, message: dict):
        """Send the engine a question (`message`, given an id here) -> its answer, or the error it answered."""
        wire, rid, future = self._expect()
        try:
            await wire.send({**message, "id": rid})
            return await future
        except ConnectionError as exc:  # closed before the reader saw it go: the engine is gone (503), not a 500
            raise Draining(f"the engine process went away ({exc})") from None
        finally:
            self._pending.pop(rid, None)

    def _expect(self, future: asyncio.Future | None = None) -> tuple[Wire, int, asyncio.Future]:
        """The connected wire, a new request id and the future its reply resolves (`future`, else a new one)."""
        wire = self._connected()
        rid = next(self._ids)
        self._pending[rid] = future = self._loop.create_future() if future is None else future
        return wire, rid, future

    def _connected(self) -> Wire:
        """The wire to the engine; Draining (503) while there is none."""
        if self._wire is None:
            raise Draining(f"the engine process is not available ({self.healthy})")
        return self._wire

    # ---- the connection ----

    async def _connect_loop(self) -> None:
        while True:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.setblocking(False)
            try:
                await self._loop.sock_connect(sock, self.path)
            except (FileNotFoundError, ConnectionRefusedError):
                sock.close()
                await asyncio.sleep(self.retry_s)
                continue
            wire = self._wire = await Wire.open(sock)
            self.gone = None
            try:
                await self._read(wire)
            except (ConnectionError, OSError) as exc:
                self.gone = f"the engine process went away ({exc}); waiting for it to come back"
            finally:
                self._wire = None
                wire.close()
                self.status = {**self.status, "ready": False}
                self._fail_all(Draining(self.gone or "the engine process went away"))
            await asyncio.sleep(self.retry_s)

    async def _read(self, wire: Wire) -> None:
        wire.deliver_to(self._take_all)
        await wire.wait_closed()

    def _take_all(self, received: dict) -> None:
        self._heard = time.monotonic()  # any message says the engine is alive (`healthy`)
        for message in received["messages"] if received["op"] == "many" else (received,):
            self._take(message)

    def _take(self, message: dict) -> None:
        op = message.pop("op")
        if op == "status":
            self.status = message
            if self.on_status is not None:
                self.on_status(message)
            if not message.get("ready"):  # a ready engine sends its card next
                self._settled.set()
        elif op == "card":
            self.card = message
            if self.on_card is not None:
                self.on_card(message)
            if self._wire is not None:
                self._wire.post({"op": "loaded"})  # the engine says "ready" once every front-end has
            self._settled.set()
        elif op == "report":
            if self._wire is not None:
                self._wire.post({"op": "report", "snapshot": self.report()})
        elif (future := self._pending.get(message.get("id"))) is not None and not future.done():
            if op == "done":
                width = message["width"]
                gathered = [(np.frombuffer(dst, np.int64), np.frombuffer(values, np.float32).reshape(-1, width))
                          for dst, values in zip(message["places"], message["vectors"])]
                future.set_result((gathered, message["kept"], message["timing"]))
            elif op == "answer":
                future.set_result(message["body"])
            elif op == "error":
                future.set_exception(message["error"])

    def _fail_all(self, exc: Exception) -> None:
        for future in list(self._pending.values()):
            if not future.done():
                future.set_exception(exc)
