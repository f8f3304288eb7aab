"""Two source trees of jaxserve on the real engine, side by side in one run: in-process and HTTP.

A shared machine drifts by ±10% between runs made minutes apart, so "no
slower than before" is measured here in pairs: both trees are loaded at once
(first an in-process worker each, then a `jaxserve serve` each), and every
round times the same texts on one tree and then the other, alternating which
goes first. The
table gives each tree's best time and the median per-pair speed ratio
(after/before; > 1: this tree is faster). Each tree plans its batches from the
timings in its own warm artifact; where the two ran other buckets for the same
documents over HTTP, a line after the table says so: on a CPU, whose batch
sizes run at about the same tokens/s, which one a table's timings favour is
noise. `--only 16x256` then serves one bucket (the table cut to it), which both
trees plan alike.

    git worktree add /tmp/before COMMIT
    python scripts/bench_commits.py --before /tmp/before --out results/xeon/commits.json
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import harness

ROOT = harness.ROOT

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
        self.proc = subprocess.Popen([sys.executable, "-c", WORKER, table], cwd=path, text=True,
                                     env={**os.environ, "PYTHONPATH": str(path)},
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


def paired(timers: dict, n: int) -> dict:
    """`n` rounds, each timing both trees once (a timer returns seconds), alternating which goes first; the
    per-pair speed ratio after/before."""
    seconds = harness.rounds(timers, n)
    return {"seconds": seconds, **harness.ratios(seconds["before"], seconds["after"])}


def in_process(trees: dict, table: str, texts: dict, n: int) -> dict:
    """Both trees' workers loaded at once (nothing else running), each workload in pairs."""
    workers = {name: Worker(path, table, texts) for name, path in trees.items()}
    try:
        return {f"{workload}, in-process": paired({name: functools.partial(w.seconds, workload)
                                                   for name, w in workers.items()}, n) for workload in texts}
    finally:
        for w in workers.values():
            w.close()


def over_http(trees: dict, table: str, texts: dict, n: int) -> dict:
    """Both trees' `jaxserve serve` up at once, each workload in pairs (requests of 100, 2 in flight)."""
    with contextlib.ExitStack() as stack:
        urls = {name: stack.enter_context(harness.server("--buckets", table, tree=path, timeout_s=300)).url
                for name, path in trees.items()}
        run = stack.enter_context(asyncio.Runner()).run
        session = run(_session())
        stack.callback(run, session.close())
        report = {}
        for workload, docs in texts.items():
            for url in urls.values():  # warm each server's caches once
                run(harness.post_all(session, url, docs))
            timers = {name: (lambda url=url, docs=docs: run(harness.post_all(session, url, docs)))
                      for name, url in urls.items()}
            seen = {name: harness.dispatched(url) for name, url in urls.items()}
            report[f"{workload}, HTTP"] = paired(timers, n)
            report[f"{workload}, HTTP"]["dispatched"] = {name: _since(harness.dispatched(url), seen[name])
                                                         for name, url in urls.items()}
        return report


def _since(now: dict[str, int], then: dict[str, int]) -> dict[str, int]:
    return {bucket: n - then.get(bucket, 0) for bucket, n in now.items() if n > then.get(bucket, 0)}


def plans_differ(report: dict) -> list[str]:
    """A line per workload whose trees ran other buckets: each tree plans from the timings in its own warm
    artifact (its key covers the source), so noise when one was made can pick other batch sizes for the same
    rows, and the ratio then compares plans, not code."""
    lines = []
    for name, r in report.items():
        got = r.get("dispatched")
        if got and len({tuple(sorted(d)) for d in got.values()}) > 1:
            lines.append(f"{name}: the trees ran other buckets ("
                         + "; ".join(f"{tree} {', '.join(f'{b} x{n}' for b, n in sorted(d.items()))}"
                                     for tree, d in got.items())
                         + "): the ratio compares their plans, not only their code")
    return lines


def only(table: str, shape: str, directory: Path) -> str:
    """A copy of the bucket table `table` holding only the bucket `shape` ("16x256"), written into `directory`."""
    batch, seqlen = map(int, shape.lower().split("x"))
    spec = json.loads(Path(table).read_text())
    spec["buckets"] = [b for b in spec["buckets"] if (b["batch"], b["seqlen"]) == (batch, seqlen)]
    if not spec["buckets"]:
        raise SystemExit(f"{table} has no bucket {shape}")
    out = Path(directory) / f"only-{shape}.json"
    out.write_text(json.dumps(spec))
    return str(out)


async def _session():
    import aiohttp

    return aiohttp.ClientSession()  # made on the runner's loop, which every timed request then runs on


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--before", required=True, help="the other source tree (a git worktree of the old commit)")
    ap.add_argument("--n", type=int, default=384, help="documents per workload")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--buckets", default=str(ROOT / "buckets" / "minilm-cpu-default.json"))
    ap.add_argument("--only", metavar="BxS", help="serve only this bucket of the table (both trees then plan alike)")
    ap.add_argument("--no-http", action="store_true", help="in-process only")
    ap.add_argument("--out", default=str(ROOT / "results" / "commits.json"))
    args = ap.parse_args()

    texts = {"short": harness.sample("paragraphs", args.n),
             "long": harness.sample("docstrings", args.n, min_chars=1500)}
    trees = {"before": Path(args.before).resolve(), "after": ROOT}
    with tempfile.TemporaryDirectory(prefix="bench-commits-") as tmp, harness.bench_lock():
        table = args.buckets if args.only is None else only(args.buckets, args.only, Path(tmp))
        report = in_process(trees, table, texts, args.rounds)
        if not args.no_http:
            report.update(over_http(trees, table, texts, args.rounds))
    before, after = harness.commit(trees["before"]), harness.commit(ROOT)
    print(f"{args.rounds} alternating pairs, {args.n} documents per workload, table {Path(args.buckets).name}"
          + (f", only {args.only}" if args.only else ""))
    print(f"before: {args.before} ({before}); after: {ROOT} ({after})")
    harness.print_table(["workload", "before best s", "after best s", "after/before speed", "range"],
                        [[name, f"{min(r['seconds']['before']):.2f}", f"{min(r['seconds']['after']):.2f}",
                          f"{r['median']:.2f}x", f"{r['min']:.2f}-{r['max']:.2f}x"] for name, r in report.items()])
    for line in plans_differ(report):
        print(line)
    harness.write_result(args.out, {"before": before, "after": after, "n": args.n, "rounds": args.rounds,
                                    "only": args.only, "workloads": report})


if __name__ == "__main__":
    main()
