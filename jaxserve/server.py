"""The HTTP service: aiohttp routes over the encoder, the batcher and one device worker.

Data flows one way: HTTP -> validate (api.py) -> tokenize + plan (a thread)
-> batcher -> device worker (service.py) -> scatter -> response.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import hmac
import json
import logging
import time

import numpy as np
from aiohttp import web

from jaxserve import api, checkpoint, compiles, device
from jaxserve.api import ApiError, EmbedRequest, Limits
from jaxserve.batcher import QueueFull
from jaxserve.buckets import BucketTable
from jaxserve.encoder import Encoder, normalize_rows
from jaxserve.errors import InputError, TooLongError
from jaxserve.explain import explain
from jaxserve.metrics import ServerMetrics
from jaxserve.planner import plan
from jaxserve.service import DeviceError, Draining, EmbeddingService

log = logging.getLogger("jaxserve.server")

# Limits, each with its reason.
MAX_BODY_BYTES = 16 * 2**20  # 1024 inputs of ~16 k characters; larger bodies are refused before parsing (413)
MAX_CLIENT_BATCH = 1024  # inputs per request: a 100-document request with room to spare
MAX_INPUT_CHARS = 100_000  # characters per input: ~25 k tokens, ~100 chunk windows at most
MAX_QUEUE = 4096  # sequences waiting for the device; past it, 429 (memory stays bounded)
MAX_WAIT_MS = 5.0  # batch window: how long a partial batch may wait for company while the device is busy
DRAIN_TIMEOUT_S = 30.0  # SIGTERM: how long accepted work may take to finish
RETRY_AFTER_S = 1  # told to clients on 429/503
MAX_CONCURRENT_REQUESTS = 512  # model requests being handled at once; past it, 429 (bounds tokenizer and queue work)
REQUEST_TIMEOUT_S = 60.0  # a model request still unanswered after this gets 503 and its waiting rows are dropped


@dataclasses.dataclass(frozen=True)
class ServerConfig:
    model: str | None = None  # checkpoint dir or hub id; None = $JAXSERVE_MODEL, else bundled all-MiniLM-L6-v2
    model_name: str | None = None  # name reported in responses (default: the model argument or directory name)
    dtype: str = "float32"
    buckets: str = "auto"  # a bucket table JSON file, or auto (derived for this device)
    ladder: str = "default"
    layout: str = "packed"
    max_wait_ms: float = MAX_WAIT_MS
    max_queue: int = MAX_QUEUE
    max_client_batch: int = MAX_CLIENT_BATCH
    max_input_chars: int = MAX_INPUT_CHARS
    max_body_bytes: int = MAX_BODY_BYTES
    long: str = "truncate"  # default for inputs over the model's limit
    api_key: str | None = None
    max_concurrent: int = MAX_CONCURRENT_REQUESTS
    request_timeout_s: float = REQUEST_TIMEOUT_S
    cache_dir: str | None = None  # persistent compilation cache; None = default location
    use_cache: bool = True
    streams: int | None = None  # batches executing at once (default: the device's, 2 on CPU)
    devices: int | str = 1  # local devices sharing each batch (data parallel), or "all"

    def __post_init__(self):
        if self.max_queue < self.max_client_batch:
            raise ValueError(f"max_queue ({self.max_queue}) must be at least max_client_batch ({self.max_client_batch})")


class AppState:
    """Everything the handlers share; `ready` once the buckets are warm."""

    def __init__(self, config: ServerConfig, encoder: Encoder | None):
        self.config = config
        self.encoder = encoder
        self.metrics = ServerMetrics()
        self.service: EmbeddingService | None = None
        self.table: BucketTable | None = None
        self.ready = False
        self.failed: str | None = None
        self.tokenizer_pool = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="jaxserve-tokenize")
        self.limits = Limits(config.max_client_batch, config.max_input_chars)
        self.active = 0  # model requests being handled

    @property
    def model_name(self) -> str:
        return self.config.model_name or checkpoint.named(self.config.model) or "sentence-transformers/all-MiniLM-L6-v2"

    def require_ready(self) -> None:
        if self.service is not None and self.service.draining:
            raise ApiError(503, "the server is draining; retry on another replica", "unavailable",
                           {"Retry-After": str(RETRY_AFTER_S)})
        if not self.ready:
            raise ApiError(503, self.failed or "the model is warming up", "unavailable",
                           {"Retry-After": str(RETRY_AFTER_S)})


STATE = web.AppKey("state", AppState)


# ---- start-up: load, warm, then serve ----

def load_encoder(config: ServerConfig) -> Encoder:
    return Encoder.from_pretrained(config.model, dtype=config.dtype, devices=config.devices)


def warm(state: AppState) -> BucketTable:
    """Compile and time every bucket (blocking; runs in a thread while /health says 503)."""
    enc, cfg = state.encoder, state.config
    if cfg.use_cache:
        compiles.enable_persistent_cache(cfg.cache_dir)
    if enc.engine.table is not None and cfg.buckets == "auto":
        return enc.engine.table  # warmed by the caller (tests, embedding scripts)
    table = BucketTable.load(cfg.buckets) if cfg.buckets != "auto" else enc.derive_table(cfg.ladder, cfg.layout)
    return enc.warmup(table, progress=True)


async def lifecycle(app: web.Application):
    state = app[STATE]
    cfg = state.config
    loop = asyncio.get_running_loop()

    async def start():
        try:
            if state.encoder is None:
                state.encoder = await loop.run_in_executor(None, load_encoder, cfg)
            state.table = await loop.run_in_executor(None, warm, state)
        except Exception as exc:
            state.failed = f"warmup failed: {type(exc).__name__}: {exc}"
            log.error(state.failed)
            return
        enc = state.encoder
        state.service = EmbeddingService(enc.engine, state.table, enc.out_dim, cfg.max_wait_ms / 1000, cfg.max_queue,
                                         state.metrics, streams=cfg.streams or device.describe().streams)
        await state.service.start()
        state.ready = True
        log.info("ready: %d buckets, %d XLA compiles so far", len(state.table.buckets), compiles.xla_compiles_total())

    starting = asyncio.create_task(start())
    yield
    starting.cancel()
    if state.service is not None:
        await state.service.stop()
    state.tokenizer_pool.shutdown(wait=False)


async def on_shutdown(app: web.Application) -> None:
    """SIGTERM: the listening socket is closed already; finish what was accepted, refuse the rest."""
    state = app[STATE]
    if state.service is not None:
        finished = await state.service.drain(DRAIN_TIMEOUT_S)
        log.info("drained: %s", "all accepted requests finished" if finished else "timed out")


# ---- middleware: errors as JSON, auth, metrics ----

@web.middleware
async def errors_middleware(request: web.Request, handler):
    state = request.app[STATE]
    route = request.match_info.route.resource.canonical if request.match_info.route.resource else "unmatched"
    start = time.perf_counter()
    model_route = request.method == "POST"
    try:
        _authorize(request, state.config.api_key)
        if model_route and state.active >= state.config.max_concurrent:
            raise ApiError(429, f"{state.active} requests are being handled; the limit is "
                                f"{state.config.max_concurrent}", "rate_limit_error", {"Retry-After": str(RETRY_AFTER_S)})
        state.active += model_route
        try:
            response = await handler(request)
        finally:
            state.active -= model_route
    except ApiError as err:
        response = _error(err)
    except web.HTTPException as exc:
        kind = {404: "not_found_error", 405: "method_not_allowed", 413: "request_too_large"}.get(exc.status, "http_error")
        message = {404: f"no route {request.method} {request.path}",
                   405: f"method {request.method} is not allowed on {request.path}",
                   413: f"request body over {state.config.max_body_bytes} bytes"}.get(exc.status, exc.reason)
        response = _error(ApiError(exc.status, message, kind))
    except Exception as exc:  # a bug: say so without echoing the request
        log.exception("unhandled error on %s", route)
        response = _error(ApiError(500, f"internal error: {type(exc).__name__}", "server_error"))
    state.metrics.requests.labels(route, str(response.status)).inc()
    state.metrics.request_duration.labels(route).observe(time.perf_counter() - start)
    if response.status >= 400:
        state.metrics.errors.labels(getattr(response, "error_type", "http_error")).inc()
    return response


def _authorize(request: web.Request, api_key: str | None) -> None:
    if api_key is None or request.path == "/health":
        return
    given = request.headers.get("Authorization", "")
    scheme, _, token = given.partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), api_key.encode()):
        raise ApiError(401, "missing or wrong API key (send `Authorization: Bearer KEY`)", "authentication_error",
                       {"WWW-Authenticate": "Bearer"})


def _error(err: ApiError) -> web.Response:
    response = web.json_response(err.body(), status=err.status, headers=err.headers)
    response.error_type = err.type
    return response


async def _json_body(request: web.Request):
    raw = await request.read()  # raises 413 past client_max_size
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ApiError(400, f"the request body is not valid JSON: {exc}") from None


# ---- the embedding path ----

@dataclasses.dataclass
class Embedded:
    vectors: np.ndarray  # [N, D] in input order
    tokens: int  # run through the model
    phases: dict  # seconds per phase
    explain: dict | None  # the plan with its predicted times, when asked (measured ones are in `phases`)


async def plan_request(state: AppState, make_pieces, too_long_status: int = 400):
    """Tokenize (`make_pieces()`) and plan on a thread, no device work: (pieces, plan)."""

    def work():
        pieces = make_pieces()
        return pieces, plan([len(s) for s in pieces.seqs], state.encoder.table)

    try:
        return await asyncio.get_running_loop().run_in_executor(state.tokenizer_pool, work)
    except TooLongError as err:
        raise ApiError(too_long_status, str(err), "request_too_large" if too_long_status == 413 else
                       "invalid_request_error") from None
    except InputError as err:
        raise ApiError(400, str(err)) from None


def explain_plan(state: AppState, pieces, planned) -> dict:
    service = state.service
    return explain(planned, state.table, service.timings, pieces.doc, service.batcher.backlog(),
                   service.batches_in_flight, state.config.max_wait_ms / 1000)


async def run_planned(state: AppState, pieces, planned):
    """Through the batcher and the device: [P, out_dim] per sequence, and the request's timing."""
    rows = [(row, sum(planned.lengths[i] for i in row)) for b in planned.batches for row in b.rows]
    timeout = state.config.request_timeout_s
    try:
        return await asyncio.wait_for(state.service.run(pieces.seqs, rows, pieces.types), timeout)
    except asyncio.TimeoutError:
        raise ApiError(503, f"the request did not finish within {timeout:g} s; its waiting rows were dropped",
                       "timeout", {"Retry-After": str(RETRY_AFTER_S)}) from None
    except QueueFull as err:
        raise ApiError(429, f"queue full: {err}", "rate_limit_error", {"Retry-After": str(RETRY_AFTER_S)}) from None
    except Draining as err:
        raise ApiError(503, str(err), "unavailable", {"Retry-After": str(RETRY_AFTER_S)}) from None
    except DeviceError as err:
        raise ApiError(500, str(err), "server_error") from None


