"""text-embeddings-inference's routes, behaving as TEI's router does (router/src/http/server.rs).

`POST /` (and SageMaker's `/invocations`) dispatches by the served model's
kind, as TEI does: a classifier's `/predict`, a cross-encoder's (one label)
`/rerank`, a SPLADE model's `/embed_sparse`, an embedding model's `/embed`, or `/similarity` when the body's
`inputs` is a {source_sentence, sentences} object (huggingface_hub's
`sentence_similarity`, which TEI serves only under TASK=sentence-similarity).
`POST /vertex` runs a list of such bodies (Vertex AI's `instances`).
Errors on these routes are TEI's `{"error", "error_type"}` with TEI's codes
(the middleware writes them: `api.ApiError.tei`).
"""

from __future__ import annotations

import asyncio
import itertools

import numpy as np
import orjson
from aiohttp import web

from jaxserve.checkpoint import llm_reranker
from jaxserve.errors import InputError
from jaxserve.heads import sparse
from jaxserve.http import api
from jaxserve.http.api import ApiError
from jaxserve.http.classes import NO_ASK, Ask
from jaxserve.http.handling import (
    ask_for,
    bytes_response,
    embedding_pieces,
    expect_later,
    json_body,
    on_tokenizer,
    parsed,
    request_prompt,
    require_kind,
    respond,
    run_request,
    tei_headers,
    tokenized,
    vectors_of,
)
from jaxserve.http.routes import bge_m3 as m3_routes
from jaxserve.http.routes import multivector as multivector_routes
from jaxserve.http.state import BODY_BYTES, DICT_FLOATS, STATE, AppState

PATHS = ("/", "/invocations", "/vertex", "/embed", "/embed_all", "/embed_sparse", "/similarity", "/predict",
         "/rerank", "/tokenize", "/decode", "/embed_m3")


def kind(state: AppState) -> str:
    """TEI's model kind: embedding, sparse (SPLADE), classifier, or reranker (a classifier with one label)."""
    head = state.encoder.head
    if head.kind in ("embedding", "sparse", "multivector"):
        return head.kind
    return "reranker" if head.num_labels == 1 else "classifier"


async def _embed(state: AppState, body, ask: Ask = NO_ASK) -> web.Response:
    require_kind(state, "embedding", "/embed")
    req = await parsed(state, ask, lambda: api.parse_tei_embed(body, state.limits, state.encoder.dim, state.config.long))
    ran = await run_request(state, lambda: embedding_pieces(state, req), ask=ask, inputs=req.count)
    encoded, _ = await respond(state, lambda: orjson.dumps(vectors_of(ran, req), option=orjson.OPT_SERIALIZE_NUMPY),
                               ran.floats)
    return bytes_response(encoded, tei_headers(state, ran, req.inputs))


async def _embed_sparse(state: AppState, body, ask: Ask = NO_ASK) -> web.Response:
    """Per input its non-zero SPLADE weights [{"index", "value"}], index order (TEI's EmbedSparseResponse): every
    one, a sequence over the cap from its full row, kept into the job by the same pass (`Job.kept`). A BGE-M3
    model's lexical weights in the same shape."""
    if state.encoder.m3 is not None:
        return await m3_routes.embed_sparse(state, body, ask)
    require_kind(state, "sparse", "/embed_sparse")
    req = await parsed(state, ask, lambda: api.parse_tei_embed_sparse(body, state.limits, state.config.long))
    ran = await run_request(state, lambda: embedding_pieces(state, req), ask=ask, inputs=req.count)
    enc = state.encoder
    floats = ran.floats + len(ran.job.kept) * enc.splade.vocab_size  # at most

    def encode():  # joined, not added: a large bytes join lets go of the GIL, and so of the event loop
        rows = sparse.SparseRows(ran.out, ran.job.kept)
        return b"".join((b"[", b",".join(sparse.json_rows(rows, enc.splade)), b"]"))

    encoded, _ = await respond(state, encode, floats)
    return bytes_response(encoded, tei_headers(state, ran, req.inputs))


