"""End to end with the real MiniLM on loopback: OpenAI client, TEI routes, order, concurrency, compiles."""

import asyncio

import numpy as np
import openai
import pytest
from conftest import cosine_rows

from jaxserve.runtime import compiles

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


@pytest.fixture
async def server(make_server, minilm_warm):
    client = await make_server(minilm_warm, model_name="all-MiniLM-L6-v2")
    before = compiles.xla_compiles_total()
    yield client
    assert compiles.xla_compiles_total() == before, "an XLA compile happened after warmup"


def mixed_documents(n, reference_texts):
    """n documents of mixed length built from real text: sentences up to over-length documents."""
    rng = np.random.default_rng(0)
    words = " ".join(reference_texts).split()
    return [" ".join(words[s : s + int(k)]) for s, k in zip(rng.integers(0, len(words) - 600, n),
                                                             rng.choice([3, 12, 40, 120, 300, 600], n))]


async def test_openai_client_gets_reference_vectors(server, minilm_reference):
    texts, want = minilm_reference
    oai = openai.AsyncOpenAI(base_url=str(server.make_url("/v1")), api_key="unused")
    resp = await oai.embeddings.create(model="all-MiniLM-L6-v2", input=texts)  # base64 on the wire
    got = np.array([d.embedding for d in resp.data])
    assert [d.index for d in resp.data] == list(range(len(texts)))
    assert cosine_rows(got, want).min() >= 0.99999
    assert resp.model == "all-MiniLM-L6-v2" and resp.usage.prompt_tokens > 0
    floats = await oai.embeddings.create(model="m", input=texts[:3], encoding_format="float")
    np.testing.assert_allclose([d.embedding for d in floats.data], got[:3], atol=1e-6)
    short = await oai.embeddings.create(model="m", input=texts[0], dimensions=64, encoding_format="float")
    v = np.array(short.data[0].embedding)
    assert v.shape == (64,) and np.linalg.norm(v) == pytest.approx(1.0, abs=1e-5)
    assert cosine_rows(v[None], want[:1, :64])[0] > 0.99999


async def test_tei_embed_gets_reference_vectors(server, minilm_reference):
    texts, want = minilm_reference
    kept = [i for i, t in enumerate(texts) if t]  # TEI refuses an empty text (400 Empty); /v1/embeddings embeds it
    assert len(kept) < len(texts)
    empty = await server.post("/embed", json={"inputs": texts, "truncate": True})
    assert empty.status == 400 and (await empty.json())["error_type"] == "Empty"
    resp = await server.post("/embed", json={"inputs": [texts[i] for i in kept], "truncate": True})
    assert resp.status == 200
    got = np.array(await resp.json())
    assert cosine_rows(got, want[kept]).min() >= 0.99999
    single = await (await server.post("/embed", json={"inputs": texts[0]})).json()
    assert cosine_rows(np.array(single), want[:1])[0] >= 0.99999
    raw = np.array(await (await server.post("/embed", json={"inputs": texts[:2], "normalize": False})).json())
    assert not np.allclose(np.linalg.norm(raw, axis=1), 1.0) and cosine_rows(raw, want[:2]).min() >= 0.99999
    # `dimensions` cuts first; `normalize: false` keeps the cut raw (as TEI), true scales it to unit length
    cut = np.array(await (await server.post("/embed", json={"inputs": texts[:2], "normalize": False,
                                                             "dimensions": 64})).json())
    np.testing.assert_allclose(cut, raw[:, :64], rtol=1e-5, atol=1e-6)
    unit = np.array(await (await server.post("/embed", json={"inputs": texts[:2], "dimensions": 64})).json())
    np.testing.assert_allclose(unit, raw[:, :64] / np.linalg.norm(raw[:, :64], axis=1, keepdims=True), atol=1e-5)


async def test_hundred_mixed_documents_in_order(server, minilm_warm, minilm_reference):
    docs = mixed_documents(100, minilm_reference[0])
    resp = await server.post("/v1/embeddings", json={"input": docs, "encoding_format": "float"})
    assert resp.status == 200
    body = await resp.json()
    assert [d["index"] for d in body["data"]] == list(range(100))
    got = np.array([d["embedding"] for d in body["data"]])
    want = minilm_warm.embed(docs)
    assert cosine_rows(got, want).min() >= 0.99999
    assert body["usage"]["prompt_tokens"] == sum(len(s) for s in minilm_warm.tokenizer.encode(docs))


