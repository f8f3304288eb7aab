"""Issue 38's follow-ups on the HTTP API, mostly without a model: the OpenAPI document names every route the app
registers (/embed_m3 with its flags and response; `instruction` on the rerank and score bodies), OpenAI's
`dimensions` refused by the parser itself outside the checkpoint's Matryoshka widths, and Cohere's `input_type`
reaching Jina-embeddings-v3's task prompts (and refused where it names another task's adapter); vLLM's
`truncate_prompt_tokens` through a server on tiny models."""

from __future__ import annotations

import jsonschema
import numpy as np
import pytest
import tiny
from aiohttp import web
from conftest import TINY_TABLE, warm_encoder

from jaxserve.checkpoint.config import EmbeddingConfig
from jaxserve.errors import InputError
from jaxserve.heads import bge_m3
from jaxserve.http import api
from jaxserve.http.api import ApiError, Limits
from jaxserve.http.openapi import spec
from jaxserve.http.routes import bge_m3 as m3_routes
from jaxserve.http.routes import cohere, openai, ops, tei

LIMITS = Limits(max_client_batch=8, max_input_chars=1000)
# Jina-embeddings-v3's tasks (config.json's lora_adaptations) and their task_instructions, as on the hub
JINA_V3_PROMPTS = {"retrieval.query": "Represent the query for retrieving evidence documents: ",
                   "retrieval.passage": "Represent the document for retrieval: ", "separation": "",
                   "classification": "", "text-matching": ""}


def body_schema(paths: dict, path: str) -> dict:
    return paths[path]["post"]["requestBody"]["content"]["application/json"]["schema"]


# ---- the OpenAPI document ----

def test_the_document_names_every_route_the_app_serves():
    app = web.Application()
    for routes in (openai, tei, cohere, ops):
        routes.add_routes(app)
    paths = spec("test")["paths"]
    served = {(r.method.lower(), r.resource.canonical) for r in app.router.routes() if r.method != "HEAD"}
    missing = sorted((m, p) for m, p in served if m not in paths.get(p, {}))  # aliases too (/embeddings)
    assert not missing


def test_embed_m3_is_embeds_body_with_the_three_flags_and_flagembeddings_result():
    paths = spec("test")["paths"]
    body, embed = body_schema(paths, "/embed_m3"), body_schema(paths, "/embed")
    flags = {k for k in body["properties"] if k.startswith("return_")}
    assert flags == set(m3_routes.FLAGS)
    assert set(body["properties"]) == set(embed["properties"]) | flags and body["required"] == ["inputs"]
    jsonschema.validate({"inputs": ["a"], "return_sparse": False}, body)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"inputs": ["a"], "return_dense": "yes"}, body)

    post = paths["/embed_m3"]["post"]
    ok = post["responses"]["200"]["content"]["application/json"]["schema"]
    assert post["responses"]["422"]["content"]["application/json"]["schema"]["required"] == ["error", "error_type"]
    pairs = [(np.array([5, 9]), np.array([0.5, 0.25], np.float32)), (np.array([], int), np.array([], np.float32))]
    jsonschema.validate({"dense_vecs": [[0.1, 0.2], [0.3, 0.4]], "lexical_weights": bge_m3.lexical_weights(pairs),
                         "colbert_vecs": [[[0.1, 0.2]], [[0.3, 0.4], [0.5, 0.6]]]}, ok)
    jsonschema.validate({"dense_vecs": None, "lexical_weights": [{"7": 0.5}], "colbert_vecs": None}, ok)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"dense_vecs": None, "lexical_weights": [{"7": "high"}], "colbert_vecs": None}, ok)


@pytest.mark.parametrize("path", ["/rerank", "/v1/rerank", "/score", "/v1/score"])
def test_rerank_and_score_bodies_take_an_instruction(path):
    """The field `tei.instruction_of` reads on each of these routes (/rerank: in TEI's shape and in Jina's)."""
    schema = body_schema(spec("test")["paths"], path)
    for body in schema.get("anyOf", [schema]):
        assert body["properties"]["instruction"]["type"] == "string"