def require_kind(state: AppState, kind: str, route: str) -> None:
    head = state.encoder.head
    if head.kind != kind:
        what = {"embedding": "an embedding model", "classifier": "a sequence-classification or cross-encoder model"}
        raise ApiError(400, f"{route} needs {what[kind]}; this server serves {what[head.kind]} ({state.model_name})")


async def embed(state: AppState, req: EmbedRequest, too_long_status: int = 400, explain: bool = False) -> Embedded:
    """Validated request -> vectors in input order, tokens used, per-phase times, and, with
    `explain`, the plan with its predictions (taken before the request queues)."""
    t0 = time.perf_counter()
    pieces, planned = await plan_request(state, lambda: _embedding_pieces(state.encoder, req), too_long_status)
    t1 = time.perf_counter()
    explained = explain_plan(state, pieces, planned) if explain else None
    out, timing = await run_planned(state, pieces, planned)
    vectors = pieces.combine(out, req.count)
    if req.normalize:
        vectors = normalize_rows(vectors)
    tokens = int(pieces.token_counts(req.count).sum())
    phases = {"tokenize_s": t1 - t0, "queue_s": timing.queue_s, "host_prepare_s": timing.host_prepare_s,
              "device_s": timing.device_s, "service_s": timing.total_s, "dispatches_s": timing.batches}
    for name in ("tokenize", "queue", "host_prepare", "device"):
        state.metrics.phase.labels(name).observe(phases[name + "_s"])
    state.metrics.inputs.inc(req.count)
    return Embedded(vectors, tokens, phases, explained)


