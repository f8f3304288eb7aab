"""The HTTP service: aiohttp routes over the encoder and the device pipeline.

Data flows one way: HTTP -> decode + validate (api.py) -> tokenize + pack
into a job (a thread) -> batcher -> device pipeline (service.py, its own
threads) -> scatter -> combine + encode the response (a thread). The event
loop itself only moves bytes and awaits: nothing on it grows with the request
(large bodies are decoded in a thread too).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import hmac
import logging
import time

import numpy as np
import orjson
from aiohttp import web

from jaxserve import api, checkpoint, compiles, device
from jaxserve.api import ApiError, EmbedRequest, Limits
from jaxserve.batcher import QueueFull, TooLarge
from jaxserve.buckets import BucketTable
from jaxserve.encoder import Encoder, normalize_rows
from jaxserve.errors import InputError, TooLongError
from jaxserve.explain import explain
from jaxserve.jobs import Job
from jaxserve.metrics import ServerMetrics
from jaxserve.planner import pack
from jaxserve.service import MAX_INFLIGHT, DeviceError, Draining, EmbeddingService

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
MAX_INFLIGHT_BODY_BYTES = 256 * 2**20  # bytes of request bodies being handled at once; past it, 429 (bounds memory
# before the queue: 16 full-size bodies, or thousands of ordinary ones)
REQUEST_TIMEOUT_S = 60.0  # a model request still unanswered after this gets 503 and its waiting rows are dropped
OFFLOAD_BODY_BYTES = 64 * 2**10  # bodies larger than this are decoded on a thread, not on the event loop
OFFLOAD_FLOATS = 16_384  # responses with more floats than this are encoded on a thread


@dataclasses.dataclass(frozen=True)
class ServerConfig:
    model: str | None = None  # checkpoint dir or hub id; None = $JAXSERVE_MODEL, else bundled all-MiniLM-L6-v2
    model_name: str | None = None  # name reported in responses (default: the model argument or directory name)
    dtype: str = "auto"  # float32 on CPU, bfloat16 on accelerators
    buckets: str = "auto"  # a bucket table JSON file, or auto (derived for this device)
    ladder: str = "default"
    layout: str = "packed"
    max_wait_ms: float = MAX_WAIT_MS
    max_queue: int = MAX_QUEUE
    max_client_batch: int = MAX_CLIENT_BATCH
    max_input_chars: int = MAX_INPUT_CHARS
    max_body_bytes: int = MAX_BODY_BYTES
    long: str = "truncate"  # default for inputs over the model's limit
    default_prompt_name: str | None = None  # for requests naming no prompt (default: the checkpoint's)
    default_prompt: str | None = None  # ... or this text
    api_key: str | None = None
    max_concurrent: int = MAX_CONCURRENT_REQUESTS
    max_inflight_bytes: int = MAX_INFLIGHT_BODY_BYTES
    request_timeout_s: float = REQUEST_TIMEOUT_S
    cache_dir: str | None = None  # persistent compilation cache; None = default location
    use_cache: bool = True
    max_inflight: int = MAX_INFLIGHT  # batches on the device at once
    devices: int | str = 1  # local devices sharing each batch (data parallel), or "all"

    def __post_init__(self):
        if self.default_prompt_name is not None and self.default_prompt is not None:
            raise ValueError("give default_prompt_name or default_prompt, not both")
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
        # Work that grows with the request, off the event loop: decoding, tokenizing, packing, explaining ...
        self.tokenizer_pool = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="jaxserve-tokenize")
        # ... and combining, normalising and encoding responses (its own threads: never behind tokenizing).
        self.respond_pool = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="jaxserve-respond")
        self.limits = Limits(config.max_client_batch, config.max_input_chars)
        self.active = 0  # model requests being handled
        self.active_bytes = 0  # bytes of their bodies

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
        if (why := self.service.healthy) is not None:
            raise ApiError(503, f"this replica is unhealthy: {why}", "unavailable", {"Retry-After": str(RETRY_AFTER_S)})


STATE = web.AppKey("state", AppState)


# ---- start-up: load, warm, then serve ----

def load_encoder(config: ServerConfig) -> Encoder:
    return Encoder.from_pretrained(config.model, dtype=config.dtype, devices=config.devices)


def check_prompt(config: ServerConfig, encoder: Encoder) -> None:
    """A --default-prompt-name must be one of the model's prompts (InputError naming them)."""
    if config.default_prompt_name is not None:
        encoder.embedding_config.prompt(config.default_prompt_name)