# ---- OpenAI's `dimensions` and the declared Matryoshka widths ----

def parse(body, declared=()):
    return api.parse_openai_embeddings(body, LIMITS, 32, "truncate", 512, declared)


def test_openai_dimensions_follow_the_declared_widths():
    for width in (8, 16, 32):  # declared, or the full width
        assert parse({"input": ["a"], "dimensions": width}, (8, 16)).dimensions == width
    assert parse({"input": ["a"]}, (8, 16)).dimensions is None
    with pytest.raises(ApiError) as err:
        parse({"input": ["a"], "dimensions": 12}, (16, 8))
    assert (err.value.status, err.value.message) == (
        400, "`dimensions` 12 is not one of this model's Matryoshka dimensions (8, 16, 32)")
    assert parse({"input": ["a"], "dimensions": 12}).dimensions == 12  # none declared: any width
    with pytest.raises(ApiError, match="from 1 to 32"):
        parse({"input": ["a"], "dimensions": 33}, (8, 16))


# ---- Cohere's input_type on Jina-embeddings-v3 ----

@pytest.mark.parametrize("input_type, want", [
    ("search_query", "retrieval.query"),
    ("search_document", "retrieval.passage"),
    ("classification", "classification"),
    ("clustering", "separation"),
])
def test_input_type_names_jina_v3s_task_prompt(input_type, want):
    assert api.cohere_prompt(input_type, list(JINA_V3_PROMPTS)) == want


def test_input_type_reaches_the_served_tasks_prompt_and_not_another_tasks():
    """A server running Jina-v3's retrieval.query adapter (`EmbeddingConfig.from_checkpoint`'s fields for it):
    search_query is its prompt; search_document names retrieval.passage, whose adapter it does not run, and is
    refused (a 400 on /v2/embed), where it used to be served silently with the query adapter and prompt."""
    emb = EmbeddingConfig(prompts=tuple(JINA_V3_PROMPTS.items()), default_prompt_name="retrieval.query",
                          task="retrieval.query", other_tasks=tuple(t for t in JINA_V3_PROMPTS if t != "retrieval.query"))
    names = [name for name, _ in emb.prompts]  # cohere.py's `_prompt_names`
    assert emb.prompt(api.cohere_prompt("search_query", names)) == JINA_V3_PROMPTS["retrieval.query"]
    with pytest.raises(InputError, match="'retrieval.passage' is the prompt of another task adapter"):
        emb.prompt(api.cohere_prompt("search_document", names))


def test_predict_holds_a_plain_text_to_the_input_limit():
    """/predict checked the length of a pair's texts only: a plain text of any length was accepted. Truncating, a
    text past the limit is cut to it at the truncation's end, as TEI cuts it."""
    for inputs in ("x" * 1001, ["x" * 1001], [["x" * 1001]], [["ok"], ["x" * 1001], ["ok", "ok"]]):
        with pytest.raises(ApiError, match="has 1001 characters; at most 1000") as err:
            api.parse_predict({"inputs": inputs}, LIMITS, False)
        assert err.value.status == 413 and err.value.tei() == (422, {"error": err.value.message, "error_type": "Validation"})
    assert api.parse_predict({"inputs": ["x" * 1000, "y"]}, LIMITS, True).inputs == [("x" * 1000, "y")]
    long = "a" + "x" * 999 + "b"
    assert api.parse_predict({"inputs": [[long, "y"]]}, LIMITS, True).inputs == [(long[:1000], "y")]
    assert api.parse_predict({"inputs": long, "truncation_direction": "Left"}, LIMITS, True).inputs == [long[1:]]
    assert api.parse_predict({"inputs": [["ok"], ["a", "b"], ["c"]]}, LIMITS, True).inputs == ["ok", ("a", "b"), "c"]


