"""A query overtakes a queued bulk request (real server on loopback, the real engine slowed per step).

Order is read from the batches the engine was handed (SlowEngine.seen, in dispatch order), never from the clock.
"""

import asyncio
import dataclasses

import pytest
import tiny
from conftest import TINY_TABLE, SlowEngine

from jaxserve import Encoder
from jaxserve.server import STATE

BULK_DOCS = ["the model jax " * 9] * 40  # 29 tokens: one per row of seqlen 32  # > 8 sequences: bulk by default


@pytest.fixture(scope="module")
def tiny_enc(tmp_path_factory):
    path = tiny.write_checkpoint(tmp_path_factory.mktemp("classes") / "ckpt", max_seq_length=32)
    return Encoder.from_pretrained(str(path), buckets=TINY_TABLE)


async def _race(make_server, tiny_enc, query_body):
    """Bulk first; once its first batch is on the device, one query. -> (query batch index, bulk batch indices,
    batches handed to the engine when the query was queued, the query's response)."""
    enc = dataclasses.replace(tiny_enc, engine=SlowEngine(tiny_enc.engine, delay=0.2))
    client = await make_server(enc, max_wait_ms=0, max_inflight=1)
    bulk = asyncio.create_task(client.post("/v1/embeddings", json={"input": BULK_DOCS}))
    while not enc.engine.seen:
        await asyncio.sleep(0.01)
    service = client.app[STATE].service
    while service.batcher.waiting()["bulk"] == 0:
        await asyncio.sleep(0.01)
    submitted = service.batcher.submit
    at_submit = []  # batches handed to the engine when the query's rows entered the queue

    def recording_submit(*args, **kwargs):
        at_submit.append(len(enc.engine.seen))
        return submitted(*args, **kwargs)

    service.batcher.submit = recording_submit
    query = await client.post("/v1/embeddings?explain=1", json=query_body)
    assert query.status == 200 and (await bulk).status == 200
    needle = tiny_enc.tokenizer.encode_bodies(["query"])[0][0]
    bulk_token = tiny_enc.tokenizer.encode_bodies(["model"])[0][0]
    q = [i for i, ids in enumerate(enc.engine.seen) if (ids == needle).any()]
    b = [i for i, ids in enumerate(enc.engine.seen) if (ids == bulk_token).any()]
    metrics = await (await client.get("/metrics")).text()
    return q[0], b, at_submit[0], await query.json(), (len(q), len(enc.engine.seen), metrics)


def _sample(metrics: str, name: str) -> float:
    """One sample's value; 0 where the labelled child was never created."""
    return float(next((line.split()[-1] for line in metrics.splitlines() if line.startswith(name + " ")), 0))


async def test_query_overtakes_queued_bulk(make_server, tiny_enc):
    q, b, queued_at, body, (query_batches, batches, metrics) = await _race(make_server, tiny_enc, {"input": "query"})
    assert len(b) >= 4 and q < b[-1]  # ahead of the bulk rows queued before it
    assert q <= queued_at + 2  # behind at most the batches being prepared when it was queued, never the queue
    explain = body["explain"]
    assert explain["request_class"] == "interactive" and explain["waited_behind"] == {"interactive": 0}
    # goodput by class: every sequence dispatched once, every batch timed under the class that led it
    assert _sample(metrics, 'jaxserve_class_sequences_total{class="bulk"}') == len(BULK_DOCS)
    assert _sample(metrics, 'jaxserve_class_sequences_total{class="interactive"}') == 1
    assert _sample(metrics, 'jaxserve_dispatch_seconds_count{class="interactive"}') == query_batches
    assert _sample(metrics, 'jaxserve_dispatch_seconds_count{class="bulk"}') == batches - query_batches


async def test_a_bulk_query_waits_its_turn(make_server, tiny_enc):
    q, b, _, body, _ = await _race(make_server, tiny_enc, {"input": "query", "priority": "bulk"})
    assert q >= b[-1]  # FIFO within bulk: with or after the last bulk batch
    assert body["explain"]["request_class"] == "bulk" and body["explain"]["waited_behind"]["bulk"] > 0


async def test_bad_priority_is_a_400(make_server, tiny_enc):
    client = await make_server(tiny_enc, max_wait_ms=0)
    resp = await client.post("/v1/embeddings", json={"input": "x", "priority": "urgent"})
    assert resp.status == 400 and "priority" in (await resp.json())["error"]["message"]
    assert (await client.post("/v1/embeddings", json={"input": "x", "priority": -1, "deadline_ms": 500})).status == 200
    metrics = await (await client.get("/metrics")).text()
    assert 'jaxserve_deadlines_total{class="interactive",outcome=' in metrics
    assert 'jaxserve_class_request_seconds_count{class="interactive"}' in metrics


async def test_api_key_and_route_classes_under_what_the_request_asks(make_server, tiny_enc):
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
    assert (plan["request_class"], plan["class_from"]) == ("interactive", "body")
    explain = (await asked("indexer", {"input": "q"}, "/v1/embeddings?explain=1"))["explain"]
    assert (explain["request_class"], explain["class_from"]) == ("bulk", "api_key")

    async def served(cls):
        resp = await client.get("/metrics", headers={"Authorization": "Bearer app"})
        assert resp.status == 200
        return _sample(await resp.text(), f'jaxserve_class_request_seconds_count{{class="{cls}"}}')

    before = await served("bulk")
    assert len(await asked("app", {"inputs": "q"}, "/embed")) == 1  # TEI's route: its --route-priority class
    assert await served("bulk") == before + 1
    before = await served("interactive")
    await asked("app", {"inputs": "q", "priority": "interactive"}, "/embed")
    assert await served("interactive") == before + 1
    assert (await client.post("/v1/plan", json={"input": "q"}, headers={"Authorization": "Bearer nope"})).status == 401


async def test_a_query_is_tokenized_while_bulk_tokenizing_holds_every_tokenizer_thread(make_server, tiny_enc):
    import threading

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
