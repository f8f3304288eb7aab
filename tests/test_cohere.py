"""Cohere's v2 API (/v2/embed, /v2/rerank) and the integer encodings on /v1/embeddings.

Pure parts without JAX (the quantization, the request parsing, the error shape), then the routes on a real
server on loopback against the in-process `Encoder` on tiny checkpoints: every embedding type exact, prompts by
input_type, Matryoshka dimensions, truncation ends, the rerank scores of a cross-encoder, an embedding and a
multi-vector model, Cohere's error shape (middleware errors included), and nothing request-sized on the event loop
(tests/loopwatch.py). The `cohere` SDK itself against a server: tests/test_clients.py.
"""

from __future__ import annotations

import base64
import json

import loopwatch
import numpy as np
import orjson
import pytest
import tiny
from conftest import TINY_TABLE, cosine_rows, warm_encoder
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from jaxserve.encoder import normalize_rows
from jaxserve.http import api
from jaxserve.http.api import ApiError, Limits
from jaxserve.http.state import MAX_CLIENT_BATCH

LIMITS = Limits(max_client_batch=8, max_input_chars=1000)
TEXTS = ["the query of the jax model", "a batch of documents", "jax", "the model is a document of the batch"]
LONG = " ".join(["the document of a jax model in a batch"] * 40)  # over the tiny models' 64 tokens
TYPES = ["float", "int8", "uint8", "binary", "ubinary", "base64"]

vectors = hnp.arrays(np.float32, st.tuples(st.integers(1, 6), st.integers(1, 70)),
                     elements=st.floats(-4, 4, width=32, allow_subnormal=False))


# ---- the quantization (no JAX) ----