@pytest.mark.parametrize("inputs", [["a", "b", "c"], ["a", ["b"]], [["a"], "b"], [["a"], ["b", "c", "d"]], [[]], 3])
def test_predict_reads_inputs_as_tei_does(inputs):
    """TEI's `PredictInput`: a list that starts with a text is one input (a text or a pair); a batch is a list of
    [text] and [text, text] lists. A flat list of three texts was read as a batch of three, where two texts are a
    pair: TEI refuses it, and so does this server now (its 422 on TEI's routes)."""
    with pytest.raises(ApiError) as err:
        api.parse_predict({"inputs": inputs}, LIMITS, True)
    assert err.value.status == 400 and err.value.tei()[0] == 422
    one = api.parse_predict({"inputs": ["a", "b"]}, LIMITS, True)
    assert one.inputs == [("a", "b")] and one.single
    assert api.parse_predict({"inputs": [["a", "b"]]}, LIMITS, True).single is False


def test_a_wrong_multivector_encoding_format_is_shown_cut_short():
    with pytest.raises(ApiError) as err:
        api.parse_multivector_embeddings({"input": "x", "encoding_format": "b" * 200_000}, LIMITS)
    assert err.value.status == 400 and len(err.value.message) < 300


def test_vllms_truncate_prompt_tokens_and_add_special_tokens_are_served_or_refused():
    """vLLM's fields were ignored: a cut to N tokens, or no special tokens, answered 200 with the vectors of other
    sequences. -1 (the model's limit) truncates there, N from 1 to the limit truncates at N (vLLM's range: past the
    limit it refuses N, and 0 leaves no input); anything else is a 400 naming the field."""
    parse = lambda **kw: api.parse_openai_embeddings({"input": "x", **kw}, LIMITS, 8, "error", 16)
    assert parse().long == "error" and parse(truncate_prompt_tokens=None, add_special_tokens=True).long == "error"
    assert (parse(truncate_prompt_tokens=-1).long, parse(truncate_prompt_tokens=-1).cut) == ("truncate", None)
    assert (parse(truncate_prompt_tokens=5).long, parse(truncate_prompt_tokens=5).cut) == ("truncate", 5)
    assert parse(truncate_prompt_tokens=16).cut is None and parse().cut is None  # the limit: the model's own cut
    for kw, field in (({"truncate_prompt_tokens": 17}, "truncate_prompt_tokens"),
                      ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
                      ({"truncate_prompt_tokens": -2}, "truncate_prompt_tokens"),
                      ({"truncate_prompt_tokens": True}, "truncate_prompt_tokens"),
                      ({"truncate_prompt_tokens": "5"}, "truncate_prompt_tokens"),
                      ({"truncate_prompt_tokens": 5, "long": "chunk"}, "truncate_prompt_tokens"),
                      ({"add_special_tokens": False}, "add_special_tokens")):
        with pytest.raises(ApiError, match=f"`{field}`") as err:
            parse(**kw)
        assert err.value.status == 400
    assert api.vllm_truncation({"truncate_prompt_tokens": -1}, "error", 16) == ("truncate", None, "right")  # score
    assert api.vllm_truncation({"truncation_side": "left"}, "error", 16) == ("error", None, "left")
    with pytest.raises(ApiError, match="`truncation_side` must be one of left, right, not 'Left'"):
        api.vllm_truncation({"truncation_side": "Left"}, "truncate", 16)
    with pytest.raises(ApiError, match="`truncate_prompt_tokens` must be -1 .* from 1 to the model's limit of 16"):
        api.vllm_truncation({"truncate_prompt_tokens": 0}, "truncate", 16)


@pytest.fixture(scope="module")
def embedder(tmp_path_factory):
    return warm_encoder(tiny.write_checkpoint(tmp_path_factory.mktemp("vllm") / "emb"), TINY_TABLE)


@pytest.fixture(scope="module")
def cross_encoder(tmp_path_factory):
    path = tiny.write_checkpoint(tmp_path_factory.mktemp("vllm") / "ce", model_type="roberta", num_labels=1)
    return warm_encoder(path, TINY_TABLE)


LONG = "the model is a document of the batch and the query to jax in a model " * 2  # 32 tokens, one a word
N = 9


def one_token_a_word(enc, text: str) -> list[str]:
    words = text.split()
    assert len(enc.tokenizer.encode_bodies([text])[0]) == len(words)
    return words


