"""The host path on a SIMULATED device, and what it projects for a real host's cores.

    python scripts/bench_host.py [--docs 1,16,100] [--workers 1,2] [--sizes checkpoint,bge-base]
                                 [--concurrency 8,64] [--seconds 8] [--format base64] [--tflops 400]
    python scripts/bench_host.py --seconds 2 --docs 1 --concurrency 4 --sizes checkpoint --workers 1   # smoke

On a CPU a MiniLM forward hides the host path; on an H200 it takes a fraction
of a millisecond and the host path (HTTP, JSON, tokenizing, packing,
assembling, scattering, encoding) is the whole cost. Each configuration runs
`jaxserve serve --simulate-device TFLOPS --simulate-overhead-us US
[--simulate-size H,I,L] --workers N` on loopback: the real server over a
device that takes `overhead + FLOPs / rate` per dispatch on one clock
(`jaxserve.runtime.simulated`), with the table `jaxserve serve` derives on an
H200. `--sizes` gives the model sizes the device is costed at, side by side:
the checkpoint's own, and e.g. `bge-base` (768,3072,12) with the same
tokenizer and outputs. `--workers 1,2` runs each size at each process count.

Clients: `--concurrency` keep-alive connections in a closed loop, spread over
`--client-procs` processes (`harness.closed_loop`: raw HTTP/1.1 on an event
loop, requests built once, so the client is not the limit; its own CPU per
request is reported beside the server's), sending requests of `--docs` corpus
documents to /v1/embeddings. Every run is bounded (`MAX_REQUESTS`).

Reported per level: docs/s, tokens/s, p50/p99, the device's busy share as
the server counts it (/metrics' `jaxserve_device_busy_seconds_total`: each
batch from its launch to its output's arrival on the host, so it includes the
respond thread's waits) and as the simulated clock counts it (/info's
`SIMULATED_DEVICE.busy_s`: the steps' own time), and CPU per request of each
process kind named by /info's `processes` (supervisor, engine, front-ends; one
process with `--workers 1`, counted once), read with psutil around the level.
The floor beside it: the CPU time of the work no server avoids (JSON decode +
tokenizing + encoding the response), measured in this process right after the
level (the server idle), so that both are timed at the machine's speed of
that minute.

The projection, per size and request size, from the measured CPU and device
seconds per request of the run with the most workers (its busiest level):
with `e` the engine process's CPU per request (the serial part: one process,
at most one core), `f` every other server process's (front-ends and
supervisor: they scale with the cores), `d` the device's busy time per
request (the simulated clock's; the server's count with a real device), and
`C` cores serving nothing else,

    requests/s  R(C) = min(1 / e,  C / (e + f),  1 / d)
    docs/s = R x documents per request;  tokens/s = R x tokens per request;  device busy = R x d

and the limit is the term that is least: engine CPU, front-end CPU, or the
device. A run of one process (no split) counts all its CPU as `e`. `d` is
measured at this machine's load: batches fuller at a higher rate cost the
device less per request, so the device term is conservative.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import re
import shlex
import statistics
import sys
import time
from pathlib import Path

import harness

ROOT = harness.ROOT

H200_BF16_DENSE_TFLOPS = 989  # NVIDIA's H200 SXM datasheet, dense bfloat16
DEFAULT_TFLOPS = 400  # achieved: ~40% of that peak, a good figure for a large-batch encoder forward
DEFAULT_STEP_OVERHEAD_US = 30  # launch and synchronisation per dispatch
MAX_REQUESTS = 20_000  # hard bound on what one level sends
CORES = (8, 16, 32)  # the hosts the projection is for
BODIES = 100  # distinct request bodies per request size, sent in turn
# Model sizes the simulated device is costed at (hidden, intermediate, layers); None: the checkpoint's own
SIZES = {"checkpoint": None, "bge-small": (384, 1536, 12), "bge-base": (768, 3072, 12), "bge-large": (1024, 4096, 24)}
ROUTE = "/v1/embeddings"


# ---- the command line ----

def _ints(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be whole numbers separated by commas, not {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"must be whole numbers of at least 1, not {text!r}")
    return values


def _sizes(text: str) -> list[tuple[str, tuple[int, int, int] | None]]:
    """`checkpoint,bge-base,1024x4096x24` -> [(name, sizes or None)]."""
    out = []
    for name in (x.strip() for x in text.split(",") if x.strip()):
        if name in SIZES:
            out.append((name, SIZES[name]))
        elif re.fullmatch(r"\d+x\d+x\d+", name) and all(int(v) > 0 for v in name.split("x")):
            out.append((name, tuple(int(v) for v in name.split("x"))))
        else:
            raise argparse.ArgumentTypeError(f"{name!r} is none of {', '.join(SIZES)} nor HIDDENxINTERMEDIATExLAYERS")
    if not out:
        raise argparse.ArgumentTypeError("no size given")
    return out


def build_parser() -> argparse.ArgumentParser:
    from jaxserve.http.api import ENCODING_FORMATS

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--docs", type=_ints, default=[1, 16, 100], help="documents per request, one run each")
    ap.add_argument("--workers", type=_ints, default=[1, 2], help="`jaxserve serve --workers` values, side by side")
    ap.add_argument("--sizes", type=_sizes, default=_sizes("checkpoint,bge-base"),
                    help=f"model sizes the simulated device is costed at: {', '.join(SIZES)} or HxIxL")
    ap.add_argument("--concurrency", type=_ints, default=[8, 64], help="connections in flight, one level each")
    ap.add_argument("--seconds", type=float, default=8.0, help="per level")
    ap.add_argument("--client-procs", type=int, default=2, help="client processes the connections are spread over")
    ap.add_argument("--format", default="base64", choices=ENCODING_FORMATS, help="/v1/embeddings' encoding_format")
    ap.add_argument("--tflops", type=float, default=DEFAULT_TFLOPS, help="simulated achieved device rate")
    ap.add_argument("--step-overhead-us", type=float, default=DEFAULT_STEP_OVERHEAD_US)
    ap.add_argument("--cores", type=_ints, default=list(CORES), help="hosts to project for")
    ap.add_argument("--engine", default="sim", choices=["sim", "real"],
                    help="sim: a simulated device at --tflops; real: this machine's device (on a GPU host)")
    ap.add_argument("--model", help="a checkpoint to serve instead of the bundled model")
    ap.add_argument("--serve-command", default=f"{shlex.quote(sys.executable)} -m jaxserve.cli serve",
                    help="the server command, before `--port P` and the flags (e.g. another tree's, by PYTHONPATH)")
    ap.add_argument("--serve-args", default="", help="more `jaxserve serve` flags for every server")
    ap.add_argument("--health-probe", action=argparse.BooleanOptionalAction, default=False,
                    help="after each server's levels, /health latency during 4 concurrent 1000-document requests")
    ap.add_argument("--probe", default="embeddings", choices=sorted(PROBES),
                    help="the load /health is probed under: OpenAI embeddings, or (with --model) SPLADE's "
                         "/embed_sparse, multi-vector /v1/embeddings, /rerank")
    ap.add_argument("--probe-docs", type=int, default=1000, help="documents per request of the probe's load")
    ap.add_argument("--probe-rounds", type=int, default=10, help="requests each of the probe's 4 clients sends")
    ap.add_argument("--label", default="", help="a name for this run in the output (e.g. the commit)")
    ap.add_argument("--out", default=str(ROOT / "results" / "host.json"))
    return ap


def server_flags(args, sizes: tuple[int, int, int] | None, workers: int) -> list[str]:
    """`jaxserve serve`'s flags for one configuration (the port comes first, from `harness.server`)."""
    flags = ["--workers", str(workers)]
    if args.engine == "sim":
        flags += ["--simulate-device", f"{args.tflops:g}", "--simulate-overhead-us", f"{args.step_overhead_us:g}"]
        if sizes is not None:
            flags += ["--simulate-size", ",".join(map(str, sizes))]
    else:
        flags += ["--no-embed-all"]
    return flags + (["--model", args.model] if args.model else []) + shlex.split(args.serve_args)