async def test_concurrent_clients_get_their_own_results(server, minilm_warm, minilm_reference):
    docs = mixed_documents(48, minilm_reference[0])
    groups = [docs[i::8] for i in range(8)]

    async def one(group):
        resp = await server.post("/v1/embeddings", json={"input": group, "encoding_format": "float"})
        assert resp.status == 200
        return np.array([d["embedding"] for d in (await resp.json())["data"]])

    results = await asyncio.gather(*(one(g) for g in groups))
    for group, got in zip(groups, results):
        assert cosine_rows(got, minilm_warm.embed(group)).min() >= 0.99999


async def test_chunked_long_input_through_the_api(server, minilm_warm, minilm_reference):
    long_text = minilm_reference[0][13]  # over 2000 tokens
    resp = await server.post("/v1/embeddings", json={"input": [long_text], "long": "chunk", "encoding_format": "float"})
    got = np.array((await resp.json())["data"][0]["embedding"])
    np.testing.assert_allclose(got, minilm_warm.embed([long_text], long="chunk")[0], atol=1e-5)
    refused = await server.post("/v1/embeddings", json={"input": [long_text], "long": "error"})
    assert refused.status == 400 and "over the model's limit of 256" in (await refused.json())["error"]["message"]
    tei = await server.post("/embed", json={"inputs": [long_text], "truncate": False})
    assert tei.status == 422  # TEI's status and shape for a validation error
    assert (await tei.json())["error_type"] == "Validation" and "limit of 256" in (await tei.json())["error"]


async def test_tokenize_health_info_metrics(server):
    resp = await server.post("/tokenize", json={"inputs": ["Hello world"]})
    (tokens,) = await resp.json()
    assert [t["text"] for t in tokens] == ["[CLS]", "Hello", "world", "[SEP]"]
    assert tokens[0]["special"] and not tokens[1]["special"] and tokens[1]["start"] == 0 and tokens[2]["stop"] == 11
    # a `prompt` text goes in front of each input, as /embed puts it (it was once accepted and dropped)
    (prompted,) = await (await server.post("/tokenize", json={"inputs": ["world"], "prompt": "Hello "})).json()
    assert [t["text"] for t in prompted] == ["[CLS]", "Hello", "world", "[SEP]"]
    assert (await server.get("/health")).status == 200
    info = await (await server.get("/info")).json()
    assert info["model_id"] == "all-MiniLM-L6-v2" and info["dimensions"] == 384 and info["max_input_length"] == 256
    assert info["buckets"]["layout"] == "packed" and info["buckets"]["budget_bytes"] > 0
    assert all(b["compiled_bytes"] > 0 and b["run_s"] > 0 for b in info["buckets"]["buckets"])
    # the host time per dispatch the batcher plans with: warm-up's until enough batches ran to measure it
    host = info["host_dispatch"]
    assert host["source"] == "measured" and host["warmup_s"] == info["buckets"]["host_dispatch_s"] > 0
    assert host["planned_s"] >= host["warmup_s"]
    await server.post("/v1/embeddings", json={"input": ["a metrics probe"]})
    text = await (await server.get("/metrics")).text()
    for name in ("jaxserve_xla_compiles_total", "jaxserve_requests_total", "jaxserve_queue_depth",
                 "jaxserve_batch_wait_seconds_bucket", "jaxserve_request_duration_seconds_bucket",
                 "jaxserve_batch_fill_ratio_bucket", "jaxserve_padding_ratio_bucket", "jaxserve_tokens_total",
                 *(f'jaxserve_phase_seconds_count{{phase="{p}"}}' for p in
                   ("parse", "tokenize", "plan", "queue", "assemble", "copy", "device", "scatter", "encode"))):
        assert name in text, name
    compiles_line = next(l for l in text.splitlines() if l.startswith("jaxserve_xla_compiles_total"))
    assert float(compiles_line.split()[-1]) == compiles.xla_compiles_total()
