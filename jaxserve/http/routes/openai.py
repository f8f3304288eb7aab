"""OpenAI's embeddings route (and jaxserve's /v1/plan beside it), vLLM's /classify and its cross-encoder routes
(/v1/rerank in Jina's shape, /score); errors in OpenAI's shape."""

from __future__ import annotations

import time

import orjson
from aiohttp import web

from jaxserve.http import api
from jaxserve.http.api import ApiError
from jaxserve.http.classes import Ask, decide
from jaxserve.http.handling import (
    ask_for,
    bytes_response,
    embedding_pieces,
    expect_later,
    explain_rows,
    json_body,
    json_response,
    on_tokenizer,
    parsed,
    require_kind,
    respond,
    run_request,
    tokenized,
    vectors_of,
)
from jaxserve.http.routes import multivector as multivector_routes
from jaxserve.http.routes.tei import instruction_of, pair_scores, require_cross_encoder
from jaxserve.http.state import BODY_BYTES, DICT_FLOATS, STATE
from jaxserve.scheduling.batcher import BULK, CLASSES
from jaxserve.scheduling.planner import pack


async def embeddings(request: web.Request) -> web.Response:
    state = request.app[STATE]
    start = time.perf_counter()
    state.require_ready()
    if state.encoder.head.kind == "multivector":  # PyLate's server: per input its token vectors
        if _wants_explain(request):
            raise ApiError(400, "`explain` is for pooled embeddings; a multi-vector model's /v1/embeddings has none")
        body = await json_body(request)
        return await multivector_routes.embeddings(state, body, ask_for(request, body))
    require_kind(state, "embedding", "/v1/embeddings")
    body = await json_body(request)
    ask = ask_for(request, body)
    req = await parsed(state, ask, lambda: _parse_embeddings(state, body))
    wants_explain = _wants_explain(request)
    ran = await run_request(state, lambda: embedding_pieces(state, req, openai_ids=True), want_explain=wants_explain,
                            ask=ask, inputs=req.count)
    body, encode_s = await respond(  # every format combines and normalises the vectors first: request-sized
        state, lambda: api.openai_body(vectors_of(ran, req), state.model_name, ran.tokens, req.encoding_format,
                                      req.element),
        ran.floats)
    if wants_explain:
        measured = dict(ran.phases, encode_s=encode_s, total_s=time.perf_counter() - start)
        explained = dict(ran.explain, measured=measured, dispatched=[
            {"bucket": list(shape), "rows_of_this_request": n, "reason": reason, "device_s": device_s}
            for shape, n, reason, device_s in ran.dispatched])
        body = body[:-1] + b', "explain": ' + orjson.dumps(explained) + b"}"
    return bytes_response(body)


def _parse_embeddings(state, body) -> api.EmbedRequest:
    """OpenAI's embeddings body (/v1/embeddings, /v1/plan); its `dimensions` limited to the checkpoint's Matryoshka
    widths where it declares them (`EmbeddingConfig.matryoshka_dimensions`)."""
    enc = state.encoder
    return api.parse_openai_embeddings(body, state.limits, enc.dim, state.config.long, enc.tokenizer.max_length,
                                       enc.embedding_config.matryoshka_dimensions)


def _wants_explain(request: web.Request) -> bool:
    flag = (request.query_string and request.query.get("explain")) or request.headers.get("X-Jaxserve-Explain") or ""
    return flag.lower() in ("1", "true", "yes")


async def plan(request: web.Request) -> web.Response:
    """The batches of a /v1/embeddings body and their predicted times, without running the model."""
    state = request.app[STATE]
    state.require_ready()
    require_kind(state, "embedding", "/v1/plan")
    body = await json_body(request)
    ask = ask_for(request, body, "/v1/embeddings")  # the class it would get there
    req = await parsed(state, ask, lambda: _parse_embeddings(state, body))

    def plan_only():
        pieces = tokenized(lambda: embedding_pieces(state, req, openai_ids=True))
        rows = pack(pieces.lengths, state.table)
        cls, source = decide(ask, pieces.count, rows.real_tokens, state.config.class_policy)
        body = explain_rows(state, rows, pieces, cls)
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
    truncate, cut, side = _vllm_cut(state, body)
    texts = api.parse_classify(body, state.limits, api.cut_end(truncate, side))
    raw = not api.vllm_activation(body)
    ran = await run_request(state, lambda: state.encoder.prepare_pairs(texts, truncate, side, limit=cut),
                            ask=ask_for(request, body), inputs=len(texts))
    labels = state.encoder.head.labels

    def encode():
        probs = api.scores(ran.out, raw=raw)
        return orjson.dumps({
            "id": f"classify-{time.time_ns():x}", "object": "list", "created": int(time.time()),
            "model": state.model_name,
            "data": [{"index": i, "label": labels[int(p.argmax())], "probs": p.tolist(), "num_classes": len(labels)}
                     for i, p in enumerate(probs)],
            "usage": {"prompt_tokens": ran.tokens, "total_tokens": ran.tokens},
        })

    body, _ = await respond(state, encode, len(texts) * DICT_FLOATS + ran.floats)
    return bytes_response(body)