def _embedding_pieces(enc: Encoder, req: EmbedRequest):
    tok = enc.tokenizer
    if req.token_ids is not None:
        vocab = enc.model_config.vocab_size
        for i, ids in enumerate(req.token_ids):
            if ids.max() >= vocab:
                raise InputError(f"input {i} has token id {int(ids.max())}, outside the vocabulary of {vocab}")
        bodies = req.token_ids
    else:
        bodies = tok.encode_bodies(req.texts)
    return tok.pieces(bodies, req.long)


# ---- routes ----

async def openai_embeddings(request: web.Request) -> web.Response:
    state = request.app[STATE]
    state.require_ready()
    start = time.perf_counter()
    require_kind(state, "embedding", "/v1/embeddings")
    req = api.parse_openai_embeddings(await _json_body(request), state.limits, state.encoder.dim, state.config.long)
    wants_explain = _wants_explain(request)
    result = await embed(state, req, explain=wants_explain)
    t_respond = time.perf_counter()
    body = api.openai_response(api.shape_vectors(result.vectors, req.dimensions), state.model_name, result.tokens,
                               req.encoding_format)
    text = json.dumps(body)
    respond_s = time.perf_counter() - t_respond
    state.metrics.phase.labels("respond").observe(respond_s)
    if wants_explain:
        measured = {k: v for k, v in result.phases.items() if k != "dispatches_s"}
        measured.update(respond_s=respond_s, total_s=time.perf_counter() - start)
        explained = dict(result.explain, measured=measured, dispatched=[
            {"bucket": list(shape), "rows_of_this_request": n, "reason": reason}
            for shape, n, reason in result.phases["dispatches_s"]])
        text = text[:-1] + ', "explain": ' + json.dumps(explained) + "}"
    return web.Response(text=text, content_type="application/json")