# ---- the projection (pure) ----

@dataclasses.dataclass(frozen=True)
class PerRequest:
    """What one request costs, measured: CPU seconds of the engine process (the serial part) and of every other
    server process (they scale with the cores), the device's busy seconds (None: not known), and its size."""

    engine_s: float
    frontend_s: float
    device_s: float | None
    docs: float
    tokens: float


def project(per: PerRequest, cores: int) -> dict:
    """The rate a host of `cores` sustains (the module docstring's formula), and which term limits it."""
    bounds = {
        "engine CPU": 1 / per.engine_s if per.engine_s > 0 else math.inf,
        "front-end CPU": cores / (per.engine_s + per.frontend_s) if per.engine_s + per.frontend_s > 0 else math.inf,
        "device": 1 / per.device_s if per.device_s else math.inf,
    }
    limit = min(bounds, key=bounds.get)
    rate = bounds[limit]
    return {"cores": cores, "requests_per_s": rate, "docs_per_s": rate * per.docs, "tokens_per_s": rate * per.tokens,
            "device_busy": None if per.device_s is None else rate * per.device_s, "limit": limit,
            "bounds_requests_per_s": bounds}


def basis(rows: list[dict]) -> dict | None:
    """The measured level a projection starts from: of the runs with the most workers, the one with the most
    documents per second (the most loaded, where CPU per request is what a busy host pays)."""
    rows = [r for r in rows if r["requests"]]
    if not rows:
        return None
    most = max(r["workers"] for r in rows)
    return max((r for r in rows if r["workers"] == most), key=lambda r: r["docs_per_s"])


