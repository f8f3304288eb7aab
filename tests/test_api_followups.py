"""Issue 38's follow-ups on the HTTP API, without a model: the OpenAPI document names every route the app
registers (/embed_m3 with its flags and response; `instruction` on the rerank and score bodies), OpenAI's
`dimensions` refused by the parser itself outside the checkpoint's Matryoshka widths, and Cohere's `input_type`
reaching Jina-embeddings-v3's task prompts (and refused where it names another task's adapter)."""

from __future__ import annotations

import jsonschema
import numpy as np
import pytest
from aiohttp import web

from jaxserve.checkpoint.config import EmbeddingConfig
from jaxserve.errors import InputError
from jaxserve.heads import bge_m3
from jaxserve.http import api
from jaxserve.http.api import ApiError, Limits
from jaxserve.http.openapi import spec
from jaxserve.http.routes import bge_m3 as m3_routes
from jaxserve.http.routes import cohere, openai, ops, tei

LIMITS = Limits(max_client_batch=8, max_input_chars=1000)
ALIASES = {"/embeddings"}  # TEI's name for /v1/embeddings: the same handler, documented once
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
    missing = sorted((m, p) for m, p in served if p not in ALIASES and m not in paths.get(p, {}))
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
    """The field `tei.instruction_of` reads on each of these routes."""
    assert body_schema(spec("test")["paths"], path)["properties"]["instruction"]["type"] == "string"


# ---- OpenAI's `dimensions` and the declared Matryoshka widths ----

def parse(body, declared=()):
    return api.parse_openai_embeddings(body, LIMITS, 32, "truncate", declared)


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
    """/predict checked the length of a pair's texts only: a plain text of any length was accepted."""
    for inputs in ("x" * 1001, ["x" * 1001], [["x" * 1001]], ["ok", "x" * 1001, "ok"]):
        with pytest.raises(ApiError, match="has 1001 characters; at most 1000") as err:
            api.parse_predict({"inputs": inputs}, LIMITS, True)
        assert err.value.status == 413 and err.value.tei() == (422, {"error": err.value.message, "error_type": "Validation"})
    assert api.parse_predict({"inputs": ["x" * 1000, "y"]}, LIMITS, True).inputs == [("x" * 1000, "y")]
    assert api.parse_predict({"inputs": ["ok", ["a"], "b"]}, LIMITS, True).inputs == ["ok", "a", "b"]


def test_a_wrong_multivector_encoding_format_is_shown_cut_short():
    with pytest.raises(ApiError) as err:
        api.parse_multivector_embeddings({"input": "x", "encoding_format": "b" * 200_000}, LIMITS)
    assert err.value.status == 400 and len(err.value.message) < 300


def test_vllms_truncate_prompt_tokens_and_add_special_tokens_are_served_or_refused():
    """vLLM's fields were ignored: a cut to N tokens, or no special tokens, answered 200 with the vectors of other
    sequences. -1 (the model's limit) truncates there; anything else the server cannot do is a 400 naming it."""
    parse = lambda **kw: api.parse_openai_embeddings({"input": "x", **kw}, LIMITS, 8, "error")
    assert parse().long == "error" and parse(truncate_prompt_tokens=None, add_special_tokens=True).long == "error"
    assert parse(truncate_prompt_tokens=-1).long == "truncate"
    for kw, field in (({"truncate_prompt_tokens": 16}, "truncate_prompt_tokens"),
                      ({"truncate_prompt_tokens": True}, "truncate_prompt_tokens"),
                      ({"add_special_tokens": False}, "add_special_tokens")):
        with pytest.raises(ApiError, match=f"`{field}`") as err:
            parse(**kw)
        assert err.value.status == 400
    assert api.vllm_long({"truncate_prompt_tokens": -1}, "error") == "truncate"  # /v1/score, /score, /v1/rerank
    with pytest.raises(ApiError, match="`truncate_prompt_tokens` 0"):
        api.vllm_long({"truncate_prompt_tokens": 0}, "truncate")


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
