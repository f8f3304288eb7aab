"""Open-loop load on a `jaxserve serve` subprocess (loopback only, bounded in count and time).

    python scripts/bench_load.py [--rates 6,15,24] [--seconds 15] [--waits 0,5,20] [--slo-ms 1000]

Requests arrive as a Poisson process at each of `--rates` per second, whatever
the server's speed (open loop), with a mix of sizes (70% 1 document, 20% 10,
10% 100) from the corpus (scripts/harness.py). For each `--max-wait-ms` in `--waits` a fresh
server is started and every rate runs against it in turn; reported:
throughput (documents/s), p50/p90/p99 latency, goodput (requests within the
SLO per second), errors, and a table of all points.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import time

import aiohttp

import harness

ROOT = harness.ROOT

SIZES = [(1, 0.7), (10, 0.2), (100, 0.1)]
MAX_REQUESTS = 2000  # hard bound on what one run sends


async def run_point(url: str, rate: float, seconds: float, slo_s: float, seed: int) -> dict:
    rng = random.Random(seed)
    docs = harness.documents(2000, seed=seed)
    async with aiohttp.ClientSession() as s:
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
    with harness.bench_lock():
        for wait in [float(w) for w in args.waits.split(",")]:
            with harness.server("--buckets", args.buckets, "--max-wait-ms", str(wait)) as srv:
                for rate in rates:
                    r = {"max_wait_ms": wait, "rate": rate,
                         **asyncio.run(run_point(srv.url, rate, args.seconds, args.slo_ms / 1000, 0))}
                    rows.append(r)
                    print(f"max_wait_ms {wait:>5}, {rate}/s: {r['requests']} requests, {r['errors']} errors, "
                          f"{r['docs_per_s']} docs/s, p50 {r['p50_ms']} ms, p99 {r['p99_ms']} ms", flush=True)
    print()
    harness.print_table(["rate/s", "wait ms", "requests", "errors", "docs/s", "p50 ms", "p90 ms", "p99 ms", "goodput"],
                        [[f"{r['rate']:g}", f"{r['max_wait_ms']:g}", r["requests"], r["errors"], r["docs_per_s"],
                          r["p50_ms"], r["p90_ms"], r["p99_ms"], f"{r['goodput_rps']:.2f}"]
                         for r in sorted(rows, key=lambda r: (r["rate"], r["max_wait_ms"]))])
    harness.write_result(args.out, {"seconds": args.seconds, "sizes": SIZES, "slo_ms": args.slo_ms, "rows": rows})


if __name__ == "__main__":
    main()