def per_request(row: dict) -> PerRequest:
    """A measured level's costs per request: with one process, all of its CPU is the serial part; the device's
    time is the simulated clock's own where there is one, else the server's count."""
    cpu = row["cpu_ms_per_request"]
    engine = cpu["engine"] if row["split"] else cpu["total"]
    device = row["device_ms_per_request"] if row.get("clock_ms_per_request") is None else row["clock_ms_per_request"]
    return PerRequest(engine_s=engine / 1e3, frontend_s=(cpu["total"] - engine) / 1e3,
                      device_s=None if device is None else device / 1e3, docs=row["docs"],
                      tokens=row["tokens_per_request"])


# ---- measuring a server ----

def process_kinds(processes: dict) -> tuple[dict[str, list[int]], bool]:
    """/info's `processes` -> (pids by kind, each pid once; whether the engine is a process of its own)."""
    engine, frontends = processes["engine"], list(processes.get("frontends", []))
    if engine in frontends:
        return {"server": sorted({engine, *frontends})}, False
    kinds = {"engine": [engine], "frontends": frontends}
    if processes.get("supervisor") is not None:
        kinds["supervisor"] = [processes["supervisor"]]
    return kinds, True


def resident_mb(kinds: dict[str, list[int]]) -> dict[str, float]:
    """Each process kind's largest resident memory now, in MB (a front-end's is what each more one costs)."""
    import psutil

    def rss(pid: int) -> float:
        try:
            return psutil.Process(pid).memory_info().rss / 2**20
        except psutil.NoSuchProcess:
            return 0.0

    return {kind: max(rss(p) for p in ps) for kind, ps in kinds.items() if ps}


def cpu_seconds(pids: list[int]) -> dict[int, float | None]:
    """CPU time (user + system, all threads) each process has used so far (None: it is gone)."""
    import psutil

    out = {}
    for pid in pids:
        try:
            t = psutil.Process(pid).cpu_times()
            out[pid] = t.user + t.system
        except psutil.NoSuchProcess:
            out[pid] = None
    return out


def scrape(url: str) -> tuple[dict[str, float], float | None]:
    """From /metrics: `jaxserve_phase_seconds_sum` per phase, and the device's busy seconds so far (None: the
    server does not count them)."""
    text = harness.get(url, "/metrics")
    phases = {m.group(1): float(m.group(2)) for m in
              re.finditer(r'^jaxserve_phase_seconds_sum\{phase="([^"]+)"\} ([0-9.e+-]+)$', text, re.MULTILINE)}
    busy = re.search(r"^jaxserve_device_busy_seconds_total ([0-9.e+-]+)$", text, re.MULTILINE)
    return phases, float(busy.group(1)) if busy else None