async def test_vllms_truncate_prompt_tokens_cuts_each_input_to_its_first_n_tokens(make_server, embedder):
    """`truncate_prompt_tokens: N` embeds a text as vLLM does, the tokenizer truncating at N special tokens included
    (its first N - 2 words here, a prompt's counted with them), and token ids cut to their first N (vLLM's renderer
    cuts at the tokenizer's side, the right); usage counts the N. N past the model's limit, or 0, is a 400."""
    words = one_token_a_word(embedder, LONG)
    cut = " ".join(words[: N - 2])
    for token_ids in ("openai", "model"):
        client = await make_server(embedder, token_ids=token_ids)
        post = lambda **kw: client.post("/v1/embeddings", json={"encoding_format": "float", **kw})
        got = await (await post(input=[LONG, "jax"], truncate_prompt_tokens=N)).json()
        want = await (await post(input=[cut, "jax"])).json()
        np.testing.assert_allclose([d["embedding"] for d in got["data"]], [d["embedding"] for d in want["data"]],
                                   atol=1e-6)
        assert got["usage"]["prompt_tokens"] == N + 3
        prompted = await (await post(input=LONG, prompt="jax query ", truncate_prompt_tokens=N)).json()
        alone = await (await post(input=" ".join(["jax", "query", *words[: N - 4]]))).json()
        np.testing.assert_allclose(prompted["data"][0]["embedding"], alone["data"][0]["embedding"], atol=1e-6)
        assert prompted["usage"]["prompt_tokens"] == N
        for bad in (embedder.tokenizer.max_length + 1, 0, -2):
            resp = await post(input=LONG, truncate_prompt_tokens=bad)
            assert resp.status == 400 and "`truncate_prompt_tokens`" in (await resp.json())["error"]["message"]
    ids = [int(t) for t in embedder.tokenizer.encode([LONG])[0]]  # the model's own ids (--token-ids model)
    got = await (await post(input=[ids], truncate_prompt_tokens=N)).json()
    want = await (await post(input=[ids[:N]])).json()
    np.testing.assert_allclose(got["data"][0]["embedding"], want["data"][0]["embedding"], atol=1e-6)
    assert got["usage"]["prompt_tokens"] == N
    resp = await post(input="jax", truncate_prompt_tokens=1)  # no room for [CLS] and [SEP]
    assert resp.status == 400 and "special tokens" in (await resp.json())["error"]["message"]


async def test_vllms_truncation_side_and_use_activation_are_served_not_dropped(make_server, embedder, cross_encoder):
    """vLLM's `truncation_side: left` keeps an input's last N tokens, and `use_activation: false` (older vLLM's
    `normalize: false` on embeddings) answers the pooler's output without its activation: the embedding not
    normalised, the cross-encoder's and classifier's logits. Both were dropped: the first N tokens, normalised
    vectors and probabilities answered instead."""
    words = one_token_a_word(embedder, LONG)
    client = await make_server(embedder, token_ids="model")
    post = lambda **kw: client.post("/v1/embeddings", json={"encoding_format": "float", **kw})
    got = await (await post(input=[LONG], truncate_prompt_tokens=N, truncation_side="left")).json()
    want = await (await client.post("/embed", json={"inputs": [" ".join(words[-(N - 2):])]})).json()
    np.testing.assert_allclose(got["data"][0]["embedding"], want[0], atol=1e-6)
    ids = [int(t) for t in embedder.tokenizer.encode([LONG])[0]]
    got = await (await post(input=[ids], truncate_prompt_tokens=N, truncation_side="left")).json()
    want = await (await post(input=[ids[-N:]])).json()
    np.testing.assert_allclose(got["data"][0]["embedding"], want["data"][0]["embedding"], atol=1e-6)
    raw = embedder.embed(["jax"], normalize=False)
    for field in ("use_activation", "normalize"):
        got = await (await post(input="jax", **{field: False})).json()
        np.testing.assert_allclose(got["data"][0]["embedding"], raw[0], rtol=1e-5, atol=1e-6)
    assert np.linalg.norm(raw) != pytest.approx(1.0, abs=1e-3)
    client = await make_server(cross_encoder)
    logit = (await (await client.post("/rerank", json={"query": "q", "texts": ["jax"], "raw_scores": True})).json())
    for path, body, read in (
            ("/v1/rerank", {"query": "q", "documents": ["jax"]}, lambda r: r["results"][0]["relevance_score"]),
            ("/score", {"text_1": "q", "text_2": ["jax"]}, lambda r: r["data"][0]["score"])):
        got = read(await (await client.post(path, json={**body, "use_activation": False})).json())
        assert got == pytest.approx(logit[0]["score"], abs=1e-5), path
        activated = read(await (await client.post(path, json=body)).json())
        assert activated == pytest.approx(1 / (1 + np.exp(-got)), abs=1e-5)
    got = await (await client.post("/classify", json={"input": "jax", "use_activation": False})).json()
    want = await (await client.post("/predict", json={"inputs": "jax", "raw_scores": True})).json()
    assert got["data"][0]["probs"][0] == pytest.approx(want[0]["score"], abs=1e-5)  # a text's logit


