"""Nothing on the event loop grows with the request, on every TEI route of an embedding, a classifier and a
reranker model: at the client batch limit of inputs, no step that handles the outputs runs on the loop's
thread (tests/loopwatch.py records which thread runs each step; nothing is timed). The sparse and multi-vector
routes have theirs beside their models' tests (test_sparse.py, test_multivector.py)."""

import loopwatch
import orjson
import pytest
import tiny
from conftest import TINY_TABLE, warm_encoder

from jaxserve.http.state import MAX_CLIENT_BATCH

TEXTS = [f"{i} the query of the jax model is a batch of documents" for i in range(MAX_CLIENT_BATCH)]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("loop")
    return {kind: warm_encoder(tiny.write_checkpoint(root / kind, **kw), TINY_TABLE)
            for kind, kw in (("embedding", {}), ("classifier", {"num_labels": 3}), ("reranker", {"num_labels": 1}))}


ROUTES = {  # route: (model, body, results in the response)
    "/similarity": ("embedding", {"inputs": {"source_sentence": "the model", "sentences": TEXTS[1:]}}, len(TEXTS) - 1),
    "/embed": ("embedding", {"inputs": TEXTS}, len(TEXTS)),
    "/embed_all": ("embedding", {"inputs": TEXTS}, len(TEXTS)),
    "/decode": ("embedding", {"ids": [[7, 8, 9, 10] * 8] * MAX_CLIENT_BATCH}, MAX_CLIENT_BATCH),
    "/tokenize": ("embedding", {"inputs": ["the model " * 8] * MAX_CLIENT_BATCH}, MAX_CLIENT_BATCH),
    "/predict": ("classifier", {"inputs": [[t] for t in TEXTS]}, len(TEXTS)),
    "/rerank": ("reranker", {"query": "the model", "texts": TEXTS, "return_text": True}, len(TEXTS)),
    "/classify": ("classifier", {"input": TEXTS}, len(TEXTS)),
    # token ids: a body past the offload size, each input's ids checked off the loop (api._token_ids)
    "/v1/embeddings": ("embedding", {"input": [[7, 8, 9, 10] * 8] * MAX_CLIENT_BATCH}, MAX_CLIENT_BATCH),
}


@pytest.mark.parametrize("route", ROUTES)
async def test_route_at_its_largest_keeps_the_event_loop_free(make_server, models, monkeypatch, route):
    kind, body, results = ROUTES[route]
    client = await make_server(models[kind], token_ids="model")
    watcher = loopwatch.watch(monkeypatch)
    resp = await client.post(route, json=body)
    assert resp.status == 200, await resp.text()
    assert watcher.grown(MAX_CLIENT_BATCH) == []
    out = orjson.loads(await resp.read())
    assert len(out["data"] if isinstance(out, dict) else out) == results


async def test_the_watch_sees_small_work_on_the_loop(make_server, models, monkeypatch):
    """The check can fail: a one-input request's steps are below every offload threshold, run on the loop, and
    the watch records them there (with a size no larger than the request)."""
    client = await make_server(models["embedding"])
    watcher = loopwatch.watch(monkeypatch)
    resp = await client.post("/similarity", json={"inputs": {"source_sentence": "the model", "sentences": ["jax"]}})
    assert resp.status == 200
    assert {"Pieces.combine", "dumps"} <= {name for name, _ in watcher.on_loop}
    assert watcher.grown(MAX_CLIENT_BATCH) == []


async def test_a_large_body_is_written_whole_from_a_memoryview(make_server, models, monkeypatch):
    """Bodies past `STREAM_BODY_BYTES` go out as a StreamResponse (aiohttp would otherwise copy headers and body
    into one bytes object on the loop): the same bytes, headers and status as the plain response."""
    from jaxserve.http import server

    client = await make_server(models["embedding"])
    plain = await client.post("/embed", json={"inputs": TEXTS[:64]})
    monkeypatch.setattr(server, "STREAM_BODY_BYTES", 1000)
    streamed = await client.post("/embed", json={"inputs": TEXTS[:64]})
    body = await streamed.read()
    assert streamed.status == plain.status == 200 and len(body) > 1000
    assert body == await plain.read() and int(streamed.headers["Content-Length"]) == len(body)
    assert streamed.headers["Content-Type"] == plain.headers["Content-Type"]
    error = await client.post("/embed", json={"inputs": []})  # errors keep their shape either way
    assert 400 <= error.status < 500 and "error" in await error.json()
