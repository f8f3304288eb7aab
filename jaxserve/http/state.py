"""What the HTTP handlers share: the server's configuration, its limits (each with its reason) and its state."""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import functools
import json
import math
import os
import time

from aiohttp import web

from jaxserve.checkpoint import loader
from jaxserve.http.api import ApiError, Limits
from jaxserve.http.budget import ByteBudget
from jaxserve.http.classes import INTERACTIVE_MAX_SEQUENCES, INTERACTIVE_MAX_TOKENS, Policy, route_ceilings
from jaxserve.http.metrics import EngineMetrics, ServerMetrics
from jaxserve.runtime import artifact, host
from jaxserve.runtime.buckets import BucketTable
from jaxserve.runtime.derivation import TableOptions
from jaxserve.runtime.startup import Startup
from jaxserve.scheduling.batcher import CLASSES
from jaxserve.scheduling.pipeline import BULK_DISPATCH_MS, MAX_INFLIGHT, Draining, Pipeline
from jaxserve.view import ModelView

# Limits, each with its reason.
MAX_BODY_BYTES = 16 * 2**20  # 1024 inputs of ~16 k characters; larger bodies are refused before parsing (413)
MAX_CLIENT_BATCH = 1024  # inputs per request: a 100-document request with room to spare
MAX_INPUT_CHARS = 100_000  # characters per input: ~25 k tokens, ~100 chunk windows at most
# The queue is bounded in tokens (each row at its seqlen: device work); default `batcher.queue_tokens`: 2 s of the
# device's measured best rate, clamped to [2**18, 2**24] tokens; past it, 429 (memory stays bounded)
MAX_WAIT_MS = 5.0  # batch window: how long a partial batch may wait for company while the device is busy
DRAIN_TIMEOUT_S = 30.0  # SIGTERM: how long accepted work may take to finish
RETRY_AFTER_S = 1  # told to clients on 429/503
MAX_CONCURRENT_REQUESTS = 512  # model requests being handled at once; past it, 429 (bounds tokenizer and queue work)
MAX_INFLIGHT_BODY_BYTES = 256 * 2**20  # bytes of request bodies being handled at once; past it, 429 (bounds memory
# before the queue: 16 full-size bodies, or thousands of ordinary ones)
REQUEST_TIMEOUT_S = 60.0  # a model request still unanswered after this gets 503 and its waiting rows are dropped
ENGINE_METRICS_TIMEOUT_S = 5.0  # /metrics: past this, the engine process's metrics are left out (the rest shown)
OFFLOAD_BODY_BYTES = 64 * 2**10  # bodies larger than this are decoded on a thread, not on the event loop
# A request of at most this many inputs and body bytes is tokenized and packed on the event loop: its tokenizing
# costs less than the two thread hand-offs that would move it (a few hundred tokens at most: bounded, not growing)
INLINE_INPUTS = 2
INLINE_BODY_BYTES = 2048
OFFLOAD_FLOATS = 16_384  # responses with more floats than this are encoded on a thread
DICT_FLOATS = 32  # building one result object (a label's or a text's score) costs about as much as this many floats
TOKEN_ID_MODES = ("openai", "model")  # whose ids /v1/embeddings' token-id inputs are
WARMUP_FAILED = "warmup failed"  # how /health's status starts when the warm-up failed: no retry will make it ready


def warmup_failed(exc: Exception) -> str:
    """/health's status (503) after the warm-up raised `exc`."""
    return f"{WARMUP_FAILED}: {type(exc).__name__}: {exc}"


