"""Two source trees of jaxserve on the real engine, side by side in one run: in-process and HTTP.

A shared machine drifts by ±10% between runs made minutes apart, so "no
slower than before" is measured here in pairs: both trees are loaded at once
(first an in-process worker each, then a `jaxserve serve` each), and every
round times the same texts on one tree and then the other, alternating which
goes first. The
table gives each tree's best time and the median per-pair speed ratio
(after/before; > 1: this tree is faster).

    git worktree add /tmp/before COMMIT
    python scripts/bench_commits.py --before /tmp/before --out results/xeon/commits.json
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import inspect
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

import corpus  # noqa: E402

WORKER = """
import sys, time, json
from jaxserve import Encoder
enc = Encoder.from_pretrained(None, buckets=sys.argv[1])
texts = json.loads(sys.stdin.readline())
for t in texts.values():
    enc.embed(t)
print("ready", flush=True)
for line in sys.stdin:
    start = time.perf_counter()
    enc.embed(texts[line.strip()])
    print(time.perf_counter() - start, flush=True)
"""


class Worker:
    """`Encoder.embed` in a process of its own, loaded from one source tree, timed on request."""

    def __init__(self, path: Path, table: str, texts: dict):
        self.proc = subprocess.Popen([sys.executable, "-c", WORKER, table], cwd=path, env=_env(path), text=True,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        self.proc.stdin.write(json.dumps(texts) + "\n")
        self.proc.stdin.flush()
        assert self.proc.stdout.readline().strip() == "ready", f"{path}: worker failed"

    def seconds(self, workload: str) -> float:
        self.proc.stdin.write(workload + "\n")
        self.proc.stdin.flush()
        return float(self.proc.stdout.readline())

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


def _env(path: Path) -> dict:
    return {**os.environ, "PYTHONPATH": str(path)}


async def http_seconds(session, url: str, texts: list[str], per_request: int = 100, in_flight: int = 2) -> float:
    sem = asyncio.Semaphore(in_flight)

    async def one(chunk):
        async with sem, session.post(url + "/v1/embeddings", json={"input": chunk}) as r:
            assert r.status == 200, await r.text()
            await r.read()

    start = time.perf_counter()
    await asyncio.gather(*(one(texts[i : i + per_request]) for i in range(0, len(texts), per_request)))
    return time.perf_counter() - start


async def paired(timers: dict, n: int) -> dict:
    """`n` rounds, each timing every tree once (a timer returns seconds, or an awaitable of them), alternating the order; per-pair speed ratio after/before."""
    seconds = {name: [] for name in timers}
    for r in range(n):
        for name in (list(timers) if r % 2 == 0 else list(timers)[::-1]):
            value = timers[name]()
            seconds[name].append(await value if inspect.isawaitable(value) else value)
    ratios = np.array(seconds["before"]) / np.array(seconds["after"])
    return {"seconds": seconds, "median_ratio": float(np.median(ratios)), "min_ratio": float(ratios.min()),
            "max_ratio": float(ratios.max())}


async def in_process(trees: dict, table: str, texts: dict, n: int) -> dict:
    """Both trees' workers loaded at once (nothing else running), each workload in pairs."""
    workers = {name: Worker(path, table, texts) for name, path in trees.items()}
    try:
        report = {}
        for workload in texts:
            timers = {name: functools.partial(w.seconds, workload) for name, w in workers.items()}
            report[f"{workload}, in-process"] = await paired(timers, n)
        return report
    finally:
        for w in workers.values():
            w.close()


async def over_http(trees: dict, table: str, texts: dict, n: int) -> dict:
    """Both trees' `jaxserve serve` up at once, each workload in pairs (requests of 100, 2 in flight)."""
    import aiohttp

    from jaxserve.launch import free_port, wait_ready

    urls, servers = {}, []
    for name, path in trees.items():
        port = free_port()
        servers.append(subprocess.Popen([sys.executable, "-m", "jaxserve.cli", "serve", "--port", str(port),
                                         "--buckets", table], cwd=path, env=_env(path),
                                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        urls[name] = f"http://127.0.0.1:{port}"
    try:
        async with aiohttp.ClientSession() as s:
            for url in urls.values():
                await wait_ready(s, url, timeout_s=300)
            report = {}
            for workload, docs in texts.items():
                for url in urls.values():  # warm each server's caches once
                    await http_seconds(s, url, docs)
                timers = {name: (lambda url=url: http_seconds(s, url, docs)) for name, url in urls.items()}
                report[f"{workload}, HTTP"] = await paired(timers, n)
            return report
    finally:
        for p in servers:
            p.terminate()
            p.wait(timeout=60)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--before", required=True, help="the other source tree (a git worktree of the old commit)")
    ap.add_argument("--n", type=int, default=384, help="documents per workload")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--buckets", default=str(ROOT / "buckets" / "minilm-cpu-default.json"))
    ap.add_argument("--no-http", action="store_true", help="in-process only")
    ap.add_argument("--out", default=str(ROOT / "results" / "commits.json"))
    args = ap.parse_args()

    texts = {"short": corpus.sample("paragraphs", args.n),
             "long": corpus.sample("docstrings", args.n, min_chars=1500)}
    trees = {"before": Path(args.before).resolve(), "after": ROOT}
    report = asyncio.run(in_process(trees, args.buckets, texts, args.rounds))
    if not args.no_http:
        report.update(asyncio.run(over_http(trees, args.buckets, texts, args.rounds)))
    commit = lambda p: subprocess.run(["git", "-C", str(p), "rev-parse", "--short", "HEAD"], capture_output=True,
                                      text=True).stdout.strip()
    print(f"{args.rounds} alternating pairs, {args.n} documents per workload, table {Path(args.buckets).name}")
    print(f"before: {args.before} ({commit(args.before)}); after: {ROOT} ({commit(ROOT)}, plus any uncommitted)")
    print(f"{'workload':22} {'before best s':>14} {'after best s':>13} {'after/before speed':>19}  range")
    for name, r in report.items():
        print(f"{name:22} {min(r['seconds']['before']):14.2f} {min(r['seconds']['after']):13.2f} "
              f"{r['median_ratio']:18.2f}x  {r['min_ratio']:.2f}-{r['max_ratio']:.2f}x")
    Path(args.out).write_text(json.dumps({"before": commit(args.before), "after": commit(ROOT), "n": args.n,
                                          "rounds": args.rounds, "workloads": report}, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