@given(vectors)
def test_binary_is_the_packed_sign_bits_and_ubinary_less_128(v):
    ubinary, binary = api.quantize(v, "ubinary"), api.quantize(v, "binary")
    assert ubinary.dtype == np.uint8 and binary.dtype == np.int8 and ubinary.shape == (len(v), -(-v.shape[1] // 8))
    np.testing.assert_array_equal(np.unpackbits(ubinary, axis=1, count=v.shape[1]), (v > 0).astype(np.uint8))
    np.testing.assert_array_equal(binary.astype(int), ubinary.astype(int) - 128)


@given(vectors, st.integers(0, 5))
def test_int8_uses_each_vectors_own_scale(v, i):
    """int8: round(127 v / max|v|), so each row is what it is alone (no other input of the request moves it), its
    largest magnitude is 127, and uint8 is int8 + 128."""
    i = i % len(v)
    q, u = api.quantize(v, "int8"), api.quantize(v, "uint8")
    np.testing.assert_array_equal(q[i], api.quantize(v[i : i + 1], "int8")[0])
    np.testing.assert_array_equal(u.astype(int), q.astype(int) + 128)
    peak = np.abs(v).max(axis=1)
    np.testing.assert_array_equal(np.abs(q.astype(int)).max(axis=1), np.where(peak > 0, 127, 0))
    scaled = np.divide(v * 127, peak[:, None], out=np.zeros_like(v), where=peak[:, None] > 0)
    assert np.abs(q - scaled).max() <= 0.5 + 1e-4


@given(vectors, st.sampled_from(["<f4", ">f4", "<f8"]), st.booleans())
def test_base64_rows_are_each_vectors_little_endian_float32_bytes(v, dtype, transposed):
    """Whatever the array's byte order, width or layout, each row encodes as the standard library encodes its
    little-endian float32 bytes."""
    x = np.ascontiguousarray(v.T).astype(dtype).T if transposed else v.astype(dtype)
    rows = api.b64_rows(x)
    assert rows == [base64.b64encode(np.asarray(r, "<f4").tobytes()).decode("ascii") for r in v]
    assert all(type(r) is str for r in rows)


def test_int8_keeps_the_cosine_of_unit_vectors():
    v = normalize_rows(np.random.default_rng(0).standard_normal((64, 384)).astype(np.float32))
    q = api.quantize(v, "int8").astype(np.float64)
    assert cosine_rows(q, v).min() > 0.9999
    sims, qsims = v @ v[0], normalize_rows(q) @ normalize_rows(q)[0]
    assert np.abs(sims - qsims).max() < 3e-3


# ---- parsing (no JAX) ----

def parse(body, declared=(), prompts=("query", "document")):
    return api.parse_cohere_embed(body, LIMITS, 32, "truncate", prompts, 64, declared)


def test_embed_request_fields():
    req, types = parse({"texts": TEXTS, "input_type": "search_document", "embedding_types": ["ubinary", "float",
                                                                                             "ubinary"],
                        "truncate": "START", "output_dimension": 16, "max_tokens": 64})
    assert req.texts == TEXTS and types == ("ubinary", "float") and req.prompt_name == "document"
    assert (req.long, req.direction, req.dimensions, req.normalize) == ("truncate", "left", 16, True)
    req, types = parse({"texts": "one", "truncate": "NONE"})
    assert types == () and (req.long, req.direction) == ("error", "right") and req.prompt_name is None
    assert parse({"texts": ["a"], "truncate": "end"})[0].long == "truncate"
    assert parse({"texts": ["a"]})[0].long == "truncate"  # absent: the server's mode


@pytest.mark.parametrize("input_type, prompts, want", [
    ("search_query", ("query", "document"), "query"),
    ("search_query", ("Retrieval-query", "query"), "query"),
    ("search_query", ("search_query", "query"), "search_query"),  # nomic's own names first
    ("search_document", ("query", "passage"), "passage"),
    ("search_document", ("Retrieval-document",), "Retrieval-document"),
    ("classification", ("Classification", "Clustering"), "Classification"),
    ("clustering", ("query",), None),  # none of its names: the request's default prompt
])
def test_input_type_to_prompt(input_type, prompts, want):
    assert api.cohere_prompt(input_type, prompts) == want


@pytest.mark.parametrize("body, status, words", [
    ({"texts": ["a"], "input_type": "image"}, 400, "text only"),
    ({"images": ["data:image/png;base64,AA=="], "input_type": "image"}, 400, "text only"),
    ({"texts": ["a"], "input_type": "search"}, 400, "input_type"),
    ({"texts": ["a"], "input_type": []}, 400, "input_type"),  # was a 500: a list is not a key
    ({"texts": ["a"], "input_type": {}}, 400, "input_type"),
    ({"texts": ["a"], "embedding_types": []}, 400, "embedding_types"),
    ({"texts": ["a"], "embedding_types": ["float16"]}, 400, "embedding_types"),
    ({"texts": ["a"], "truncate": "LEFT"}, 400, "NONE, START, END"),
    ({"texts": ["a"], "output_dimension": 33}, 400, "from 1 to 32"),
    ({"texts": ["a"], "max_tokens": 10}, 400, "limit of 64"),
    ({"texts": ["a"] * 9}, 413, "at most 8"),
    ({"input_type": "search_query"}, 400, "texts"),
])
def test_embed_request_refusals(body, status, words):
    with pytest.raises(ApiError) as err:
        parse(body)
    assert err.value.status == status and words in err.value.message


def test_output_dimension_only_where_the_checkpoint_declares_one():
    assert parse({"texts": ["a"], "output_dimension": 12})[0].dimensions == 12  # declares none: any width
    assert parse({"texts": ["a"], "output_dimension": 16}, declared=(8, 16))[0].dimensions == 16
    assert parse({"texts": ["a"], "output_dimension": 32}, declared=(8, 16))[0].dimensions == 32  # the full width
    with pytest.raises(ApiError, match=r"Matryoshka dimensions \(8, 16, 32\)"):
        parse({"texts": ["a"], "output_dimension": 12}, declared=(8, 16))


def test_rerank_request():
    req = api.parse_cohere_rerank({"query": "q", "documents": ["a", "b"], "top_n": 1, "return_documents": True,
                                   "relevant_spans": {"enabled": True}, "max_tokens_per_doc": 4096}, LIMITS, 64)
    assert req == api.CohereRerank("q", ["a", "b"], 1, True)
    for body, words in [({"query": " ", "documents": ["a"]}, "query"), ({"query": "q", "documents": []}, "empty"),
                        ({"query": "q", "documents": [{"text": "a"}]}, "string"),
                        ({"query": "q", "documents": ["a"], "top_n": 0}, "top_n"),
                        ({"query": "q", "documents": ["a"], "max_tokens_per_doc": 8}, "limit of 64")]:
        with pytest.raises(ApiError, match=words):
            api.parse_cohere_rerank(body, LIMITS, 64)


def test_rerank_body_orders_and_cuts():
    req = api.CohereRerank("q", ["a", "b", "c"], top_n=2, return_documents=True)
    out = orjson.loads(api.cohere_rerank_body(np.array([0.2, 0.9, 0.2], np.float32), req, 7))
    assert [(r["index"], r["document"]["text"]) for r in out["results"]] == [(1, "b"), (0, "a")]
    assert out["meta"]["billed_units"] == {"input_tokens": 7} and out["id"]


def test_error_shape():
    status, body = ApiError(413, "too many").cohere()
    assert status == 413 and body["message"] == "too many" and set(body) == {"id", "message"}


# ---- the routes on a server ----

@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("cohere")
    emb = tiny.write_checkpoint(root / "embedding", matryoshka_dimensions=[8, 16])
    (emb / "config_sentence_transformers.json").write_text(json.dumps({"prompts": {"query": "query: ",
                                                                                   "document": "passage: "}}))
    return {"embedding": warm_encoder(emb, TINY_TABLE),
            "reranker": warm_encoder(tiny.write_checkpoint(root / "reranker", num_labels=1), TINY_TABLE),
            "classifier": warm_encoder(tiny.write_checkpoint(root / "classifier", num_labels=3), TINY_TABLE)}


async def post(client, path, body):
    resp = await client.post(path, json=body)
    return resp.status, orjson.loads(await resp.read())


async def test_embed_every_type_exact(make_server, models):
    enc = models["embedding"]
    client = await make_server(enc)
    status, out = await post(client, "/v2/embed", {"texts": TEXTS, "model": "m", "input_type": "search_document",
                                                   "embedding_types": TYPES})
    assert status == 200, out
    want = enc.embed(TEXTS, normalize=True, prompt_name="document")
    got = np.array(out["embeddings"]["float"], np.float32)
    assert cosine_rows(got, want).min() > 0.99999
    decoded = np.stack([np.frombuffer(base64.b64decode(s), "<f4") for s in out["embeddings"]["base64"]])
    np.testing.assert_array_equal(decoded, got)
    for kind in ("binary", "ubinary"):  # exact against the in-process vectors
        np.testing.assert_array_equal(out["embeddings"][kind], api.quantize(want, kind))
    for kind in ("int8", "uint8"):
        np.testing.assert_array_equal(out["embeddings"][kind], api.quantize(got, kind))
        assert np.abs(np.array(out["embeddings"][kind]) - api.quantize(want, kind).astype(int)).max() <= 1
    assert np.array(out["embeddings"]["ubinary"]).shape == (len(TEXTS), enc.dim // 8)
    assert out["texts"] == TEXTS and out["response_type"] == "embeddings_by_type"
    assert out["meta"]["billed_units"]["input_tokens"] > len(TEXTS)


async def test_embed_prompts_dimensions_and_truncation(make_server, models):
    enc = models["embedding"]
    client = await make_server(enc)
    for input_type, prompt_name in [("search_query", "query"), ("search_document", "document"),
                                    ("clustering", None)]:
        status, out = await post(client, "/v2/embed", {"texts": TEXTS, "input_type": input_type})
        want = enc.embed(TEXTS, normalize=True, prompt_name=prompt_name)
        assert status == 200 and cosine_rows(out["embeddings"]["float"], want).min() > 0.99999, input_type
    assert cosine_rows(enc.embed(TEXTS, prompt_name="query"), enc.embed(TEXTS, prompt_name="document")).min() < 0.999
    status, out = await post(client, "/v2/embed", {"texts": TEXTS, "output_dimension": 16,
                                                   "embedding_types": ["float", "ubinary"]})
    want = normalize_rows(enc.embed(TEXTS, normalize=True)[:, :16])
    assert status == 200 and cosine_rows(out["embeddings"]["float"], want).min() > 0.99999
    np.testing.assert_array_equal(out["embeddings"]["ubinary"], api.quantize(want, "ubinary"))
    status, out = await post(client, "/v2/embed", {"texts": TEXTS, "output_dimension": 12})
    assert status == 400 and "Matryoshka dimensions (8, 16, 32)" in out["message"] and set(out) == {"id", "message"}
    for truncate, direction in [("END", "right"), ("START", "left")]:
        status, out = await post(client, "/v2/embed", {"texts": [LONG], "truncate": truncate})
        pieces = enc.tokenizer.documents([LONG], "truncate", direction=direction)
        want = normalize_rows(pieces.combine(enc.run(pieces), 1))
        assert status == 200 and cosine_rows(out["embeddings"]["float"], want).min() > 0.99999, truncate
    status, out = await post(client, "/v2/embed", {"texts": [LONG], "truncate": "NONE"})
    assert status == 400 and "tokens" in out["message"] and set(out) == {"id", "message"}


async def test_errors_in_cohere_shape_from_the_middleware_too(make_server, models):
    client = await make_server(models["embedding"], api_key="secret")
    resp = await client.post("/v2/embed", json={"texts": ["a"]})
    body = await resp.json()
    assert resp.status == 401 and set(body) == {"id", "message"} and "API key" in body["message"]
    resp = await client.post("/v2/rerank", data=b"{not json", headers={"Authorization": "Bearer secret"})
    assert resp.status == 400 and set(await resp.json()) == {"id", "message"}
    resp = await client.post("/v1/embeddings", json={"input": "a"})  # the other routes keep their shapes
    assert resp.status == 401 and "error" in await resp.json()


async def test_rerank_a_cross_encoder(make_server, models):
    enc = models["reranker"]
    client = await make_server(enc)
    query = "the query of the jax model"
    status, out = await post(client, "/v2/rerank", {"model": "m", "query": query, "documents": TEXTS, "top_n": 3,
                                                    "return_documents": True})
    assert status == 200, out
    scores = 1 / (1 + np.exp(-enc.rerank(query, TEXTS).astype(np.float64)))
    best = np.argsort(-scores, kind="stable")[:3]
    assert [r["index"] for r in out["results"]] == best.tolist()
    np.testing.assert_allclose([r["relevance_score"] for r in out["results"]], scores[best], atol=1e-6)
    assert [r["document"]["text"] for r in out["results"]] == [TEXTS[i] for i in best]
    status, out = await post(client, "/v2/rerank", {"query": query, "documents": TEXTS})
    assert len(out["results"]) == len(TEXTS) and "document" not in out["results"][0]


async def test_rerank_an_embedding_model_by_cosine(make_server, models):
    enc = models["embedding"]
    client = await make_server(enc)
    query = "jax model"
    status, out = await post(client, "/v2/rerank", {"query": query, "documents": TEXTS})
    assert status == 200, out
    q = enc.embed([query], normalize=True, prompt_name="query")[0]
    want = enc.embed(TEXTS, normalize=True, prompt_name="document") @ q
    assert [r["index"] for r in out["results"]] == np.argsort(-want, kind="stable").tolist()
    np.testing.assert_allclose(sorted((r["index"], r["relevance_score"]) for r in out["results"]),
                               list(enumerate(want)), atol=1e-5)


async def test_rerank_a_multivector_model_by_maxsim(make_server, tmp_path_factory):
    """A multi-vector model's MaxSim, as its /rerank gives it (tested there against MultiVectorEncoder)."""
    from test_multivector import DOCUMENTS, TABLE, st_checkpoint

    enc = warm_encoder(st_checkpoint(tmp_path_factory.mktemp("cohere-mv")), TABLE, dtype="float32")
    client = await make_server(enc)
    query = "the jax model"
    want = orjson.loads(await (await client.post("/rerank", json={"query": query, "texts": DOCUMENTS})).read())
    status, out = await post(client, "/v2/rerank", {"query": query, "documents": DOCUMENTS, "top_n": 3})
    assert status == 200, out
    assert [r["index"] for r in out["results"]] == [w["index"] for w in want[:3]]
    np.testing.assert_allclose([r["relevance_score"] for r in out["results"]], [w["score"] for w in want[:3]],
                               rtol=1e-6)


async def test_rerank_and_embed_refuse_other_models(make_server, models):
    client = await make_server(models["classifier"])
    status, out = await post(client, "/v2/rerank", {"query": "q", "documents": ["a"]})
    assert status == 400 and "3 labels" in out["message"] and set(out) == {"id", "message"}
    status, out = await post(client, "/v2/embed", {"texts": ["a"]})
    assert status == 400 and "embedding model" in out["message"]


async def test_v1_embeddings_integer_formats(make_server, models):
    enc = models["embedding"]
    client = await make_server(enc)
    want = enc.embed(TEXTS, normalize=True)
    for fmt in api.QUANTIZED:
        status, out = await post(client, "/v1/embeddings", {"input": TEXTS, "encoding_format": fmt})
        assert status == 200, out
        got = [d["embedding"] for d in out["data"]]
        if fmt.endswith("binary"):
            np.testing.assert_array_equal(got, api.quantize(want, fmt))
        else:
            assert np.abs(np.array(got) - api.quantize(want, fmt).astype(int)).max() <= 1
    status, out = await post(client, "/v1/embeddings", {"input": TEXTS, "encoding_format": "bit"})
    assert status == 400 and "ubinary" in out["error"]["message"]


def watch(monkeypatch):
    """loopwatch's steps and the Cohere encoders beside them."""
    watcher = loopwatch.watch(monkeypatch)
    for name in ("quantize", "b64_rows", "cohere_embed_body", "cohere_rerank_body"):
        monkeypatch.setattr(api, name, watcher.wrap(name, getattr(api, name)))
    return watcher


BIG = [f"{i} the query of the jax model is a batch of documents" for i in range(MAX_CLIENT_BATCH)]


@pytest.mark.parametrize("route, kind, body", [
    ("/v2/embed", "embedding", {"texts": BIG, "embedding_types": TYPES}),
    ("/v2/rerank", "reranker", {"query": "the model", "documents": BIG, "return_documents": True}),
    ("/v2/rerank", "embedding", {"query": "the model", "documents": BIG}),
    ("/v1/embeddings", "embedding", {"input": BIG, "encoding_format": "ubinary"}),
])
async def test_at_their_largest_nothing_grows_on_the_event_loop(make_server, models, monkeypatch, route, kind, body):
    client = await make_server(models[kind])
    watcher = watch(monkeypatch)
    status, out = await post(client, route, body)
    assert status == 200, out
    assert watcher.grown(MAX_CLIENT_BATCH) == []
    assert len(out.get("data") or out.get("results") or out["embeddings"]["float"]) == MAX_CLIENT_BATCH


async def test_v1_embeddings_base64_at_its_largest_keeps_the_loop_free(make_server, models, monkeypatch):
    """The OpenAI SDK's default format: its vectors were combined, normalised and encoded on the event loop (the
    route offloaded only float responses)."""
    client = await make_server(models["embedding"])
    watcher = loopwatch.watch(monkeypatch)
    status, out = await post(client, "/v1/embeddings", {"input": BIG, "encoding_format": "base64"})
    assert status == 200 and len(out["data"]) == MAX_CLIENT_BATCH
    assert watcher.grown(MAX_CLIENT_BATCH) == []


@settings(max_examples=25)
@given(st.lists(st.sampled_from(TYPES), min_size=1, max_size=6))
def test_embed_body_has_what_was_asked(types):
    v = normalize_rows(np.random.default_rng(1).standard_normal((3, 20)).astype(np.float32))
    req, asked = parse({"texts": ["a", "b", "c"], "embedding_types": types})
    for version in ("1", "2"):
        out = orjson.loads(api.cohere_embed_body(v, asked, req.texts, 5, version))
        assert list(out["embeddings"]) == list(dict.fromkeys(types)) and out["response_type"] == "embeddings_by_type"
        assert all(len(rows) == 3 for rows in out["embeddings"].values())


def test_embed_body_without_types():
    """v2 answers floats by type; v1 its list of float vectors (EmbeddingsFloatsEmbedResponse)."""
    v = normalize_rows(np.random.default_rng(2).standard_normal((3, 20)).astype(np.float32))
    req, asked = parse({"texts": ["a", "b", "c"]})
    v2 = orjson.loads(api.cohere_embed_body(v, asked, req.texts, 5))
    v1 = orjson.loads(api.cohere_embed_body(v, asked, req.texts, 5, "1"))
    assert v2["response_type"] == "embeddings_by_type" and list(v2["embeddings"]) == ["float"]
    assert v1["response_type"] == "embeddings_floats" and v1["meta"]["api_version"]["version"] == "1"
    np.testing.assert_array_equal(v1["embeddings"], v2["embeddings"]["float"])