@dataclasses.dataclass(frozen=True)
class ServerConfig:
    model: str | None = None  # checkpoint dir or hub id; None = $JAXSERVE_MODEL, else bundled all-MiniLM-L6-v2
    model_name: str | None = None  # name reported in responses (default: the model argument or directory name)
    dtype: str = "auto"  # float32 on CPU, bfloat16 on accelerators
    task: str | None = None  # task adapter merged at load (Jina-embeddings-v3's LoRA); None: $JAXSERVE_TASK, else none
    attention: str = "auto"  # attention implementation per bucket (jaxserve.models.attention.plan), with fallback
    buckets: str = "auto"  # a bucket table JSON file, or auto (derived for this device)
    ladder: str = "default"
    layout: str = "packed"
    max_wait_ms: float = MAX_WAIT_MS
    max_queue_tokens: int | None = None  # tokens waiting before 429 (None: `batcher.queue_tokens` of the table)
    max_client_batch: int = MAX_CLIENT_BATCH
    max_input_chars: int = MAX_INPUT_CHARS
    max_body_bytes: int = MAX_BODY_BYTES
    long: str = "truncate"  # default for inputs over the model's limit
    default_prompt_name: str | None = None  # for requests naming no prompt (default: the checkpoint's)
    default_prompt: str | None = None  # ... or this text
    api_key: str | None = None  # one key (JAXSERVE_API_KEY), no class of its own
    api_keys: tuple[tuple[str, str | None], ...] = ()  # (key, its requests' class or None): --api-key KEY[=CLASS]
    route_priority: tuple[tuple[str, str], ...] = ()  # (route path, class of its requests): --route-priority
    max_concurrent: int = MAX_CONCURRENT_REQUESTS
    max_inflight_bytes: int = MAX_INFLIGHT_BODY_BYTES
    request_timeout_s: float = REQUEST_TIMEOUT_S
    cache_dir: str | None = None  # where warm artifacts are (in warm/); None = $JAXSERVE_CACHE_DIR or ~/.cache/jaxserve
    use_cache: bool = True  # start from a matching warm artifact, and save one after a cold start
    keep_artifacts: int = artifact.KEEP  # after a save, the newest artifacts of the model kept in the cache
    max_inflight: int = MAX_INFLIGHT  # batches on the device at once
    streams: int | None = None  # device threads each running a batch (None: the device's; 2 on a CPU, else 1)
    devices: int | str = 1  # local devices sharing each batch (data parallel), or "all"
    token_ids: str = "openai"  # token-id inputs on /v1/embeddings: OpenAI's tokenizer's (tiktoken), or the model's
    default_priority: str = "auto"  # class of requests that ask for none: auto (by size), interactive or bulk
    interactive_max_sequences: int = INTERACTIVE_MAX_SEQUENCES  # larger requests run as bulk, whatever they ask
    interactive_max_tokens: int = INTERACTIVE_MAX_TOKENS  # ... and so do requests of more tokens
    bulk_dispatch_ms: float = BULK_DISPATCH_MS  # while queries are likely, a bulk batch's predicted run at most this
    host_dispatch_us: float | None = None  # host time per dispatch for batch sizes (None: measured, scheduling/host_cost)
    tokenizer_threads: int | None = None  # decode/tokenize/pack pool (None: half the usable cores, at least 2)
    respond_threads: int | None = None  # combine/normalise/encode pool (None: a quarter of the usable cores, at least 2)
    embed_all: bool = True  # compile token outputs for TEI's /embed_all (one more shape per seqlen)
    table: TableOptions | None = None  # all of the derivation's options (default: `ladder` and `layout`, else the device's)
    workers: int = 1  # front-end processes (http/workers.py); 1: one process does everything
    engine_restarts: int = 3  # with workers > 1: times the supervisor restarts an engine process that died
    simulate: object | None = None  # a runtime.simulated.SimSpec: serve on a simulated device (capacity planning)
    malloc: str = "auto"  # with workers > 1: the serving processes' allocator (runtime/host.malloc_env)
    cors_allow_origins: tuple[str, ...] = ("*",)  # origins whose pages may call it (CORS; "*": any, as TEI); (): none
    access_log: bool = False  # one log line per request (aiohttp's access log): off, it costs more than a small request

    @functools.cached_property
    def keys(self) -> tuple[tuple[bytes, str | None], ...]:
        """Every accepted API key (bytes, as compared) with its class; empty: no authentication. Once per config:
        every request reads it."""
        given = self.api_keys + (((self.api_key, None),) if self.api_key else ())
        return tuple((k.encode("utf-8", "surrogateescape"), c) for k, c in given)

    @functools.cached_property
    def route_classes(self) -> dict[str, str]:
        """`route_priority` by route path, each also on the paths that serve the same route (`route_ceilings`)."""
        return route_ceilings(dict(self.route_priority))

    @functools.cached_property
    def class_policy(self) -> Policy:
        return Policy(self.default_priority, self.interactive_max_sequences, self.interactive_max_tokens)

    @property
    def table_options(self) -> TableOptions:
        return self.table or TableOptions(ladder=self.ladder, layout=self.layout)

    def __post_init__(self):
        if self.token_ids not in TOKEN_ID_MODES:
            raise ValueError(f"token_ids must be one of {', '.join(TOKEN_ID_MODES)}, not {self.token_ids!r}")
        if self.default_prompt_name is not None and self.default_prompt is not None:
            raise ValueError("give default_prompt_name or default_prompt, not both")
        for what, cls in [("api key class", c) for _, c in self.api_keys if c is not None] + \
                [(f"route {r}", c) for r, c in self.route_priority]:
            if cls not in CLASSES:
                raise ValueError(f"{what}: class must be one of {', '.join(CLASSES)}, not {cls!r}")
        if any(not key.strip() for key, _ in self.api_keys):  # `Authorization: Bearer` with no key would match it
            raise ValueError("an API key is empty (an --api-key \"$KEY\" of an unset variable, or a line of "
                             "--api-keys-file with only =CLASS?)")
        if self.max_queue_tokens is not None and self.max_queue_tokens < 1:
            raise ValueError(f"max_queue_tokens must be positive, not {self.max_queue_tokens}")
        # a limit below these refuses every request (max_inflight: runs no batch; max_inflight_bytes: takes one body
        # at a time): a server that starts and then answers nothing; 0 interactive is a choice (every request bulk)
        least = {"keep_artifacts": 1, "max_concurrent": 1, "max_client_batch": 1, "max_input_chars": 1,
                 "max_body_bytes": 1, "max_inflight_bytes": 1, "max_inflight": 1, "streams": 1, "tokenizer_threads": 1,
                 "respond_threads": 1, "workers": 1, "engine_restarts": 0, "interactive_max_sequences": 0,
                 "interactive_max_tokens": 0}
        for name, low in least.items():
            if (value := getattr(self, name)) is not None and value < low:
                raise ValueError(f"{name} must be at least {low}, not {value}")
        for name in ("max_wait_ms", "host_dispatch_us"):  # a NaN compares false everywhere; an infinite window is
            if (value := getattr(self, name)) is not None and not 0 <= value < math.inf:  # a timer that overflows
                raise ValueError(f"{name} must be a finite number of at least 0, not {value}")
        if not self.bulk_dispatch_ms >= 0:  # infinite: bulk batches are never cut
            raise ValueError(f"bulk_dispatch_ms must be a number of at least 0, not {self.bulk_dispatch_ms}")
        if not 0 < self.request_timeout_s < math.inf:  # a NaN would never expire
            raise ValueError(f"request_timeout_s must be a finite number of seconds above 0, "
                             f"not {self.request_timeout_s}")