def warm(state: AppState) -> BucketTable:
    """Compile and time every bucket (blocking; runs in a thread while /health says 503)."""
    enc, cfg = state.encoder, state.config
    check_prompt(cfg, enc)
    if cfg.use_cache:
        compiles.enable_persistent_cache(cfg.cache_dir)
    if enc.engine.table is not None and cfg.buckets == "auto":
        return enc.engine.table  # warmed by the caller (tests, embedding scripts)
    if cfg.buckets != "auto":
        return enc.warmup(BucketTable.load(cfg.buckets), progress=True)
    return enc.warmup(enc.derive_table(cfg.ladder, cfg.layout), progress=True, knee=True)


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
        state.service = EmbeddingService(state.encoder.engine, state.table, cfg.max_wait_ms / 1000, cfg.max_queue,
                                         state.metrics, max_inflight=cfg.max_inflight)
        await state.service.start()
        state.ready = True
        log.info("ready: %d buckets, %d XLA compiles so far", len(state.table.buckets), compiles.xla_compiles_total())

    starting = asyncio.create_task(start())
    yield
    starting.cancel()
    if state.service is not None:
        await state.service.stop()
    state.tokenizer_pool.shutdown(wait=False)
    state.respond_pool.shutdown(wait=False)


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
    cfg = state.config
    # A body without Content-Length may be as large as any body.
    size = (request.content_length if request.content_length is not None else cfg.max_body_bytes) if model_route else 0
    try:
        _authorize(request, cfg.api_key)
        if model_route and state.active >= cfg.max_concurrent:
            raise ApiError(429, f"{state.active} requests are being handled; the limit is "
                                f"{cfg.max_concurrent}", "rate_limit_error", {"Retry-After": str(RETRY_AFTER_S)})
        if model_route and state.active_bytes + size > cfg.max_inflight_bytes and state.active_bytes:
            raise ApiError(429, f"{state.active_bytes} bytes of requests are being handled; {size} more would pass "
                                f"the limit of {cfg.max_inflight_bytes}", "rate_limit_error",
                           {"Retry-After": str(RETRY_AFTER_S)})
        state.active += model_route
        state.active_bytes += size
        try:
            response = await handler(request)
        finally:
            state.active -= model_route
            state.active_bytes -= size
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
    response = _json(err.body(), status=err.status, headers=err.headers)
    response.error_type = err.type
    return response


def _json(body, status: int = 200, headers=None) -> web.Response:
    return web.Response(body=orjson.dumps(body, option=orjson.OPT_SERIALIZE_NUMPY), status=status, headers=headers,
                        content_type="application/json")


async def _json_body(request: web.Request):
    """The decoded body (a large one decoded on a thread); 400 for anything that is not strict UTF-8 JSON."""
    state = request.app[STATE]
    start = time.perf_counter()
    raw = await request.read()  # raises 413 past client_max_size
    try:
        if len(raw) > OFFLOAD_BODY_BYTES:
            body = await asyncio.get_running_loop().run_in_executor(state.tokenizer_pool, orjson.loads, raw)
        else:
            body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise ApiError(400, f"the request body is not valid JSON: {exc}") from None
    state.metrics.phase("parse", time.perf_counter() - start)
    return body


async def _off_loop(state: AppState, fn, big: bool):
    """fn() on a respond thread when `big`, else here (a thread hop costs more than small work)."""
    if big:
        return await asyncio.get_running_loop().run_in_executor(state.respond_pool, fn)
    return fn()


# ---- the embedding path ----

