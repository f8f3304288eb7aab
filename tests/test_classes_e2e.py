"""A query overtakes a queued bulk request (real server on loopback, the real engine slowed per step).

Order is read from the batches the engine was handed (SlowEngine.seen, in prepare order; .launched, in launch
order), never from the clock; SlowEngine.gate holds the batch on the device while the query arrives.
"""

import asyncio
import dataclasses
import threading

import pytest
import tiny
from conftest import TINY_TABLE, SlowEngine, until, warm_encoder
from prometheus_client.parser import text_string_to_metric_families

from jaxserve.http.classes import ask_of, decide
from jaxserve.http.server import STATE
from jaxserve.scheduling.batcher import CLASSES

BULK_DOCS = ["the model jax " * 9] * 40  # 29 tokens: one per row of seqlen 32  # > 8 sequences: bulk by default


@pytest.fixture(scope="module")
def tiny_enc(tmp_path_factory):
    path = tiny.write_checkpoint(tmp_path_factory.mktemp("classes") / "ckpt", max_seq_length=32)
    return warm_encoder(path, TINY_TABLE)


async def _race(make_server, tiny_enc, query_body) -> dict:
    """Bulk first; once its first batch is on the device, one query. Returns where the query's batch went, in the
    order batches were prepared (`q`, bulk ones `b`) and launched (`launched_q`), against the counts of both when
    its rows entered the queue; its response; and /metrics."""
    enc = dataclasses.replace(tiny_enc, engine=SlowEngine(tiny_enc.engine, delay=0.2))
    client = await make_server(enc, max_wait_ms=0, max_inflight=1)
    bulk = asyncio.create_task(client.post("/v1/embeddings", json={"input": BULK_DOCS}))
    while not enc.engine.seen:
        await asyncio.sleep(0.01)
    service = client.app[STATE].service
    while service.batcher.waiting()["bulk"] == 0:
        await asyncio.sleep(0.01)
    # hold the batch on the device: nothing launches from here until the query is prepared
    enc.engine.gate = threading.Event()
    while not enc.engine.held:
        await asyncio.sleep(0.01)
    submitted = service.batcher.submit
    at_submit = []  # (batches prepared, batches launched) when the query's rows entered the queue

    def recording_submit(*args, **kwargs):
        at_submit.append((len(enc.engine.seen), len(enc.engine.launched)))
        return submitted(*args, **kwargs)

    service.batcher.submit = recording_submit
    needle = tiny_enc.tokenizer.encode_bodies(["query"])[0][0]
    pending = asyncio.create_task(client.post("/v1/embeddings?explain=1", json=query_body))
    while not at_submit:
        await asyncio.sleep(0.01)
    if CLASSES[decide(ask_of(query_body, {}), 1, 1)[0]] == "interactive":  # prepared at once: wait for it
        for _ in range(2000):  # a bound, not a timing: it fails only if the query is never prepared
            if any((ids == needle).any() for ids in enc.engine.seen):
                break
            await asyncio.sleep(0.01)
        else:
            raise AssertionError("the query was not prepared while the device was held")
    enc.engine.gate.set()
    query = await pending
    assert query.status == 200 and (await bulk).status == 200
    bulk_token = tiny_enc.tokenizer.encode_bodies(["model"])[0][0]
    q = [i for i, ids in enumerate(enc.engine.seen) if (ids == needle).any()]
    b = [i for i, ids in enumerate(enc.engine.seen) if (ids == bulk_token).any()]
    launched_q = [i for i, ids in enumerate(enc.engine.launched) if (ids == needle).any()]
    return {"q": q[0], "b": b, "prepared_at_submit": at_submit[0][0], "launched_at_submit": at_submit[0][1],
            "launched_q": launched_q[0], "body": await query.json(), "query_batches": len(q),
            "batches": len(enc.engine.seen), "metrics": await (await client.get("/metrics")).text()}


def _sample(metrics: str, name: str, cls: str) -> float:
    """One class's sample (prometheus_client's parser); 0 where that class's child was never created."""
    return next((s.value for family in text_string_to_metric_families(metrics) for s in family.samples
                 if s.name == name and s.labels == {"class": cls}), 0.0)


