"""The HTTP service: the aiohttp app, its start-up, middleware (auth, limits, errors as JSON) and shutdown.

Data flows one way: HTTP -> decode + validate (api.py) -> tokenize + pack
into a job (a thread) -> batcher -> device pipeline (service.py, its own
threads) -> scatter -> combine + encode the response (a thread); see
`jaxserve.http.handling`. Routes: OpenAI's and vLLM's (`openai_routes`), TEI's
(`tei_routes`), Cohere's v2 (`cohere_routes`), operations (`ops_routes`).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import os
import signal
import time

from aiohttp import HttpVersion11, http_exceptions, web
from aiohttp.web_protocol import RequestHandler

from jaxserve.errors import InputError
from jaxserve.http.api import ApiError
from jaxserve.http.classes import DEADLINE_HEADER, PRIORITY_HEADER
from jaxserve.http.handling import json_response
from jaxserve.http.routes import cohere as cohere_routes
from jaxserve.http.routes import openai as openai_routes
from jaxserve.http.routes import ops as ops_routes
from jaxserve.http.routes import tei as tei_routes
from jaxserve.http.state import (  # noqa: F401
    API_KEY_CLASS,
    BULK_DISPATCH_MS,
    CHARGE,
    DRAIN_TIMEOUT_S,
    EXPECTS,
    MAX_BODY_BYTES,
    MAX_CLIENT_BATCH,
    MAX_CONCURRENT_REQUESTS,
    MAX_INFLIGHT_BODY_BYTES,
    MAX_INPUT_CHARS,
    MAX_WAIT_MS,
    REQUEST_TIMEOUT_S,
    RETRY_AFTER_S,
    STATE,
    AppState,
    ServerConfig,
    warmup_failed,
)
from jaxserve.runtime import compiles, startup
from jaxserve.runtime.host import (
    PRELOADS,
    allocator_in_use,
    keep_freed_memory,
    malloc_env,
    not_on_linux,
    raise_open_files,
    settle_heap,
)
from jaxserve.view import ModelView

log = logging.getLogger("jaxserve.http.server")

# A front-end waits this long at most for the engine to say where it stands before it listens (an engine
# process that is up answers in milliseconds; one being restarted may not, and /health then says why)
LINK_SETTLE_S = 10.0


# ---- start-up: load, warm, then serve ----

async def lifecycle(app: web.Application):
    state = app[STATE]
    cfg = state.config
    loop = asyncio.get_running_loop()

    async def start():
        # here, not at the top: they import JAX, which a front-end process (`link`, below) never does
        from jaxserve.http.loading import load_encoder, make_pipeline, start_engine
        from jaxserve.runtime import device

        try:
            if state.encoder is None:
                state.encoder = await loop.run_in_executor(None, load_encoder, cfg)
            state.table = await loop.run_in_executor(None, start_engine, cfg, state.encoder, state.startup)
        except Exception as exc:
            state.failed = warmup_failed(exc)
            log.error(state.failed)
            return
        state.service = make_pipeline(cfg, state.encoder, state.table, state.engine_metrics)
        await state.service.start()
        state.device = device.info_of(state.table)
        state.ready = True
        state.startup.doing = "ready"
        state.engine_metrics.startup(state.startup.phases)
        if state.settle_heap:
            settle_heap()
        log.info("ready: %d buckets, %d XLA compiles so far", len(state.table.buckets), compiles.xla_compiles_total())

    if state.link is not None:  # a front-end process: the engine process does all of the above
        state.service = state.link
        await state.link.start()
        await state.link.settled(LINK_SETTLE_S)  # before it listens (a front-end's socket: workers.listeners)
        starting = None
    else:
        starting = asyncio.create_task(start())
    yield
    if starting is not None:
        starting.cancel()
    if state.service is not None:
        await state.service.stop()
    state.tokenizer_pool.shutdown(wait=False)
    state.interactive_pool.shutdown(wait=False)
    state.respond_pool.shutdown(wait=False)


async def on_shutdown(app: web.Application) -> None:
    """Stopping: the listening socket is closed already; finish what was accepted, refuse the rest. `run_app` has
    drained already; an app run by another aiohttp runner (Ray Serve's replica, the tests') drains here."""
    await _drain(app)


async def _drain(app: web.Application) -> None:
    state = app[STATE]
    if state.service is None or state.stopping:
        return
    state.stopping = True
    log.info("draining: %d requests being handled", state.active)
    finished = await state.drain(DRAIN_TIMEOUT_S)
    log.info("drained: %s", "all accepted requests finished" if finished else "timed out")


# ---- middleware: errors as JSON, auth, metrics ----

@web.middleware
async def errors_middleware(request: web.Request, handler):
    state = request.app[STATE]
    route = request.match_info.route.resource.canonical if request.match_info.route.resource else "unmatched"
    start = time.perf_counter()
    model_route = request.method == "POST"
    cfg = state.config
    origin = request.headers.get("Origin") if cfg.cors_allow_origins else None  # sent by browsers only
    cors = origin and _cors(cfg.cors_allow_origins, origin)
    if cors and request.method == "OPTIONS" and "Access-Control-Request-Method" in request.headers:
        return web.Response(status=204, headers={**cors, **_preflight(request)})  # before auth: preflights carry no key
    # A body without Content-Length may be as large as any body.
    size = (request.content_length if request.content_length is not None else cfg.max_body_bytes) if model_route else 0
    expect = request.get(EXPECTS)  # a client that waits to be told before it sends its body (handling.expect_later)
    try:
        request[API_KEY_CLASS] = _authorize(request, cfg.keys)
        if size > cfg.max_body_bytes:  # declared, not sent: refused before it holds the in-flight budget
            raise ApiError(413, f"request body over {cfg.max_body_bytes} bytes ({size} declared)", "body_too_large")
        if model_route:
            state.require_room()
        charge = request[CHARGE] = state.budget.charge()
        if model_route and not charge.take(size):
            raise ApiError(429, f"{state.budget.held} bytes of requests are being handled; {size} more would pass "
                                f"the limit of {cfg.max_inflight_bytes}", "rate_limit_error",
                           {"Retry-After": str(RETRY_AFTER_S)})
        state.active += model_route
        try:  # written here, the request's slot and bytes still held: a client that does not read holds those
            if expect is not None:
                state.require_ready()  # warming or draining: told before the body, not after it
                await _continue(request, expect)
                expect = None
            response = await handler(request)
            if cors:
                response.headers.update(cors)
            if state.stopping:  # the client's next request goes to a server that is not stopping
                response.force_close()
            response = await _write(request, response, cfg.request_timeout_s)
        finally:
            state.active -= model_route
            charge.release()
    except ApiError as err:
        response = _error(err, request.path)
        if expect is not None:  # refused before its 100: the body will not come, the stream cannot be read on
            response.force_close()
    except InputError as err:  # the request's own fault wherever it was found (e.g. an unknown prompt_name)
        response = _error(ApiError(400, str(err)), request.path)
    except web.HTTPException as exc:
        kind = {404: "not_found_error", 405: "method_not_allowed", 413: "body_too_large"}.get(exc.status, "http_error")
        message = {404: f"no route {request.method} {request.path}",
                   405: f"method {request.method} is not allowed on {request.path}",
                   413: f"request body over {state.config.max_body_bytes} bytes"}.get(exc.status, exc.reason)
        headers = {k: v for k, v in exc.headers.items() if k.lower() not in ("content-type", "content-length")}
        response = _error(ApiError(exc.status, message, kind, headers), request.path)  # 405's Allow, RFC 9110 15.5.6
    except Exception as exc:  # a bug: say so without echoing the request
        log.exception("unhandled error on %s", route)
        response = _error(ApiError(500, f"internal error: {type(exc).__name__}", "server_error"), request.path)
    except asyncio.CancelledError:  # its client went away (handler cancellation): counted, as nginx logs it, as 499
        state.metrics.request(route, CLIENT_CLOSED, time.perf_counter() - start, "client_closed")
        raise
    if cors and not response.prepared:  # an error's: a browser shows its page a response only with them
        response.headers.update(cors)
    if state.stopping and not response.prepared:  # (a 503 while draining, mostly)
        response.force_close()
    error = getattr(response, "error_type", "http_error") if response.status >= 400 else None
    state.metrics.request(route, response.status, time.perf_counter() - start, error)
    return response


CLIENT_CLOSED = 499  # the status counted for a request whose client went away before its answer (nginx's)
ANY_ORIGIN = {"Access-Control-Allow-Origin": "*"}
# a CORS preflight's answer: the methods and request headers the API reads (TEI allows GET and POST, Content-Type)
PREFLIGHT = {"Access-Control-Allow-Methods": "GET, POST",
             "Access-Control-Allow-Headers": ", ".join(("Content-Type", "Authorization", "Content-Encoding",
                                                       PRIORITY_HEADER, DEADLINE_HEADER, "X-Jaxserve-Explain")),
             "Access-Control-Max-Age": "600"}


def _preflight(request: web.Request) -> dict:
    """A preflight's answer, allowing the request headers it asks for, as Starlette's and tower-http's mirroring
    does: clients send headers of their own (OpenAI's JavaScript SDK its X-Stainless-* on every request), which
    the server ignores and a fixed list would refuse, the browser then sending nothing."""
    asked = request.headers.get("Access-Control-Request-Headers")
    return {**PREFLIGHT, "Access-Control-Allow-Headers": asked} if asked else PREFLIGHT


async def _continue(request: web.Request, expect: str) -> None:
    """`Expect: 100-continue` answered once the headers' checks have passed, as aiohttp's default handler answers it
    (HTTP/1.1 only; 417 for any other expectation, RFC 9110 10.1.1)."""
    if request.version != HttpVersion11:
        return
    if expect.lower() != "100-continue":
        raise ApiError(417, "the only expectation served is Expect: 100-continue", "expectation_failed")
    await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
    request.writer.output_size = 0  # the response proper has not begun (aiohttp's handler does the same)


def _cors(allowed: tuple[str, ...], origin: str) -> dict | None:
    """The CORS headers of a response to a browser page from `origin`; None when that origin is not allowed."""
    if "*" in allowed:
        return ANY_ORIGIN
    return {"Access-Control-Allow-Origin": origin, "Vary": "Origin"} if origin in allowed else None


STREAM_BODY_BYTES = 2**20  # larger response bodies are written from a memoryview (`_write`)


async def _write(request: web.Request, response: web.StreamResponse, timeout_s: float) -> web.StreamResponse:
    """The response written (to the socket, or to the transport's buffer below its high-water mark of 64 KiB) before
    the middleware gives back the request's slot and bytes: returned unwritten, aiohttp would write it after, and a
    client that does not read would hold its body with neither. A client that has not taken it within `timeout_s`
    (--request-timeout-s, from here) has its connection aborted. A large body (over STREAM_BODY_BYTES) goes as its
    headers with the first byte, then the rest from a memoryview: returned as a plain Response, aiohttp (on Python
    before 3.12.9) joins headers and body into one new bytes object on the event loop, a copy of the whole body
    (about 120 ms for a 250 MB multi-vector response) that stalls every other client. A client gone mid-write ends
    the write; the response is counted as sent."""
    body = getattr(response, "body", None)
    large = isinstance(body, bytes) and len(body) > STREAM_BODY_BYTES
    if large:
        headers = {k: v for k, v in response.headers.items() if k.lower() != "content-length"}
        response = web.StreamResponse(status=response.status, reason=response.reason, headers=headers)
        response.content_length = len(body)
    deadline = asyncio.get_running_loop().call_later(timeout_s, _not_read, request, timeout_s)
    try:
        await response.prepare(request)
        if large:
            await response.write(body[:1])
            await response.write(memoryview(body)[1:])
        await response.write_eof()
    except (ConnectionError, RuntimeError) as exc:  # the client went away
        log.info("a response to %s was not sent whole: %s", request.path, exc)
    finally:
        deadline.cancel()
    return response


def _not_read(request: web.Request, timeout_s: float) -> None:
    """A client has not read its response within --request-timeout-s: its connection is aborted, which ends the
    write (`_write`), and with it the request's hold on its slot and bytes."""
    log.warning("a client did not read its response to %s within --request-timeout-s %g: connection aborted",
                request.path, timeout_s)
    if (transport := request.transport) is not None:
        transport.abort()


def _authorize(request: web.Request, keys: tuple[tuple[bytes, str | None], ...]) -> str | None:
    """401 unless the request carries one of `keys` (none: no authentication); -> that key's class, if any.
    Every key is compared, in constant time each, so the time taken does not say which one nearly matched."""
    if not keys or request.path in ("/health", "/ping") or (request.path == "/" and request.method == "GET"):
        return None
    given = request.headers.get("Authorization", "")
    scheme, _, token = given.partition(" ")
    # aiohttp decodes header bytes that are not UTF-8 as lone surrogates: encode them back, do not fail on them
    token = token.strip().encode("utf-8", "surrogateescape")
    matched, cls = False, None
    for key, key_cls in keys:
        if hmac.compare_digest(token, key):
            matched, cls = True, key_cls
    if scheme.lower() != "bearer" or not matched:
        raise ApiError(401, "missing or wrong API key (send `Authorization: Bearer KEY`)", "authentication_error",
                       {"WWW-Authenticate": "Bearer"})
    return cls


def _error(err: ApiError, path: str) -> web.Response:
    """The error in its route's shape: TEI's on TEI's routes, Cohere's on Cohere's, OpenAI's elsewhere."""
    status, body = (err.tei() if path in tei_routes.PATHS else err.cohere() if path in cohere_routes.PATHS
                    else (err.status, err.body()))
    response = json_response(body, status=status, headers=err.headers)
    response.error_type = err.type
    if err.status == 408:  # the rest of its body may still come: read as the next request, it would desync the stream
        response.force_close()
    return response


_AIOHTTP_HANDLE_ERROR = RequestHandler.handle_error


def _unparsed(self: RequestHandler, request: web.BaseRequest, status: int = 500, exc: BaseException | None = None,
              message: str | None = None) -> web.StreamResponse:
    """A fixed JSON 400 for bytes aiohttp could not parse as HTTP/1.1 (a bad chunk size, bare-LF lines, an over-long
    header), logged as one line naming the fault's kind. aiohttp's own answer quotes the bytes around the fault in a
    text/plain body, and its log a traceback holding them: a document in a badly framed body appeared whole in both
    (documents never appear in logs or error messages: docs/api.md). Such a request reaches no application, so aiohttp
    has no hook per application for it: `create_app` puts this in `RequestHandler.handle_error`'s place, for every
    aiohttp server of the process once a jaxserve app exists; other errors (a handler's 500, 504) are aiohttp's as
    before."""
    if not isinstance(exc, http_exceptions.HttpProcessingError):
        return _AIOHTTP_HANDLE_ERROR(self, request, status, exc, message)
    # a first request that is not HTTP at all (a port scanner, TLS to a plain port): at debug, as aiohttp logs it
    # (getattr: the aiohttp 3.10 that pyproject.toml allows may lack BadHttpMethod and _request_count)
    quiet = getattr(self, "_request_count", 0) == 1 and isinstance(exc, getattr(http_exceptions, "BadHttpMethod", ()))
    (log.debug if quiet else log.info)("a request from %s was not valid HTTP/1.1 (%s): 400, connection closed",
                                       request.remote, type(exc).__name__)
    if request.writer.output_size > 0:  # as aiohttp: a response has begun, none other can be sent
        raise ConnectionError("a response was being sent when the request's framing broke")
    err = ApiError(status, f"the request is not valid HTTP/1.1 ({type(exc).__name__}); the connection is closed")
    response = json_response(err.body(), status=status)
    response.force_close()
    return response


def create_app(config: ServerConfig, encoder: ModelView | None = None,
               started: startup.Startup | None = None, link=None) -> web.Application:
    """The aiohttp application. With `encoder` given (already loaded, maybe warmed), it is used as is;
    `started` carries the phases timed before the app existed (import, weights). With `link` (a front-end
    process: `scheduling.link.EngineLink`), the engine process loads, warms and runs the model instead."""
    # auto_decompress off: aiohttp would answer a body it cannot inflate with plain text, or fail mid-read and
    # leave the connection broken; handling.json_body undoes Content-Encoding itself, with JSON errors.
    app = web.Application(client_max_size=config.max_body_bytes, middlewares=[errors_middleware],
                          handler_args={"auto_decompress": False})
    app[STATE] = AppState(config, encoder, started, link)
    RequestHandler.handle_error = _unparsed  # framing errors without the bytes (no hook per application)
    app.cleanup_ctx.append(lifecycle)
    app.on_shutdown.append(on_shutdown)
    openai_routes.add_routes(app)
    tei_routes.add_routes(app, vllm={"/rerank": ("documents", openai_routes.jina_rerank, "/v1/rerank"),
                                     "/tokenize": ("prompt", openai_routes.vllm_tokenize, None)})
    cohere_routes.add_routes(app)
    ops_routes.add_routes(app)
    return app


def new_loop() -> asyncio.AbstractEventLoop:
    """uvloop's event loop where it is installed (libuv: less CPU per request than asyncio's own), else asyncio's."""
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


def run_app(app: web.Application, config: ServerConfig, *, host: str | None = None, port: int | None = None,
            sock=None, announce=None) -> None:
    """Serve `app` on `host` and `port`, or on `sock`, until the first SIGTERM or SIGINT; then stop listening, drain
    with every connection still read (`_serve`), and end. A SIGTERM after the first is let be: systemd stopping the
    unit signals every process of it, and the supervisor then its front-ends, and aiohttp's own handler took the
    second as the first, cancelling the drain and closing every connection unanswered. A second SIGINT (Ctrl-C
    again) stops at once."""
    loop = new_loop()
    asyncio.set_event_loop(loop)
    main = loop.create_task(_serve(app, config, host, port, sock, announce))
    hurried = False
    try:
        loop.run_until_complete(main)
    except (web.GracefulExit, KeyboardInterrupt):  # the second SIGINT
        hurried = True
    finally:
        if not main.done():
            main.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                loop.run_until_complete(main)
        _cancel_the_rest(loop)
        loop.run_until_complete(loop.shutdown_asyncgens())
        loop.close()
    if hurried:  # stopped before its drain ended: not a clean exit (aiohttp's run_app exits 1 then too)
        raise SystemExit(1)


def _cancel_the_rest(loop: asyncio.AbstractEventLoop) -> None:
    """Every task still pending cancelled and awaited; one that had failed reported, as aiohttp's run_app does."""
    tasks = asyncio.all_tasks(loop)
    for task in tasks:
        task.cancel()
    loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))
    for task in tasks:
        if not task.cancelled() and task.exception() is not None:
            loop.call_exception_handler({"message": "unhandled exception while stopping", "exception": task.exception(),
                                         "task": task})


