"""The 100-document question, measured: sequential vs one padded max-shape batch vs jaxserve's plan.

    python scripts/bench_latency.py [--docs 100] [--repeats 3] [--out results/latency.json]

In-process (the engine, no HTTP) and through a `jaxserve serve` subprocess on
loopback. Each measured time is printed next to its prediction from the
per-bucket times recorded at warmup, with the speed-up ratios.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from pathlib import Path

import harness

ROOT = harness.ROOT


def median_time(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def in_process(enc, docs):
    """The plan explained, and the two in-process runs with their predictions."""
    from jaxserve.scheduling.explain import LiveTimings, explain

    pieces, rows = enc.prepare(docs)
    e = explain(rows, enc.warm_table(), LiveTimings(enc.warm_table()), pieces.doc)
    return e, {
        "sequential (one call per document)": (lambda: [enc.embed([d]) for d in docs], e["predicted_sequential_s"]),
        "jaxserve plan": (lambda: enc.embed(docs), e["predicted_s"]),
    }


def http_times(docs, table_file, repeats):
    import aiohttp

    async def main(url):
        async with aiohttp.ClientSession() as s:
            async def post(inputs):
                async with s.post(url + "/v1/embeddings?explain=1", json={"input": inputs}) as r:
                    assert r.status == 200, await r.text()
                    return await r.json()

            async def sequential():
                for d in docs:
                    await post([d])

            out = {}
            for name, fn in (("sequential (one request per document)", sequential), ("jaxserve, one request", None)):
                times, predicted = [], None
                for _ in range(repeats + 1):
                    start = time.perf_counter()
                    if fn:
                        await fn()
                    else:
                        body = await post(docs)
                        predicted = body["explain"]["predicted_s"]
                    times.append(time.perf_counter() - start)
                out[name] = (statistics.median(times[1:]), predicted)
            return out

    with harness.server("--buckets", str(table_file)) as srv:
        return asyncio.run(main(srv.url))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--docs", type=int, default=100)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--buckets", default=str(ROOT / "buckets" / "minilm-cpu-default.json"))
    ap.add_argument("--out", default=str(ROOT / "results" / "latency.json"))
    ap.add_argument("--no-http", action="store_true")
    args = ap.parse_args()
    with harness.bench_lock():
        measure(args)


def measure(args) -> None:
    from jaxserve import Encoder
    from jaxserve.runtime.buckets import fixed

    docs = harness.documents(args.docs, seed=1)
    enc = Encoder.from_pretrained(None, buckets=args.buckets)
    e, rows = in_process(enc, docs)
    results = {}
    for name, (fn, predicted) in rows.items():
        results[f"in-process: {name}"] = (median_time(fn, args.repeats), predicted)
    # one padded max-shape batch: all documents in one dispatch at the longest seqlen
    one = Encoder.from_pretrained(None)
    table = one.warmup(fixed([(args.docs, enc.warm_table().max_seqlen)], layout="padded"))
    results["in-process: one padded max-shape batch"] = (median_time(lambda: one.embed(docs), args.repeats),
                                                       table.buckets[0].run_s)
    if not args.no_http:
        for name, value in http_times(docs, Path(args.buckets), args.repeats).items():
            results[f"HTTP: {name}"] = value
    base = results["in-process: jaxserve plan"][0]
    print(f"{args.docs} documents (the corpus of scripts/harness.py, seed 1): {e['real_tokens']} real tokens; "
          f"jaxserve plan: {e['dispatches']} dispatches, padding {e['padding_ratio']:.1%}")
    harness.print_table(["", "measured", "predicted", "error", "vs jaxserve"], [
        [name, f"{measured * 1e3:.0f} ms", f"{predicted * 1e3:.0f} ms" if predicted else "",
         f"{measured / predicted - 1:+.0%}" if predicted else "", f"{measured / base:.2f}x"]
        for name, (measured, predicted) in results.items()])
    harness.write_result(args.out, {"documents": args.docs, "explain": e, "results": {
        k: {"measured_s": m, "predicted_s": p} for k, (m, p) in results.items()}})


if __name__ == "__main__":
    main()
