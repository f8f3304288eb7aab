"""The 100-document question, measured: sequential vs one padded max-shape batch vs jaxserve's plan.

    python scripts/bench_latency.py [--docs 100] [--repeats 3] [--out results/latency.json]

In-process (the engine, no HTTP) and through a `jaxserve serve` subprocess on
loopback. Each measured time is printed next to its prediction from the
per-bucket times recorded at warmup, with the speed-up ratios.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

import corpus  # noqa: E402


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
    from jaxserve.explain import LiveTimings, explain

    pieces, rows = enc.prepare(docs)
    e = explain(rows, enc.table, LiveTimings(enc.table), pieces.doc)
    return e, {
        "sequential (one call per document)": (lambda: [enc.embed([d]) for d in docs], e["predicted_sequential_s"]),
        "jaxserve plan": (lambda: enc.embed(docs), e["predicted_s"]),
    }


def http_times(docs, table_file, repeats):
    import aiohttp

    from jaxserve.launch import free_port, served, wait_ready

    async def main(url):
        async with aiohttp.ClientSession() as s:
            await wait_ready(s, url)

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

    with served(free_port(), "--buckets", str(table_file)) as (url, _):
        return asyncio.run(main(url))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--docs", type=int, default=100)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--buckets", default=str(ROOT / "buckets" / "minilm-cpu-default.json"))
    ap.add_argument("--out", default=str(ROOT / "results" / "latency.json"))
    ap.add_argument("--no-http", action="store_true")
    args = ap.parse_args()

    from jaxserve import Encoder
    from jaxserve.buckets import fixed

    docs = corpus.documents(args.docs, seed=1)
    enc = Encoder.from_pretrained(None, buckets=args.buckets)
    e, rows = in_process(enc, docs)
    results = {}
    for name, (fn, predicted) in rows.items():
        results[f"in-process: {name}"] = (median_time(fn, args.repeats), predicted)
    # one padded max-shape batch: all documents in one dispatch at the longest seqlen
    one = Encoder.from_pretrained(None)
    table = one.warmup(fixed([(args.docs, enc.table.max_seqlen)], layout="padded"))
    results["in-process: one padded max-shape batch"] = (median_time(lambda: one.embed(docs), args.repeats),
                                                       table.buckets[0].run_s)
    if not args.no_http:
        for name, value in http_times(docs, Path(args.buckets), args.repeats).items():
            results[f"HTTP: {name}"] = value
    base = results["in-process: jaxserve plan"][0]
    print(f"{args.docs} documents (scripts/corpus.py, seed 1): {e['real_tokens']} real tokens; jaxserve plan: "
          f"{e['dispatches']} dispatches, padding {e['padding_ratio']:.1%}")
    print(f"{'':52} {'measured':>10} {'predicted':>10} {'error':>7} {'vs jaxserve':>11}")
    for name, (measured, predicted) in results.items():
        err = "" if not predicted else f"{measured / predicted - 1:+.0%}"
        pred = "" if not predicted else f"{predicted * 1e3:.0f} ms"
        print(f"{name:52} {measured * 1e3:>7.0f} ms {pred:>10} {err:>7} {measured / base:>10.2f}x")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"documents": args.docs, "explain": e, "results": {
        k: {"measured_s": m, "predicted_s": p} for k, (m, p) in results.items()}}, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
