"""Many hosts: jaxserve replicas as a Ray Serve deployment, one replica per accelerator.

Each replica is a whole jaxserve server (its own buckets, batcher and device
worker) listening on the replica's loopback; the deployment forwards every
HTTP request from Ray's proxy to it unchanged, so routes, validation, errors,
limits and auth are exactly those of `jaxserve serve`. Ray places the replicas
(one per GPU with `num_gpus=1`; none asked for by default), routes between them by queue length, restarts failed ones
(`check_health` asks the replica's /health) and autoscales.

    serve run jaxserve.integrations.ray_serve:build_app num_replicas=4 num_gpus=1 model=/models/minilm

or from Python: `serve.run(deployment(ServerConfig(...), num_replicas=4))`.
Ray Python callers can skip HTTP: `handle.embed.remote(texts).result()`, or with
an API key (its class applies): `handle.embed.remote(texts, api_key=KEY)`.
"""

from __future__ import annotations

import logging
import typing

import aiohttp
import numpy as np
import orjson
import pybase64
from aiohttp import web
from ray import serve
from starlette.requests import Request
from starlette.responses import Response

from jaxserve.http.loading import load_encoder
from jaxserve.http.server import KEEPALIVE_S, ServerConfig, access_logger, create_app
from jaxserve.integrations.launch import wait_ready

log = logging.getLogger("jaxserve.integrations.ray_serve")

# Requests Ray sends one replica before waiting for answers. Ray's default (5)
# would starve the batcher: buckets fill from many concurrent requests.
MAX_ONGOING_REQUESTS = 256
AUTOSCALE_TARGET = 32  # ongoing requests per replica the autoscaler aims for
MAX_QUEUED_REQUESTS = 1024  # past this the Ray proxy answers 503 itself
WARMUP_TIMEOUT_S = 1800.0  # compile every bucket on a cold cache
HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "content-length", "host"}
# A request body is forwarded as it came, compressed or not, with its Content-Encoding: the replica inflates it
# within its own limits. A response body is inflated by the session's read, so its Content-Encoding is dropped.
RESPONSE_DROPPED = HOP_BY_HOP | {"content-encoding"}
# The key the handle uses when its caller names none: the least any key grants (a bulk key, else an unclassed
# one), so a Ray caller without a key gets no more than every HTTP client with one.
DEFAULT_KEY_ORDER = {"bulk": 0, None: 1, "interactive": 2}
# `jaxserve serve`'s process layout: a replica is one in-process server (Ray scales and restarts replicas instead)
NOT_IN_A_REPLICA = ("workers", "malloc", "engine_restarts")
MAX_REPLICAS = 8  # with num_replicas="auto", unless given


class JaxserveReplica:
    """One jaxserve server on the replica's loopback, behind Ray Serve's proxy."""

    async def __init__(self, config: ServerConfig):
        self.runner = web.AppRunner(create_app(config, load_encoder(config)), handler_cancellation=True,
                                    keepalive_timeout=KEEPALIVE_S, access_log=access_logger(config))
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", 0).start()
        self.url = "http://127.0.0.1:%d" % self.runner.addresses[0][1]
        self.session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None))
        await wait_ready(self.session, self.url, WARMUP_TIMEOUT_S)
        self.replica = serve.get_replica_context().replica_id.unique_id
        self.default_key = (min(config.keys, key=lambda kc: DEFAULT_KEY_ORDER[kc[1]])[0]
                            .decode("utf-8", "surrogateescape") if config.keys else None)
        log.info("replica %s ready at %s", self.replica, self.url)

    async def __call__(self, request: Request) -> Response:
        path, prefix = request.url.path, request.scope.get("root_path", "")  # the app's route_prefix, if any
        if prefix and path.startswith(prefix):
            path = path[len(prefix):] or "/"
        headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP_BY_HOP}
        async with self.session.request(request.method, self.url + path, params=request.query_params,
                                         headers=headers, data=await request.body()) as r:
            body = await r.read()
            out = {k: v for k, v in r.headers.items() if k.lower() not in RESPONSE_DROPPED}
        out["X-Jaxserve-Replica"] = self.replica
        return Response(body, status_code=r.status, headers=out)

    async def embed(self, texts: list[str], api_key: str | None = None) -> np.ndarray:
        """[N, D] float32 in input order, for Ray callers (through the replica's own /v1/embeddings, so as over
        HTTP: `api_key` must be one of the server's keys, and its class applies; none given: `default_key`)."""
        key = api_key or self.default_key
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        async with self.session.post(self.url + "/v1/embeddings", headers=headers,
                                     json={"input": texts, "encoding_format": "base64"}) as r:
            body = await r.json(loads=orjson.loads)
            if r.status != 200:
                raise ValueError(body["error"]["message"])
        # the server's own base64 (api.b64_rows): little-endian float32, decoded by the same SIMD library
        return np.stack([np.frombuffer(pybase64.b64decode(d["embedding"]), "<f4") for d in body["data"]])

    async def check_health(self) -> None:
        async with self.session.get(self.url + "/health") as r:
            if r.status != 200:
                raise RuntimeError(f"replica /health answered {r.status}: {await r.text()}")

    async def __del__(self):
        """Ray stops routing here first; then drain what was accepted, as on SIGTERM."""
        await self.session.close()
        await self.runner.cleanup()