@dataclasses.dataclass
class Ran:
    """One request's sequences after the device: per-sequence outputs, and where the time went."""

    pieces: object  # tokenize.Pieces
    out: np.ndarray  # [P, out_dim] per sequence
    phases: dict  # seconds per phase
    dispatched: list  # (bucket shape, rows of this request, reason) of the batches that carried it
    explain: dict | None  # the request's own plan with its predictions, when asked (taken before it queued)


async def run_request(state: AppState, make_pieces, too_long_status: int = 400, want_explain: bool = False) -> Ran:
    """Tokenize (`make_pieces()`) and pack into a job on a thread, then through the batcher and the device."""
    enc = state.encoder
    service = state.service

    def prepare():
        t0 = time.perf_counter()
        pieces = make_pieces()
        t1 = time.perf_counter()
        rows = pack(pieces.lengths, state.table)
        job = Job(rows, pieces.ids, pieces.offsets, pieces.types, enc.out_dim)
        t2 = time.perf_counter()
        explained = explain(rows, state.table, service.timings, pieces.doc, service.batcher.backlog(),
                            service.batches_in_flight, state.config.max_wait_ms / 1000) if want_explain else None
        return pieces, job, explained, {"tokenize_s": t1 - t0, "plan_s": t2 - t1}

    try:
        pieces, job, explained, phases = await asyncio.get_running_loop().run_in_executor(state.tokenizer_pool, prepare)
    except TooLongError as err:
        raise ApiError(too_long_status, str(err), "request_too_large" if too_long_status == 413 else
                       "invalid_request_error") from None
    except InputError as err:
        raise ApiError(400, str(err)) from None
    timeout = state.config.request_timeout_s
    try:
        out, timing = await asyncio.wait_for(service.run(job), timeout)
    except asyncio.TimeoutError:
        raise ApiError(503, f"the request did not finish within {timeout:g} s; its waiting rows were dropped",
                       "timeout", {"Retry-After": str(RETRY_AFTER_S)}) from None
    except TooLarge as err:
        raise ApiError(413, f"{err} (--max-queue); send fewer or shorter inputs", "request_too_large") from None
    except QueueFull as err:
        raise ApiError(429, f"queue full: {err}", "rate_limit_error", {"Retry-After": str(RETRY_AFTER_S)}) from None
    except Draining as err:
        raise ApiError(503, str(err), "unavailable", {"Retry-After": str(RETRY_AFTER_S)}) from None
    except DeviceError as err:
        raise ApiError(500, str(err), "server_error") from None
    phases.update(queue_s=timing.queue_s, service_s=timing.total_s)
    for name in ("tokenize", "plan", "queue"):
        state.metrics.phase(name, phases[name + "_s"])
    state.metrics.inputs.inc(int(pieces.doc[-1]) + 1 if len(pieces.doc) else 0)
    return Ran(pieces, out, phases, timing.batches, explained)


def require_kind(state: AppState, kind: str, route: str) -> None:
    head = state.encoder.head
    if head.kind != kind:
        what = {"embedding": "an embedding model", "classifier": "a sequence-classification or cross-encoder model"}
        raise ApiError(400, f"{route} needs {what[kind]}; this server serves {what[head.kind]} ({state.model_name})")


def request_prompt(state: AppState, req: EmbedRequest) -> str | None:
    """The prompt text for a request: its own, else the server's default, else the checkpoint's."""
    cfg = state.config
    emb = state.encoder.embedding_config
    if req.prompt_name is None and req.prompt is None:
        if cfg.default_prompt is not None:
            return cfg.default_prompt
        return emb.prompt(cfg.default_prompt_name)
    return emb.prompt(req.prompt_name, req.prompt)


def embedding_pieces(state: AppState, req: EmbedRequest):
    """The request's documents as model sequences (runs on a tokenizer thread)."""
    enc = state.encoder
    tok = enc.tokenizer
    prompt = request_prompt(state, req)
    if req.token_ids is not None:
        vocab = enc.model_config.vocab_size
        for i, ids in enumerate(req.token_ids):
            if ids.max() >= vocab:
                raise InputError(f"input {i} has token id {int(ids.max())}, outside the vocabulary of {vocab}")
        return tok.pieces(req.token_ids, req.long, prompt=prompt)
    return tok.documents(req.texts, req.long, prompt=prompt)