def clock_busy_s(url: str) -> float | None:
    """The simulated device's own busy seconds so far, from /info (None: a real device)."""
    return (json.loads(harness.get(url, "/info")).get("SIMULATED_DEVICE") or {}).get("busy_s")


def run_level(url: str, processes: dict, bodies: list[bytes], docs: int, concurrency: int, seconds: float,
              client_procs: int) -> dict:
    """One closed-loop level; CPU per request by process kind, device busy share, rates and latencies."""
    kinds, split = process_kinds(processes)
    pids = [p for ps in kinds.values() for p in ps]
    before = {}

    def start():
        before["phases"], before["busy"] = scrape(url)
        before["clock"] = clock_busy_s(url)
        before["cpu"] = cpu_seconds(pids)
        before["t"] = time.perf_counter()

    load = harness.closed_loop(url, ROUTE, bodies, concurrency, seconds, client_procs, MAX_REQUESTS, on_start=start)
    cpu = cpu_seconds(pids)
    window = time.perf_counter() - before["t"]
    phases, busy = scrape(url)
    clock = clock_busy_s(url)
    n = load.requests
    gone = [p for p in pids if before["cpu"][p] is None or cpu[p] is None]
    per_kind = {kind: 1e3 * sum(cpu[p] - before["cpu"][p] for p in ps if p not in gone) / max(n, 1)
                for kind, ps in kinds.items()}
    if not split:
        per_kind["engine"] = per_kind["total"] = per_kind.pop("server")
    else:
        per_kind["total"] = sum(per_kind.values())
    device_s = None if busy is None or before["busy"] is None else busy - before["busy"]
    clock_s = None if clock is None or before["clock"] is None else clock - before["clock"]
    lat = sorted(load.latencies)
    pct = lambda q: 1e3 * lat[min(n - 1, int(q * n))] if n else None
    return {"docs": docs, "concurrency": concurrency, "requests": n, "errors": load.errors, "wall_s": load.wall_s,
            "docs_per_s": n * docs / load.wall_s, "tokens_per_s": load.tokens / load.wall_s,
            "tokens_per_request": load.tokens / max(n, 1), "p50_ms": pct(0.5), "p99_ms": pct(0.99),
            "device_busy": None if device_s is None else device_s / window,
            "device_ms_per_request": None if device_s is None else 1e3 * device_s / max(n, 1),
            "clock_busy": None if clock_s is None else clock_s / window,
            "clock_ms_per_request": None if clock_s is None else 1e3 * clock_s / max(n, 1),
            "split": split, "cpu_ms_per_request": per_kind, "processes_gone": gone, "rss_mb": resident_mb(kinds),
            "client_cpu_ms_per_request": 1e3 * load.client_cpu_s / max(n, 1),
            "phase_ms_per_request": {k: 1e3 * (v - before["phases"].get(k, 0.0)) / max(n, 1)
                                     for k, v in phases.items()}}


def request_bodies(docs: list[str], n: int, fmt: str) -> list[bytes]:
    """`BODIES` requests of `n` corpus documents each, in turn through the corpus."""
    return [json.dumps({"input": [docs[(i * n + j) % len(docs)] for j in range(n)], "model": "m",
                        "encoding_format": fmt}).encode() for i in range(BODIES)]