async def rerank(request: web.Request) -> web.Response:
    """vLLM's /v1/rerank (Jina's shape)."""
    state = request.app[STATE]
    state.require_ready()
    body = await json_body(request)
    return await jina_rerank(state, body, ask_for(request, body), request.path)


async def jina_rerank(state, body, ask, path: str = "/v1/rerank") -> web.Response:
    """Jina's rerank shape, which vLLM serves on /v1/rerank and /rerank (and Infinity on /rerank): `query`,
    `documents`, `top_n` -> results best first with `relevance_score` (the cross-encoder's sigmoid, as TEI's
    /rerank) and, unless `return_documents` is false, the text."""
    if state.encoder.head.kind == "multivector" and path == "/rerank":
        raise ApiError(400, "a multi-vector model's /rerank takes TEI's body, `query` and `texts` (scored by MaxSim); "
                            "Jina's `documents` are served for cross-encoders")
    require_cross_encoder(state, path)
    truncate, cut, side = _vllm_cut(state, body)
    query, documents, top_n, with_docs = _parse_rerank(body, state, api.cut_end(truncate, side))
    scores, ran = await pair_scores(state, [(query, d) for d in documents], ask, truncate, side,
                                    not api.vllm_activation(body), instruction_of(state, body), cut)
    tokens = ran.tokens

    def encode():
        order = sorted(enumerate(scores().tolist()), key=lambda t: -t[1])[:top_n]
        return orjson.dumps({
            "id": f"rerank-{time.time_ns():x}", "model": state.model_name, "usage": {"total_tokens": tokens},
            "results": [{"index": i, "relevance_score": s, **({"document": {"text": documents[i]}} if with_docs else {})}
                        for i, s in order],
        })

    encoded, _ = await respond(state, encode, len(documents) * DICT_FLOATS)
    return bytes_response(encoded)


def _vllm_cut(state, body) -> tuple[bool, int | None, str]:
    """A vLLM classify, score or rerank body's truncation (`api.vllm_truncation`): (truncate at all, the request's own
    length or None, the side cut). vLLM cuts a score template's whole rendered prompt at N, its end included; an LLM
    reranker's template here keeps its end, so N is refused for one, where -1 is served."""
    enc = state.encoder
    long, cut, side = api.vllm_truncation(api._object(body), state.config.long, enc.tokenizer.max_length)
    if cut is not None and enc.pair_template is not None:
        raise ApiError(400, f"`truncate_prompt_tokens` {cut} is not served for an LLM reranker: its prompt template is "
                            "cut at the model's length only (-1), keeping the template's end")
    return long != "error", cut, side


def _parse_rerank(body, state, chars_cut: str | None) -> tuple[str, list[str], int, bool]:
    """`chars_cut`: the end a text past --max-input-chars is cut at (`api.within_limit`), where the body truncates."""
    body = api._object(body)
    query = body.get("query")
    if not isinstance(query, str) or not query:
        raise ApiError(400, "`query` must be a non-empty string")
    if "documents" not in body:
        raise ApiError(400, "missing required field `documents`")
    documents = api.texts_of(body["documents"], "documents", state.limits, cut=chars_cut)
    query = api.within_limit(query, "query", state.limits, chars_cut)  # by the same limits as the documents'
    top_n = body.get("top_n")
    if top_n is not None and (not isinstance(top_n, int) or isinstance(top_n, bool) or top_n < 0):
        raise ApiError(400, "`top_n` must be a non-negative integer")
    top_n = top_n or len(documents)  # vLLM: 0 or absent is every document
    with_docs = body.get("return_documents", True)
    if not isinstance(with_docs, bool):
        raise ApiError(400, "`return_documents` must be a boolean")
    return query, documents, top_n, with_docs


