"""Correctness when clients leave, time out or overload, when the device fails, and at shutdown (real server, loopback).

Each test here failed on the service before the device pipeline was rewritten
(commit edcd6b3): there a cancelled request's rows stayed queued and ran as
padding, a full seqlen starved an expired one, an unfittable request got 429,
/health said 200 with a dead device task, body bytes were not admitted, and
stopping the service blocked the event loop on the device.
"""

import asyncio
import dataclasses
import threading

import aiohttp
import numpy as np
import orjson
import pytest
import tiny
from conftest import ONE_COVER, TINY_TABLE, SlowEngine, until, warm_encoder

from jaxserve.http.server import STATE
from jaxserve.scheduling.jobs import Job
from jaxserve.scheduling.pipeline import Draining
from jaxserve.scheduling.planner import pack

GOOD = {"input": ["the model", "a query"]}


@pytest.fixture(scope="module")
def tiny_enc(tmp_path_factory):
    path = tiny.write_checkpoint(tmp_path_factory.mktemp("churn") / "ckpt", max_seq_length=32)
    return warm_encoder(path, TINY_TABLE)


def slow(enc, **kw):
    return dataclasses.replace(enc, engine=SlowEngine(enc.engine, **kw))


def no_padding_only_batches(engine: SlowEngine) -> bool:
    """Every batch that reached the device carried tokens (a dropped request's rows never run as padding)."""
    return all((ids != 0).any() for ids in engine.seen)


async def test_disconnected_client_has_none_of_its_rows_dispatched(make_server, tiny_enc):
    watched = slow(tiny_enc, gate=threading.Event())  # the device holds each batch until the test opens the gate
    client = await make_server(watched, max_wait_ms=0, max_inflight=1, **ONE_COVER)
    service = client.app[STATE].service
    busy = [asyncio.create_task(client.post("/v1/embeddings", json={"input": ["the model " * 2] * 4}))]
    await until(lambda: watched.engine.held == 1, "the first request's batch on the device")
    busy.append(asyncio.create_task(client.post("/v1/embeddings", json={"input": ["the model"] * 4})))
    await until(lambda: len(watched.engine.seen) == 2, "the second request's batch prepared behind it")
    async with aiohttp.ClientSession() as other:
        # bulk: an interactive request would be prepared at once, into the slot kept for queries
        doomed = asyncio.create_task(other.post(client.make_url("/v1/embeddings"),
                                                json={"input": ["a query"] * 4, "priority": "bulk"}))
        await until(lambda: service.batcher.queued > 0, "the third request queued")
        # all its rows, as the planner packs them at this table (the packing width follows the table's timings)
        _, rows = tiny_enc.prepare(["a query"] * 4)
        assert service.batcher.queued == int(rows.seqlen.sum()) and service.batcher.queued_rows == rows.count
        doomed.cancel()
    await until(lambda: service.batcher.queued == 0, "the disconnected request's rows dropped")
    assert watched.engine.held == 1 and len(watched.engine.seen) == 2  # dropped while the device was still busy
    watched.engine.gate.set()
    assert [(await t).status for t in busy] == [200, 200]
    await until(lambda: service.in_flight == 0, "the pipeline idle")
    assert watched.engine.steps == 2 and no_padding_only_batches(watched.engine)
    query = tiny_enc.tokenizer.encode_bodies(["query"])[0][0]
    assert not any((ids == query).any() for ids in watched.engine.seen)
    assert (await client.post("/v1/embeddings", json=GOOD)).status == 200
    metrics = await (await client.get("/metrics")).text()  # the request gone is counted, as nginx logs it: 499
    assert 'jaxserve_requests_total{route="/v1/embeddings",status="499"} 1.0' in metrics
    assert 'jaxserve_errors_total{type="client_closed"} 1.0' in metrics