async def _embed_all(state: AppState, body, ask: Ask = NO_ASK) -> web.Response:
    require_kind(state, "embedding", "/embed_all")
    if state.encoder.m3 is not None:
        raise ApiError(400, "a BGE-M3 server's token outputs are its heads' (/embed_m3), not its hidden states")
    if "tokens" not in state.encoder.engine.tables:
        raise ApiError(400, "/embed_all is off on this server (started with --no-embed-all)")
    req = await parsed(state, ask,
                       lambda: api.parse_tei_embed_all(body, state.limits, state.encoder.dim, state.config.long))
    if req.long == "chunk":
        raise ApiError(400, "/embed_all returns each input's own tokens: `long: chunk` does not apply")
    ran = await run_request(state, lambda: embedding_pieces(state, req), output="tokens", ask=ask,
                            inputs=req.count)
    encoded, _ = await respond(
        state, lambda: orjson.dumps([ran.job.token_vectors(p) for p in range(ran.pieces.count)],
                                    option=orjson.OPT_SERIALIZE_NUMPY), ran.floats)
    return bytes_response(encoded, tei_headers(state, ran, req.inputs))


async def _similarity(state: AppState, body, ask: Ask = NO_ASK) -> web.Response:
    """Cosine similarity of `source_sentence` to each of `sentences` (TEI: un-normalised embeddings, then cosine)."""
    require_kind(state, "embedding", "/similarity")
    req, _ = api.parse_similarity(body, state.limits, state.config.long)
    ran = await run_request(state, lambda: embedding_pieces(state, req), ask=ask, inputs=req.count)

    def similarities() -> bytes:
        vectors = vectors_of(ran, req)
        unit = vectors / np.maximum(np.linalg.norm(vectors, axis=1, keepdims=True), 1e-12)
        return orjson.dumps((unit[1:] @ unit[0]).astype(np.float32), option=orjson.OPT_SERIALIZE_NUMPY)

    encoded, _ = await respond(state, similarities, ran.floats)
    return bytes_response(encoded, tei_headers(state, ran, req.inputs))


async def _predict(state: AppState, body, ask: Ask = NO_ASK) -> web.Response:
    """Labels with scores, best first (softmax, or sigmoid for one logit; `raw_scores`: logits)."""
    require_kind(state, "classifier", "/predict")
    req = api.parse_predict(body, state.limits, state.config.long != "error")
    ran = await run_request(state, lambda: state.encoder.prepare_pairs(req.inputs, req.truncate, req.direction),
                            ask=ask, inputs=len(req.inputs))
    labels = state.encoder.head.labels

    def predictions() -> bytes:
        results = []
        for row in api.scores(ran.out, req.raw_scores, req.function):
            values = row.tolist()
            results.append([{"label": labels[i], "score": values[i]} for i in api.tei_order(row)[: req.top_k]])
        return orjson.dumps(results[0] if req.single else results)

    encoded, _ = await respond(state, predictions, ran.floats * DICT_FLOATS)
    return bytes_response(encoded, tei_headers(state, ran, req.inputs))


async def _rerank(state: AppState, body, ask: Ask = NO_ASK) -> web.Response:
    """(query, text) pairs through the cross-encoder, sorted by score (a multi-vector model: by MaxSim)."""
    instruction = instruction_of(state, body)
    if state.encoder.head.kind == "multivector":
        return await multivector_routes.rerank(state, body, ask)
    require_cross_encoder(state, "/rerank")
    query, texts, raw, return_text, truncate, direction = api.parse_rerank(body, state.limits,
                                                                           state.config.long != "error")
    pairs = [(query, t) for t in texts]
    scores, ran = await pair_scores(state, pairs, ask, truncate, direction, raw, instruction)

    def ranked() -> bytes:
        values = scores()
        best = values.tolist()
        return orjson.dumps([{"index": i, "score": best[i], **({"text": texts[i]} if return_text else {})}
                             for i in api.tei_order(values)])

    encoded, _ = await respond(state, ranked, len(texts) * DICT_FLOATS)
    return bytes_response(encoded, tei_headers(state, ran, pairs))


def require_cross_encoder(state: AppState, route: str) -> None:
    """A cross-encoder with one output (an LLM reranker included), else 400."""
    require_kind(state, "classifier", route)
    if state.encoder.head.num_labels != 1:
        raise api.wrong_model(f"{route} needs a cross-encoder with one output; this server serves a model with "
                              f"{state.encoder.head.num_labels} labels (use /predict)")


