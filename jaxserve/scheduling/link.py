"""The device pipeline across a process boundary: front-end processes send jobs, one engine process runs them.

With `jaxserve serve --workers N`, N front-end processes do HTTP, validation,
tokenizing, packing and response encoding; the engine process owns the device,
the batchers (cross-request batching over every front-end's rows) and the
pipeline threads. Each front-end holds one Unix socket to the engine:

    front-end                                   engine
    EngineLink.run(job) --- run {job} --------> LinkServer: Pipeline.run(job)
                        <-- done {out, timing} --
                        --- cancel ------------> (client gone, timeout)
                        <-- status, card -------- (pushed: health, queue, the model and its tables)

A message is a pickled header (protocol 5) whose numpy arrays travel out of
band after it: a job's token ids in, its outputs out, each copied once into the
socket and once out of it, into one buffer the arrays then use. Only
jaxserve's own processes speak on the socket: it lives in a directory only this
user may open (`http/workers.py` makes it 0700).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import pickle
import socket
import struct
import time

from jaxserve.scheduling.batcher import BULK
from jaxserve.scheduling.jobs import Job
from jaxserve.scheduling.pipeline import Draining, Pipeline

PREFIX = struct.Struct("<IIQ")  # header bytes, buffers, their bytes; then each buffer's length (<Q), the header, them
JOIN_BYTES = 64 * 2**10  # a message whose arrays hold less than this goes out as one write (a copy costs less)
STATUS_EVERY_S = 0.25  # the engine's queue and health, pushed to each front-end this often (and on change)


# ---- the wire ----

class Wire:
    """One connected socket: whole messages in and out (sends never interleave)."""

    def __init__(self, sock: socket.socket):
        sock.setblocking(False)
        self.sock = sock
        self._loop = asyncio.get_running_loop()
        self._sending = asyncio.Lock()
        self._outbox: list[dict] = []
        self._flushing: asyncio.Task | None = None

    def post(self, message: dict, nbytes: int = 0) -> None:
        """Send `message` (its arrays holding `nbytes`): a small one with the others posted in this turn of the
        event loop, as one (a batch's replies, a burst of requests: one write and one read for all of them, not
        one each); a large one at once, on its own (joined, large messages would overfill the socket's buffer
        and cost more than they save). A broken connection surfaces to the reader of the other side, not here."""
        loop = asyncio.get_running_loop()
        if nbytes >= JOIN_BYTES:
            loop.create_task(self._quietly(message))
            return
        self._outbox.append(message)
        if self._flushing is None:
            self._flushing = loop.create_task(self._flush())

    async def _flush(self) -> None:
        await asyncio.sleep(0)  # let the rest of this turn post theirs
        messages, self._outbox, self._flushing = self._outbox, [], None
        await self._quietly(messages[0] if len(messages) == 1 else {"op": "many", "messages": messages})

    async def _quietly(self, message: dict) -> None:
        with contextlib.suppress(ConnectionError, OSError):
            await self.send(message)

    async def send(self, message: dict) -> None:
        buffers: list[pickle.PickleBuffer] = []
        head = pickle.dumps(message, protocol=5, buffer_callback=buffers.append)
        views = [b.raw() for b in buffers]
        size = sum(v.nbytes for v in views)
        prefix = PREFIX.pack(len(head), len(views), size) + b"".join(struct.pack("<Q", v.nbytes) for v in views)
        async with self._sending:
            if size < JOIN_BYTES:
                await self._loop.sock_sendall(self.sock, b"".join((prefix, head, *views)))
                return
            await self._loop.sock_sendall(self.sock, prefix + head)
            for view in views:
                await self._loop.sock_sendall(self.sock, view)

    async def recv(self) -> dict:
        """The next message; ConnectionError when the other side is gone. Two reads: its prefix, then the rest
        into one buffer that its arrays use (no copy after the socket's)."""
        head_bytes, count, size = PREFIX.unpack(await self._exactly(PREFIX.size))
        rest = memoryview(await self._exactly(8 * count + head_bytes + size))
        sizes = struct.unpack_from(f"<{count}Q", rest)
        at = 8 * count + head_bytes
        head, buffers = rest[8 * count : at], []
        for n in sizes:
            buffers.append(rest[at : at + n])
            at += n
        return pickle.loads(head, buffers=buffers)

    async def _exactly(self, n: int) -> bytearray:
        buf = bytearray(n)
        view, got = memoryview(buf), 0
        while got < n:
            k = await self._loop.sock_recv_into(self.sock, view[got:])
            if k == 0:
                raise ConnectionError("the other process closed the link")
            got += k
        return buf

    def close(self) -> None:
        self.sock.close()


# ---- the engine's side ----

class LinkServer:
    """Serves a Pipeline to every front-end that connects. It listens before the model is loaded, so a front-end
    can say "warming" on /health; `ready` hands each front-end the card (the model view and its tables)."""

    def __init__(self, path: str, status):
        self.path = path
        self.status = status  # () -> dict: the engine's state (ready, draining, healthy, queue)
        self.pipeline: Pipeline | None = None
        self.card: dict | None = None
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

    async def ready(self, pipeline: Pipeline, card: dict) -> None:
        self.pipeline, self.card = pipeline, card
        await self.push({"op": "status", **self.status()})  # ready, before the card: no front-end sees one alone
        await self.push({"op": "card", **card})

    async def push(self, message: dict) -> None:
        for wire in list(self._wires):
            with contextlib.suppress(ConnectionError, OSError):
                await wire.send(message)

    async def _accept(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            sock, _ = await loop.sock_accept(self._listener)
            self._spawn(self._serve(Wire(sock)))

    def _spawn(self, coro) -> asyncio.Task:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def _push_status(self) -> None:
        last = None
        while True:
            status = self.status()
            if status != last:
                await self.push({"op": "status", **status})
                last = status
            await asyncio.sleep(STATUS_EVERY_S)

    async def _serve(self, wire: Wire) -> None:
        """One front-end: its jobs run as tasks; when it goes away, they are cancelled (their rows dropped)."""
        running: dict[int, asyncio.Task] = {}
        self._wires.add(wire)
        try:
            await wire.send({"op": "status", **self.status()})
            if self.card is not None:
                await wire.send({"op": "card", **self.card})
            while True:
                received = await wire.recv()
                for message in received["messages"] if received["op"] == "many" else (received,):
                    self._handle(wire, message, running)
        except (ConnectionError, OSError):
            pass
        finally:
            self._wires.discard(wire)
            for task in running.values():
                task.cancel()
            wire.close()

    def _handle(self, wire: Wire, message: dict, running: dict) -> None:
        op = message["op"]
        if op == "run":
            rid = message["id"]
            running[rid] = self._spawn(self._run(wire, rid, message, running))
        elif op == "cancel" and (task := running.pop(message["id"], None)) is not None:
            task.cancel()
        elif op == "explain":
            self._spawn(self._explain(wire, message))

    async def _run(self, wire: Wire, rid: int, message: dict, running: dict) -> None:
        job: Job = message["job"]
        try:
            if self.pipeline is None:
                raise Draining("the engine is still warming up")
            out, timing = await self.pipeline.run(job, message["cls"], message["deadline_s"])
            reply = {"op": "done", "id": rid, "out": out, "kept": job.kept, "timing": timing}
        except asyncio.CancelledError:
            return
        except Exception as exc:  # the request's own outcome (queue full, too large, draining, its batch failed)
            reply = {"op": "error", "id": rid, "error": exc}
        finally:
            running.pop(rid, None)
        wire.post(reply, reply["out"].nbytes if reply["op"] == "done" else 0)

    async def _explain(self, wire: Wire, message: dict) -> None:
        try:
            reply = {"op": "explained", "id": message["id"],
                     "body": self.pipeline.explain(message["rows"], message["doc"], message["output"],
                                                   message["max_wait_s"])}
        except Exception as exc:
            reply = {"op": "error", "id": message["id"], "error": exc}
        with contextlib.suppress(ConnectionError, OSError):
            await wire.send(reply)


# ---- the front-end's side ----

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

    def __init__(self, path: str, on_card=None, on_status=None, retry_s: float = 0.1):
        self.path = path
        self.on_card = on_card  # (card dict) -> None, on the loop, each time the engine hands one over
        self.on_status = on_status  # (status dict) -> None, on the loop, each status the engine pushes
        self.retry_s = retry_s
        self.status: dict = {"ready": False, "doing": "connecting to the engine process"}
        self.card: dict | None = None
        self.batcher = RemoteBatcher(self)
        self.gone: str | None = None  # why the engine is unreachable (None: connected, or not yet tried)
        self._wire: Wire | None = None
        self._pending: dict[int, asyncio.Future] = {}  # by request id: what the engine will answer
        self._ids = itertools.count()
        self._draining = False
        self._idle: asyncio.Event | None = None
        self._task: asyncio.Task | None = None

    # ---- lifecycle ----

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._idle = asyncio.Event()
        self._idle.set()
        self._task = asyncio.create_task(self._connect_loop())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
        if self._wire is not None:
            self._wire.close()
        self._fail_all(Draining("the server stopped before this request finished"))

    async def drain(self, timeout: float) -> bool:
        """This front-end takes no new jobs; wait for its own to finish (the engine serves the other front-ends)."""
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

    async def run(self, job: Job, cls: int = BULK, deadline_s: float | None = None):
        """As `Pipeline.run`: the job's outputs ([P, D] per sequence) and its timing; cancelling drops its rows."""
        if self._draining:
            raise Draining("the server is draining")
        wire, rid, future = self._expect()
        self._idle.clear()
        try:
            wire.post({"op": "run", "id": rid, "job": job, "cls": cls, "deadline_s": deadline_s}, job.flat.nbytes)
            out, kept, timing = await future
        except asyncio.CancelledError:
            if rid in self._pending and self._wire is wire:
                wire.post({"op": "cancel", "id": rid})
            raise
        finally:
            self._pending.pop(rid, None)
            if not self._pending:
                self._idle.set()
        job.out, job.kept, job.remaining = out, kept, 0
        return out, timing

    def explain(self, rows, doc, output: str, max_wait_s: float) -> dict:
        """The engine's latency math for these rows (blocking: called from a tokenizer thread)."""
        return asyncio.run_coroutine_threadsafe(self._explain(rows, doc, output, max_wait_s), self._loop).result()

    async def _explain(self, rows, doc, output, max_wait_s) -> dict:
        wire, rid, future = self._expect()
        try:
            await wire.send({"op": "explain", "id": rid, "rows": rows, "doc": doc, "output": output,
                             "max_wait_s": max_wait_s})
            return await future
        finally:
            self._pending.pop(rid, None)

    def _expect(self) -> tuple[Wire, int, asyncio.Future]:
        """The connected wire, a new request id and the future its reply resolves (Draining: no engine)."""
        wire = self._wire
        if wire is None:
            raise Draining(f"the engine process is not available ({self.healthy})")
        rid = next(self._ids)
        future = self._pending[rid] = self._loop.create_future()
        return wire, rid, future

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
            wire = self._wire = Wire(sock)
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
        while True:
            received = await wire.recv()
            for message in received["messages"] if received["op"] == "many" else (received,):
                self._take(message)

    def _take(self, message: dict) -> None:
        op = message.pop("op")
        if op == "status":
            message["at"] = time.monotonic()
            self.status = message
            if self.on_status is not None:
                self.on_status(message)
        elif op == "card":
            self.card = message
            if self.on_card is not None:
                self.on_card(message)
        elif (future := self._pending.get(message.get("id"))) is not None and not future.done():
            if op == "done":
                future.set_result((message["out"], message["kept"], message["timing"]))
            elif op == "explained":
                future.set_result(message["body"])
            elif op == "error":
                future.set_exception(message["error"])

    def _fail_all(self, exc: Exception) -> None:
        for future in list(self._pending.values()):
            if not future.done():
                future.set_exception(exc)