async def test_timed_out_request_has_none_of_its_rows_dispatched(make_server, tiny_enc):
    watched = slow(tiny_enc, gate=threading.Event())
    client = await make_server(watched, request_timeout_s=0.3, max_inflight=1, max_wait_ms=0, **ONE_COVER)
    service = client.app[STATE].service
    # 8 long documents each, bulk: the pipeline holds one batch on the device and one prepared (interactive rows
    # would get one more prepared batch)
    full = {"input": ["the model " * 20] * 8, "priority": "bulk"}
    busy = [asyncio.create_task(client.post("/v1/embeddings", json=full)) for _ in range(2)]
    await until(lambda: watched.engine.held == 1 and len(watched.engine.seen) == 2,
                "one batch on the device, one prepared behind it")
    late = await client.post("/v1/embeddings", json={"input": ["a batch"], "priority": "bulk"})  # queued, not
    # prepared into the slot kept for queries
    assert late.status == 503 and (await late.json())["error"]["type"] == "timeout"
    assert service.batcher.queued == 0 and watched.engine.held == 1  # answered while the device was still held
    assert [(await t).status for t in busy] == [503, 503]  # both time out, but their batches still run
    watched.engine.gate.set()
    await until(lambda: watched.engine.steps == 2 and service.batches_in_flight == 0, "the two batches ran")
    assert len(watched.engine.seen) == 2 and no_padding_only_batches(watched.engine)
    batch = tiny_enc.tokenizer.encode_bodies(["batch"])[0][0]
    assert not any((ids == batch).any() for ids in watched.engine.seen)
    assert (await client.post("/v1/embeddings", json=GOOD)).status == 200


async def test_a_request_that_can_never_fit_the_queue_gets_413(make_server, tiny_enc):
    client = await make_server(tiny_enc, max_queue_tokens=128, max_client_batch=8)
    long = {"input": ["the model " * 40] * 2, "long": "chunk"}  # 2 documents, 6 windows each: 12 > 8
    resp = await client.post("/v1/embeddings", json=long)
    assert resp.status == 413
    err = (await resp.json())["error"]
    assert err["type"] == "request_too_large" and "at most 128" in err["message"] and "--max-queue-tokens" in err["message"]
    assert "Retry-After" not in resp.headers
    assert (await client.post("/v1/embeddings", json=GOOD)).status == 200


async def test_admission_by_bytes_of_bodies_in_flight(make_server, tiny_enc):
    watched = slow(tiny_enc, gate=threading.Event())
    client = await make_server(watched, max_inflight_bytes=3000)
    body = {"input": ["the model " * 20] * 8}  # ~1.7 kB
    first = asyncio.create_task(client.post("/v1/embeddings", json=body))
    await until(lambda: watched.engine.held >= 1, "the first request on the device")
    over = await client.post("/v1/embeddings", json=body)
    assert over.status == 429 and over.headers["Retry-After"] == "1"
    assert "bytes" in (await over.json())["error"]["message"]
    watched.engine.gate.set()
    assert (await first).status == 200
    assert (await client.post("/v1/embeddings", json=body)).status == 200  # admitted again once it left


async def _raw_post(client, headers: bytes, body: bytes = b"", path: bytes = b"/v1/embeddings"):
    """A POST of `path` on a connection of its own that sends `body` and then nothing (kept open)."""
    reader, writer = await asyncio.open_connection(client.server.host, client.server.port)
    writer.write(b"POST " + path + b" HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n" + headers +
                 b"\r\n" + body)
    await writer.drain()
    return reader, writer


async def test_a_body_declared_over_the_limit_is_refused_before_it_holds_the_budget(make_server, tiny_enc):
    """A Content-Length past --max-body-bytes is a 413 at once: it was charged to the in-flight budget as
    declared, and one such request (its body never sent) made every other model request a 429."""
    client = await make_server(tiny_enc, max_body_bytes=50_000)
    reader, writer = await _raw_post(client, b"Content-Length: 1099511627776\r\n")
    try:
        assert b" 413 " in await asyncio.wait_for(reader.readline(), 60)
        assert (await client.post("/v1/embeddings", json=GOOD)).status == 200
    finally:
        writer.close()


