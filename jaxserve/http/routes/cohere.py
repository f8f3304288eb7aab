"""Cohere's v2 API, as the `cohere` SDK (`ClientV2.embed`, `ClientV2.rerank`) calls it, and v1's embed (`Client.embed`,
which langchain-cohere's `CohereEmbeddings` calls); errors in Cohere's shape (`{"id", "message"}`: the middleware
writes them, `api.ApiError.cohere`). v1's rerank (`Client.rerank`) is vLLM's `/v1/rerank`, whose answer it reads.

- `POST /v2/embed`: an embedding model's vectors in any of Cohere's embedding types at once (`api.quantize`),
  `input_type` read as the checkpoint's prompt (`api.cohere_prompt`), `output_dimension` limited to the
  checkpoint's Matryoshka dimensions where config.json declares them (`EmbeddingConfig.matryoshka_dimensions`).
  `POST /v1/embed` the same, answering v1's float vectors where no `embedding_types` is asked for.
- `POST /v2/rerank`: relevance scores, best first: a cross-encoder's probability (sigmoid of its logit, TEI's
  /rerank score), an embedding model's cosine of query (input_type search_query) and document (search_document)
  as vLLM scores them, a multi-vector model's MaxSim (its /rerank score).
"""

from __future__ import annotations

import numpy as np
from aiohttp import web

from jaxserve.heads import multivector
from jaxserve.http import api
from jaxserve.http.api import ApiError, EmbedRequest
from jaxserve.http.classes import Ask
from jaxserve.http.handling import (
    ask_for,
    bytes_response,
    embedding_pieces,
    expect_later,
    json_body,
    parsed,
    require_kind,
    respond,
    run_request,
    together,
    vectors_of,
)
from jaxserve.http.routes import multivector as multivector_routes
from jaxserve.http.routes import tei as tei_routes
from jaxserve.http.state import DICT_FLOATS, STATE, AppState

PATHS = ("/v2/embed", "/v2/rerank", "/v1/embed")


def _prompt_names(state: AppState) -> list[str]:
    return [name for name, _ in state.encoder.embedding_config.prompts]


async def embed(request: web.Request) -> web.Response:
    return await _embed(request, "2")


async def embed_v1(request: web.Request) -> web.Response:
    return await _embed(request, "1")


async def _embed(request: web.Request, version: str) -> web.Response:
    state = request.app[STATE]
    state.require_ready()
    require_kind(state, "embedding", request.path)
    body = await json_body(request)
    ask = ask_for(request, body)
    enc = state.encoder
    req, types = await parsed(state, ask, lambda: api.parse_cohere_embed(
        body, state.limits, enc.dim, state.config.long, _prompt_names(state), enc.tokenizer.max_length,
        enc.embedding_config.matryoshka_dimensions))
    ran = await run_request(state, lambda: embedding_pieces(state, req), ask=ask, inputs=req.count)
    encoded, _ = await respond(state, lambda: api.cohere_embed_body(vectors_of(ran, req), types, req.texts, ran.tokens,
                                                                    version), ran.floats * max(len(types), 1))
    return bytes_response(encoded)


async def rerank(request: web.Request) -> web.Response:
    state = request.app[STATE]
    state.require_ready()
    body = await json_body(request)
    ask = ask_for(request, body)
    head, kind = state.encoder.head, tei_routes.kind(state)
    if kind not in SCORERS:
        what = f"a classifier with {head.num_labels} labels" if kind == "classifier" else f"a {kind} model"
        raise ApiError(400, f"/v2/rerank needs a cross-encoder (one label), an embedding or a multi-vector model; "
                            f"this server serves {what} ({state.model_name})")
    score = SCORERS[kind]
    cut = api.cut_end(state.config.long != "error")  # (each scorer truncates unless the server refuses)
    req = await parsed(state, ask, lambda: api.parse_cohere_rerank(body, state.limits,
                                                                    state.encoder.tokenizer.max_length, cut))
    scores, tokens, size = await score(state, req, ask)
    encoded, _ = await respond(state, lambda: api.cohere_rerank_body(scores(), req, tokens),
                               size + len(req.documents) * DICT_FLOATS)
    return bytes_response(encoded)


async def _cross_encoder(state: AppState, req: api.CohereRerank, ask: Ask):
    """(query, document) pairs through the cross-encoder, as /rerank -> (scores, lazily; tokens; output floats)."""
    scores, ran = await tei_routes.pair_scores(state, [(req.query, d) for d in req.documents], ask,
                                               state.config.long != "error")
    return scores, ran.tokens, len(req.documents)


async def _cosine(state: AppState, req: api.CohereRerank, ask: Ask):
    """The query as a search_query, the documents as search_documents, one batch window; cosine of each pair."""
    long = "error" if state.config.long == "error" else "truncate"
    names = _prompt_names(state)
    query, docs = (EmbedRequest(texts, None, long, prompt_name=api.cohere_prompt(kind, names))
                   for texts, kind in (([req.query], "search_query"), (req.documents, "search_document")))
    q, d = await together(*(run_request(state, lambda r=r: embedding_pieces(state, r), ask=ask, inputs=r.count)
                                  for r in (query, docs)))
    return (lambda: (vectors_of(d, docs) @ vectors_of(q, query)[0]).astype(np.float32),
            q.tokens + d.tokens, q.floats + d.floats)


async def _maxsim(state: AppState, req: api.CohereRerank, ask: Ask):
    """The query and the documents as a multi-vector model's query and documents, scored by MaxSim (its /rerank)."""
    long = "error" if state.config.long == "error" else "truncate"
    q, d = await together(multivector_routes.run(state, [req.query], "query", long, ask),
                                multivector_routes.run(state, req.documents, "document", long, ask))
    mean = state.encoder.colbert.similarity == "meanmaxsim"
    return (lambda: multivector.maxsim_flat(multivector_routes.token_outputs(state, q, "query")[0],
                                            *multivector_routes.token_outputs(state, d, "document"), mean=mean),
            q.tokens + d.tokens, q.floats + d.floats)


SCORERS = {"reranker": _cross_encoder, "embedding": _cosine, "multivector": _maxsim}


def add_routes(app: web.Application) -> None:
    app.router.add_post("/v2/embed", embed, expect_handler=expect_later)
    app.router.add_post("/v1/embed", embed_v1, expect_handler=expect_later)
    app.router.add_post("/v2/rerank", rerank, expect_handler=expect_later)