async def score(request: web.Request) -> web.Response:
    """vLLM's /score: `text_1` and `text_2`, each a text or a list (one against many, or pairwise) -> per pair its
    score (the cross-encoder's sigmoid, as /rerank), in pair order."""
    state = request.app[STATE]
    state.require_ready()
    require_cross_encoder(state, request.path)
    body = api._object(await json_body(request))
    truncate, cut, side = _vllm_cut(state, body)
    sides = []
    for key in ("text_1", "text_2"):
        if key not in body:
            raise ApiError(400, f"missing required field `{key}`")
        texts = api.texts_of(body[key], key, state.limits, cut=api.cut_end(truncate, side))
        sides.append(texts)
    first, second = sides
    if len(first) == 1:
        first = first * len(second)
    if len(first) != len(second):
        raise ApiError(400, f"`text_1` has {len(first)} texts and `text_2` {len(second)}: give one `text_1`, "
                            "or as many as `text_2`")
    scores, ran = await pair_scores(state, list(zip(first, second)), ask_for(request, body), truncate, side,
                                    not api.vllm_activation(body), instruction_of(state, body), cut)
    tokens = ran.tokens

    def encode():
        return orjson.dumps({
            "id": f"score-{time.time_ns():x}", "object": "list", "created": int(time.time()),
            "model": state.model_name,
            "data": [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores().tolist())],
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens, "completion_tokens": 0},
        })

    encoded, _ = await respond(state, encode, len(second) * DICT_FLOATS)
    return bytes_response(encoded)


async def vllm_tokenize(state, body, ask, path: str = "/tokenize") -> web.Response:
    """vLLM's /tokenize (a completion's shape: `prompt`, `add_special_tokens`, `return_token_strs`) -> its token ids,
    their count and the model's length: what clients of vLLM count tokens with before they chunk a document."""
    prompt, special, strs = await parsed(state, ask, lambda: api.parse_vllm_tokenize(body, state.limits))
    tok = state.encoder.tokenizer.tokenizer

    def encode() -> bytes:
        e = tok.encode(prompt, add_special_tokens=special)
        return orjson.dumps({"count": len(e.ids), "max_model_len": max_model_len(state),
                             "tokens": e.ids, "token_strs": e.tokens if strs else None})

    return bytes_response(await on_tokenizer(state, lambda: tokenized(encode)))


async def detokenize(request: web.Request) -> web.Response:
    """vLLM's /detokenize: `tokens` -> `{"prompt": their text}`, special tokens kept, as vLLM decodes them."""
    state = request.app[STATE]
    state.require_ready()
    body = await json_body(request)
    ids = await parsed(state, Ask(body_bytes=request.get(BODY_BYTES, 0)),  # no model run: no class, as TEI's /decode
                       lambda: api.parse_detokenize(body, state.limits, state.encoder.arch.vocab_size))
    tok = state.encoder.tokenizer.tokenizer
    text = await on_tokenizer(state, lambda: tokenized(lambda: tok.decode(ids.tolist(), skip_special_tokens=False)))
    return json_response({"prompt": text})


def max_model_len(state) -> int:
    """vLLM's `max_model_len`: the tokens a sequence holds, special tokens included (the tokenizer's limit)."""
    return state.encoder.tokenizer.max_length


def model_card(state) -> dict:
    """The served model as OpenAI lists it, with vLLM's `root` and `max_model_len`."""
    return {"id": state.model_name, "object": "model", "created": int(time.time()), "owned_by": "jaxserve",
            "root": state.model_name, "parent": None, "max_model_len": max_model_len(state)}


async def models(request: web.Request) -> web.Response:
    """OpenAI's model list (`GET /v1/models`), as vLLM and Infinity serve it: what the openai SDK's
    `models.list()`, LiteLLM and chat front-ends such as Open WebUI read to find (and check) the served model;
    503 while it warms, as every model route (a model listed can be used)."""
    state = request.app[STATE]
    state.require_ready()
    return json_response({"object": "list", "data": [model_card(state)]})


async def model(request: web.Request) -> web.Response:
    """OpenAI's `GET /v1/models/{model}` (the SDK's `models.retrieve`): the served model, else 404."""
    state = request.app[STATE]
    state.require_ready()
    name = request.match_info["model"]
    if name != state.model_name:
        raise ApiError(404, f"the model {api._show(name)} does not exist; this server serves {state.model_name!r}",
                       "not_found_error")
    return json_response(model_card(state))


def add_routes(app: web.Application) -> None:
    routes = {"/v1/embeddings": embeddings, "/embeddings": embeddings,  # TEI serves OpenAI's route under this name too
              "/v1/plan": plan, "/classify": classify, "/v1/rerank": rerank, "/score": score, "/v1/score": score,
              "/detokenize": detokenize}
    for path, handler in routes.items():
        app.router.add_post(path, handler, expect_handler=expect_later)
    for prefix in ("/v1/models", "/models"):  # Infinity's is /models
        app.router.add_get(prefix, models)
        app.router.add_get(prefix + "/{model:.+}", model)  # a model's name holds its organisation's slash