async def test_vllms_truncate_prompt_tokens_cuts_a_pair_longest_first(make_server, cross_encoder):
    """On /score, /v1/score and /v1/rerank vLLM truncates each (query, document) pair at N tokens, special tokens
    included, `longest_first` (the tokenizer's pair truncation): a long document loses its end, as if it had been
    sent cut; usage counts N tokens a pair. /classify cuts its texts at N too."""
    words = one_token_a_word(cross_encoder, LONG)
    query = "the query"
    cut = " ".join(words[: N - 4 - 2])  # <s> q </s></s> d </s>: four special tokens around the two-word query
    client = await make_server(cross_encoder)
    for path in ("/score", "/v1/score"):
        got = await (await client.post(path, json={"text_1": query, "text_2": [LONG, "jax"],
                                                   "truncate_prompt_tokens": N})).json()
        want = await (await client.post(path, json={"text_1": query, "text_2": [cut, "jax"]})).json()
        np.testing.assert_allclose([d["score"] for d in got["data"]], [d["score"] for d in want["data"]], atol=1e-6)
        assert got["usage"]["prompt_tokens"] == N + 7
    got = await (await client.post("/v1/rerank", json={"query": query, "documents": [LONG],
                                                       "truncate_prompt_tokens": N})).json()
    want = await (await client.post("/v1/rerank", json={"query": query, "documents": [cut]})).json()
    assert got["results"][0]["relevance_score"] == pytest.approx(want["results"][0]["relevance_score"], abs=1e-6)
    assert got["usage"]["total_tokens"] == N
    resp = await client.post("/v1/rerank", json={"query": query, "documents": [LONG], "truncate_prompt_tokens": 0})
    assert resp.status == 400 and "`truncate_prompt_tokens`" in (await resp.json())["error"]["message"]
    got = await (await client.post("/classify", json={"input": LONG, "truncate_prompt_tokens": N})).json()
    want = await (await client.post("/classify", json={"input": " ".join(words[: N - 2])})).json()
    np.testing.assert_allclose(got["data"][0]["probs"], want["data"][0]["probs"], atol=1e-6)
    assert got["usage"]["prompt_tokens"] == N


def test_a_nan_score_fails_its_request_as_teis_backend_error():
    """A logit past float range gives NaN probabilities: TEI answers 424 `score is NaN`; the scores were served
    as `null` and sorted anywhere."""
    logits = np.array([[np.inf, 0.0, -np.inf]], np.float32)
    for raw in (False, True):
        bad = np.array([[np.nan, 1.0, 0.0]], np.float32) if raw else logits
        with pytest.raises(ApiError, match="score is NaN") as err:
            api.scores(bad, raw)
        assert err.value.tei() == (424, {"error": "score is NaN", "error_type": "Backend"})
    np.testing.assert_allclose(api.scores(np.array([[40.0, 0.0]], np.float32), False), [[1.0, 0.0]], atol=1e-12)


