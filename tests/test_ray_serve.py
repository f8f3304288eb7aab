"""Ray Serve: two jaxserve replicas on a small local Ray cluster, reached through Ray's HTTP proxy on loopback."""

import asyncio
import gzip
import json
import re
import zlib

import aiohttp
import numpy as np
import pytest
import ray
import tiny
from conftest import TINY_TABLE, warm_encoder
from ray import serve

from jaxserve.http.server import ServerConfig
from jaxserve.integrations.launch import free_port
from jaxserve.integrations.ray_serve import AUTOSCALE_TARGET, build_app, deployment

# The deployment's keys come from `api_keys` only (as `--api-key KEY=CLASS` gives them), each with a class.
QUERY_KEY, INDEX_KEY = "query-key", "index-key"
AUTH = {"Authorization": f"Bearer {QUERY_KEY}"}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """(url, handle, checkpoint): 2 replicas of the tiny model behind the Ray proxy, under a route prefix, with two
    API keys of different classes."""
    tmp = tmp_path_factory.mktemp("ray")
    path = tiny.write_checkpoint(tmp / "ckpt")
    TINY_TABLE.save(tmp / "t.json")
    ray.init(num_cpus=2, include_dashboard=False, object_store_memory=80 * 2**20, log_to_driver=False)
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    config = ServerConfig(model=str(path), buckets=str(tmp / "t.json"), use_cache=False,
                          api_keys=((QUERY_KEY, "interactive"), (INDEX_KEY, "bulk")))
    handle = serve.run(deployment(config, num_replicas=2, num_cpus=0.5), name="jaxserve", route_prefix="/jx")
    yield f"http://127.0.0.1:{port}/jx", handle, path
    serve.shutdown()
    ray.shutdown()


async def test_http_through_ray_proxy_spreads_over_replicas_in_order(cluster):
    url, _, path = cluster
    docs = [f"document {i} " + "jax " * (i % 11) for i in range(60)]
    want = warm_encoder(path, TINY_TABLE).embed(docs)
    replicas = set()
    async with aiohttp.ClientSession(headers=AUTH) as session:
        async def one(i):
            async with session.post(url + "/v1/embeddings", json={"input": docs[i : i + 6], "encoding_format": "float"}) as r:
                assert r.status == 200, await r.text()
                replicas.add(r.headers["X-Jaxserve-Replica"])
                return i, np.array([d["embedding"] for d in (await r.json())["data"]])

        for _ in range(3):  # Ray's router picks by queue length; a few concurrent waves reach both replicas
            for i, got in await asyncio.gather(*[one(i) for i in range(0, 60, 6)]):
                np.testing.assert_allclose(got, want[i : i + 6], atol=1e-5)
            if len(replicas) == 2:
                break
        assert len(replicas) == 2

        async with session.post(url + "/v1/embeddings", json={"input": []}) as r:  # errors pass through unchanged
            assert r.status == 400
            assert (await r.json())["error"]["message"] == "`input` must not be empty"
        async with session.get(url + "/health") as r:
            assert r.status == 200 and (await r.json()) == {"status": "ok"}
        async with session.post(url + "/v1/embeddings", json={"input": ["x"]},
                                headers={"Authorization": "Bearer wrong"}) as r:  # auth is the replica's
            assert r.status == 401


async def test_compressed_bodies_through_ray_proxy(cluster):
    """A gzip or deflate body reaches the replica with its Content-Encoding (was: the header dropped, the body
    forwarded compressed, 400); the replica's own limits still hold."""
    url, _, path = cluster
    docs = ["hello world", "static shapes", "jax " * 40]
    want = warm_encoder(path, TINY_TABLE).embed(docs)
    body = json.dumps({"input": docs, "encoding_format": "float"}).encode()
    async with aiohttp.ClientSession(headers=AUTH) as session:
        for coding, data in [("gzip", gzip.compress(body, mtime=0)), ("deflate", zlib.compress(body)),
                             ("identity", body)]:
            async with session.post(url + "/v1/embeddings", data=data,
                                    headers={"Content-Encoding": coding, "Content-Type": "application/json"}) as r:
                assert r.status == 200, (coding, await r.text())
                np.testing.assert_allclose([d["embedding"] for d in (await r.json())["data"]], want, atol=1e-5)
        bomb = gzip.compress(b'{"input": ["' + b"a" * (17 * 2**20) + b'"]}', mtime=0)  # over max_body_bytes inflated
        async with session.post(url + "/v1/embeddings", data=bomb, headers={"Content-Encoding": "gzip"}) as r:
            assert r.status == 413 and "once inflated" in (await r.json())["error"]["message"]