async def _serve(app: web.Application, config: ServerConfig, host, port, sock, announce) -> None:
    """aiohttp's `run_app` with the drain moved first. aiohttp's runner, stopping, marks every connection closing
    before `on_shutdown` runs, and a closing connection drops the bytes it receives: a request still sending its
    body was never read to its end, and waited out the drain's timeout before its connection was closed. Here the
    listener closes, the drain runs while every connection is still read (new requests on them get 503), and
    aiohttp's own shutdown follows (`on_shutdown` then finds the drain done)."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()

    def first_signal():
        loop.add_signal_handler(signal.SIGTERM, lambda: None)
        loop.add_signal_handler(signal.SIGINT, _graceful_exit)
        stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, first_signal)
    runner = web.AppRunner(app, handle_signals=False, handler_cancellation=True, shutdown_timeout=DRAIN_TIMEOUT_S,
                           keepalive_timeout=KEEPALIVE_S, access_log=access_logger(config))
    await runner.setup()
    hurried = False
    try:
        if not stop.is_set():  # (a signal during the start-up: no listening at all)
            site = web.SockSite(runner, sock) if sock is not None else web.TCPSite(runner, host, port)
            await site.start()
            if announce is not None:
                announce(f"======== Running on {site.name} ========\n(Press CTRL+C to quit)")
            await stop.wait()
            await site.stop()  # new connections refused from here
        await _drain(app)
    except asyncio.CancelledError:  # a second SIGINT: no waiting for anything (`run_app`)
        hurried = True
        raise
    finally:
        if not hurried:
            await runner.cleanup()


KEEPALIVE_S = 75.0  # an idle connection is closed after this long (aiohttp's run_app's; its AppRunner's is an hour)


def _graceful_exit():
    raise web.GracefulExit()


def access_logger(config: ServerConfig):
    """aiohttp's access log when asked for (`--access-log`), else none."""
    return logging.getLogger("aiohttp.access") if config.access_log else None