def _wants_explain(request: web.Request) -> bool:
    flag = request.query.get("explain") or request.headers.get("X-Jaxserve-Explain") or ""
    return flag.lower() in ("1", "true", "yes")


async def openai_plan(request: web.Request) -> web.Response:
    """The plan of a /v1/embeddings body and its predicted times, without running the model."""
    state = request.app[STATE]
    state.require_ready()
    require_kind(state, "embedding", "/v1/plan")
    req = api.parse_openai_embeddings(await _json_body(request), state.limits, state.encoder.dim, state.config.long)
    pieces, planned = await plan_request(state, lambda: _embedding_pieces(state.encoder, req))
    body = explain_plan(state, pieces, planned)
    body.update(documents=req.count, sequences=len(pieces.seqs), usage={"prompt_tokens": planned.real_tokens})
    return web.json_response(body)


async def tei_embed(request: web.Request) -> web.Response:
    state = request.app[STATE]
    state.require_ready()
    require_kind(state, "embedding", "/embed")
    req = api.parse_tei_embed(await _json_body(request), state.limits, state.config.long)
    result = await embed(state, req, too_long_status=413)  # TEI answers 413 for over-length inputs
    start = time.perf_counter()
    response = web.json_response(result.vectors.tolist())
    state.metrics.phase.labels("respond").observe(time.perf_counter() - start)
    return response


