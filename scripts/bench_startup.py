"""Start-up time: `jaxserve serve` to /health 200, cold (empty cache) and warm (from its warm artifact).

    .venv/bin/python scripts/bench_startup.py [--starts 3] [--models minilm,bert,mpnet,...] [--out FILE]

Per model, `--starts` cold starts (each on an empty cache directory) and as
many warm starts (on the artifact the first cold start saved), alternating,
each a fresh `jaxserve serve` process on loopback with the default table. Reports the
median and range of seconds to /health 200, the XLA compiles the start made
(`jaxserve_xla_compiles_total`) and its phases (`jaxserve_startup_seconds`).
The bundled MiniLM, and a tiny random checkpoint of each other family, written
by transformers (tests/hf_tiny.py; needs the test extra).
"""

from __future__ import annotations

import argparse
import itertools
import json
import re
import statistics
import sys
import tempfile
from pathlib import Path

import harness

ROOT = harness.ROOT
sys.path.insert(0, str(ROOT / "tests"))
FAMILIES = ("minilm", "bert", "mpnet", "distilbert", "modernbert", "qwen3", "embeddinggemma")


def write_model(name: str, directory: Path) -> str | None:
    """A checkpoint directory for `name` (None: the bundled MiniLM)."""
    if name == "minilm":
        return None
    path = directory / name
    if name == "bert":
        import tiny

        return str(tiny.write_checkpoint(path))
    if name in ("mpnet", "distilbert"):
        from test_family_mpnet import CASES

        return str(CASES[name].write(path))
    if name == "modernbert":
        from test_family_modernbert import write

        return str(write(path))
    if name == "qwen3":
        from test_family_decoder import write

        return str(write(path, "qwen3"))
    if name == "embeddinggemma":
        from test_family_gemma3 import write

        return str(write(path, "embeddinggemma"))
    raise ValueError(f"unknown model {name!r}; choose from {', '.join(FAMILIES)}")


def start_once(model: str | None, cache: Path, tree: Path = ROOT) -> dict:
    flags = ["--cache-dir", str(cache)] + (["--model", model] if model else [])
    with harness.server(*flags, tree=tree, timeout_s=600, poll_s=0.02) as srv:
        ready = srv.ready_s
        text, info = harness.get(srv.url, "/metrics"), json.loads(harness.get(srv.url, "/info"))
    phases = {m[0]: float(m[1]) for m in re.findall(r'jaxserve_startup_seconds\{phase="(\w+)"\} ([\d.e+-]+)', text)}
    compiles = float(re.search(r"^jaxserve_xla_compiles_total ([\d.e+-]+)", text, re.M).group(1))
    return {"ready_s": ready, "compiles": int(compiles), "phases": phases,
            "source": info.get("startup", {}).get("table", {}).get("source", "?"), "buckets": len(info["buckets"]["buckets"])}


def starts(model: str | None, name: str, tmp: Path, tree: Path, n: int) -> tuple[list[dict], list[dict]]:
    """`n` cold and `n` warm starts, alternating; round 0 starts cold, and that start's cache (the warm
    artifact it saves) is the one the warm starts use; every other cold start has an empty one."""
    colds = itertools.count()

    def cold():
        i = next(colds)
        return start_once(model, tmp / (f"cache-{name}" if i == 0 else f"cold-{name}-{i}"), tree)

    runs = harness.rounds({"cold": cold, "warm": lambda: start_once(model, tmp / f"cache-{name}", tree)}, n)
    return runs["cold"], runs["warm"]


def summary(runs: list[dict]) -> dict:
    times = [r["ready_s"] for r in runs]
    phases = {k: statistics.median(r["phases"].get(k, 0.0) for r in runs) for k in runs[0]["phases"]}
    return {"median_s": statistics.median(times), "min_s": min(times), "max_s": max(times),
            "compiles": sorted({r["compiles"] for r in runs}), "sources": sorted({r["source"] for r in runs}),
            "buckets": sorted({r["buckets"] for r in runs}), "phases": phases}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--starts", type=int, default=3)
    ap.add_argument("--models", default=",".join(FAMILIES))
    ap.add_argument("--tree", type=Path, default=ROOT, help="the jaxserve source tree to start (another commit's "
                    "checkout: `git worktree add /tmp/before COMMIT`); its warm start is whatever that tree has")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    results = {}
    with harness.bench_lock(), tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        print(f"{'model':>15} {'start':>5} {'median s':>9} {'range s':>12} {'compiles':>9} {'buckets':>8}  phases (median s)")
        for name in args.models.split(","):
            model = write_model(name, tmp / "models")
            cold, warm = starts(model, name, tmp, args.tree, args.starts)
            results[name] = {"cold": summary(cold), "warm": summary(warm), "runs": {"cold": cold, "warm": warm}}
            for kind in ("cold", "warm"):
                s = results[name][kind]
                phases = ", ".join(f"{k} {v:.2f}" for k, v in s["phases"].items())
                print(f"{name:>15} {kind:>5} {s['median_s']:>9.2f} {s['min_s']:>5.2f}-{s['max_s']:<6.2f} "
                      f"{'/'.join(map(str, s['compiles'])):>9} {'/'.join(map(str, s['buckets'])):>8}  {phases}",
                      flush=True)
    if args.out:
        harness.write_result(args.out, {"tree": str(args.tree), "tree_commit": harness.commit(args.tree),
                                        "models": results})


if __name__ == "__main__":
    main()