def vectors_of(ran: Ran, req: EmbedRequest) -> np.ndarray:
    """Per-sequence outputs -> per-document vectors, normalised and cut to `dimensions` as asked."""
    vectors = ran.pieces.combine(ran.out, req.count)
    if req.normalize:
        vectors = normalize_rows(vectors)
    return api.shape_vectors(vectors, req.dimensions)


async def respond(state: AppState, encode, floats: int) -> tuple[bytes, float]:
    """Encode a response body (on a thread when it is big); returns it with the seconds it took."""
    def timed():
        start = time.perf_counter()
        body = encode()
        return body, time.perf_counter() - start

    body, seconds = await _off_loop(state, timed, big=floats > OFFLOAD_FLOATS)
    state.metrics.phase("encode", seconds)
    return body, seconds


# ---- routes ----

async def openai_embeddings(request: web.Request) -> web.Response:
    state = request.app[STATE]
    start = time.perf_counter()
    state.require_ready()
    require_kind(state, "embedding", "/v1/embeddings")
    req = api.parse_openai_embeddings(await _json_body(request), state.limits, state.encoder.dim, state.config.long)
    wants_explain = _wants_explain(request)
    ran = await run_request(state, lambda: embedding_pieces(state, req), want_explain=wants_explain)
    tokens = int(ran.pieces.lengths.sum())
    body, encode_s = await respond(
        state, lambda: api.openai_body(vectors_of(ran, req), state.model_name, tokens, req.encoding_format),
        ran.out.size if req.encoding_format == "float" else 0)
    if wants_explain:
        measured = dict(ran.phases, encode_s=encode_s, total_s=time.perf_counter() - start)
        explained = dict(ran.explain, measured=measured, dispatched=[
            {"bucket": list(shape), "rows_of_this_request": n, "reason": reason, "device_s": device_s}
            for shape, n, reason, device_s in ran.dispatched])
        body = body[:-1] + b', "explain": ' + orjson.dumps(explained) + b"}"
    return web.Response(body=body, content_type="application/json")


def _wants_explain(request: web.Request) -> bool:
    flag = request.query.get("explain") or request.headers.get("X-Jaxserve-Explain") or ""
    return flag.lower() in ("1", "true", "yes")


async def openai_plan(request: web.Request) -> web.Response:
    """The batches of a /v1/embeddings body and their predicted times, without running the model."""
    state = request.app[STATE]
    state.require_ready()
    require_kind(state, "embedding", "/v1/plan")
    req = api.parse_openai_embeddings(await _json_body(request), state.limits, state.encoder.dim, state.config.long)
    service = state.service

    def plan_only():
        pieces = embedding_pieces(state, req)
        rows = pack(pieces.lengths, state.table)
        body = explain(rows, state.table, service.timings, pieces.doc, service.batcher.backlog(),
                       service.batches_in_flight, state.config.max_wait_ms / 1000)
        body.update(documents=req.count, sequences=pieces.count, usage={"prompt_tokens": rows.real_tokens})
        return orjson.dumps(body)

    try:
        body = await asyncio.get_running_loop().run_in_executor(state.tokenizer_pool, plan_only)
    except InputError as err:
        raise ApiError(400, str(err)) from None
    return web.Response(body=body, content_type="application/json")


async def tei_embed(request: web.Request) -> web.Response:
    state = request.app[STATE]
    state.require_ready()
    require_kind(state, "embedding", "/embed")
    req = api.parse_tei_embed(await _json_body(request), state.limits, state.config.long)
    ran = await run_request(state, lambda: embedding_pieces(state, req), too_long_status=413)
    body, _ = await respond(state, lambda: orjson.dumps(vectors_of(ran, req), option=orjson.OPT_SERIALIZE_NUMPY),
                            ran.out.size)
    return web.Response(body=body, content_type="application/json")