def deployment(config: ServerConfig, num_replicas: int | str = 1, num_gpus: float = 0, num_cpus: float = 1,
               max_replicas: int | None = None, max_ongoing_requests: int = MAX_ONGOING_REQUESTS):
    """The bound Ray Serve application: `num_replicas` jaxserve servers, or "auto" (1 to `max_replicas`, default
    MAX_REPLICAS). Options that cannot apply to a replica are refused (ValueError), not dropped."""
    defaults = ServerConfig()
    if unused := [f for f in NOT_IN_A_REPLICA if getattr(config, f) != getattr(defaults, f)]:
        raise ValueError(f"{', '.join(unused)}: not for a Ray Serve replica, which is one in-process jaxserve "
                         "server (num_replicas scales it, and Ray restarts it)")
    if max_replicas is not None and num_replicas != "auto":
        raise ValueError(f"max_replicas bounds the autoscaler: it needs num_replicas=auto, not {num_replicas!r}")
    autoscaling = None
    if num_replicas == "auto":
        # Ray's default target (2 requests per replica) would add a replica for every two requests;
        # a replica's batcher is at its best with many requests in flight.
        autoscaling = {"min_replicas": 1, "max_replicas": max_replicas or MAX_REPLICAS,
                       "target_ongoing_requests": AUTOSCALE_TARGET}
    return serve.deployment(
        JaxserveReplica, name="jaxserve", num_replicas=num_replicas, autoscaling_config=autoscaling,
        ray_actor_options={"num_gpus": num_gpus, "num_cpus": num_cpus},
        max_ongoing_requests=max_ongoing_requests, max_queued_requests=MAX_QUEUED_REQUESTS,
        health_check_period_s=10, graceful_shutdown_timeout_s=30,
    ).bind(config)


def build_app(args: dict):
    """`serve run jaxserve.integrations.ray_serve:build_app key=value ...`: any scalar ServerConfig field but
    NOT_IN_A_REPLICA's, plus num_replicas (a number or auto), max_replicas (with auto), num_gpus (per replica;
    1 on a GPU cluster) and num_cpus."""
    args = dict(args)
    placement = {k: float(args.pop(k)) for k in ("num_gpus", "num_cpus") if k in args}
    if "max_replicas" in args:
        placement["max_replicas"] = int(args.pop("max_replicas"))
    replicas = args.pop("num_replicas", 1)
    hints = typing.get_type_hints(ServerConfig)
    unknown = sorted(set(args) - set(hints))
    if unknown:
        raise ValueError(f"unknown jaxserve options {unknown}; known: {sorted(hints)}, num_replicas, max_replicas, "
                         "num_gpus, num_cpus")
    config = ServerConfig(**{k: _parse(v, hints[k]) for k, v in args.items()})
    return deployment(config, num_replicas=_parse(replicas, int | str), **placement)


def _parse(value, hint):
    """A command-line string as the first type of the field's annotation that accepts it."""
    if not isinstance(value, str):
        return value
    for t in [t for t in (bool, int, float, str) if t in (typing.get_args(hint) or (hint,))]:
        if t is bool:
            if value.lower() in ("1", "true", "yes", "0", "false", "no"):
                return value.lower() in ("1", "true", "yes")
            continue
        try:
            return t(value)
        except ValueError:
            continue
    raise ValueError(f"cannot read {value!r} as {hint}")
