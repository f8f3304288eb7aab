"""scheduling/link.py's wire: whole messages, arrays out of band, and what one turn of the loop posts sent as one."""

import asyncio
import socket

import numpy as np
import pytest
import uvloop

from jaxserve.scheduling.link import SILENT_S, STATUS_BEAT_S
from jaxserve.scheduling.wire import DIRECT_BYTES, JOIN_BYTES, STAGE_BYTES, Wire

BOUND_S = 60.0  # the most a state is waited for


async def pair():
    a, b = socket.socketpair()
    return await Wire.open(a), await Wire.open(b)


def inbox(wire: Wire) -> asyncio.Queue:
    """What `wire` receives, message by message, as `deliver_to` hands it over."""
    received = asyncio.Queue()
    wire.deliver_to(received.put_nowait)
    return received


@pytest.mark.parametrize("size", [0, 10, JOIN_BYTES // 4 + 1, 3 * JOIN_BYTES])  # joined, and sent piece by piece
async def test_arrays_cross_whole_and_writable(size):
    left, right = await pair()
    arrays = {"ids": np.arange(size, dtype=np.int32), "out": np.random.default_rng(0).random((size, 3), np.float32),
              "strided": np.arange(2 * size, dtype=np.int64)[::2]}
    received = inbox(right)
    send = asyncio.create_task(left.send({"op": "run", "id": 7, **arrays}))
    got = await received.get()
    await send
    assert got["op"] == "run" and got["id"] == 7
    for name, want in arrays.items():
        np.testing.assert_array_equal(got[name], want)
        assert got[name].dtype == want.dtype
    got["out"][...] = 1  # outputs are scattered into in place: the received buffer is the array's own
    left.close(), right.close()


async def test_posts_of_one_turn_travel_as_one_message_in_order():
    left, right = await pair()
    received = inbox(right)
    for i in range(3):
        left.post({"op": "done", "id": i, "out": np.full(4, i, np.float32)})
    got = await received.get()
    assert got["op"] == "many" and [m["id"] for m in got["messages"]] == [0, 1, 2]
    assert [float(m["out"][0]) for m in got["messages"]] == [0.0, 1.0, 2.0]
    left.post({"op": "cancel", "id": 9})  # alone in its turn: sent as itself
    assert await received.get() == {"op": "cancel", "id": 9}
    left.close(), right.close()


async def test_a_closed_peer_is_a_connection_error():
    left, right = await pair()
    left.close()
    with pytest.raises(ConnectionError):
        await right.wait_closed()
    right.close()


async def test_a_stream_of_small_and_large_messages_arrives_whole_and_in_order():
    """Small messages batched in the staging buffer, prefixes split across reads, messages over the staging
    buffer read straight into their own: every one whole, in the order posted and sent."""
    left, right = await pair()
    rng = np.random.default_rng(1)
    sizes = [int(n) for n in rng.choice([0, 1, 7, 1000, DIRECT_BYTES // 4, DIRECT_BYTES // 4 + 1,
                                         STAGE_BYTES // 4 + 3, 2 * STAGE_BYTES // 4], 60)]

    async def produce():
        for i, n in enumerate(sizes):
            out = np.arange(n, dtype=np.float32) + i
            if i % 3:
                left.post({"op": "done", "id": i, "out": out}, out.nbytes)
            else:
                await left.send({"op": "done", "id": i, "out": out})
            if i % 7 == 0:
                await asyncio.sleep(0)

    received = inbox(right)
    producer = asyncio.create_task(produce())
    got = []
    while len(got) < len(sizes):
        m = await received.get()
        got += m["messages"] if m["op"] == "many" else [m]
    await producer
    assert [m["id"] for m in got] == list(range(len(sizes)))
    for m, n in zip(got, sizes):
        np.testing.assert_array_equal(m["out"], np.arange(n, dtype=np.float32) + m["id"])
    left.close(), right.close()


async def test_closing_wakes_a_send_held_by_a_full_buffer_and_a_wait_for_the_close():
    """A peer that stopped reading: a large send waits for room (the transport's flow control), and closing this
    end wakes it and a pending `wait_closed` at once, instead of when a flush that never comes would."""
    left, right = await pair()
    right._transport.pause_reading()
    big = {"op": "done", "id": 1, "out": np.zeros(2**20, np.float32)}  # 4 MiB, well over the socket's buffer
    sends = [asyncio.create_task(left.send(big)) for _ in range(2)]
    closed = asyncio.create_task(left.wait_closed())
    await asyncio.sleep(0)
    assert not sends[-1].done() and left._writable is not None  # held: the buffer is over its high-water mark
    left.close()
    done = await asyncio.wait_for(asyncio.gather(*sends, closed, return_exceptions=True), 10)
    assert done[:2] == [None, None] and isinstance(done[2], ConnectionError)
    with pytest.raises(ConnectionError):
        await left.send({"op": "cancel", "id": 2})
    right.close()


async def test_a_failed_job_cancelled_before_its_answer_leaves_no_unread_exception():
    """The front-end's cancel can reach the engine between a batch failing and the job's callback: the reply is
    not sent, and the failure is read anyway (asyncio would log an exception never retrieved)."""
    import gc

    from jaxserve.scheduling.link import LinkServer

    loop, logged, posted = asyncio.get_running_loop(), [], []
    loop.set_exception_handler(lambda _, context: logged.append(context["message"]))
    wire = type("Posts", (), {"post": lambda self, message, nbytes=0: posted.append(message)})()
    running = {7: 3}
    future = loop.create_future()
    future.add_done_callback(lambda f: LinkServer._answer(wire, 7, None, None, f, running))
    future.set_exception(RuntimeError("the batch failed"))
    running.pop(7)  # the cancel, handled before the callback runs
    await asyncio.sleep(0)
    del future
    gc.collect()
    assert posted == [] and logged == []


async def test_a_front_end_link_settles_once_the_engine_says_where_it_stands(tmp_path):
    """A front-end listens only after this: an engine warming says so (its /health: 503, warming); a ready one
    hands over its card first (never a 503 from a new front-end of a ready engine); no engine: not settled."""
    from jaxserve.scheduling.link import EngineLink, LinkServer

    path = str(tmp_path / "engine.sock")
    alone = EngineLink(path, retry_s=0.01)
    await alone.start()
    assert not await alone.settled(0.2)  # nothing listens: it serves anyway after the wait, saying why
    state = {"ready": False, "doing": "warming"}
    server = LinkServer(path, lambda: dict(state))
    await server.start()
    try:
        assert await alone.settled(BOUND_S) and alone.card is None and alone.status["doing"] == "warming"
        state.update(ready=True, doing="ready")
        await server.ready(object(), {"model": "m"})
        late = EngineLink(path, retry_s=0.01)
        await late.start()
        assert await late.settled(BOUND_S) and late.card["model"] == "m" and late.status["ready"]
        await late.stop()
    finally:
        await alone.stop()
        await server.stop()


async def test_a_front_end_that_does_not_read_holds_no_other_back(tmp_path, monkeypatch):
    """A front-end connected but not reading (stopped, hung) fills its socket with the card: the engine hands the
    others the card and its status anyway, and says ready without it (it once waited on that socket for ever)."""
    from jaxserve.scheduling import link as link_mod
    from jaxserve.scheduling.link import EngineLink, LinkServer

    monkeypatch.setattr(link_mod, "PUSH_WAIT_S", 0.2)
    path = str(tmp_path / "engine.sock")
    server = LinkServer(path, lambda: {"ready": True})
    await server.start()
    quick = EngineLink(path, retry_s=0.01)
    await quick.start()
    stuck = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stuck.setblocking(False)
    try:
        await asyncio.get_running_loop().sock_connect(stuck, path)  # never read
        await until(lambda: len(server._wires) == 2)
        card = {"model": "m", "blob": bytes(8 << 20)}  # past any socket's buffer
        await asyncio.wait_for(server.ready(object(), card, loaded_timeout_s=0.1), BOUND_S)
        await until(lambda: quick.status.get("ready"))
        assert quick.card["model"] == "m" and server._announced
    finally:
        stuck.close()
        await quick.stop()
        await server.stop()


async def test_the_engine_says_ready_once_every_front_end_has_loaded_its_card(tmp_path):
    """Front-ends unpickle the card each at its own pace: the engine says "ready" only once every one connected has
    loaded it (or has gone), so that no load balancer sees one front-end's /health say 200 while a request to
    another still gets 503 "warming". Here one front-end is a bare wire that says "loaded" when the test does."""
    from jaxserve.scheduling.link import EngineLink, LinkServer

    path = str(tmp_path / "engine.sock")
    server = LinkServer(path, lambda: {"ready": True})
    await server.start()
    quick = EngineLink(path, retry_s=0.01)
    await quick.start()
    slow, gone = [], []
    try:
        for wires in (slow, gone):
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.setblocking(False)
            await asyncio.get_running_loop().sock_connect(sock, path)
            wires.append(await Wire.open(sock))
        received = inbox(slow[0])
        await until(lambda: len(server._wires) == 3)
        ready = asyncio.create_task(server.ready(object(), {"model": "m"}))
        await until(lambda: len(server._loaded) == 1)  # the quick one has loaded it
        assert quick.card == {"model": "m"} and not quick.status["ready"] and quick.healthy is not None
        assert not ready.done()
        gone[0].close()  # a front-end that dies before loading the card is not waited for ...
        await until(lambda: len(server._wires) == 2)
        assert not ready.done() and not quick.status["ready"]
        slow[0].post({"op": "loaded"})  # ... the last one connected: now every front-end hears "ready"
        await asyncio.wait_for(ready, BOUND_S)
        await until(lambda: quick.status.get("ready"))
        assert quick.healthy is None
        seen = []
        while not any(m.get("op") == "status" and m.get("ready") for m in seen):
            m = await asyncio.wait_for(received.get(), BOUND_S)
            seen += m["messages"] if m["op"] == "many" else [m]
        ops = [m["op"] for m in seen]
        assert ops.index("card") < len(ops) - 1 and not any(m.get("ready") for m in seen[:-1])
        # a front-end that never says it loaded the card holds "ready" up only as long as the engine allows
        await server.ready(object(), {"model": "m2"}, loaded_timeout_s=0.01)
        assert server._announced and slow[0] not in server._loaded
    finally:
        await quick.stop()
        for wire in slow:
            wire.close()
        await server.stop()


def test_the_same_on_uvloop():
    """The tests above run on asyncio's loop; every server process runs uvloop's, whose transports differ."""

    async def each():
        for size in (0, 10, JOIN_BYTES // 4 + 1, 3 * JOIN_BYTES):
            await test_arrays_cross_whole_and_writable(size)
        await test_posts_of_one_turn_travel_as_one_message_in_order()
        await test_a_stream_of_small_and_large_messages_arrives_whole_and_in_order()
        await test_a_closed_peer_is_a_connection_error()
        await test_closing_wakes_a_send_held_by_a_full_buffer_and_a_wait_for_the_close()
        return type(asyncio.get_running_loop())

    assert uvloop.run(each()) is uvloop.Loop


async def test_a_job_past_its_timeout_fails_with_timeout_and_the_engine_drops_it(tmp_path):
    """EngineLink.run's `timeout_s` (the request's timeout): TimeoutError for the caller, and a cancel to the
    engine, whose pipeline drops the job's waiting rows."""
    from jaxserve.runtime.buckets import fixed
    from jaxserve.scheduling.jobs import Job
    from jaxserve.scheduling.link import EngineLink, LinkServer
    from jaxserve.scheduling.planner import pack

    loop = asyncio.get_running_loop()

    class Held:  # a pipeline that never finishes a job
        cancelled: list = []

        def submit(self, job, cls, deadline_s, requests=1):
            self.job = job
            return 5, loop.create_future(), None

        def cancel(self, jid):
            self.cancelled.append(jid)

    path, held = str(tmp_path / "engine.sock"), Held()
    server = LinkServer(path, lambda: {"ready": True})
    await server.start()
    link = EngineLink(path, retry_s=0.01)
    await link.start()
    try:
        await server.ready(held, {"model": "m"})
        assert await link.settled(BOUND_S)
        ids, offsets = np.arange(3, dtype=np.int32), np.array([0, 3])
        job = Job(pack([3], fixed([(1, 16)])), ids, offsets, None, 4, "pooled")
        with pytest.raises(TimeoutError):
            await link.run(job, timeout_s=0.05)
        async with asyncio.timeout(BOUND_S):
            while held.cancelled != [5]:
                await asyncio.sleep(0.01)
        assert held.job.inputs_of(0)[0].tolist() == [0, 1, 2] and not link._pending
    finally:
        await link.stop()
        await server.stop()


async def test_a_draining_front_end_still_sends_its_accepted_requests_jobs_and_the_engine_waits_for_it(tmp_path):
    """A front-end draining (SIGTERM) refuses new requests at the door, but one it accepted before may be
    tokenizing still: its job goes to the engine and is answered, as `Pipeline.run` takes jobs while draining
    (before: 503 "the server is draining" with --workers N alone). The engine, signalled with it, waits for its
    front-ends to go (`without_front_ends`) before it drains."""
    loop = asyncio.get_running_loop()

    class Held:  # a pipeline whose jobs finish when the test says
        def submit(self, job, cls, deadline_s, requests=1):
            from jaxserve.scheduling.pipeline import RequestTiming

            self.job, self.done = job, loop.create_future()
            return 5, self.done, RequestTiming(0.0)

        def cancel(self, jid):
            pass

    held = Held()
    server, link, table = await linked(tmp_path, held)
    try:
        assert not await server.without_front_ends(0.1)  # one is connected
        assert await link.drain(BOUND_S) and link.draining  # nothing running: drained at once (the HTTP layer then
        # waits for the requests it is handling, as with one process)
        job = query(table, 0, 3)
        ran = asyncio.create_task(link.run(job, join=False))
        async with asyncio.timeout(BOUND_S):
            while not hasattr(held, "done"):
                await asyncio.sleep(0.01)
        held.job.gathered.append((np.zeros(1, np.int64), np.ones((1, 4), np.float32)))  # as the batches gather it
        held.done.set_result(None)
        await asyncio.wait_for(ran, BOUND_S)
        np.testing.assert_array_equal(job.out, np.ones((1, 4), np.float32))
        gone = asyncio.create_task(server.without_front_ends(BOUND_S))
        await asyncio.sleep(0.1)
        assert not gone.done()
        await link.stop()
        assert await asyncio.wait_for(gone, BOUND_S)
    finally:
        await link.stop()
        await server.stop()


def test_a_request_timing_crosses_the_link_whole():
    """RequestTiming pickles as its fields' values (`__reduce__`): every field, set or default, comes back."""
    import pickle

    from jaxserve.scheduling.pipeline import RequestTiming

    full = RequestTiming(submitted=1.0, first_dispatch=1.5, done=2.0, batches=[((4, 32), 1, "interactive", 1e-4)],
                         cls=0, deadline_s=0.25, behind={"interactive": 3})
    for timing in (full, RequestTiming(submitted=3.0)):
        assert pickle.loads(pickle.dumps(timing, protocol=5)) == timing


async def test_the_engines_metrics_cross_the_link_and_an_open_ask_does_not_hold_a_drain(tmp_path):
    """`EngineLink.metrics` returns the engine's snapshot, or raises the error its snapshot raised (the link keeps
    serving); a drain waits for jobs only, not for an ask still unanswered (a /metrics scrape, an explain)."""
    from jaxserve.runtime.buckets import fixed
    from jaxserve.scheduling.jobs import Job
    from jaxserve.scheduling.link import EngineLink, LinkServer
    from jaxserve.scheduling.planner import pack

    loop = asyncio.get_running_loop()

    class Quick:  # a pipeline that finishes each job at once
        def submit(self, job, cls, deadline_s, requests=1):
            done = loop.create_future()
            done.set_result(None)
            return 7, done, None

    snapshots = [{("jaxserve_tokens", ()): 3.0}, ValueError("no snapshot")]

    def metrics():
        got = snapshots.pop(0)
        if isinstance(got, Exception):
            raise got
        return got

    path = str(tmp_path / "engine.sock")
    server = LinkServer(path, lambda: {"ready": True}, metrics)
    await server.start()
    link = EngineLink(path, retry_s=0.01)
    await link.start()
    try:
        await server.ready(Quick(), {"model": "m"})
        assert await link.settled(BOUND_S)
        assert await link.metrics() == {("jaxserve_tokens", ()): 3.0}
        with pytest.raises(ValueError, match="no snapshot"):
            await link.metrics()
        _, _, unanswered = link._expect()  # an ask the engine has not answered yet
        job = Job(pack([3], fixed([(1, 16)])), np.arange(3, dtype=np.int32), np.array([0, 3]), None, 4, "pooled")
        await link.run(job)
        assert await link.drain(5.0) and not unanswered.done()
        unanswered.cancel()
    finally:
        await link.stop()
        await server.stop()


class Echo:
    """A pipeline whose jobs finish when the test says: each sequence's output is [its first token id, its length,
    the job's class, 0]. Records what it was given (jobs, classes, deadlines, requests) and what was cancelled."""

    def __init__(self, loop, fail: Exception | None = None):
        self.loop, self.fail = loop, fail
        self.got, self.cancelled, self.futures = [], [], {}

    def submit(self, job, cls, deadline_s, requests=1):
        if self.fail is not None:
            raise self.fail
        jid = len(self.got)
        self.got.append((job, cls, deadline_s, requests))
        self.futures[jid] = self.loop.create_future()
        return jid, self.futures[jid], None

    def finish(self, jid):
        job, cls = self.got[jid][:2]
        p = len(job.lengths)
        firsts = [job.inputs_of(q)[0, 0] for q in range(p)]
        job.put(np.arange(p), np.stack([firsts, job.lengths, np.full(p, cls), np.zeros(p)], 1))
        self.futures[jid].set_result(None)

    def cancel(self, jid):
        self.cancelled.append(jid)


async def linked(tmp_path, pipeline, max_queued=None, beat_s=STATUS_BEAT_S, silent_s=SILENT_S):
    from jaxserve.runtime.buckets import fixed
    from jaxserve.scheduling.link import EngineLink, LinkServer

    path = str(tmp_path / "engine.sock")
    server = LinkServer(path, lambda: {"ready": True, "max_queued": max_queued}, beat_s=beat_s)
    await server.start()
    link = EngineLink(path, retry_s=0.01, silent_s=silent_s)
    await link.start()
    table = fixed([(4, 16), (4, 64)], layout="packed")
    await server.ready(pipeline, {"table": table})
    assert await link.settled(BOUND_S)
    return server, link, table


def query(table, first: int, n: int):
    from jaxserve.scheduling.jobs import Job
    from jaxserve.scheduling.planner import pack

    return Job(pack([n], table), np.arange(first, first + n, dtype=np.int32), np.array([0, n]), None, 4)


async def until(condition):
    async with asyncio.timeout(BOUND_S):
        while not condition():
            await asyncio.sleep(0.005)


async def test_queries_of_one_turn_reach_the_engine_as_one_job_and_each_gets_its_own_output(tmp_path):
    """One-sequence jobs of a class that arrive in one turn of the loop: one job at the engine (counted as that
    many requests), each caller's output its own. Not joined: another class (a job of its own), a job with a
    deadline, one that asked not to be (`join=False`), one of several sequences, one alone in its turn."""
    from jaxserve.scheduling.batcher import BULK, INTERACTIVE
    from jaxserve.scheduling.jobs import Job
    from jaxserve.scheduling.planner import pack

    echo = Echo(asyncio.get_running_loop())
    server, link, table = await linked(tmp_path, echo)
    try:
        two = Job(pack([3, 2], table), np.arange(500, 505, dtype=np.int32), np.array([0, 3, 5]), None, 4)
        jobs = [query(table, 100 * (i + 1), 3 + i) for i in range(7)]
        runs = [link.run(j, BULK) for j in jobs[:4]] + [link.run(jobs[4], INTERACTIVE),
                                                        link.run(jobs[5], BULK, deadline_s=5.0),
                                                        link.run(jobs[6], BULK, join=False), link.run(two, BULK)]
        tasks = [asyncio.ensure_future(r) for r in runs]
        await until(lambda: len(echo.got) == 5)
        sizes = sorted((len(job.lengths), cls, deadline or 0, requests) for job, cls, deadline, requests in echo.got)
        assert sizes == [(1, INTERACTIVE, 0, 1), (1, BULK, 0, 1), (1, BULK, 5.0, 1), (2, BULK, 0, 1), (4, BULK, 0, 4)]
        for jid in range(5):
            echo.finish(jid)
        await asyncio.gather(*tasks)
        for i, j in enumerate(jobs):
            cls = INTERACTIVE if i == 4 else BULK
            np.testing.assert_array_equal(j.out, [[100 * (i + 1), 3 + i, cls, 0]])
        np.testing.assert_array_equal(two.out, [[500, 3, BULK, 0], [503, 2, BULK, 0]])
        alone = query(table, 900, 5)
        task = asyncio.ensure_future(link.run(alone))
        await until(lambda: len(echo.got) == 6)
        assert echo.got[5][3] == 1 and len(echo.got[5][0].lengths) == 1
        echo.finish(5)
        await task
        np.testing.assert_array_equal(alone.out, [[900, 5, BULK, 0]])
        assert not link._pending and not link._joining
    finally:
        await link.stop()
        await server.stop()


async def test_a_joined_job_takes_at_most_its_share_of_the_engines_queue(tmp_path):
    """The engine admits a job whole or not at all: queries are joined only up to `JOIN_QUEUE_SHARE` of its queue
    (their rows' tokens), so a joined job is never refused where its queries alone would be taken."""
    from jaxserve.scheduling.link import JOIN_QUEUE_SHARE

    echo = Echo(asyncio.get_running_loop())
    server, link, table = await linked(tmp_path, echo, max_queued=int(2 * 16 / JOIN_QUEUE_SHARE))  # 2 rows of 16
    try:
        jobs = [query(table, 10 * (i + 1), 3) for i in range(5)]
        tasks = [asyncio.ensure_future(link.run(j)) for j in jobs]
        await until(lambda: len(echo.got) == 3)
        assert [requests for *_, requests in echo.got] == [2, 2, 1]
        for jid in range(3):
            echo.finish(jid)
        await asyncio.gather(*tasks)
        for i, j in enumerate(jobs):
            np.testing.assert_array_equal(j.out, [[10 * (i + 1), 3, 1, 0]])
    finally:
        await link.stop()
        await server.stop()


async def test_a_joined_job_is_dropped_only_once_every_request_in_it_has_gone(tmp_path):
    """A request joined with others that goes away (cancelled, timed out) leaves the job running for the rest; the
    last one to go cancels it at the engine. One gone before its turn ended is never sent."""
    echo = Echo(asyncio.get_running_loop())
    server, link, table = await linked(tmp_path, echo)
    try:
        jobs = [query(table, 10 * (i + 1), 2) for i in range(3)]
        tasks = [asyncio.ensure_future(link.run(j)) for j in jobs[:2]]
        timed = asyncio.ensure_future(link.run(jobs[2], timeout_s=0.05))
        never = asyncio.ensure_future(link.run(query(table, 7, 2)))
        await asyncio.sleep(0)  # each task runs up to its wait for the engine; `never` goes before the turn ends
        never.cancel()
        await until(lambda: len(echo.got) == 1)
        assert echo.got[0][3] == 3  # the three that stayed, `never` left out
        with pytest.raises(TimeoutError):
            await timed
        tasks[0].cancel()
        await asyncio.sleep(0.05)
        assert echo.cancelled == []  # one request of the job still waits
        tasks[1].cancel()
        await until(lambda: echo.cancelled == [0])
        for t in (*tasks, never):
            with pytest.raises(asyncio.CancelledError):
                await t
        assert not link._pending
    finally:
        await link.stop()
        await server.stop()


async def test_a_joined_jobs_error_reaches_each_of_its_requests(tmp_path):
    """The engine refuses the joined job (its queue is full): every request in it gets that error."""
    from jaxserve.scheduling.batcher import QueueFull

    echo = Echo(asyncio.get_running_loop(), fail=QueueFull("no room"))
    server, link, table = await linked(tmp_path, echo)
    try:
        runs = [link.run(query(table, 10 * (i + 1), 2)) for i in range(3)]
        results = await asyncio.gather(*runs, return_exceptions=True)
        assert [type(r) for r in results] == [QueueFull] * 3 and all("no room" in str(r) for r in results)
    finally:
        await link.stop()
        await server.stop()


async def test_a_failed_batch_of_a_joined_job_fails_only_the_queries_whose_rows_fail(tmp_path):
    """The engine fails a job whole when one of its batches fails, and a joined job's queries can sit in several
    batches: each query still waiting then goes again on its own, and only the one whose own rows fail gets the
    error (it once reached all of them). Any other error of the joined job (the engine refusing it) still reaches
    every query (the test above)."""
    from jaxserve.scheduling.batcher import BULK
    from jaxserve.scheduling.pipeline import BatchError

    loop = asyncio.get_running_loop()

    class FailsQuery(Echo):
        """Fails a job holding the query whose first token is `bad`: the joined job, then that query alone."""

        def submit(self, job, cls, deadline_s, requests=1):
            jid, future, timing = super().submit(job, cls, deadline_s, requests)
            if 300 in [job.inputs_of(q)[0, 0] for q in range(len(job.lengths))]:
                future.set_exception(BatchError("the batch at (4, 16) failed being launched"))
            else:
                loop.call_soon(self.finish, jid)
            return jid, future, timing

    echo = FailsQuery(loop)
    server, link, table = await linked(tmp_path, echo)
    try:
        jobs = [query(table, 100 * (i + 1), 2 + i) for i in range(4)]
        results = await asyncio.gather(*(link.run(j, BULK) for j in jobs), return_exceptions=True)
        assert [requests for *_, requests in echo.got] == [4, 1, 1, 1, 1]  # joined, then each on its own
        assert isinstance(results[2], BatchError) and "failed being launched" in str(results[2])
        for i in (0, 1, 3):
            assert not isinstance(results[i], Exception), results[i]
            np.testing.assert_array_equal(jobs[i].out, [[100 * (i + 1), 2 + i, BULK, 0]])
        assert not link._pending
    finally:
        await link.stop()
        await server.stop()


async def test_metrics_add_up_every_front_end_and_keep_those_of_one_gone(tmp_path):
    """/metrics on one front-end: the engine's metrics with every other front-end's, each asked for its report when
    the question comes; a front-end that stops reports first, and what it counted stays counted."""
    from jaxserve.http.tally import combined
    from jaxserve.scheduling.link import EngineLink, LinkServer

    path = str(tmp_path / "engine.sock")
    server = LinkServer(path, lambda: {"ready": True}, lambda: {("engine", ()): 1.0}, combined)
    await server.start()
    counts = [{("requests", ()): 2.0}, {("requests", ()): 5.0}, {("requests", ()): 11.0}]
    links = [EngineLink(path, retry_s=0.01, report=lambda c=c: dict(c)) for c in counts]
    try:
        await server.ready(object(), {"model": "m"})
        for link in links:
            await link.start()
            assert await link.settled(BOUND_S)
        # asked by the first: the others' (5 + 11) and the engine's, not its own (it adds its own, live)
        assert await links[0].metrics() == {("engine", ()): 1.0, ("requests", ()): 16.0}
        counts[1][("requests", ())] = 6.0  # it counts on: the next question asks again
        assert await links[2].metrics() == {("engine", ()): 1.0, ("requests", ()): 8.0}
        await links[1].stop()  # its last report (6) outlives it
        async with asyncio.timeout(BOUND_S):
            while await links[0].metrics() != {("engine", ()): 1.0, ("requests", ()): 17.0}:
                await asyncio.sleep(0.01)
    finally:
        for link in links:
            await link.stop()
        await server.stop()


async def test_a_joined_job_refused_for_room_goes_again_query_by_query(tmp_path):
    """A nearly full engine queue refuses the joined job whole (429) where some of its queries alone would be taken,
    as one process takes them: each query then goes again as a job of its own, admitted or refused (its own size
    named) on its own."""
    from jaxserve.scheduling.batcher import QueueFull

    class Room(Echo):  # room for `left` more sequences
        left = 2

        def submit(self, job, cls, deadline_s, requests=1):
            if len(job.lengths) > self.left:
                raise QueueFull(f"{len(job.lengths)} more would pass the limit")
            self.left -= len(job.lengths)
            return super().submit(job, cls, deadline_s, requests)

    room = Room(asyncio.get_running_loop())
    server, link, table = await linked(tmp_path, room)
    try:
        jobs = [query(table, 10 * (i + 1), 2) for i in range(3)]
        tasks = [asyncio.ensure_future(link.run(j)) for j in jobs]
        await until(lambda: len(room.got) == 2)
        assert [requests for *_, requests in room.got] == [1, 1]  # each alone, after the three were refused together
        for jid in range(2):
            room.finish(jid)
        results = await asyncio.gather(*tasks, return_exceptions=True)
        assert results[:2] == [None, None] and isinstance(results[2], QueueFull) and "1 more" in str(results[2])
        for i, j in enumerate(jobs[:2]):
            np.testing.assert_array_equal(j.out, [[10 * (i + 1), 2, 1, 0]])
    finally:
        await link.stop()
        await server.stop()



async def test_an_explain_the_engine_does_not_answer_times_out_and_one_without_an_engine_is_draining(tmp_path):
    """`EngineLink.explain` runs on a tokenizer thread: against a stalled engine it waited as long as the engine
    stalled, holding that thread and the requests queued behind it (and /v1/plan never timed out), and with the
    engine gone it raised a Draining the route answered as a 500. Now TimeoutError past its timeout, the ask
    withdrawn, and Draining: each a 503 (`handling.explain_rows`)."""
    from jaxserve.scheduling.pipeline import Draining
    from jaxserve.scheduling.planner import pack

    loop = asyncio.get_running_loop()
    never = loop.create_future()

    class Stalled(Echo):
        def explain(self, *args):
            async def unanswered():
                return await never
            return unanswered()

    server, link, table = await linked(tmp_path, Stalled(loop))
    rows, doc = pack([3], table), np.zeros(1, np.int64)
    try:
        with pytest.raises(TimeoutError, match="did not answer within 0.2 s"):
            await asyncio.to_thread(link.explain, rows, doc, "pooled", 0.0, timeout_s=0.2)
        await until(lambda: not link._pending)  # its reply is no longer waited for
        await server.stop()
        await until(lambda: link.healthy is not None)
        with pytest.raises(Draining):
            await asyncio.to_thread(link.explain, rows, doc, "pooled", 0.0, timeout_s=BOUND_S)
    finally:
        never.cancel()
        await link.stop()
        await server.stop()


async def test_an_engine_that_stops_talking_is_unhealthy(tmp_path):
    """The engine pushes its status on change and at least every beat; a front-end that hears nothing for
    `silent_s` says so in `healthy` (/health 503). It trusted the last status: an engine stopped (SIGSTOP) or
    with its loop blocked left every /health at 200 while every request timed out."""
    server, link, _ = await linked(tmp_path, Echo(asyncio.get_running_loop()), beat_s=0.05, silent_s=0.5)
    try:
        heard = link._heard
        await until(lambda: link._heard > heard + 1.0)  # unchanged, still pushed: past silent_s, and healthy
        assert link.healthy is None
        server._pusher.cancel()  # the engine goes quiet, its connection open
        await until(lambda: link.healthy is not None)
        assert "has not been heard from for" in link.healthy
    finally:
        await link.stop()
        await server.stop()
