"""Ray Serve: two jaxserve replicas on a small local Ray cluster, reached through Ray's HTTP proxy on loopback."""

import asyncio

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


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """(url, handle, checkpoint): 2 replicas of the tiny model behind the Ray proxy, under a route prefix."""
    tmp = tmp_path_factory.mktemp("ray")
    path = tiny.write_checkpoint(tmp / "ckpt")
    TINY_TABLE.save(tmp / "t.json")
    ray.init(num_cpus=2, include_dashboard=False, object_store_memory=80 * 2**20, log_to_driver=False)
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    config = ServerConfig(model=str(path), buckets=str(tmp / "t.json"), use_cache=False)
    handle = serve.run(deployment(config, num_replicas=2, num_cpus=0.5), name="jaxserve", route_prefix="/jx")
    yield f"http://127.0.0.1:{port}/jx", handle, path
    serve.shutdown()
    ray.shutdown()


async def test_http_through_ray_proxy_spreads_over_replicas_in_order(cluster):
    url, _, path = cluster
    docs = [f"document {i} " + "jax " * (i % 11) for i in range(60)]
    want = warm_encoder(path, TINY_TABLE).embed(docs)
    replicas = set()
    async with aiohttp.ClientSession() as session:
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


def test_deployment_handle_embeds_without_http(cluster):
    _, handle, path = cluster
    docs = ["hello world", "static shapes", "jax " * 40]
    got = handle.embed.remote(docs).result()
    want = warm_encoder(path, TINY_TABLE).embed(docs)
    np.testing.assert_allclose(got, want, atol=1e-5)
    with pytest.raises(Exception, match="must not be empty"):
        handle.embed.remote([]).result()


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