async def test_query_overtakes_queued_bulk(make_server, tiny_enc):
    r = await _race(make_server, tiny_enc, {"input": "query"})  # 1 sequence: interactive
    assert len(r["b"]) >= 4 and r["q"] < r["b"][-1]  # ahead of the bulk rows queued before it
    assert r["q"] == r["prepared_at_submit"]  # prepared at once, into the pipeline slot kept for queries
    # ... and launched next, ahead of the bulk batch prepared before it
    assert r["launched_q"] == r["launched_at_submit"] < r["prepared_at_submit"]
    explain = r["body"]["explain"]
    assert explain["request_class"] == "interactive" and explain["waited_behind"] == {"interactive": 0}
    assert explain["queueing"]["rows_ahead"] == 0  # the bulk rows waiting are not ahead of it
    # goodput by class: every sequence dispatched once, every batch timed under the class that led it
    metrics = r["metrics"]
    assert _sample(metrics, "jaxserve_class_sequences_total", "bulk") == len(BULK_DOCS)
    assert _sample(metrics, "jaxserve_class_sequences_total", "interactive") == 1
    assert _sample(metrics, "jaxserve_dispatch_seconds_count", "interactive") == r["query_batches"]
    assert _sample(metrics, "jaxserve_dispatch_seconds_count", "bulk") == r["batches"] - r["query_batches"]


async def test_a_bulk_query_waits_its_turn(make_server, tiny_enc):
    r = await _race(make_server, tiny_enc, {"input": "query", "priority": "bulk"})
    assert r["q"] >= r["b"][-1]  # FIFO within bulk: with or after the last bulk batch
    body = r["body"]
    assert body["explain"]["request_class"] == "bulk" and body["explain"]["waited_behind"]["bulk"] > 0
    assert body["explain"]["queueing"]["rows_ahead"] > 0


async def test_bad_priority_is_a_400(make_server, tiny_enc):
    client = await make_server(tiny_enc, max_wait_ms=0)
    resp = await client.post("/v1/embeddings", json={"input": "x", "priority": "urgent"})
    assert resp.status == 400 and "priority" in (await resp.json())["error"]["message"]
    assert (await client.post("/v1/embeddings", json={"input": "x", "priority": -1, "deadline_ms": 500})).status == 200
    metrics = await (await client.get("/metrics")).text()
    assert 'jaxserve_deadlines_total{class="interactive",outcome=' in metrics
    assert 'jaxserve_class_request_seconds_count{class="interactive"}' in metrics


async def test_api_key_and_route_classes_are_ceilings(make_server, tiny_enc):
    """A key's or a route's class is what a request gets when it asks for none, and the most it can ask for."""
    client = await make_server(tiny_enc, max_wait_ms=0, api_keys=(("indexer", "bulk"), ("app", None)),
                               route_priority=(("/embed", "bulk"),))
    async def asked(key, body, path="/v1/plan"):
        resp = await client.post(path, json=body, headers={"Authorization": f"Bearer {key}"})
        assert resp.status == 200, await resp.text()
        return await resp.json()

    plan = await asked("indexer", {"input": "q"})
    assert (plan["request_class"], plan["class_from"]) == ("bulk", "api_key")
    plan = await asked("app", {"input": "q"})
    assert (plan["request_class"], plan["class_from"]) == ("interactive", "auto")
    plan = await asked("indexer", {"input": "q", "priority": "interactive"})
    assert (plan["request_class"], plan["class_from"]) == ("bulk", "api_key")  # the indexer cannot promote itself
    resp = await client.post("/v1/plan", json={"input": "q"},
                             headers={"Authorization": "Bearer indexer", "X-Jaxserve-Priority": "interactive"})
    assert (await resp.json())["request_class"] == "bulk"  # nor with the header
    plan = await asked("app", {"input": "q", "priority": "bulk"})
    assert (plan["request_class"], plan["class_from"]) == ("bulk", "body")  # any client may demote itself
    plan = await asked("app", {"input": ["q"] * 9, "priority": "interactive"})
    assert (plan["request_class"], plan["class_from"]) == ("bulk", "size")  # over the interactive limits
    explain = (await asked("indexer", {"input": "q"}, "/v1/embeddings?explain=1"))["explain"]
    assert (explain["request_class"], explain["class_from"]) == ("bulk", "api_key")

    async def served(cls):
        resp = await client.get("/metrics", headers={"Authorization": "Bearer app"})
        assert resp.status == 200
        return _sample(await resp.text(), "jaxserve_class_request_seconds_count", cls)

    before = await served("bulk")
    assert len(await asked("app", {"inputs": "q"}, "/embed")) == 1  # TEI's route: its --route-priority class
    assert await served("bulk") == before + 1
    await asked("app", {"inputs": "q", "priority": "interactive"}, "/embed")
    assert await served("bulk") == before + 2  # the route's ceiling: asking for interactive does not promote it
    for alias in ("/", "/invocations"):  # TEI's root runs /embed here: held to /embed's ceiling (it once escaped it)
        await asked("app", {"inputs": "q", "priority": "interactive"}, alias)
    assert await served("bulk") == before + 4
    assert (await client.post("/v1/plan", json={"input": "q"}, headers={"Authorization": "Bearer nope"})).status == 401


