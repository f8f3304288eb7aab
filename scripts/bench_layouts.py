"""Bucket layouts compared on a real mixed-length corpus with the bundled model (in-process).

    python scripts/bench_layouts.py [--requests 20] [--out results/layouts]

For each seqlen ladder (one max shape; pow2; fine; the memory-derived
default), padded and packed: compiles and cold warmup time, the largest
bucket's compiled bytes, padding ratio and dispatches over the corpus,
throughput (real tokens/s) and p50/p99 latency of a 100-document request.
Writes layouts.csv, layouts.json and (with matplotlib) layouts.png.
"""

from __future__ import annotations

import argparse
import csv
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

import corpus  # noqa: E402

# (name, ladder, batch ladder): "fine" keeps one batch per seqlen to stay at 16 shapes.
LADDERS = [("max", "max", False), ("pow2", "pow2", True), ("fine", "fine", False), ("default", "default", True)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=20, help="requests of 100 documents")
    ap.add_argument("--out", default=str(ROOT / "results" / "layouts"))
    args = ap.parse_args()

    from jaxserve import Encoder, compiles

    docs = corpus.documents(100 * args.requests, seed=2)
    requests = [docs[i : i + 100] for i in range(0, len(docs), 100)]
    rows = []
    for name, ladder, batch_ladder in LADDERS:
        for layout in ("padded", "packed"):
            enc = Encoder.from_pretrained(None)
            before = compiles.xla_compiles_total()
            start = time.perf_counter()
            table = enc.warmup(enc.derive_table(ladder=ladder, layout=layout, batch_ladder=batch_ladder))
            warmup_s = time.perf_counter() - start
            built = compiles.xla_compiles_total() - before
            real = padded = dispatches = 0
            latencies = []
            enc.embed(requests[0])
            for req in requests:
                pieces, planned = enc.prepare(req)
                t = time.perf_counter()
                pieces.combine(enc.run_plan(pieces, planned), len(req))
                latencies.append(time.perf_counter() - t)
                real, padded, dispatches = real + planned.real_tokens, padded + planned.padded_tokens, dispatches + planned.dispatches
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
    (out / "layouts.json").write_text(json.dumps({"documents": len(docs), "rows": rows}, indent=1) + "\n")
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