def test_tei_orders_equal_scores_highest_index_first():
    """TEI's /rerank and /predict sort ascending (stable) and reverse: best first, equal scores from the last."""
    assert api.tei_order(np.array([0.5, 0.9, 0.5, 0.1, 0.5], np.float32)) == [1, 4, 2, 0, 3]


async def test_vllms_embed_dtype_and_endianness_shape_base64_as_vllm_encodes_it(make_server, embedder):
    """vLLM's base64 vectors in `embed_dtype` and `endianness`: the bytes of torch's conversion, as vLLM's
    `tensor2binary` makes them (a float16 or bfloat16 asked for was answered float32, which its client decodes as
    twice as many wrong numbers). Float JSON ignores them, as vLLM does."""
    import base64

    import torch

    client = await make_server(embedder)
    want = embedder.embed(["the jax model", "x"], normalize=True)
    post = lambda **kw: client.post("/v1/embeddings", json={"input": ["the jax model", "x"], **kw})
    kinds = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
             "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
    for embed_dtype, kind in kinds.items():
        for endianness in ("native", "big", "little"):
            got = await (await post(encoding_format="base64", embed_dtype=embed_dtype, endianness=endianness)).json()
            for row, v in zip(got["data"], want):
                bits = torch.from_numpy(v).to(kind).view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[
                    kind.itemsize]).numpy()
                if endianness == "big":
                    bits = bits.byteswap()
                assert base64.b64decode(row["embedding"]) == bits.tobytes(), (embed_dtype, endianness)
    floats = await (await post(encoding_format="float", embed_dtype="float16")).json()
    np.testing.assert_allclose([d["embedding"] for d in floats["data"]], want, atol=1e-6)
    for field, value in (("embed_dtype", "int4"), ("endianness", "middle")):
        resp = await post(encoding_format="base64", **{field: value})
        assert resp.status == 400 and f"`{field}` must be one of" in (await resp.json())["error"]["message"]


async def test_a_jina_body_on_rerank_is_held_to_v1_reranks_class_and_names_inputs_as_sent(make_server, cross_encoder,
                                                                                           embedder):
    """A body in Jina's shape on /rerank runs as /v1/rerank: `--route-priority /v1/rerank=bulk` holds it too (it
    ran interactive). A mixed batch's refusal names the input as sent (each kind counted from 0 before), the
    first refused in that order, and an empty token-id list is TEI's 400 Empty."""
    from prometheus_client.parser import text_string_to_metric_families

    client = await make_server(cross_encoder, route_priority=(("/v1/rerank", "bulk"),))

    async def served(cls: str) -> float:
        text = await (await client.get("/metrics")).text()
        return next((s.value for f in text_string_to_metric_families(text) for s in f.samples
                     if s.name == "jaxserve_class_request_seconds_count" and s.labels == {"class": cls}), 0.0)

    before = await served("bulk")
    assert (await client.post("/rerank", json={"query": "q", "documents": ["a b", "c"]})).status == 200
    assert await served("bulk") == before + 1
    assert (await client.post("/rerank", json={"query": "q", "texts": ["a b", "c"]})).status == 200
    assert await served("bulk") == before + 1  # TEI's body: /rerank's own class (none set here)
    client = await make_server(embedder)
    vocab = embedder.arch.vocab_size
    for inputs, truncate, named in ((["ok", [1, vocab]], True, "input 1 "), ([[1, 2], "the model " * 40], False,
                                    "input 1 "), ([[1, 2], "ok", "the model " * 40], False, "input 2 "),
                                    ([[1, vocab], "the model " * 40], False, "input 0 ")):  # the first, as TEI
        resp = await client.post("/embed", json={"inputs": inputs, "truncate": truncate})
        assert resp.status == 422 and named in (await resp.json())["error"], inputs
    for inputs in (["ok", []], [[]]):
        resp = await client.post("/embed", json={"inputs": inputs})
        assert resp.status == 400 and (await resp.json())["error_type"] == "Empty", inputs
