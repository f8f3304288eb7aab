"""Interactive queries under saturating bulk indexing: query p50/p99 idle and under N bulk clients, with and
without request classes, and bulk docs/s, against a real `jaxserve serve` on loopback.

"without classes" is the same server with `--default-priority bulk` (every request one FIFO class, as before
issue 26); "with classes" is the automatic default (a 1-text query is interactive, a 1000-doc request bulk).
Modes alternate within one invocation (the host is shared and drifts). Run it under
`flock /tmp/jaxserve-bench.lock`.

    python scripts/bench_mixed.py --bulk-clients 2 --bulk-docs 1000 --seconds 30 --rounds 1
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time

import aiohttp
import numpy as np

from jaxserve.launch import wait_ready

QUERY = {"input": "how do I reset my password"}


def doc(i: int) -> str:
    return f"document {i}: " + " ".join(f"word{(i * 7 + k) % 997}" for k in range(40))


async def measure(url: str, bulk_clients: int, bulk_docs: int, seconds: float, every_s: float) -> dict:
    lat, bulk_done, bulk_lat, errors = [], [0], [], [0]
    stop = asyncio.Event()
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as s:
        async def bulk(c):
            body = {"input": [doc(c * 100_000 + i) for i in range(bulk_docs)]}
            while not stop.is_set():
                t = time.perf_counter()
                async with s.post(url + "/v1/embeddings", json=body) as r:
                    await r.read()
                    if r.status == 200:
                        bulk_done[0] += bulk_docs
                        bulk_lat.append(time.perf_counter() - t)
                    else:
                        errors[0] += 1
                        await asyncio.sleep(0.1)

        async def queries():
            while not stop.is_set():
                t = time.perf_counter()
                async with s.post(url + "/v1/embeddings", json=QUERY) as r:
                    await r.read()
                lat.append(time.perf_counter() - t)
                await asyncio.sleep(max(0.0, every_s - (time.perf_counter() - t)))

        tasks = [asyncio.create_task(bulk(c)) for c in range(bulk_clients)]
        if bulk_clients:
            await asyncio.sleep(min(5.0, seconds / 4))  # the bulk queue fills first
        start_docs, t0 = bulk_done[0], time.perf_counter()
        q = asyncio.create_task(queries())
        await asyncio.sleep(seconds)
        elapsed = time.perf_counter() - t0
        docs = bulk_done[0] - start_docs
        stop.set()
        await q
        for t in tasks:
            t.cancel()
        async with s.get(url + "/metrics") as r:
            metrics = await r.text()
    wait = [line for line in metrics.splitlines() if line.startswith("jaxserve_batch_wait_seconds_count")]
    a = np.array(lat) * 1000
    return {"queries": len(a), "query_p50_ms": float(np.percentile(a, 50)) if len(a) else None,
            "query_p99_ms": float(np.percentile(a, 99)) if len(a) else None,
            "bulk_docs_per_s": docs / elapsed, "bulk_errors": errors[0], "batches": wait}


async def one_mode(args, priority: str, port: int) -> dict:
    cmd = [sys.executable, "-m", "jaxserve.cli", "serve", "--port", str(port), "--default-priority", priority]
    proc = subprocess.Popen(cmd + args.serve_args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        async with aiohttp.ClientSession() as session:
            await wait_ready(session, url, timeout_s=300, poll_s=0.25, proc=proc)
        idle = await measure(url, 0, args.bulk_docs, args.idle_seconds, args.every_s)
        loaded = await measure(url, args.bulk_clients, args.bulk_docs, args.seconds, args.every_s)
    finally:
        proc.terminate()
        proc.wait(30)
    return {"idle": idle, "loaded": loaded}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bulk-clients", type=int, default=2)
    ap.add_argument("--bulk-docs", type=int, default=1000)
    ap.add_argument("--seconds", type=float, default=30.0)
    ap.add_argument("--idle-seconds", type=float, default=5.0)
    ap.add_argument("--every-s", type=float, default=0.1, help="one query this often")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--port", type=int, default=18426)
    ap.add_argument("--out", help="write the results as JSON here")
    ap.add_argument("serve_args", nargs="*", help="more `jaxserve serve` flags (after --)")
    args = ap.parse_args()
    results = []
    for r in range(args.rounds):
        for mode, priority in (("fifo", "bulk"), ("classes", "auto")):
            res = asyncio.run(one_mode(args, priority, args.port))
            res.update(mode=mode, round=r)
            results.append(res)
            print(json.dumps({k: v for k, v in res.items()}, default=str), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