async def test_a_body_that_stalls_is_answered_408_and_its_bytes_given_back(make_server, tiny_enc):
    """A sender that stops part-way holds the bytes it declared only until --request-timeout-s: then 408, and
    the budget is free for the others (it was held for as long as the connection stayed open)."""
    client = await make_server(tiny_enc, max_inflight_bytes=3000, request_timeout_s=0.5)
    reader, writer = await _raw_post(client, b"Content-Length: 2500\r\n", b'{"input": [')
    try:
        assert b" 408 " in await asyncio.wait_for(reader.readline(), 60)
        body = {"input": ["the model " * 20] * 8}  # ~1.7 kB: over what the stalled request left of 3000
        assert (await client.post("/v1/embeddings", json=body)).status == 200
    finally:
        writer.close()


async def test_health_turns_503_when_the_device_keeps_failing(make_server, tiny_enc):
    broken = slow(tiny_enc, fail_when=lambda ids: True)
    client = await make_server(broken, max_wait_ms=0)
    for _ in range(3):
        assert (await client.post("/v1/embeddings", json=GOOD)).status == 500
    health = await client.get("/health")
    assert health.status == 503 and "device steps failed" in (await health.json())["reason"]
    refused = await client.post("/v1/embeddings", json=GOOD)
    assert refused.status == 503 and "unhealthy" in (await refused.json())["error"]["message"]


class Fatal(BaseException):
    """Not an Exception: nothing inside the pipeline may swallow it."""


async def test_health_turns_503_when_a_pipeline_thread_dies(make_server, tiny_enc):
    class Dying(SlowEngine):
        def put(self, bucket, inputs, output="pooled", sequences=None):
            raise Fatal("the prepare thread is gone")

    client = await make_server(dataclasses.replace(tiny_enc, engine=Dying(tiny_enc.engine)), max_wait_ms=0)
    resp = await client.post("/v1/embeddings", json=GOOD)
    assert resp.status == 503  # its request is answered, not left hanging
    health = await client.get("/health")
    assert health.status == 503 and "thread died" in (await health.json())["reason"]
    # the pipeline itself (what the engine process's link submits to): its rows dropped, a new job refused at once
    service = client.app[STATE].service
    assert all(b.queued == 0 for b in service.batchers.values())
    job = Job(pack(np.array([3]), service.tables["pooled"]), np.arange(3, dtype=np.int32) + 5, np.array([0, 3]), None,
              tiny_enc.out_dim)
    with pytest.raises(Draining, match="thread died"):
        service.submit(job)


async def test_stopping_never_blocks_the_event_loop_and_answers_batches_in_flight(make_server, tiny_enc):
    watched = slow(tiny_enc, gate=threading.Event())
    client = await make_server(watched, max_wait_ms=0)
    service = client.app[STATE].service
    inflight = asyncio.create_task(client.post("/v1/embeddings", json=GOOD))
    await until(lambda: watched.engine.held == 1, "the request's batch on the device")
    ticks = 0

    async def ticker():
        """Runs only while the loop is free; opens the device's gate once it has run 5 times with the batch held.
        A drain that blocked the loop would leave it at 0 (the gate then opens by its own 30 s bound)."""
        nonlocal ticks
        while ticks < 5 and watched.engine.held:
            await asyncio.sleep(0.01)
            ticks += 1
        watched.engine.gate.set()

    tick = asyncio.create_task(ticker())
    assert await service.drain(timeout=60)  # the batch on the device still answers its request
    resp = await inflight
    assert resp.status == 200 and len((await resp.json())["data"]) == 2
    await service.stop()
    await tick
    assert ticks == 5  # the loop kept running while drain waited for the device