def floor_ms(bodies: list[bytes], fmt: str, dim: int, max_length: int, model: str | None,
             repeats: int = 5, min_s: float = 0.5) -> dict:
    """CPU time per request, in this process: JSON decode (orjson) + tokenize (the tokenizer's fastest batch call,
    with truncation, ids read out) + encode the response (orjson from numpy, `dim` wide); means over at least
    `repeats` passes and `min_s` of CPU, after one pass unmeasured, and how many requests they timed. Five passes
    of one-document requests are a few tens of milliseconds, the first one cold (the tokenizer's caches): that
    read high, and one hiccup of a shared VM moved it (docs/benchmarks.md)."""
    import itertools

    import numpy as np
    import orjson
    from tokenizers import Tokenizer

    from jaxserve.checkpoint import loader
    from jaxserve.http import api

    tok = Tokenizer.from_file(str(loader.resolve(model) / "tokenizer.json"))
    tok.no_padding()
    tok.enable_truncation(max_length)
    docs = len(orjson.loads(bodies[0])["input"])
    vectors = np.random.default_rng(0).standard_normal((docs, dim)).astype(np.float32)
    decode, tokenize, encode = [], [], []
    clock = time.process_time  # CPU time of every thread of this process (the tokenizer's own threads too)
    passes = 0
    while passes <= repeats or sum(decode) + sum(tokenize) + sum(encode) < min_s:
        timed = passes > 0
        passes += 1
        for body in bodies[: max(20, 2000 // docs)]:
            t0 = clock()
            texts = orjson.loads(body)["input"]
            t1 = clock()
            encodings = tok.encode_batch_fast(texts)
            np.fromiter(itertools.chain.from_iterable(e.ids for e in encodings), np.int32)
            t2 = clock()
            api.openai_body(vectors, "m", 0, fmt)
            t3 = clock()
            if timed:
                decode.append(t1 - t0)
                tokenize.append(t2 - t1)
                encode.append(t3 - t2)
    mean = lambda xs: 1e3 * statistics.fmean(xs)  # process_time ticks coarsely: a mean, not a median
    out = {"decode": mean(decode), "tokenize": mean(tokenize), "encode": mean(encode)}
    out["total"] = sum(out.values())
    out["requests"] = len(decode)
    return out


# The load under which /health is probed: per --probe, the route and a request of `docs` as its inputs
PROBES = {
    "embeddings": lambda docs, fmt: ("/v1/embeddings", {"input": docs, "encoding_format": fmt}),
    "embed_sparse": lambda docs, fmt: ("/embed_sparse", {"inputs": docs}),  # a SPLADE model
    "multivector": lambda docs, fmt: ("/v1/embeddings", {"input": docs, "is_query": False}),  # a ColBERT model
    "rerank": lambda docs, fmt: ("/rerank", {"query": docs[0][:200], "texts": docs}),  # a reranker or ColBERT
}


async def health_probe(url: str, docs: list[str], fmt: str, clients: int = 4, size: int = 1000,
                       rounds: int = 10, every_s: float = 0.01, probe: str = "embeddings") -> dict:
    """/health latency, probed every `every_s` from a thread of its own (so the load's client work cannot delay
    the probe's timing), while `clients` send `rounds` requests of `size` documents each (to `probe`'s route)."""
    import http.client
    import threading
    from urllib.parse import urlparse

    import aiohttp

    route, request = PROBES[probe]((docs * (size // len(docs) + 1))[:size], fmt)
    body = json.dumps(request).encode()
    probes: list[float] = []
    done = threading.Event()

    def probe_loop():
        where = urlparse(url)
        conn = http.client.HTTPConnection(where.hostname, where.port, timeout=30)
        while not done.is_set():
            t = time.perf_counter()
            conn.request("GET", "/health")
            conn.getresponse().read()
            probes.append(time.perf_counter() - t)
            time.sleep(every_s)
        conn.close()

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
        async def client():
            for _ in range(rounds):
                async with s.post(url + route, data=body, headers={"Content-Type": "application/json"},
                                  timeout=aiohttp.ClientTimeout(total=300)) as r:
                    await r.read()
                    assert r.status == 200, (r.status, await r.text())

        prober = threading.Thread(target=probe_loop)
        start = time.perf_counter()
        prober.start()
        try:
            await asyncio.gather(*(client() for _ in range(clients)))
        finally:
            done.set()
        wall = time.perf_counter() - start
    prober.join()
    probes.sort()
    return {"route": probe, "clients": clients, "documents": size, "rounds": rounds, "probes": len(probes),
            "wall_s": wall,
            "health_max_ms": 1e3 * probes[-1], "health_p99_ms": 1e3 * probes[int(0.99 * (len(probes) - 1))],
            "health_p50_ms": 1e3 * probes[len(probes) // 2]}


# ---- the run ----

def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    with harness.bench_lock():
        measure(args)


def measure(args) -> None:
    corpus = harness.documents(4000, seed=0)
    bodies = {n: request_bodies(corpus, n, args.format) for n in args.docs}
    if args.engine == "sim":
        print(f"SIMULATED device: step = {args.step_overhead_us:g} us + FLOPs / {args.tflops:g} TFLOP/s "
              f"(H200 dense bf16 peak {H200_BF16_DENSE_TFLOPS}); real server, tokenizer, planner, batcher, HTTP",
              flush=True)
    log = Path(args.out).with_suffix(".server.log")
    log.parent.mkdir(parents=True, exist_ok=True)
    floors: dict[int, dict] = {}
    rows, tables, probes = [], {}, []
    for size_name, sizes in args.sizes:
        for workers in args.workers:
            flags = server_flags(args, sizes, workers)
            command = lambda port, flags=flags: [*shlex.split(args.serve_command), "--port", str(port), *flags]
            print(f"\n== size {size_name}, --workers {workers}: {' '.join(flags)}", flush=True)
            with harness.server(command=command, log=log, timeout_s=600, poll_s=0.25) as srv:
                info = harness.ready_info(srv.url)
                # pids by role, read again before each level (a front-end that died is restarted with a new one)
                processes = lambda: (json.loads(harness.get(srv.url, "/info")).get("processes")
                                     or {"engine": srv.proc.pid, "frontends": [srv.proc.pid]})
                table = info["buckets"]
                tables.setdefault(size_name, {"buckets": [f"{b['batch']}x{b['seqlen']}" for b in table["buckets"]],
                                              "device": table.get("device")})
                print(f"ready in {srv.ready_s:.1f} s; processes {processes()}; table: "
                      + ", ".join(tables[size_name]["buckets"]), flush=True)
                for n in args.docs:
                    for c in args.concurrency:
                        r = run_level(srv.url, processes(), bodies[n], n, c, args.seconds, args.client_procs)
                        # the level's own floor, measured as soon as its load ends: a shared VM's speed drifts
                        # within a run, and a floor from minutes before divides CPU timed at another speed
                        f = floor_ms(bodies[n], args.format, info["dimensions"], info["max_input_length"], args.model)
                        if n not in floors:  # the first level's, by part
                            floors[n] = f
                            print(f"floor, {n} documents: decode {f['decode']:.3f} + tokenize {f['tokenize']:.3f} + "
                                  f"encode {f['encode']:.3f} = {f['total']:.3f} ms/request", flush=True)
                        r.update(size=size_name, workers=workers, floor_ms=f["total"])
                        rows.append(r)
                        print(level_line(r), flush=True)
                if args.health_probe:
                    p = asyncio.run(health_probe(srv.url, corpus, "float", size=args.probe_docs,
                                                 rounds=args.probe_rounds, probe=args.probe))
                    p.update(size=size_name, workers=workers)
                    probes.append(p)
                    print(f"/health during {p['clients']} concurrent requests of {p['documents']} documents "
                          f"({args.probe}): {p['probes']} probes, p50 {p['health_p50_ms']:.1f} ms, "
                          f"p99 {p['health_p99_ms']:.1f} ms, max {p['health_max_ms']:.1f} ms", flush=True)
    projection = projections(rows, args.cores)
    print_summary(rows, projection)
    harness.write_result(args.out, {
        "label": args.label, "engine": args.engine, "tflops": args.tflops, "step_overhead_us": args.step_overhead_us,
        "format": args.format, "docs": args.docs, "workers": args.workers, "client_procs": args.client_procs,
        "sizes": {name: sizes for name, sizes in args.sizes}, "floor_ms": floors, "tables": tables, "rows": rows,
        "projection": projection, "health_probes": probes})


def level_line(r: dict) -> str:
    cpu = r["cpu_ms_per_request"]
    kinds = ", ".join(f"{k} {v:.3f}" for k, v in cpu.items() if k != "total")
    share = lambda v: "n/a" if v is None else f"{v:.1%}"
    busy = f"{share(r['device_busy'])} (clock {share(r['clock_busy'])})"
    return (f"{r['docs']:>4} docs x {r['concurrency']:>3} conns: {r['requests']} requests, {r['errors']} errors, "
            f"{r['docs_per_s']:,.0f} docs/s, {r['tokens_per_s']:,.0f} tokens/s, p50 {r['p50_ms'] or 0:.1f} ms, "
            f"p99 {r['p99_ms'] or 0:.1f} ms, device busy {busy}; server CPU {cpu['total']:.3f} ms/request "
            f"({cpu['total'] / r['floor_ms']:.1f}x the floor of {r['floor_ms']:.3f}, measured after; {kinds}); "
            f"client {r['client_cpu_ms_per_request']:.3f}; "
            + "resident " + ", ".join(f"{k} {v:.0f} MB" for k, v in r.get("rss_mb", {}).items())
            + (f"; processes gone: {r['processes_gone']}" if r["processes_gone"] else ""))


def projections(rows: list[dict], cores: list[int]) -> list[dict]:
    """Per size and request size: the basis level and the projection for each host."""
    out = []
    for size in dict.fromkeys(r["size"] for r in rows):
        for docs in dict.fromkeys(r["docs"] for r in rows if r["size"] == size):
            base = basis([r for r in rows if r["size"] == size and r["docs"] == docs])
            if base is None:
                continue
            per = per_request(base)
            for c in cores:
                out.append({"size": size, "docs": docs, "basis": {"workers": base["workers"],
                                                                  "concurrency": base["concurrency"]},
                            "per_request": dataclasses.asdict(per), **project(per, c)})
    return out


def print_summary(rows: list[dict], projection: list[dict]) -> None:
    print("\nmeasured (CPU in ms per request; x floor: all server processes' CPU over the floor)")
    w1 = {(r["size"], r["docs"], r["concurrency"]): r["docs_per_s"] for r in rows if r["workers"] == 1}
    fmt = lambda v, spec: "-" if v is None else format(v, spec)
    harness.print_table(
        ["size", "docs", "workers", "conns", "docs/s", "vs w1", "tokens/s", "p50 ms", "p99 ms", "busy", "clock",
         "engine", "front-ends", "total", "x floor", "client"],
        [[r["size"], r["docs"], r["workers"], r["concurrency"], f"{r['docs_per_s']:,.0f}",
          fmt(r["docs_per_s"] / w1[k] if (k := (r["size"], r["docs"], r["concurrency"])) in w1 else None, ".2f"),
          f"{r['tokens_per_s']:,.0f}", fmt(r["p50_ms"], ".1f"), fmt(r["p99_ms"], ".1f"), fmt(r["device_busy"], ".1%"),
          fmt(r["clock_busy"], ".1%"),
          f"{r['cpu_ms_per_request']['engine']:.3f}" + ("" if r["split"] else " (one process)"),
          fmt(r["cpu_ms_per_request"].get("frontends"), ".3f"), f"{r['cpu_ms_per_request']['total']:.3f}",
          f"{r['cpu_ms_per_request']['total'] / r['floor_ms']:.1f}", f"{r['client_cpu_ms_per_request']:.3f}"]
         for r in rows])
    print("\nprojected: R = min(1/e, C/(e+f), 1/d) requests/s (e engine CPU, f other server CPU, d device, per "
          "request; C cores)")
    harness.print_table(
        ["size", "docs", "from", "cores", "docs/s", "tokens/s", "device busy", "limit"],
        [[p["size"], p["docs"], f"w{p['basis']['workers']} c{p['basis']['concurrency']}", p["cores"],
          f"{p['docs_per_s']:,.0f}", f"{p['tokens_per_s']:,.0f}", fmt(p["device_busy"], ".0%"), p["limit"]]
         for p in projection])


if __name__ == "__main__":
    main()
