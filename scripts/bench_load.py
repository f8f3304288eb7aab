"""Open-loop load on a `jaxserve serve` subprocess (loopback only, bounded in count and time).

    python scripts/bench_load.py [--rates 6,15,24] [--seconds 15] [--waits 0,5,20] [--slo-ms 1000]

Requests arrive as a Poisson process at each of `--rates` per second, whatever
the server's speed (open loop), with a mix of sizes (70% 1 document, 20% 10,
10% 100) from scripts/corpus.py. For each `--max-wait-ms` in `--waits` a fresh
server is started and every rate runs against it in turn; reported:
throughput (documents/s), p50/p90/p99 latency, goodput (requests within the
SLO per second), errors, and a table of all points.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from pathlib import Path

import aiohttp

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

import corpus  # noqa: E402

from jaxserve.launch import free_port, served, wait_ready  # noqa: E402

SIZES = [(1, 0.7), (10, 0.2), (100, 0.1)]
MAX_REQUESTS = 2000  # hard bound on what one run sends


async def run_point(url: str, rate: float, seconds: float, slo_s: float, seed: int) -> dict:
    rng = random.Random(seed)
    docs = corpus.documents(2000, seed=seed)
    async with aiohttp.ClientSession() as s:
        await wait_ready(s, url)
        results: list[tuple[int, int, float]] = []

        async def one(n):
            start = time.perf_counter()
            batch = rng.sample(docs, n)
            try:
                async with s.post(url + "/v1/embeddings", json={"input": batch},
                                  timeout=aiohttp.ClientTimeout(total=60)) as r:
                    await r.read()
                    results.append((r.status, n, time.perf_counter() - start))
            except (aiohttp.ClientError, asyncio.TimeoutError):
                results.append((0, n, time.perf_counter() - start))

        tasks, t0 = [], time.perf_counter()
        while time.perf_counter() - t0 < seconds and len(tasks) < MAX_REQUESTS:
            n = rng.choices([k for k, _ in SIZES], [w for _, w in SIZES])[0]
            tasks.append(asyncio.create_task(one(n)))
            await asyncio.sleep(rng.expovariate(rate))
        await asyncio.gather(*tasks)
        wall = time.perf_counter() - t0
    ok = sorted(lat for status, _, lat in results if status == 200)
    pct = lambda q: round(1e3 * ok[min(len(ok) - 1, int(q * len(ok)))], 1) if ok else None
    return {"requests": len(results), "ok": len(ok), "errors": len(results) - len(ok),
            "docs_per_s": round(sum(n for status, n, _ in results if status == 200) / wall, 1),
            "p50_ms": pct(0.5), "p90_ms": pct(0.9), "p99_ms": pct(0.99),
            "goodput_rps": round(sum(lat <= slo_s for lat in ok) / wall, 2)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rates", default="6,15,24", help="requests per second (Poisson), comma-separated")
    ap.add_argument("--seconds", type=float, default=15.0, help="per rate")
    ap.add_argument("--waits", default="0,5,20", help="max_wait_ms values to sweep")
    ap.add_argument("--slo-ms", type=float, default=1000.0)
    ap.add_argument("--buckets", default=str(ROOT / "buckets" / "minilm-cpu-default.json"))
    ap.add_argument("--out", default=str(ROOT / "results" / "load.json"))
    args = ap.parse_args()
    rates = [float(r) for r in args.rates.split(",")]
    rows = []
    for wait in [float(w) for w in args.waits.split(",")]:
        with served(free_port(), "--buckets", args.buckets, "--max-wait-ms", str(wait)) as (url, _):
            for rate in rates:
                r = {"max_wait_ms": wait, "rate": rate,
                     **asyncio.run(run_point(url, rate, args.seconds, args.slo_ms / 1000, 0))}
                rows.append(r)
                print(f"max_wait_ms {wait:>5}, {rate}/s: {r['requests']} requests, {r['errors']} errors, "
                      f"{r['docs_per_s']} docs/s, p50 {r['p50_ms']} ms, p99 {r['p99_ms']} ms", flush=True)
    print(f"\n{'rate/s':>6} {'wait ms':>7} {'requests':>8} {'errors':>6} {'docs/s':>7} {'p50 ms':>7} {'p90 ms':>7} "
          f"{'p99 ms':>7} {'goodput':>8}")
    for r in sorted(rows, key=lambda r: (r["rate"], r["max_wait_ms"])):
        print(f"{r['rate']:6g} {r['max_wait_ms']:7g} {r['requests']:8d} {r['errors']:6d} {r['docs_per_s']:7.1f} "
              f"{r['p50_ms']:7.1f} {r['p90_ms']:7.1f} {r['p99_ms']:7.1f} {r['goodput_rps']:8.2f}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"command": " ".join(sys.argv), "seconds": args.seconds, "sizes": SIZES,
                                          "slo_ms": args.slo_ms, "rows": rows}, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