class AppState:
    """Everything the handlers share; `ready` once the buckets are warm."""

    def __init__(self, config: ServerConfig, encoder: ModelView | None, started: Startup | None = None, link=None):
        self.config = config
        self.server_config = config  # a front-end of several: the whole server's (`config` holds its share of the limits)
        self.encoder = encoder
        self.startup = started or Startup()
        self.metrics = ServerMetrics()
        self.engine_metrics = EngineMetrics() if link is None else None  # one process: its pipeline's
        self.service: Pipeline | None = None  # or, in a front-end process, the EngineLink (`link`)
        self.link = link
        self.table: BucketTable | None = None
        self.device: dict | None = None  # the device's description for /info (runtime.device.describe)
        self.processes_file: str | None = None  # a front-end process: the supervisor's pids by role (http/workers.py)
        self.ready = False
        self.failed: str | None = None
        self.stopping = False  # the server's drain has begun (`server._drain`: once, when it stops)
        if link is not None:
            link.on_card = self.take_card
            link.on_status = self.take_status
            link.report = self.metrics.snapshot  # what this front-end adds to another's /metrics
        # Work that grows with the request, off the event loop: decoding, tokenizing, packing, explaining ...
        self.pool_threads = host.pool_sizes(config.tokenizer_threads, config.respond_threads)
        self.tokenizer_pool = concurrent.futures.ThreadPoolExecutor(self.pool_threads[0],
                                                                    thread_name_prefix="jaxserve-tokenize")
        # ... one more thread for requests that will likely be interactive, never behind a bulk request's
        # thousand documents ...
        self.interactive_pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="jaxserve-tokenize-q")
        # ... and combining, normalising and encoding responses (its own threads: never behind tokenizing).
        self.respond_pool = concurrent.futures.ThreadPoolExecutor(self.pool_threads[1],
                                                                  thread_name_prefix="jaxserve-respond")
        self.limits = Limits(config.max_client_batch, config.max_input_chars)
        # a serving process (`jaxserve serve`'s, not an app inside another program, whose later garbage this would
        # keep): once ready, what it loaded leaves the garbage collector's sight (`host.settle_heap`)
        self.settle_heap = False
        self.active = 0  # model requests being handled
        self.budget = ByteBudget(config.max_inflight_bytes)  # bytes their bodies hold, inflated

    def take_card(self, card: dict) -> None:
        """A front-end process: the engine process's model view, tables and device (scheduling/link.py); ready once
        the engine says it is (it waits for every front-end to load its card: `LinkServer.ready`)."""
        self.encoder, self.table, self.device = card["encoder"], card["table"], card["device"]
        self.startup.source, self.startup.phases = card["source"], card["phases"]
        self.failed = None
        if self.link.status.get("ready"):
            self.ready, self.startup.doing = True, "ready"
        if self.settle_heap:
            host.settle_heap()

    def take_status(self, status: dict) -> None:
        """A front-end process: the engine's start-up as it goes (/health shows it while warming)."""
        if not status.get("ready"):
            self.failed = status.get("failed")
            if "doing" in status:
                self.startup.doing = status["doing"]
                self.startup.phases = dict(status.get("phases", {}))
        elif self.table is not None:  # the card came first
            self.ready, self.startup.doing = True, "ready"

    @property
    def processes(self) -> dict:
        """Pids by role, for /info: one process does everything, or a supervisor's engine and front-ends; and the
        allocator that serves their malloc, as this process resolves it (every child starts with the same
        environment, so what the supervisor chose, or an allocator of the user's own LD_PRELOAD before it)."""
        if self.processes_file is None:
            return {"engine": os.getpid(), "frontends": [os.getpid()], "malloc": host.allocator_in_use()}
        try:
            with open(self.processes_file) as f:
                return {**json.load(f), "malloc": host.allocator_in_use()}
        except (OSError, ValueError):
            return {}

    @property
    def simulated(self) -> dict | None:
        """A simulated device's description and its clock (busy seconds, steps); None for a real device."""
        if self.link is not None:
            return self.link.status.get("simulated")
        from jaxserve.runtime.simulated import described  # JAX: a process with the engine has it loaded already

        return described(getattr(self.encoder, "engine", None))

    @functools.cached_property
    def model_name(self) -> str:
        """The name responses report; once per process (`loader.named` reads the environment), not per request."""
        return self.config.model_name or loader.named(self.config.model) or "sentence-transformers/all-MiniLM-L6-v2"

    async def engine_snapshot(self) -> dict | None:
        """The pipeline's metrics now (`EngineMetrics.snapshot`): this process's, or the engine process's over its
        link with every other front-end's added (`LinkServer`); None while the engine process does not answer."""
        if self.link is None:
            return self.engine_metrics.snapshot()
        try:
            return await asyncio.wait_for(self.link.metrics(), ENGINE_METRICS_TIMEOUT_S)
        except (Draining, TimeoutError):
            return None

    async def drain(self, timeout: float) -> bool:
        """Refuse new requests; finish every request being handled, tokenizing ones included (each awaits its
        job). True if all finished within `timeout` seconds."""
        deadline = time.monotonic() + timeout
        if not await self.service.drain(timeout):  # /health and require_ready refuse from here on
            return False
        while self.active:
            if time.monotonic() > deadline:
                return False
            await asyncio.sleep(0.01)
        return True

    def require_room(self, more: int = 1, detail: str = "") -> None:
        """429 unless `more` requests may be handled beside those being handled (--max-concurrent-requests)."""
        if self.active + more > self.config.max_concurrent:
            raise ApiError(429, f"{self.active} requests are being handled{detail}; the limit is "
                                f"{self.config.max_concurrent}", "rate_limit_error",
                           {"Retry-After": str(RETRY_AFTER_S)})

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
# request[API_KEY_CLASS]: the class of the API key it was authorised with, or None (aiohttp < 3.14: a plain name)
_key = web.RequestKey if hasattr(web, "RequestKey") else lambda name, t: f"jaxserve.{name}"
API_KEY_CLASS = _key("api_key_class", str)
BODY_BYTES = _key("body_bytes", int)  # request[BODY_BYTES]: its body's size once decoded (handling.json_body)
CHARGE = _key("charge", object)  # request[CHARGE]: its share of the in-flight byte budget (budget.Charge)
# request[EXPECTS]: its `Expect` header, where its route left the answer to the middleware (handling.expect_later)
EXPECTS = _key("expects", str)