def instruction_of(state: AppState, body) -> str | None:
    """A rerank body's `instruction` (as Qwen3-Reranker's card, and the hosted APIs that serve it, name it): the task
    in the prompt's instruction slot, at most an input's length; a model without that slot refuses one
    (`llm_reranker.with_instruction`), before anything is tokenized."""
    instruction = body.get("instruction") if isinstance(body, dict) else None
    if isinstance(instruction, str):
        api.within_limit(instruction, "instruction", state.limits)
    try:
        llm_reranker.with_instruction(state.encoder.pair_template, instruction)
    except InputError as err:
        raise ApiError(400, str(err)) from None
    return instruction


async def pair_scores(state: AppState, pairs: list[tuple[str, str]], ask: Ask, truncate: bool,
                      direction: str = "right", raw: bool = False, instruction: str | None = None,
                      limit: int | None = None):
    """(text, text) pairs through the cross-encoder, the one run behind /rerank, /v1/rerank and /score ->
    (their scores, lazily: the sigmoid of each logit, as CrossEncoder.predict; `raw`: the logits; the run).
    `instruction`: in the prompt's slot (`instruction_of`); `limit`: a request's own length (vLLM's
    `truncate_prompt_tokens`)."""
    ran = await run_request(state, lambda: state.encoder.prepare_pairs(pairs, truncate, direction, instruction, limit),
                            ask=ask, inputs=len(pairs))
    return (lambda: api.scores(ran.out, raw)[:, 0]), ran


async def _tokenize(state: AppState, body, ask: Ask = NO_ASK) -> web.Response:
    texts, add_special, prompt_name, prompt_text = await parsed(state, ask,
                                                                lambda: api.parse_tokenize(body, state.limits))
    tok = state.encoder.tokenizer.tokenizer
    kind = state.encoder.head.kind
    if kind in ("embedding", "sparse"):
        prompt = request_prompt(state, api.EmbedRequest(texts, None, "truncate", prompt_name=prompt_name,
                                                        prompt=prompt_text))
    else:
        api._refuse(body, ("prompt_name", "prompt"), f"a {kind} model", "prompts apply to embedding models")
        prompt = None
    texts = [prompt + t for t in texts] if prompt else texts

    def tokens() -> bytes:  # per token Python objects: on a tokenizer thread
        out = []
        for text, e in zip(texts, tok.encode_batch(texts, add_special_tokens=add_special)):
            at = _byte_offsets(text)
            out.append([
                {"id": tid, "text": token if special else text[a:b], "special": bool(special),
                 "start": None if special else at(a), "stop": None if special else at(b)}
                for tid, token, (a, b), special in zip(e.ids, e.tokens, e.offsets, e.special_tokens_mask)
            ])
        return orjson.dumps(out)

    return bytes_response(await on_tokenizer(state, lambda: tokenized(tokens)))


def _byte_offsets(text: str):
    """Character offset -> UTF-8 byte offset in `text`: TEI's /tokenize answers the byte offsets of Rust's
    tokenizers (core/src/tokenization.rs `into_tokens` slices the input's bytes), Python's gives characters."""
    if text.isascii():
        return lambda i: i
    return list(itertools.accumulate((len(c.encode()) for c in text), initial=0)).__getitem__


async def _decode(state: AppState, body, ask: Ask = NO_ASK) -> web.Response:
    ids, skip_special = await parsed(state, ask,
                                     lambda: api.parse_decode(body, state.limits, state.encoder.arch.vocab_size))
    tok = state.encoder.tokenizer.tokenizer
    decode = lambda: tok.decode_batch(ids, skip_special_tokens=skip_special)
    return bytes_response(await on_tokenizer(state, lambda: orjson.dumps(tokenized(decode))))


HANDLERS = {"/embed": _embed, "/embed_all": _embed_all, "/embed_sparse": _embed_sparse, "/similarity": _similarity, "/predict": _predict,
            "/rerank": _rerank, "/tokenize": _tokenize, "/decode": _decode, "/embed_m3": m3_routes.embed_m3}


NO_MODEL_RUN = ("/tokenize", "/decode")  # no class asked for: only the body's size (checked off the loop if large)