async def test_a_query_is_tokenized_while_bulk_tokenizing_holds_every_tokenizer_thread(make_server, tiny_enc):
    client = await make_server(tiny_enc, max_wait_ms=0)
    state = client.app[STATE]
    release = threading.Event()
    held = [state.tokenizer_pool.submit(release.wait, 60) for _ in range(state.pool_threads[0])]
    try:
        bulk = asyncio.create_task(client.post("/v1/embeddings", json={"input": BULK_DOCS}))
        query = await client.post("/embed", json={"inputs": "query"})  # TEI's route: 1 input, interactive
        assert query.status == 200 and len(await query.json()) == 1
        assert not bulk.done() and not any(f.done() for f in held)  # answered with every tokenizer thread held
    finally:
        release.set()
    assert (await bulk).status == 200 and all(f.result() for f in held)


async def test_a_large_request_claiming_interactive_is_not_tokenized_on_the_query_thread(make_server, tiny_enc):
    """The interactive tokenizer thread is for queries: a request over the interactive limits (or of a large body)
    is tokenized on the bulk threads whatever it claims, so it never holds the thread a query needs. Here the
    query thread is held: the claimed-interactive bulk request still finishes, as bulk."""
    client = await make_server(tiny_enc, max_wait_ms=0)
    state = client.app[STATE]
    release = threading.Event()
    held = state.interactive_pool.submit(release.wait, 60)
    try:
        resp = await asyncio.wait_for(client.post("/v1/embeddings?explain=1",
                                                  json={"input": BULK_DOCS, "priority": "interactive"}), 60)
        assert resp.status == 200
        assert (await resp.json())["explain"]["request_class"] == "bulk" and not held.done()
    finally:
        release.set()
    assert held.result()


async def test_a_query_is_admitted_beside_a_bulk_request_that_fills_the_queue(make_server, tiny_enc):
    """A lone bulk request may fill the whole queue (else the largest requests could never be served); a query
    beside it is still admitted, into the quarter kept for queries, where it used to get 429 until the bulk
    request had drained."""
    enc = dataclasses.replace(tiny_enc, engine=SlowEngine(tiny_enc.engine, gate=threading.Event()))
    client = await make_server(enc, max_wait_ms=0, max_inflight=1, max_queue_tokens=1280)
    service = client.app[STATE].service
    try:  # two queries first: one held on the device, one prepared behind it, so no bulk row is prepared
        first = [asyncio.create_task(client.post("/v1/embeddings", json={"input": "first"}))]
        await until(lambda: enc.engine.held, "the first query held on the device")
        first.append(asyncio.create_task(client.post("/v1/embeddings", json={"input": "second"})))
        await until(lambda: len(enc.engine.seen) == 2, "the second query prepared")
        bulk = asyncio.create_task(client.post("/v1/embeddings", json={"input": BULK_DOCS}))
        await until(lambda: service.batcher.waiting()["bulk"] or bulk.done(), "the bulk request queued")
        assert service.batcher.waiting() == {"interactive": 0, "bulk": 1280}  # the whole queue, past the bulk limit
        query = asyncio.create_task(client.post("/v1/embeddings", json={"input": "query"}))
        await until(lambda: query.done() or service.batcher.waiting()["interactive"] or len(enc.engine.seen) > 2,
                    "the query queued or refused")
        assert not query.done(), "the query was refused"
    finally:
        enc.engine.gate.set()
    assert [r.status for r in await asyncio.gather(*first, bulk, query)] == [200] * 4