async def classify_inputs(state: AppState, inputs: list, truncate: bool) -> tuple[np.ndarray, int]:
    """Texts or pairs -> [N, num_labels] logits in input order, and the tokens run."""
    enc = state.encoder
    pieces, planned = await plan_request(state, lambda: enc.prepare_pairs(inputs, truncate), too_long_status=413)
    out, _ = await run_planned(state, pieces, planned)
    state.metrics.inputs.inc(len(inputs))
    return out, planned.real_tokens


async def tei_predict(request: web.Request) -> web.Response:
    """TEI /predict: labels with scores, best first (softmax, or sigmoid for one logit; `raw_scores`: logits)."""
    state = request.app[STATE]
    state.require_ready()
    require_kind(state, "classifier", "/predict")
    req = api.parse_predict(await _json_body(request), state.limits, state.config.long != "error")
    logits, _ = await classify_inputs(state, req.inputs, req.truncate)
    labels = state.encoder.head.labels
    results = []
    for row in api.scores(logits, req.raw_scores):
        ranked = sorted(zip(labels, row.tolist()), key=lambda t: -t[1])[: req.top_k]
        results.append([{"label": label, "score": score} for label, score in ranked])
    return web.json_response(results[0] if req.single else results)


async def tei_rerank(request: web.Request) -> web.Response:
    """TEI /rerank: (query, text) pairs through the cross-encoder, sorted by score."""
    state = request.app[STATE]
    state.require_ready()
    require_kind(state, "classifier", "/rerank")
    query, texts, raw, return_text, truncate = api.parse_rerank(
        await _json_body(request), state.limits, state.config.long != "error")
    if state.encoder.head.num_labels != 1:
        raise ApiError(400, f"/rerank needs a cross-encoder with one output; this model has "
                            f"{state.encoder.head.num_labels} labels (use /predict)")
    logits, _ = await classify_inputs(state, [(query, t) for t in texts], truncate)
    ranked = sorted(enumerate(api.scores(logits, raw)[:, 0].tolist()), key=lambda t: -t[1])
    return web.json_response([{"index": i, "score": s, **({"text": texts[i]} if return_text else {})}
                              for i, s in ranked])


async def classify(request: web.Request) -> web.Response:
    """vLLM-style /classify: per input its best label and the probabilities of all."""
    state = request.app[STATE]
    state.require_ready()
    require_kind(state, "classifier", "/classify")
    texts = api.parse_classify(await _json_body(request), state.limits)
    logits, tokens = await classify_inputs(state, texts, state.config.long != "error")
    labels = state.encoder.head.labels
    probs = api.scores(logits, raw=False)
    return web.json_response({
        "id": f"classify-{time.time_ns():x}", "object": "list", "created": int(time.time()), "model": state.model_name,
        "data": [{"index": i, "label": labels[int(p.argmax())], "probs": p.tolist(), "num_classes": len(labels)}
                 for i, p in enumerate(probs)],
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
    })


async def tei_tokenize(request: web.Request) -> web.Response:
    state = request.app[STATE]
    state.require_ready()
    texts, add_special = api.parse_tokenize(await _json_body(request), state.limits)
    tok = state.encoder.tokenizer.tokenizer
    encodings = await asyncio.get_running_loop().run_in_executor(
        state.tokenizer_pool, lambda: tok.encode_batch(texts, add_special_tokens=add_special))
    out = [
        [
            {"id": tid, "text": token if special else text[a:b], "special": bool(special),
             "start": None if special else a, "stop": None if special else b}
            for tid, token, (a, b), special in zip(e.ids, e.tokens, e.offsets, e.special_tokens_mask)
        ]
        for text, e in zip(texts, encodings)
    ]
    return web.json_response(out)