def route(path: str, handler, vllm: tuple | None = None):
    """The aiohttp handler of TEI's route `path`. `vllm`: where vLLM serves the same path, (the field of its body,
    its handler(state, body, ask, path), the vLLM route it runs as): a body with that field and without TEI's own
    (`TEI_FIELDS`) is vLLM's, held to that route's class ceiling too (`ask_for`'s `runs`)."""
    runs_model = path not in NO_MODEL_RUN

    async def handle(request: web.Request) -> web.Response:
        state = request.app[STATE]
        state.require_ready()
        body = await json_body(request)
        run, runs = handler, None
        if vllm is not None and isinstance(body, dict) and vllm[0] in body and TEI_FIELDS[path] not in body:
            _, theirs, runs = vllm
            run = lambda state, body, ask: theirs(state, body, ask, path)
        if not runs_model:
            return await run(state, body, Ask(body_bytes=request.get(BODY_BYTES, 0)))
        return await run(state, body, ask_for(request, body, runs=runs))

    return handle


def kind_route(state: AppState, body) -> str:
    """The route TEI's `POST /` runs a body on: the model kind's own (an embedding model's /similarity for a body
    whose `inputs` is an object)."""
    model = kind(state)
    if model == "classifier":
        return "/predict"
    if model in ("reranker", "multivector"):
        return "/rerank"
    if model == "sparse":
        return "/embed_sparse"
    return "/similarity" if isinstance(body, dict) and isinstance(body.get("inputs"), dict) else "/embed"


async def root(request: web.Request) -> web.Response:
    """TEI's `POST /`: the model kind's own route."""
    state = request.app[STATE]
    state.require_ready()
    body = await json_body(request)
    path = kind_route(state, body)
    return await HANDLERS[path](state, body, ask_for(request, body, runs=path))  # held to that route's ceiling too


async def vertex(request: web.Request) -> web.Response:
    """TEI's `POST /vertex`, Vertex AI's prediction shape: `instances`, each a body as `POST /` takes it, run at
    once -> `{"predictions": [each one's answer, in order]}`. Each instance is a request of its own to
    `--max-concurrent-requests`, as each takes a permit of TEI's; an instance refused fails the request with its
    error, as TEI's does, the others cancelled (their rows dropped)."""
    state = request.app[STATE]
    state.require_ready()
    body = await json_body(request)
    instances = body.get("instances") if isinstance(body, dict) else None
    if not isinstance(instances, list):
        raise ApiError(400, "`instances` must be a list of request bodies")
    if not instances:
        raise api.empty("instances")
    if len(instances) > state.limits.max_client_batch:
        raise ApiError(413, f"`instances` has {len(instances)} bodies; at most {state.limits.max_client_batch}",
                       "request_too_large")
    more = len(instances) - 1  # the middleware counted this request once
    state.require_room(more, f" and this one has {len(instances)} instances")
    state.active += more
    try:
        async with asyncio.TaskGroup() as group:
            runs = [group.create_task(HANDLERS[path](state, instance, ask_for(request, instance, runs=path)))
                    for path, instance in ((kind_route(state, i), i) for i in instances)]
    except BaseExceptionGroup as failed:  # the first refused (the rest cancelled)
        raise failed.exceptions[0] from None
    finally:
        state.active -= more
    return bytes_response(b"".join((b'{"predictions":[', b",".join(run.result().body for run in runs), b"]}")))


TEI_FIELDS = {"/rerank": "texts", "/tokenize": "inputs"}  # a TEI body's own field on routes vLLM shares


def add_routes(app: web.Application, vllm: dict | None = None) -> None:
    """TEI's routes. `vllm`: vLLM's bodies on the paths TEI shares with it (`route`'s): Jina's rerank shape on
    /rerank, which vLLM and Infinity serve there and their clients send; vLLM's `prompt` on /tokenize."""
    for path, handler in HANDLERS.items():
        app.router.add_post(path, route(path, handler, (vllm or {}).get(path)), expect_handler=expect_later)
    app.router.add_post("/", root, expect_handler=expect_later)
    app.router.add_post("/invocations", root, expect_handler=expect_later)
    app.router.add_post("/vertex", vertex, expect_handler=expect_later)