async def classify_inputs(state: AppState, inputs: list, truncate: bool) -> tuple[np.ndarray, int]:
    """Texts or pairs -> [N, num_labels] logits in input order, and the tokens run."""
    ran = await run_request(state, lambda: state.encoder.prepare_pairs(inputs, truncate), too_long_status=413)
    return ran.out, int(ran.pieces.lengths.sum())


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
    return _json(results[0] if req.single else results)


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
    return _json([{"index": i, "score": s, **({"text": texts[i]} if return_text else {})}
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
    return _json({
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

    def tokens() -> bytes:  # per token Python objects: on a tokenizer thread
        return orjson.dumps([
            [
                {"id": tid, "text": token if special else text[a:b], "special": bool(special),
                 "start": None if special else a, "stop": None if special else b}
                for tid, token, (a, b), special in zip(e.ids, e.tokens, e.offsets, e.special_tokens_mask)
            ]
            for text, e in zip(texts, tok.encode_batch(texts, add_special_tokens=add_special))
        ])

    body = await asyncio.get_running_loop().run_in_executor(state.tokenizer_pool, tokens)
    return web.Response(body=body, content_type="application/json")


async def health(request: web.Request) -> web.Response:
    """200 when serving; 503 while warming or draining, or when the device pipeline is broken (restart me)."""
    state = request.app[STATE]
    if state.service is not None and state.service.draining:
        return _json({"status": "draining"}, status=503)
    if not state.ready:
        return _json({"status": state.failed or "warming"}, status=503)
    if (why := state.service.healthy) is not None:
        return _json({"status": "unhealthy", "reason": why}, status=503)
    return _json({"status": "ok"})


async def info(request: web.Request) -> web.Response:
    state = request.app[STATE]
    enc, cfg = state.encoder, state.config
    body = {
        "model_id": state.model_name,
        "ready": state.ready,
        "version": _version(),
        "limits": {
            "max_client_batch_size": cfg.max_client_batch, "max_input_chars": cfg.max_input_chars,
            "max_body_bytes": cfg.max_body_bytes, "max_inflight_bytes": cfg.max_inflight_bytes,
            "max_queue": cfg.max_queue, "max_wait_ms": cfg.max_wait_ms,
            "default_long": cfg.long, "auth": cfg.api_key is not None,
        },
    }
    if enc is not None:
        c, e = enc.model_config, enc.embedding_config
        body.update({
            "model_type": c.model_type, "family": enc.family.name, "model_dtype": enc.dtype, "dimensions": enc.dim,
            "max_input_length": e.max_seq_length, "pooling": e.pooling, "normalize": e.normalize,
            "dense_layers": [{"in": d.in_features, "out": d.out_features, "activation": d.activation} for d in e.dense],
            "prompts": dict(e.prompts), "default_prompt_name": cfg.default_prompt_name or e.default_prompt_name,
            "default_prompt": cfg.default_prompt,
            "kind": enc.head.kind, "labels": list(enc.head.labels),
        })
    if state.table is not None:
        import jax

        body["device"] = {"platform": jax.devices()[0].platform, "kind": state.table.device,
                          "count": len(jax.devices()), "memory_bytes": state.table.device_memory}
        body["buckets"] = state.table.to_json()
        body["xla_compiles_total"] = compiles.xla_compiles_total()
    return _json(body)


async def metrics(request: web.Request) -> web.Response:
    state = request.app[STATE]
    if state.service is not None:
        state.metrics.queue_depth(state.service.batcher.queued)
    return web.Response(body=state.metrics.render(), content_type="text/plain", charset="utf-8")


async def openapi_json(request: web.Request) -> web.Response:
    from jaxserve.openapi import spec

    return _json(spec(_version()))


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
    check_prompt(config, encoder)
    log.info("loaded %s (%s, dim %d); warming up", encoder.path, encoder.model_config.model_type, encoder.dim)
    web.run_app(create_app(config, encoder), host=host, port=port, handler_cancellation=True,
                shutdown_timeout=DRAIN_TIMEOUT_S, print=lambda msg: log.info(msg))