async def class_sequences(session: aiohttp.ClientSession, url: str) -> dict[str, float]:
    """Sequences dispatched per request class, summed over both replicas' /metrics (each GET reaches one)."""
    pages = {}
    for _ in range(200):
        async with session.get(url + "/metrics") as r:
            assert r.status == 200
            pages[r.headers["X-Jaxserve-Replica"]] = await r.text()
        if len(pages) == 2:
            break
    assert len(pages) == 2
    totals = {"interactive": 0.0, "bulk": 0.0}
    for page in pages.values():
        for cls, n in re.findall(r'^jaxserve_class_sequences_total\{class="(\w+)"\} (\S+)$', page, re.MULTILINE):
            totals[cls] += float(n)
    return totals


async def test_deployment_handle_embeds_without_http_with_any_key_and_its_class(cluster):
    """The handle authenticates with the deployment's keys whatever their source (was: only `api_key`, so keys
    from `api_keys` gave 401), and the key's class applies as over HTTP."""
    url, handle, path = cluster
    docs = ["hello world", "static shapes", "jax " * 40]
    want = warm_encoder(path, TINY_TABLE).embed(docs)
    async with aiohttp.ClientSession(headers=AUTH) as session:
        for key, cls in [(None, "bulk"), (INDEX_KEY, "bulk"), (QUERY_KEY, "interactive")]:  # none: the least key
            before = await class_sequences(session, url)
            got = await (handle.embed.remote(docs) if key is None else handle.embed.remote(docs, api_key=key))
            np.testing.assert_allclose(got, want, atol=1e-5)
            after = await class_sequences(session, url)
            assert {c: after[c] - before[c] for c in after} == {c: 3.0 * (c == cls) for c in after}, key
    with pytest.raises(Exception, match="missing or wrong API key"):
        await handle.embed.remote(docs, api_key="wrong")
    with pytest.raises(Exception, match="must not be empty"):
        await handle.embed.remote([])


def test_build_app_reads_serve_run_arguments():
    app = build_app({"model": "/m", "num_replicas": "3", "num_gpus": "1", "max_wait_ms": "2.5", "devices": "all",
                     "max_inflight": "1", "use_cache": "false"})
    d = app._bound_deployment
    assert (d.num_replicas, d.ray_actor_options["num_gpus"], d.max_ongoing_requests) == (3, 1.0, 256)
    assert d.init_args == (ServerConfig(model="/m", max_wait_ms=2.5, devices="all", max_inflight=1, use_cache=False),)
    auto = build_app({"num_replicas": "auto", "max_replicas": "4"})._bound_deployment._deployment_config
    assert (auto.autoscaling_config.max_replicas, auto.autoscaling_config.target_ongoing_requests) == (4, AUTOSCALE_TARGET)
    with pytest.raises(ValueError, match="unknown jaxserve options \\['modle'\\]"):
        build_app({"modle": "/m"})


def test_options_a_replica_cannot_apply_are_refused_not_dropped():
    """A replica is one in-process server: the process layout of `jaxserve serve` (workers, their allocator, the
    engine's restarts) cannot apply, and max_replicas bounds only the autoscaler; each was taken and dropped."""
    auto = build_app({"num_replicas": "auto"})._bound_deployment._deployment_config.autoscaling_config
    assert auto.max_replicas == 8
    for args, message in (({"workers": "4"}, "workers: not for a Ray Serve replica"),
                          ({"malloc": "jemalloc", "engine_restarts": "0"}, "malloc, engine_restarts: not for a Ray"),
                          ({"num_replicas": "2", "max_replicas": "4"}, "max_replicas bounds the autoscaler"),
                          ({"max_replicas": "4"}, "it needs num_replicas=auto, not 1")):
        with pytest.raises(ValueError, match=message):
            build_app(args)
    with pytest.raises(ValueError, match="workers: not for a Ray Serve replica"):
        deployment(ServerConfig(workers=2))
    assert build_app({"access_log": "true"})._bound_deployment.init_args == (ServerConfig(access_log=True),)


async def test_a_replica_whose_warmup_failed_says_why_at_once(aiohttp_client, tmp_path):
    """A replica waits for its server's /health (`wait_ready`, for up to WARMUP_TIMEOUT_S): a warm-up that failed
    (here a default prompt the checkpoint lacks, found at warm-up) ends the wait with its reason, not a bare
    TimeoutError half an hour later. No Ray needed: the replica's server and wait, on loopback."""
    from jaxserve.http.server import create_app
    from jaxserve.integrations.launch import wait_ready

    TINY_TABLE.save(tmp_path / "t.json")
    config = ServerConfig(model=str(tiny.write_checkpoint(tmp_path / "ckpt")), buckets=str(tmp_path / "t.json"),
                          use_cache=False, default_prompt_name="nope")
    client = await aiohttp_client(create_app(config))
    with pytest.raises(RuntimeError, match="will not be ready: warmup failed: InputError: unknown prompt_name 'nope'"):
        await wait_ready(client.session, str(client.make_url("")).rstrip("/"), timeout_s=120)
