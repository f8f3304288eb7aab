"""OpenAI's embeddings route (and jaxserve's /v1/plan beside it) and vLLM's /classify; errors in OpenAI's shape."""

from __future__ import annotations

import time

import orjson
from aiohttp import web

from jaxserve.http import api
from jaxserve.http.classes import decide
from jaxserve.http.handling import (
    ask_for,
    bytes_response,
    embedding_pieces,
    explain_rows,
    json_body,
    on_tokenizer,
    parsed,
    require_kind,
    respond,
    run_request,
    tokenized,
    vectors_of,
)
from jaxserve.http.routes import multivector as multivector_routes
from jaxserve.http.state import DICT_FLOATS, STATE
from jaxserve.scheduling.batcher import BULK, CLASSES
from jaxserve.scheduling.planner import pack


async def embeddings(request: web.Request) -> web.Response:
    state = request.app[STATE]
    start = time.perf_counter()
    state.require_ready()
    if state.encoder.head.kind == "multivector":  # PyLate's server: per input its token vectors
        body = await json_body(request)
        return await multivector_routes.embeddings(state, body, ask_for(request, body))
    require_kind(state, "embedding", "/v1/embeddings")
    body = await json_body(request)
    ask = ask_for(request, body)
    req = await parsed(state, ask, lambda: api.parse_openai_embeddings(body, state.limits, state.encoder.dim,
                                                                        state.config.long))
    wants_explain = _wants_explain(request)
    ran = await run_request(state, lambda: embedding_pieces(state, req, openai_ids=True), want_explain=wants_explain,
                            ask=ask, inputs=req.count)
    body, encode_s = await respond(
        state, lambda: api.openai_body(vectors_of(ran, req), state.model_name, ran.tokens, req.encoding_format),
        ran.out.size if req.encoding_format == "float" else 0)
    if wants_explain:
        measured = dict(ran.phases, encode_s=encode_s, total_s=time.perf_counter() - start)
        explained = dict(ran.explain, measured=measured, dispatched=[
            {"bucket": list(shape), "rows_of_this_request": n, "reason": reason, "device_s": device_s}
            for shape, n, reason, device_s in ran.dispatched])
        body = body[:-1] + b', "explain": ' + orjson.dumps(explained) + b"}"
    return bytes_response(body)


def _wants_explain(request: web.Request) -> bool:
    flag = request.query.get("explain") or request.headers.get("X-Jaxserve-Explain") or ""
    return flag.lower() in ("1", "true", "yes")


async def plan(request: web.Request) -> web.Response:
    """The batches of a /v1/embeddings body and their predicted times, without running the model."""
    state = request.app[STATE]
    state.require_ready()
    require_kind(state, "embedding", "/v1/plan")
    body = await json_body(request)
    ask = ask_for(request, body, "/v1/embeddings")  # the class it would get there
    req = await parsed(state, ask, lambda: api.parse_openai_embeddings(body, state.limits, state.encoder.dim,
                                                                        state.config.long))

    def plan_only():
        pieces = tokenized(lambda: embedding_pieces(state, req, openai_ids=True))
        rows = pack(pieces.lengths, state.table)
        body = explain_rows(state, rows, pieces)
        cls, source = decide(ask, int(rows.docs.sum()), rows.real_tokens, state.config.class_policy)
        waiting = state.service.batcher.waiting()
        body.update(documents=req.count, sequences=pieces.count, usage={"prompt_tokens": rows.real_tokens},
                    request_class=CLASSES[cls], class_from=source,
                    would_wait_behind={c: n for c, n in waiting.items() if c == CLASSES[0] or cls == BULK})
        return orjson.dumps(body)

    return bytes_response(await on_tokenizer(state, plan_only))


async def classify(request: web.Request) -> web.Response:
    """vLLM-style /classify: per input its best label and the probabilities of all."""
    state = request.app[STATE]
    state.require_ready()
    require_kind(state, "classifier", "/classify")
    body = await json_body(request)
    texts = api.parse_classify(body, state.limits)
    truncate = state.config.long != "error"
    ran = await run_request(state, lambda: state.encoder.prepare_pairs(texts, truncate),
                            ask=ask_for(request, body), inputs=len(texts))
    labels = state.encoder.head.labels

    def encode():
        probs = api.scores(ran.out, raw=False)
        return orjson.dumps({
            "id": f"classify-{time.time_ns():x}", "object": "list", "created": int(time.time()),
            "model": state.model_name,
            "data": [{"index": i, "label": labels[int(p.argmax())], "probs": p.tolist(), "num_classes": len(labels)}
                     for i, p in enumerate(probs)],
            "usage": {"prompt_tokens": ran.tokens, "total_tokens": ran.tokens},
        })

    body, _ = await respond(state, encode, len(texts) * DICT_FLOATS + ran.out.size)
    return bytes_response(body)


def add_routes(app: web.Application) -> None:
    app.router.add_post("/v1/embeddings", embeddings)
    app.router.add_post("/embeddings", embeddings)  # TEI serves OpenAI's route under this name too
    app.router.add_post("/v1/plan", plan)
    app.router.add_post("/classify", classify)
