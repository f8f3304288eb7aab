"""Bucket layouts compared on a real mixed-length corpus with the bundled model (in-process).

    python scripts/bench_layouts.py [--requests 20] [--out results/layouts]
    python scripts/bench_layouts.py --paired default,pow2 [--rounds 6] [--out results/layouts]

For each seqlen ladder (one max shape; pow2; fine; the memory-derived
default), padded and packed: compiles and cold warmup time, the largest
bucket's compiled bytes, padding ratio and dispatches over the corpus,
throughput (real tokens/s) and p50/p99 latency of a 100-document request.
Writes layouts.csv, layouts.json and (with matplotlib) layouts.png.

Each layout is timed on its own, so two close ones can swap places between
runs on a shared machine. `--paired A,B` instead warms ladders A and B (both
packed) and times them over the same requests in alternating pairs: the
median per-pair ratio says which is faster here, and by how much
(written to paired-A-B.json).
"""

from __future__ import annotations

import argparse
import csv
import statistics
import time
from pathlib import Path

import harness

ROOT = harness.ROOT

# (name, ladder, batch ladder): "fine" keeps one batch per seqlen to stay at 16 shapes.
LADDERS = [("max", "max", False), ("pow2", "pow2", True), ("fine", "fine", False), ("default", "default", True)]


def warm(name: str, layout: str):
    """A fresh encoder ($JAXSERVE_MODEL or the bundled model), warmed on this ladder and layout:
    (encoder, table, warmup s, compiles)."""
    from jaxserve import Encoder

    from jaxserve.runtime import compiles
    ladder, batch_ladder = next((lad, bl) for n, lad, bl in LADDERS if n == name)
    enc = Encoder.from_pretrained(None)
    before = compiles.xla_compiles_total()
    start = time.perf_counter()
    table = enc.warmup(enc.derive_table(ladder=ladder, layout=layout, batch_ladder=batch_ladder))
    return enc, table, time.perf_counter() - start, compiles.xla_compiles_total() - before


def run_requests(enc, requests: list[list[str]]) -> tuple[list[float], list]:
    """Each request packed and run in turn: (seconds per request, (real tokens, padded tokens, dispatches) each)."""
    latencies, plans = [], []
    for req in requests:
        pieces, rows = enc.prepare(req)
        t = time.perf_counter()
        pieces.combine(enc.run(pieces, rows), len(req))
        latencies.append(time.perf_counter() - t)
        ran = enc.last_dispatches
        plans.append((rows.real_tokens, sum(d.bucket.tokens for d in ran), len(ran)))
    return latencies, plans


def compare(a: str, b: str, requests: list[list[str]], rounds: int, out: Path) -> None:
    """Ladders a and b (packed) over the same requests in alternating pairs."""
    encoders = {name: warm(name, "packed")[0] for name in (a, b)}
    for enc in encoders.values():
        enc.embed(requests[0])
    result = harness.paired_rounds(lambda: run_requests(encoders[a], requests),
                                   lambda: run_requests(encoders[b], requests), rounds)
    print(f"packed {b} runs {result['median']:.3f}x as fast as packed {a} (time {a} / time {b}; median of "
          f"{rounds} alternating pairs over {len(requests)} requests of 100; range {result['min']:.3f}-{result['max']:.3f})")
    harness.write_result(out / f"paired-{a}-{b}.json", dict(result, reference=a, candidate=b))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=20, help="requests of 100 documents")
    ap.add_argument("--out", default=str(ROOT / "results" / "layouts"))
    ap.add_argument("--no-plot", action="store_true", help="csv and json only")
    ap.add_argument("--paired", metavar="A,B",
                    help="only compare two ladders (packed) in alternating pairs, e.g. default,pow2")
    ap.add_argument("--rounds", type=int, default=6, help="pairs for --paired")
    args = ap.parse_args()
    names = [n for n, _, _ in LADDERS]
    if args.paired and (len(args.paired.split(",")) != 2 or not set(args.paired.split(",")) <= set(names)):
        ap.error(f"--paired takes two of {', '.join(names)}, comma-separated")
    with harness.bench_lock():
        measure(args)


def measure(args) -> None:
    docs = harness.documents(100 * args.requests, seed=2)
    requests = [docs[i : i + 100] for i in range(0, len(docs), 100)]
    if args.paired:
        compare(*args.paired.split(","), requests, args.rounds, Path(args.out))
        return
    rows = []
    for name, _, _ in LADDERS:
        for layout in ("padded", "packed"):
            enc, table, warmup_s, built = warm(name, layout)
            enc.embed(requests[0])
            latencies, plans = run_requests(enc, requests)
            real, padded, dispatches = (sum(p[k] for p in plans) for k in range(3))
            lat = sorted(latencies)
            rows.append({
                "ladder": name, "layout": layout, "shapes": len(table.buckets), "compiles": built,
                "warmup_s": round(warmup_s, 1), "max_compiled_mib": round(max(b.compiled_bytes for b in table.buckets) / 2**20, 1),
                "padding_ratio": round(1 - real / padded, 4), "dispatches": dispatches,
                "tokens_per_s": round(real / sum(latencies)), "p50_ms": round(1e3 * statistics.median(lat), 1),
                "p99_ms": round(1e3 * lat[min(len(lat) - 1, int(0.99 * len(lat)))], 1),
            })
            r = rows[-1]
            print(f"{name:>8} {layout:>7}: {r['shapes']:>3} shapes, {r['compiles']:>3} compiles, warmup {r['warmup_s']:>5} s, "
                  f"max bucket {r['max_compiled_mib']:>6} MiB, padding {r['padding_ratio']:>6.1%}, {r['dispatches']:>4} dispatches, "
                  f"{r['tokens_per_s']:>6} tok/s, p50 {r['p50_ms']:>6} ms, p99 {r['p99_ms']:>6} ms", flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "layouts.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    harness.write_result(out / "layouts.json", {"documents": len(docs), "rows": rows}, quiet=True)
    if args.no_plot:
        return
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed (pip install -e '.[bench]'): no plot")
        return
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    labels = [f"{r['ladder']}\n{r['layout']}" for r in rows]
    a.bar(labels, [r["tokens_per_s"] for r in rows], color=["#888" if r["layout"] == "padded" else "#37a" for r in rows])
    a.set_ylabel("real tokens / s")
    a.set_title("throughput")
    b.bar(labels, [100 * r["padding_ratio"] for r in rows], color=["#888" if r["layout"] == "padded" else "#37a" for r in rows])
    b.set_ylabel("padding %")
    b.set_title("padding ratio")
    for ax in (a, b):
        ax.tick_params(axis="x", labelsize=8)
    fig.tight_layout()
    fig.savefig(out / "layouts.png", dpi=110)
    print(f"wrote {out}/layouts.csv, layouts.json, layouts.png")


if __name__ == "__main__":
    main()
