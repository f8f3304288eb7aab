"""`jaxserve embed` in one process against `jaxserve embed --ray local` (a local Ray cluster, an actor pool), on one
corpus, one after the other, alternating the order each round.

    flock /tmp/jaxserve-cpu.lock python scripts/bench_ray_data.py [--n 3072] [--chunk 256] [--actors 2] \
        [--rounds 2] [--out results/ray_data.json]

Both read the same JSONL (`scripts/corpus.py`'s documents), write .parquet and
use the same bucket table; the warm artifact the Ray actors load is built
first, as the single process compiles its table before its timed loop. Per run: the command's wall time, and from OUTPUT.summary.json
the job's seconds (the single process: its embedding loop; Ray: connecting,
the warm-up task, the actors' start and every range) and, for Ray, the
seconds the actors spent inside ranges (reading, embedding, writing a part).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import harness

ROOT = harness.ROOT


def run(cmd: list[str], env: dict) -> float:
    began = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    if done.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}")
    return time.perf_counter() - began


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=3072)
    ap.add_argument("--chunk", type=int, default=256)
    ap.add_argument("--actors", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--buckets", default=str(ROOT / "buckets" / "minilm-cpu-default.json"))
    ap.add_argument("--out", default=str(ROOT / "results" / "ray_data.json"))
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="jaxserve-bench-ray-data-"))
    corpus = tmp / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": t}) + "\n" for t in harness.documents(args.n)))
    env = {**os.environ, "JAXSERVE_CACHE_DIR": str(tmp / "cache")}
    jaxserve = [sys.executable, "-m", "jaxserve.cli"]
    # The artifact the actors load, built as the job's warm-up task builds it (an artifact is keyed on jaxserve's
    # source too: a tree edited between this and the runs would make the Ray job compile).
    warm = ("import sys; from jaxserve.integrations.ray_data import warm; from jaxserve.runtime.buckets import "
            "BucketTable; warm({'table': BucketTable.load(sys.argv[1])})")
    run([sys.executable, "-c", warm, args.buckets], env)
    runs: dict[str, list[dict]] = {"single": [], "ray": []}
    with harness.bench_lock():
        for r in range(args.rounds):
            for name in (("single", "ray") if r % 2 == 0 else ("ray", "single")):
                out = tmp / f"{name}{r}.parquet"
                extra = ["--ray", "local", "--ray-actors", str(args.actors)] if name == "ray" else []
                wall = run([*jaxserve, "embed", "--input", str(corpus), "--output", str(out), "--buckets",
                            args.buckets, "--chunk", str(args.chunk), *extra], env)
                summary = json.loads(out.with_name(out.name + ".summary.json").read_text())
                runs[name].append({"wall_s": round(wall, 2), **summary})
                print(name, r, runs[name][-1], flush=True)
    ranges = -(-args.n // args.chunk)
    med = lambda name, key: statistics.median(x[key] for x in runs[name])
    single_per_chunk = med("single", "seconds") / ranges
    ray_per_range = statistics.median(x["ray"]["range_seconds"] for x in runs["ray"]) / ranges
    # Actor time not spent inside a range, per range: connecting, the warm-up task, actor start, scheduling, idle.
    outside = statistics.median((args.actors * x["seconds"] - x["ray"]["range_seconds"]) / ranges for x in runs["ray"])
    # The job's time the ranges do not explain, were the actors busy side by side: start-up, scheduling, the end.
    fixed = statistics.median(x["seconds"] - x["ray"]["range_seconds"] / args.actors for x in runs["ray"])
    table = [["single process", med("single", "wall_s"), med("single", "seconds"), med("single", "docs_per_s"),
              round(single_per_chunk, 3), "-", "-"],
             [f"Ray, {args.actors} CPU actors", med("ray", "wall_s"), med("ray", "seconds"), med("ray", "docs_per_s"),
              round(ray_per_range, 3), round(outside, 3), round(fixed, 2)]]
    harness.print_table(["run", "command wall s", "job s", "job docs/s", "s per chunk (in an actor)",
                         "actor s outside ranges, per range", "job s outside ranges"], table)
    harness.write_result(args.out, {"n": args.n, "chunk": args.chunk, "actors": args.actors, "runs": runs,
                                    "table": table})


if __name__ == "__main__":
    main()
