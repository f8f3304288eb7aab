"""What the Ray Serve hop costs: the same requests to `jaxserve serve` directly and through Ray's proxy.

    python scripts/bench_ray.py [--docs 100] [--repeats 20] [--out results/ray.json]

One process at a time on this machine (a jaxserve server, then a one-replica
Ray Serve app with the same bucket table), so they never share the CPU.
Requests are sequential: the figure is the hop's added latency, not throughput.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time

import aiohttp

import harness

ROOT = harness.ROOT


async def latencies(url: str, bodies: dict, repeats: int) -> dict:
    from jaxserve.integrations.launch import wait_ready

    out = {}
    async with aiohttp.ClientSession() as s:
        await wait_ready(s, url, 600)  # Ray's proxy (a server started by harness.server is ready already)
        for name, body in bodies.items():
            times = []
            for i in range(repeats + 1):
                start = time.perf_counter()
                async with s.post(url + "/v1/embeddings", json=body) as r:
                    assert r.status == 200, await r.text()
                    await r.read()
                if i:  # the first settles caches
                    times.append(time.perf_counter() - start)
            out[name] = {"p50_ms": 1000 * statistics.median(times), "min_ms": 1000 * min(times)}
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--docs", type=int, default=100)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--buckets", default=str(ROOT / "buckets" / "minilm-cpu-default.json"))
    ap.add_argument("--out", default=str(ROOT / "results" / "ray.json"))
    args = ap.parse_args()
    with harness.bench_lock():
        rows = measure(args)
    harness.write_result(args.out, {"rows": rows})
    return 0


def measure(args) -> list[dict]:
    docs = harness.documents(args.docs)
    bodies = {f"{args.docs} documents": {"input": docs}, "1 short document": {"input": ["a short query"]}}
    with harness.server("--buckets", args.buckets, timeout_s=600) as srv:
        direct = asyncio.run(latencies(srv.url, bodies, args.repeats))

    import ray
    from ray import serve

    from jaxserve.http.server import ServerConfig
    from jaxserve.integrations.launch import free_port
    from jaxserve.integrations.ray_serve import deployment

    ray.init(include_dashboard=False, log_to_driver=False)
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    serve.run(deployment(ServerConfig(buckets=args.buckets), num_replicas=1), name="jaxserve", route_prefix="/")
    via_ray = asyncio.run(latencies(f"http://127.0.0.1:{port}", bodies, args.repeats))
    serve.shutdown()
    ray.shutdown()

    table = []
    for name in bodies:
        d, r = direct[name]["p50_ms"], via_ray[name]["p50_ms"]
        table.append([name, f"{d:.1f}", f"{r:.1f}", f"{r - d:.1f}", f"{r / d:.2f}"])
    harness.print_table(["request", "direct p50 ms", "Ray p50 ms", "added ms", "ratio"], table)
    return [{"request": name, "direct": direct[name], "ray": via_ray[name]} for name in bodies]


if __name__ == "__main__":
    sys.exit(main())