async def test_many_requests_racing_cancellations_lose_nothing(make_server, tiny_enc):
    """Random disconnects amid concurrent requests: every answered request gets its own vectors, in order."""
    client = await make_server(slow(tiny_enc, delay=0.01), max_wait_ms=1)
    docs = [f"the model {i} " + "jax " * (i % 9) for i in range(40)]
    want = tiny_enc.embed(docs)
    rng = np.random.default_rng(0)

    async def one(k):
        idx = rng.choice(len(docs), size=int(rng.integers(1, 12)), replace=False)
        task = asyncio.create_task(client.post("/v1/embeddings", json={"input": [docs[i] for i in idx]}))
        if k % 3 == 0:
            await asyncio.sleep(float(rng.uniform(0, 0.03)))
            task.cancel()
            return None
        resp = await task
        got = np.array([d["embedding"] for d in (await resp.json())["data"]])
        np.testing.assert_allclose(got, want[idx], atol=2e-5)
        return resp.status

    results = await asyncio.gather(*(one(k) for k in range(60)), return_exceptions=True)
    assert all(r in (None, 200) for r in results), [r for r in results if r not in (None, 200)]
    state = client.app[STATE]
    await until(lambda: state.service.in_flight == 0, "every request answered or dropped")
    assert state.service.batcher.queued == 0
    text = await (await client.get("/metrics")).text()
    count = lambda k: float(next(line.split()[-1] for line in text.splitlines()
                                 if line.startswith(f'jaxserve_sequences_total{{outcome="{k}"}}')))
    assert count("submitted") == count("dispatched") + count("dropped")


async def test_the_default_queue_bound_is_the_tables_seconds_of_work_and_info_shows_it(make_server, tiny_enc):
    from jaxserve.runtime.host import pool_sizes
    from jaxserve.scheduling.batcher import queue_tokens

    client = await make_server(tiny_enc)
    info = await (await client.get("/info")).json()
    table = tiny_enc.engine.table
    assert table.host_dispatch_s is not None  # measured at warmup
    assert info["limits"]["max_queue_tokens"] == queue_tokens(table)
    assert (info["limits"]["tokenizer_threads"], info["limits"]["respond_threads"]) == pool_sizes()
    assert info["tokenization_workers"] == pool_sizes()[0]


async def test_one_failing_run_of_a_request_cancels_its_others():
    """A request of two runs (a query and its documents: /rerank on a multi-vector model, Cohere's /v2/rerank)
    whose one run fails is answered at once, and its other run is cancelled (its rows dropped), not left to hold
    the queue and the device after the request's slot and bytes were given back (asyncio.gather leaves it)."""
    from jaxserve.http.api import ApiError
    from jaxserve.http.handling import together

    cancelled = asyncio.Event()

    async def documents():
        try:
            await asyncio.Event().wait()  # for ever, unless cancelled
        except asyncio.CancelledError:
            cancelled.set()
            raise

    async def query():
        raise ApiError(400, "the query is over the model's query length")

    with pytest.raises(ApiError, match="query length"):
        await together(documents(), query())
    assert cancelled.is_set()


async def test_a_client_that_does_not_read_its_large_response_holds_its_slot(make_server, tiny_enc):
    """A large response is written with its request's concurrency slot still held: a client that never reads
    (its response stuck in the socket) counts against --max-concurrent-requests, so a crowd of them meets 429,
    not a server holding every response in memory; once it leaves, its slot is free."""
    client = await make_server(tiny_enc, max_concurrent=1)
    state = client.app[STATE]
    body = orjson.dumps({"inputs": ["the model of a batch " * 6] * 1024})  # every token's vector: tens of MB
    reader, writer = await _raw_post(client, b"Content-Length: %d\r\n" % len(body), body, b"/embed_all")
    try:
        assert b" 200 " in await asyncio.wait_for(reader.readline(), 60)  # its status line: the response is being
        assert state.active == 1  # written, and the rest of it waits in the socket, unread
        refused = await client.post("/v1/embeddings", json=GOOD)
        assert refused.status == 429 and "requests are being handled" in (await refused.json())["error"]["message"]
    finally:
        writer.close()
    await until(lambda: state.active == 0, "the slot given back once the client left")
    assert (await client.post("/v1/embeddings", json=GOOD)).status == 200