async def health(request: web.Request) -> web.Response:
    state = request.app[STATE]
    if state.service is not None and state.service.draining:
        return web.json_response({"status": "draining"}, status=503)
    if not state.ready:
        return web.json_response({"status": state.failed or "warming"}, status=503)
    return web.json_response({"status": "ok"})


async def info(request: web.Request) -> web.Response:
    state = request.app[STATE]
    enc, cfg = state.encoder, state.config
    body = {
        "model_id": state.model_name,
        "ready": state.ready,
        "version": _version(),
        "limits": {
            "max_client_batch_size": cfg.max_client_batch, "max_input_chars": cfg.max_input_chars,
            "max_body_bytes": cfg.max_body_bytes, "max_queue": cfg.max_queue, "max_wait_ms": cfg.max_wait_ms,
            "default_long": cfg.long, "auth": cfg.api_key is not None,
        },
    }
    if enc is not None:
        c, e = enc.model_config, enc.embedding_config
        body.update({
            "model_type": c.model_type, "family": enc.family.name, "model_dtype": enc.dtype, "dimensions": enc.dim,
            "max_input_length": e.max_seq_length, "pooling": e.pooling, "normalize": e.normalize,
            "kind": enc.head.kind, "labels": list(enc.head.labels),
        })
    if state.table is not None:
        import jax

        body["device"] = {"platform": jax.devices()[0].platform, "kind": state.table.device,
                          "count": len(jax.devices()), "memory_bytes": state.table.device_memory}
        body["buckets"] = state.table.to_json()
        body["xla_compiles_total"] = compiles.xla_compiles_total()
    return web.json_response(body)


async def metrics(request: web.Request) -> web.Response:
    state = request.app[STATE]
    if state.service is not None:
        state.metrics.queue_depth(state.service.batcher.queued)
    return web.Response(body=state.metrics.render(), content_type="text/plain", charset="utf-8")


async def openapi_json(request: web.Request) -> web.Response:
    from jaxserve.openapi import spec

    return web.json_response(spec(_version()))


def _version() -> str:
    from jaxserve import __version__

    return __version__


def create_app(config: ServerConfig, encoder: Encoder | None = None) -> web.Application:
    """The aiohttp application. With `encoder` given (already loaded, maybe warmed), it is used as is."""
    app = web.Application(client_max_size=config.max_body_bytes, middlewares=[errors_middleware])
    app[STATE] = AppState(config, encoder)
    app.cleanup_ctx.append(lifecycle)
    app.on_shutdown.append(on_shutdown)
    app.router.add_post("/v1/embeddings", openai_embeddings)
    app.router.add_post("/v1/plan", openai_plan)
    app.router.add_post("/embed", tei_embed)
    app.router.add_post("/tokenize", tei_tokenize)
    app.router.add_post("/predict", tei_predict)
    app.router.add_post("/rerank", tei_rerank)
    app.router.add_post("/classify", classify)
    app.router.add_get("/health", health)
    app.router.add_get("/info", info)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/openapi.json", openapi_json)
    return app


def serve(config: ServerConfig, host: str, port: int) -> None:
    """Load the model (errors end the process at once), then serve; warmup runs while /health says 503."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    encoder = load_encoder(config)
    log.info("loaded %s (%s, dim %d); warming up", encoder.path, encoder.model_config.model_type, encoder.dim)
    web.run_app(create_app(config, encoder), host=host, port=port, handler_cancellation=True,
                shutdown_timeout=DRAIN_TIMEOUT_S, print=lambda msg: log.info(msg))