def serve(config: ServerConfig, host: str, port: int) -> None:
    """Load the model (errors end the process at once), then serve; warmup runs while /health says 503."""
    from jaxserve.http.loading import check_prompt, load_encoder  # JAX: only a process that runs the model

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    malloc = allocator_in_use()  # one process cannot preload an allocator into itself: its starter does
    if config.malloc not in ("auto", "glibc", malloc):
        if malloc == "system":
            raise SystemExit(f"jaxserve serve: {not_on_linux(config.malloc)}")
        raise SystemExit(f"jaxserve serve: --malloc {config.malloc} with one worker: start it as "
                         f"LD_PRELOAD={PRELOADS[config.malloc]} jaxserve serve ...")
    log.info("malloc: %s; open files: at most %s", malloc, raise_open_files())
    if config.malloc == "auto" and malloc == "glibc" and (found := malloc_env("auto", os.environ))[0] != "glibc":
        log.info("%s is installed: LD_PRELOAD=%s jaxserve serve ... runs this process on it (docs/operations.md)",
                 found[0], found[1]["LD_PRELOAD"])
    keep_freed_memory()
    started = startup.Startup()
    started.add("import", startup.since_process_start())
    with started.phase("weights", "loading weights"):
        encoder = load_encoder(config)
    check_prompt(config, encoder)
    log.info("loaded %s (%s, dim %d) in %s; warming up", encoder.path, encoder.arch.model_type, encoder.dim,
             started.summary())
    app = create_app(config, encoder, started)
    app[STATE].settle_heap = True
    run_app(app, config, host=host, port=port, announce=log.info)
