"""Soak: sustained mixed load on a `jaxserve serve` subprocess, with bad requests and disconnects (loopback).

    python scripts/soak.py [--seconds 120] [--clients 8] [--model DIR] [--buckets FILE]

Each client loops until the deadline: 80% good requests (1-40 documents from
a fixed pool; every vector is checked, in order, against the same model run
in this process), 10% bad requests (must get a 4xx JSON error), 10% requests
abandoned mid-flight (disconnects). Afterwards: the server's RSS growth, its
compile counter (must not move), queue depth (must be 0), and the sequence
ledger from /metrics: every sequence submitted was dispatched for a waiting
request or dropped because its client left (abandoned rows never reach the
device). Bounded: at most `--seconds` and 100,000 requests.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import time

import aiohttp
import numpy as np
import psutil

import harness

ROOT = harness.ROOT

MAX_REQUESTS = 100_000
BAD_BODIES = [b"{not json", b'{"input": []}', b'{"input": 5}', b'{"input": ["ok", null]}', b'{"inputs": ["x"]}',
              b'{"input": ["ok"], "dimensions": 0}']


def metric(text: str, name: str) -> float:
    m = re.search(rf"^{name}(?:{{[^}}]*}})? ([0-9.e+-]+)$", text, re.M)
    return float(m.group(1)) if m else float("nan")


async def soak(url: str, pid: int, seconds: float, clients: int, docs: list[str], expected: np.ndarray,
               seed: int = 0) -> dict:
    rng = random.Random(seed)
    stats = {"good": 0, "good_wrong": 0, "bad": 0, "bad_wrong_status": 0, "abandoned": 0, "errors": 0}
    proc = psutil.Process(pid)
    async with aiohttp.ClientSession() as s:
        for _ in range(3):  # settle allocator and caches before the RSS baseline
            async with s.post(url + "/v1/embeddings", json={"input": docs[:40]}) as r:
                await r.read()
        rss0 = proc.memory_info().rss
        compiles0 = metric(await (await s.get(url + "/metrics")).text(), "jaxserve_xla_compiles_total")
        deadline = time.monotonic() + seconds
        sent = 0

        async def client():
            nonlocal sent
            while time.monotonic() < deadline and sent < MAX_REQUESTS:
                sent += 1
                roll = rng.random()
                if roll < 0.1:
                    async with s.post(url + "/v1/embeddings", data=rng.choice(BAD_BODIES)) as r:
                        body = await r.json()
                        stats["bad"] += 1
                        stats["bad_wrong_status"] += not (400 <= r.status < 500 and "error" in body)
                    continue
                idx = rng.sample(range(len(docs)), rng.randint(1, 40))
                request = s.post(url + "/v1/embeddings", json={"input": [docs[i] for i in idx], "encoding_format": "float"})
                if roll < 0.2:
                    task = asyncio.ensure_future(request)
                    await asyncio.sleep(rng.uniform(0.001, 0.02))
                    task.cancel()
                    stats["abandoned"] += 1
                    continue
                try:
                    async with request as r:
                        if r.status != 200:
                            stats["errors"] += 1
                            continue
                        got = np.array([d["embedding"] for d in (await r.json())["data"]])
                except aiohttp.ClientError:
                    stats["errors"] += 1
                    continue
                cos = (got * expected[idx]).sum(1) / np.linalg.norm(got, axis=1) / np.linalg.norm(expected[idx], axis=1)
                stats["good"] += 1
                stats["good_wrong"] += bool(cos.min() < 0.99999)

        await asyncio.gather(*(client() for _ in range(clients)))
        await asyncio.sleep(0.5)
        text = await (await s.get(url + "/metrics")).text()
        healthy = (await s.get(url + "/health")).status == 200
    return dict(stats, requests=sent, seconds=seconds, rss_start_mib=round(rss0 / 2**20, 1),
                rss_growth_mib=round((proc.memory_info().rss - rss0) / 2**20, 1),
                compiles_during=metric(text, "jaxserve_xla_compiles_total") - compiles0,
                queue_depth_after=metric(text, "jaxserve_queue_depth"), healthy_after=healthy,
                **{f"sequences_{k}": metric(text, f'jaxserve_sequences_total\\{{outcome="{k}"\\}}')
                   for k in ("submitted", "dispatched", "dropped")})


def run(model: str | None, buckets: str, seconds: float, clients: int, port: int | None = None) -> dict:
    from jaxserve import Encoder

    docs = harness.documents(300, seed=3)
    expected = Encoder.from_pretrained(model, buckets=buckets).embed(docs)
    flags = ["--buckets", buckets] + (["--model", model] if model else [])
    with harness.server(*flags, port=port) as srv:
        return asyncio.run(soak(srv.url, srv.proc.pid, seconds, clients, docs, expected))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=120)
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--model", default=None)
    ap.add_argument("--buckets", default=str(ROOT / "buckets" / "minilm-cpu-default.json"))
    ap.add_argument("--out", default=str(ROOT / "results" / "soak.json"))
    args = ap.parse_args()
    with harness.bench_lock():
        result = run(args.model, args.buckets, args.seconds, args.clients)
    print(json.dumps(result, indent=1))
    harness.write_result(args.out, result)


if __name__ == "__main__":
    main()
