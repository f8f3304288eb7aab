"""The path every model request takes, shared by the OpenAI and TEI routes.

decode the body (on a thread when large) -> validate (api.py) -> tokenize and
pack into a job (a tokenizer thread) -> the device pipeline (service.py) ->
combine, normalise and encode the response (a respond thread when large).
Nothing on the event loop grows with the request.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
import zlib

import numpy as np
import orjson
from aiohttp import hdrs, web

from jaxserve.checkpoint.tokenize import interleaved, openai_token_texts
from jaxserve.errors import InputError, TokenizerError
from jaxserve.http import api
from jaxserve.http.api import ApiError, EmbedRequest
from jaxserve.http.budget import Charge
from jaxserve.http.classes import NO_ASK, Ask, ask_of, decide, likely_interactive, route_class
from jaxserve.http.state import (
    API_KEY_CLASS,
    BODY_BYTES,
    CHARGE,
    EXPECTS,
    INLINE_BODY_BYTES,
    INLINE_INPUTS,
    OFFLOAD_BODY_BYTES,
    OFFLOAD_FLOATS,
    RETRY_AFTER_S,
    STATE,
    AppState,
)
from jaxserve.scheduling.batcher import CLASSES, QueueFull, TooLarge
from jaxserve.scheduling.jobs import Job
from jaxserve.scheduling.pipeline import BatchError, Draining
from jaxserve.scheduling.planner import pack


def json_response(body, status: int = 200, headers=None) -> web.Response:
    return web.Response(body=orjson.dumps(body, option=orjson.OPT_SERIALIZE_NUMPY), status=status, headers=headers,
                        content_type="application/json")


async def expect_later(request: web.Request) -> None:
    """Every model (POST) route's expect handler: nothing is sent here, the header is left to
    `server.errors_middleware`, which answers it after the checks the headers decide. aiohttp's own handler answers
    `Expect: 100-continue` before any middleware runs, so a client those checks refuse (a missing key, a declared
    body over the limit, a full or warming server) was told to send its body first."""
    request[EXPECTS] = request.headers[hdrs.EXPECT]


GZIP_MAGIC = b"\x1f\x8b"  # a gzip member's first two bytes
INFLATE_CHUNK = 2**20  # a compressed body inflates this many bytes at a time, each charged before the next


def inflate(raw: bytes, coding: str, limit: int, charge: Charge | None = None) -> bytearray:
    """A gzip or deflate body inflated, to at most `limit` bytes (413 past it, 400 when it is not that coding),
    each piece charged to the in-flight byte budget as it appears (429 when the budget is spent). A gzip body may
    be several members, one after another (RFC 1952, 2.2: what `gzip.decompress` reads as one); bytes after the
    last that are not one are refused, not dropped."""
    out, data = bytearray(), raw
    try:
        while True:
            wbits = 47 if coding != "deflate" or (data[:1] and data[0] & 0x0F == 8) else -15  # gzip/zlib; raw deflate
            inflater = zlib.decompressobj(wbits)
            while not inflater.eof and len(out) <= limit:
                piece = inflater.decompress(data, min(INFLATE_CHUNK, limit + 1 - len(out)))
                data = inflater.unconsumed_tail
                if not piece and not data:
                    break
                if charge is not None and not charge.take(len(piece)):
                    raise ApiError(429, f"the request bodies being handled hold {charge.budget.held} bytes once "
                                        f"inflated; this one would pass the limit of {charge.budget.limit}",
                                   "rate_limit_error", {"Retry-After": str(RETRY_AFTER_S)})
                out += piece
            data = inflater.unused_data
            if len(out) > limit or not inflater.eof or not data:
                break
            if coding == "deflate" or data[:2] != GZIP_MAGIC:
                raise ApiError(400, f"the request body is not valid {coding}: {len(data)} bytes follow its end")
    except zlib.error as exc:
        raise ApiError(400, f"the request body is not valid {coding}: {exc}") from None
    if len(out) > limit:
        raise ApiError(413, f"request body over {limit} bytes once inflated", "body_too_large")
    if not inflater.eof:
        raise ApiError(400, f"the request body is not valid {coding}: it ends early")
    return out


async def json_body(request: web.Request):
    """The decoded body (a large or compressed one decoded on a thread); 400 for anything that is not strict
    UTF-8 JSON, 415 for a Content-Encoding other than gzip or deflate (server.create_app turns aiohttp's off).
    Its decoded size goes into request[BODY_BYTES]; a compressed body's inflated bytes are charged to the
    in-flight budget (request[CHARGE], which the middleware gives back)."""
    state = request.app[STATE]
    start = time.perf_counter()
    try:
        async with asyncio.timeout(state.config.request_timeout_s):  # a sender that stalls holds the budget
            raw = await request.read()  # raises 413 past client_max_size
    except web.RequestPayloadError as exc:  # e.g. broken chunked framing
        raise ApiError(400, f"the request body could not be read: {exc}") from None
    except TimeoutError:
        raise ApiError(408, f"the request body did not arrive within --request-timeout-s "
                            f"{state.config.request_timeout_s:g}", "timeout_error") from None
    coding = request.headers.get("Content-Encoding", "").strip().lower()
    if coding not in ("", "identity", "gzip", "x-gzip", "deflate"):
        raise ApiError(415, f"Content-Encoding {coding[:40]!r} is not supported; send gzip, deflate or none")
    packed = coding not in ("", "identity")
    charge = request.get(CHARGE)

    def decode():
        text = inflate(raw, coding, state.config.max_body_bytes, charge) if packed else raw
        request[BODY_BYTES] = len(text)
        return orjson.loads(text)

    try:
        if packed or len(raw) > OFFLOAD_BODY_BYTES:
            body = await asyncio.get_running_loop().run_in_executor(state.tokenizer_pool, decode)
        else:
            body = decode()
    except orjson.JSONDecodeError as exc:
        raise ApiError(400, f"the request body is not valid JSON: {exc}") from None
    state.metrics.phase("parse", time.perf_counter() - start)
    return body


async def parsed(state: AppState, ask: Ask, fn):
    """fn() (validating a decoded body) on a tokenizer thread when the body was large (`ask.body_bytes`): checking
    a million token ids is work that grows with the request, never the event loop's."""
    if ask.body_bytes <= OFFLOAD_BODY_BYTES:
        return fn()
    return await asyncio.get_running_loop().run_in_executor(state.tokenizer_pool, fn)


async def together(*runs):
    """The runs of one request at once (as asyncio.gather), one failing cancelling the rest: a request answered
    with an error must leave nothing of it holding the queue, the device or a thread (gather lets them run on)."""
    tasks = [asyncio.ensure_future(r) for r in runs]
    try:
        return await asyncio.gather(*tasks)
    except BaseException:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


async def on_thread(state: AppState, fn, big: bool = True):
    """fn() on a respond thread when `big`, else here (a thread hop costs more than small work)."""
    if big:
        return await asyncio.get_running_loop().run_in_executor(state.respond_pool, fn)
    return fn()


def tokenized(fn):
    """fn(), the tokenizer at work on a request's texts: whatever it raises is the request's fault (TokenizerError),
    but for a refusal of its own (InputError; ApiError: a decoded text past `--max-input-chars`)."""
    try:
        return fn()
    except (InputError, ApiError):
        raise
    except Exception as exc:
        raise TokenizerError(f"the tokenizer could not read an input: {type(exc).__name__}: {exc}") from None
    except BaseException as exc:  # a Rust panic in the tokenizer: pyo3's PanicException is a BaseException
        if type(exc).__name__ != "PanicException":
            raise
        raise TokenizerError(f"the tokenizer could not read an input (it panicked: {exc})") from None


async def on_tokenizer(state: AppState, fn, interactive: bool = False, inline: bool = False):
    """fn() on a tokenizer thread (`interactive`: the interactive requests' own; `inline`: here, for a request
    too small to be worth two thread hand-offs); an InputError it raises (too long, an unknown prompt, the
    tokenizer refusing a text: see `tokenized`) is the request's 400. Anything else is a bug, and stays a 500."""
    pool = state.interactive_pool if interactive else state.tokenizer_pool
    try:
        if inline:
            return fn()
        return await asyncio.get_running_loop().run_in_executor(pool, fn)
    except TokenizerError as err:
        raise ApiError(400, str(err), "tokenizer_error") from None
    except InputError as err:
        raise ApiError(400, str(err)) from None


@dataclasses.dataclass
class Ran:
    """One request's sequences after the device: outputs, and where the time went."""

    pieces: object  # tokenize.Pieces
    job: Job  # its outputs: job.out
    phases: dict  # seconds per phase
    dispatched: list  # (bucket shape, rows of this request, reason, device s) of the batches that carried it
    explain: dict | None  # the request's own batches with their predictions, when asked (taken before it queued)

    @property
    def out(self) -> np.ndarray:
        return self.job.out

    @property
    def floats(self) -> int:
        """The outputs' size, read without placing them (a response's size, decided on the event loop)."""
        return self.job.out_size

    @property
    def tokens(self) -> int:
        return self.pieces.tokens


def ask_for(request: web.Request, body, route: str | None = None, runs: str | None = None) -> Ask:
    """What a request asked for, with the classes its API key and its route (`route`, default its own path; and
    `runs`, the route a path such as TEI's `/` runs) grant as ceilings (`route_class`)."""
    routes = request.app[STATE].config.route_classes
    return ask_of(body, request.headers, request.get(API_KEY_CLASS), route_class(routes, route or request.path, runs),
                  request.get(BODY_BYTES, 0))


def explain_rows(state: AppState, rows, pieces, cls: int, output: str = "pooled") -> dict:
    """The latency math of one request's rows on its output's table, as a request of class `cls` (`decide`'s),
    given what waits ahead of it (of the classes it waits behind) and runs now; 413 where the queue could never
    hold it, 503 where the engine process is gone or has not answered within --request-timeout-s."""
    try:
        return state.service.explain(rows, pieces.doc, output, state.config.max_wait_ms / 1000, cls,
                                     timeout_s=state.config.request_timeout_s)
    except TooLarge as err:
        raise too_large(err) from None
    except TimeoutError as err:
        raise ApiError(503, str(err), "timeout", {"Retry-After": str(RETRY_AFTER_S)}) from None
    except Draining as err:
        raise unavailable(err) from None


def too_large(err: TooLarge) -> ApiError:
    return ApiError(413, f"{err} (--max-queue-tokens); send fewer or shorter inputs", "request_too_large")


def unavailable(err: Draining) -> ApiError:
    """The engine gone, or the server draining: 503, try again (another replica)."""
    return ApiError(503, str(err), "unavailable", {"Retry-After": str(RETRY_AFTER_S)})


async def run_request(state: AppState, make_pieces, want_explain: bool = False, output: str = "pooled",
                      ask: Ask = NO_ASK, inputs: int | None = None) -> Ran:
    """Tokenize (`make_pieces()`, `inputs` texts; None: many) and pack into a job on a thread, then through the
    batcher and the device."""
    enc = state.encoder
    service = state.service
    table = enc.engine.tables[output]

    def prepare():
        t0 = time.perf_counter()
        pieces = tokenized(make_pieces)
        t1 = time.perf_counter()
        rows = pack(pieces.lengths, table)
        width = enc.token_dim if output == "tokens" else enc.out_dim
        job = Job(rows, pieces.ids, pieces.offsets, pieces.types, width, output)
        t2 = time.perf_counter()
        decided = decide(ask, pieces.count, pieces.tokens, policy)
        explained = explain_rows(state, rows, pieces, decided[0], output) if want_explain else None
        return pieces, job, explained, {"tokenize_s": t1 - t0, "plan_s": t2 - t1}, decided

    policy = state.config.class_policy
    small = inputs is not None and likely_interactive(ask, inputs, policy, most_bytes=OFFLOAD_BODY_BYTES)
    tiny = inputs is not None and inputs <= INLINE_INPUTS and 0 < ask.body_bytes <= INLINE_BODY_BYTES
    pieces, job, explained, phases, (cls, source) = await on_tokenizer(state, prepare, interactive=small,
                                                                       inline=tiny and not want_explain)
    timeout = state.config.request_timeout_s
    try:
        deadline_s = None if ask.deadline_ms is None else ask.deadline_ms / 1000
        # a request that asked for its latency math is not joined with others: its batches are then its own
        timing = await service.run(job, cls, deadline_s, timeout_s=timeout, join=not want_explain)
    except TimeoutError:
        raise ApiError(503, f"the request did not finish within {timeout:g} s; its waiting rows were dropped",
                       "timeout", {"Retry-After": str(RETRY_AFTER_S)}) from None
    except TooLarge as err:
        raise too_large(err) from None
    except QueueFull as err:
        raise ApiError(429, f"queue full: {err}", "rate_limit_error", {"Retry-After": str(RETRY_AFTER_S)}) from None
    except Draining as err:
        raise unavailable(err) from None
    except BatchError as err:
        raise ApiError(500, str(err), "server_error") from None
    phases.update(queue_s=timing.queue_s, service_s=timing.total_s)
    for name in ("tokenize", "plan", "queue"):
        state.metrics.phase(name, phases[name + "_s"])
    state.metrics.inputs(int(pieces.doc[-1]) + 1 if len(pieces.doc) else 0)
    if explained is not None:
        explained["request_class"] = CLASSES[timing.cls]
        explained["class_from"] = source
        explained["waited_behind"] = timing.behind
    return Ran(pieces, job, phases, timing.batches, explained)


def require_kind(state: AppState, kind: str, route: str) -> None:
    head = state.encoder.head
    if head.kind != kind:
        what = {"embedding": "an embedding model", "classifier": "a sequence-classification or cross-encoder model",
                "sparse": "a sparse (SPLADE) embedding model", "multivector": "a multi-vector (ColBERT) model"}
        raise api.wrong_model(f"{route} needs {what[kind]}; this server serves {what[head.kind]} ({state.model_name})")


def request_prompt(state: AppState, req: EmbedRequest) -> str | None:
    """The prompt text for a request: its own, else the server's default, else the checkpoint's."""
    cfg = state.config
    emb = state.encoder.embedding_config
    if req.prompt_name is None and req.prompt is None:
        if cfg.default_prompt is not None:
            return cfg.default_prompt
        return emb.prompt(cfg.default_prompt_name)
    return emb.prompt(req.prompt_name, req.prompt)


def embedding_pieces(state: AppState, req: EmbedRequest, openai_ids: bool = False, at: list[int] | None = None):
    """The request's documents as model sequences (runs on a tokenizer thread).

    Token ids are the model's own vocabulary (TEI), except on OpenAI's route with
    `--token-ids openai` (the default), where they are OpenAI's tokenizer's ids,
    decoded to text first (`openai_token_texts`). The model's own ids run as given
    (`TextTokenizer.given`), or with a prompt, as TEI runs them: decoded without their
    special tokens, the prompt put in front of the text, and tokenized as text. A TEI batch of texts and token ids
    runs each kind so, and puts their sequences back in the order sent; `at`: each input's index in its request,
    which a refusal names."""
    if req.ids_at:
        of_ids = set(req.ids_at)
        texts_at = [i for i in range(req.count) if i not in of_ids]
        alone = lambda where, **kind: embedding_pieces(state, dataclasses.replace(req, ids_at=(), **kind), openai_ids,
                                                        where)
        try:
            return interleaved([(alone(texts_at, token_ids=None), texts_at),
                                (alone(req.ids_at, texts=None), req.ids_at)])
        except (InputError, ApiError):  # the first input refused in the order sent, as TEI names it
            for i, x in enumerate(req.inputs):
                alone([i], texts=[x], token_ids=None) if isinstance(x, str) else alone([i], texts=None, token_ids=[x])
            raise
    enc = state.encoder
    tok = enc.tokenizer
    prompt = request_prompt(state, req)
    texts, token_ids = req.texts, req.token_ids
    cut = api.cut_end(req.long == "truncate", req.direction)  # (a decoded text past --max-input-chars)
    if token_ids is not None and openai_ids and state.config.token_ids == "openai":
        texts, token_ids = decoded(state, openai_token_texts(token_ids, req.model), "input", cut, at), None
    if token_ids is not None:
        vocab = enc.arch.vocab_size
        for i, ids in enumerate(token_ids):
            if ids.max() >= vocab:
                raise InputError(f"input {i if at is None else at[i]} has token id {int(ids.max())}, outside the "
                                 f"vocabulary of {vocab}")
        if not prompt:
            return tok.given(token_ids, req.long, direction=req.direction, limit=req.cut, at=at)
        texts = decoded(state, tok.tokenizer.decode_batch([ids.tolist() for ids in token_ids],
                                                          skip_special_tokens=True), "inputs", cut, at)
    return tok.documents(texts, req.long, prompt=prompt, direction=req.direction, limit=req.cut, at=at)


def decoded(state: AppState, texts: list[str], field: str, cut: str | None, at: list[int] | None = None) -> list[str]:
    """Texts decoded from token ids, held to `--max-input-chars` as texts sent as such are (cut to it at the `cut`
    end where the request truncates): one id decodes to up to a hundred-odd characters, so a body of ids within
    `--max-body-bytes` would otherwise tokenize a text of many megabytes (gigabytes of the tokenizer's memory).
    `at[i]`: text i's index in its request, which a refusal names."""
    return [api.within_limit(t, f"{field}[{i if at is None else at[i]}]", state.limits, cut)
            for i, t in enumerate(texts)]


def vectors_of(ran: Ran, req: EmbedRequest) -> np.ndarray:
    """Per-sequence outputs -> per-document vectors, normalised and cut to `dimensions` as asked."""
    return api.shape_vectors(ran.pieces.combine(ran.out, req.count), req.dimensions, req.normalize)


async def respond(state: AppState, encode, floats: int) -> tuple[bytes, float]:
    """Encode a response body (on a thread when it is big); returns it with the seconds it took."""
    def timed():
        start = time.perf_counter()
        body = encode()
        return body, time.perf_counter() - start

    body, seconds = await on_thread(state, timed, big=floats > OFFLOAD_FLOATS)
    state.metrics.phase("encode", seconds)
    return body, seconds


def bytes_response(body: bytes, headers: dict | None = None) -> web.Response:
    return web.Response(body=body, content_type="application/json", headers=headers)


def tei_headers(state: AppState, ran: Ran, inputs) -> dict:
    """TEI's metadata of a response (`router/src/lib.rs`, ResponseMetadata), which its clients read (the tokens
    for billing, the times for dashboards): the characters and tokens computed (of `inputs`: texts, token-id
    arrays or text pairs) and, in milliseconds, the request's time from tokenizing to its outputs, its tokenizing,
    its wait in the queue, and its time from its first batch to its last."""
    p = ran.phases
    tokenize, queue, service = p["tokenize_s"] + p["plan_s"], p["queue_s"], p["service_s"]
    chars = sum(len(x) if isinstance(x, (str, np.ndarray)) else sum(map(len, x)) for x in inputs)
    ms = lambda s: str(int(s * 1000))
    return {"x-compute-type": state.device.get("platform", "") if state.device else "",
            "x-compute-time": ms(tokenize + service), "x-total-time": ms(tokenize + service),
            "x-compute-characters": str(chars), "x-compute-tokens": str(ran.tokens),
            "x-tokenization-time": ms(tokenize), "x-queue-time": ms(queue), "x-inference-time": ms(service - queue)}
