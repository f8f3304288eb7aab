"""The host path on a SIMULATED device: how well the real server keeps a GPU-speed device fed.

    python scripts/bench_host.py [--concurrency 1,2,4,8,16,32] [--seconds 8] [--docs 100]
                                 [--tflops 400] [--step-overhead-us 30] [--format float|base64|ubinary|...]

On this CPU a MiniLM forward takes ~0.4 s and hides the host path; on an
H100/H200 it takes milliseconds and the host path (HTTP, JSON, tokenize,
plan, assemble, copies, scatter, encode) is the whole cost. This script runs
the real server (real tokenizer, planner, batcher, HTTP) in a subprocess
whose engine is a simulated device: a step at bucket (B, S) takes
`overhead + FLOPs(B, S) / rate` of wall time on one device clock (batches
queue behind each other as on one GPU; launching returns at once, as JAX's
dispatch does) and returns zeros of the right shape. Nothing else is
simulated.

Clients (closed loop, `--concurrency` of them) send requests of `--docs`
corpus documents over loopback. Reported per level: device-busy fraction,
documents/s, tokens/s, p50/p99, the server process's CPU time per request
(all its threads), and where each request's wall time went per phase (from
the server's Prometheus phase histograms; per-batch phases spread over the
requests). Also reported: the floor for the same requests, the CPU time of
the work no server can avoid: JSON decode of the body + tokenizing + encoding
the response, measured here. Then /health's latency while 4 clients send
1000-document requests with float responses (`--probe`: to another route, e.g. a SPLADE or multi-vector
model's, served with `--model DIR --engine real`; `--concurrency ""`: the probe alone).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import statistics
import sys
import threading
import time
from pathlib import Path

import harness
import numpy as np

from jaxserve.http import api

ROOT = harness.ROOT

H200_BF16_DENSE_TFLOPS = 989  # NVIDIA's H200 SXM datasheet, dense bfloat16
DEFAULT_TFLOPS = 400  # achieved: ~40% of that peak, a good figure for a large-batch encoder forward
DEFAULT_STEP_OVERHEAD_US = 30  # launch and synchronisation per dispatch
DEFAULT_D2H_GBPS = 25  # device-to-host copy of a batch's output (PCIe Gen5 x16, achieved)
MAX_REQUESTS = 20_000  # hard bound on what one run sends


def sim_dims(hidden: int, intermediate: int, layers: int):
    """A BERT-shaped model of these sizes in this tree's `ModelDims` (whatever jaxserve the server imports);
    one head of `hidden` width: the FLOPs only see heads x head_dim."""
    return harness.ModelDims(hidden, intermediate, heads=1, layers=layers)


def step_seconds(dims, bucket, rate_flops: float, overhead_s: float) -> float:
    """The simulated device's time for one step at `bucket`: its padded forward's FLOPs at `rate_flops`."""
    return overhead_s + dims.forward_flops([bucket.seqlen] * bucket.batch) / rate_flops


class SimDevice:
    """One device clock shared by every step: a step starts when the device is free and takes `step_s`."""

    def __init__(self):
        self._free_at = 0.0
        self._lock = threading.Lock()
        self.busy_s = 0.0
        self.steps = 0

    def launch(self, step_s: float) -> float:
        """Queue a step; returns when it will be done (perf_counter time)."""
        with self._lock:
            start = max(time.perf_counter(), self._free_at)
            self._free_at = start + step_s
            self.busy_s += step_s
            self.steps += 1
            return self._free_at


class SimEngine:
    """The engine's interface over a SimDevice: same shapes, same checks, no JAX computation.

    It speaks both engine interfaces: `put`/`launch`/`fetch` (this tree) and
    `put`/`execute` (the commit before the pipeline rewrite, edcd6b3), so the
    same script measures both. Its output is the real engine's: the slot chunks
    that hold the batch's sequences (`jaxserve.runtime.output_chunks`), joined on the
    host; each arrives `bytes / d2h_bps` after its step ends (the copy overlaps
    the next step, as `copy_to_host_async` does). With `full_slots`, or under
    a server that does not say how full its rows are (a commit before output
    chunks), every batch ships all its K slots."""

    def __init__(self, real, table, rate_flops: float, overhead_s: float, dims, d2h_bps: float = DEFAULT_D2H_GBPS * 1e9,
                 full_slots: bool = False):
        self._real = real
        self._d2h_bps = d2h_bps
        try:
            from jaxserve.runtime import output_chunks
        except ImportError:  # a commit before output chunks
            output_chunks = None
        self._chunks = None if full_slots else output_chunks  # None: every batch ships its K slots
        self.shipped_bytes = 0
        self.device = SimDevice()
        self.devices = 1
        self.params = real.params
        self.weights_bytes = real.weights_bytes
        self._step_s = {b.shape: step_seconds(dims, b, rate_flops, overhead_s) for b in table.buckets}
        from dataclasses import replace

        self.table = replace(table, buckets=tuple(replace(b, run_s=self._step_s[b.shape], compile_s=0.0)
                                                  for b in table.buckets))
        self.tables = {"pooled": self.table}

    def use(self, table, progress=False):
        return self.table

    def put(self, bucket, inputs, output="pooled", sequences=None):
        shape = inputs["token_ids"].shape if isinstance(inputs, dict) else inputs.shape[1:]
        if bucket.shape not in self._step_s or shape != bucket.shape:
            raise ValueError(f"batch {shape} is not a bucket")
        copy = {k: np.array(v) for k, v in inputs.items()} if isinstance(inputs, dict) else np.array(inputs)
        if sequences is None or self._chunks is None:
            widths = [bucket.slots]
        else:
            ends = self._chunks.ends(bucket.slots)[: self._chunks.needed(bucket.slots, sequences)]
            widths = [int(w) for w in np.diff((0, *ends))]
        return bucket, copy, widths  # the host side of a host-to-device copy; the chunks to copy back

    def launch(self, prepared):
        bucket, _, widths = prepared
        done = self.device.launch(self._step_s[bucket.shape])
        nbytes = bucket.batch * sum(widths) * self._real_dim * 4
        self.shipped_bytes += nbytes
        return bucket, widths, done + nbytes / self._d2h_bps

    def fetch(self, launched):
        bucket, widths, arrives = launched
        time.sleep(max(0.0, arrives - time.perf_counter()))
        chunks = [np.zeros((bucket.batch, w, self._real_dim), np.float32) for w in widths]
        return self._chunks.join(chunks) if self._chunks else chunks[0]  # several only with output chunks

    def execute(self, prepared):
        return self.fetch(self.launch(prepared))


def gpu_table(enc, step_s, knee: bool = True):
    """The table `jaxserve serve` derives on an H200: default ladder, packed, batch ladder, batches bounded by
    memory (the analytic estimate here: no GPU compiler) and cut at their throughput knee (the simulated times;
    `knee=False`: not cut, as where throughput still grows with the batch, which a step linear in FLOPs never shows)."""
    import dataclasses

    from jaxserve.runtime import buckets
    from jaxserve.runtime.device import UNCAPPED, budget_bytes

    table = buckets.derive(
        buckets.ladder("default", enc.embedding_config.max_seq_length), enc.dims, enc.engine.weights_bytes,
        budget_bytes(int(141e9)), None, max_batch_tokens=UNCAPPED, max_batch=UNCAPPED, multiple=8, layout="packed",
        batch_ladder=True, device="simulated H200", device_memory=int(141e9),
    )
    timed = dataclasses.replace(table, buckets=tuple(dataclasses.replace(b, run_s=step_s(b)) for b in table.buckets))
    return buckets.throughput_knee(timed) if knee else timed


def serve(port: int, rate_flops: float, overhead_s: float, table_file: str | None, real: bool = False,
          default_priority: str = "auto", sizes: tuple[int, int, int] | None = None, knee: bool = True,
          d2h_bps: float = DEFAULT_D2H_GBPS * 1e9, full_slots: bool = False, model: str | None = None) -> None:
    """The server process: the real app over a SimEngine (or, `real`, over the real engine and device).
    `sizes` (hidden, intermediate, layers): step times of another model's size (default: the bundled model's);
    `model`: a checkpoint other than the bundled one (with `real`)."""
    from aiohttp import web

    from jaxserve.encoder import Encoder
    from jaxserve.http.server import ServerConfig, create_app

    enc = Encoder.from_pretrained(model)
    if real:  # the device's own derived table, warmed by the server; busy time from its metrics
        web.run_app(create_app(ServerConfig(embed_all=False, buckets=table_file or "auto",
                                            default_priority=default_priority), enc),
                    host="127.0.0.1", port=port, print=None, handler_cancellation=True)
        return
    c = enc.model_config
    dims = sim_dims(*(sizes or (c.hidden_size, c.intermediate_size, c.num_layers)))
    step_s = lambda b: step_seconds(dims, b, rate_flops, overhead_s)
    if table_file:  # the same shapes for another commit's server
        from jaxserve.runtime.buckets import BucketTable

        table = BucketTable.load(table_file)
    else:
        table = gpu_table(enc, step_s, knee)
    sim = SimEngine(enc.engine, table, rate_flops, overhead_s, dims, d2h_bps, full_slots)
    sim._real_dim = enc.out_dim
    enc = _with_engine(enc, sim)
    import dataclasses

    fields = {f.name for f in dataclasses.fields(ServerConfig)}
    extra = {"streams": 1} if "streams" in fields else {}  # a GPU runs one batch at a time
    extra.update({"embed_all": False} if "embed_all" in fields else {})  # no token outputs to simulate
    extra.update({"default_priority": default_priority} if "default_priority" in fields else {})
    app = create_app(ServerConfig(use_cache=False, **extra), enc)

    async def sim_stats(request):
        return web.json_response({"busy_s": sim.device.busy_s, "steps": sim.device.steps, "now": time.perf_counter(),
                                  "shipped_bytes": sim.shipped_bytes})

    app.router.add_get("/sim", sim_stats)
    web.run_app(app, host="127.0.0.1", port=port, print=None, handler_cancellation=True)


def _with_engine(enc, engine):
    import dataclasses

    return dataclasses.replace(enc, engine=engine)


# ---- the client side ----

def phase_sums(metrics_text: str) -> dict[str, float]:
    """`jaxserve_phase_seconds_sum{phase=...}` per phase."""
    return {m.group(1): float(m.group(2))
            for m in re.finditer(r'^jaxserve_phase_seconds_sum\{phase="([^"]+)"\} ([0-9.e+-]+)$', metrics_text, re.M)}


def cpu_seconds(pid: int) -> float:
    """CPU time (user + system, all threads) a process has used so far."""
    import psutil

    t = psutil.Process(pid).cpu_times()
    return t.user + t.system


async def device_clock(get, simulated: bool) -> dict:
    """Device busy seconds and steps so far: the simulated device's own count, or (a real engine) the server's
    metrics."""
    if simulated:
        return json.loads(await get("/sim"))
    text = await get("/metrics")
    value = lambda name: float(re.search(rf"^{name} ([0-9.e+-]+)$", text, re.M).group(1))
    return {"busy_s": value("jaxserve_device_seconds_total"), "now": time.perf_counter(),
            "steps": value(r'jaxserve_phase_seconds_count\{phase="device"\}')}


async def run_level(url: str, pid: int, bodies: list[bytes], concurrency: int, seconds: float,
                    simulated: bool = True) -> dict:
    import aiohttp

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
        async def get(path):
            async with s.get(url + path) as r:
                r.raise_for_status()
                return await r.text()

        for body in bodies[:concurrency]:  # settle connections
            async with s.post(url + "/v1/embeddings", data=body, headers={"Content-Type": "application/json"}) as r:
                await r.read()
        phases0, sim0 = phase_sums(await get("/metrics")), await device_clock(get, simulated)
        cpu0 = cpu_seconds(pid)
        latencies, tokens, errors = [], 0, 0
        sent = 0
        t0 = time.perf_counter()
        deadline = t0 + seconds

        async def client(k: int):
            nonlocal tokens, errors, sent
            i = k
            while time.perf_counter() < deadline and sent < MAX_REQUESTS:
                sent += 1
                body = bodies[i % len(bodies)]
                i += concurrency
                start = time.perf_counter()
                async with s.post(url + "/v1/embeddings", data=body, headers={"Content-Type": "application/json"},
                                  timeout=aiohttp.ClientTimeout(total=120)) as r:
                    raw = await r.read()
                if r.status != 200:
                    errors += 1
                    continue
                latencies.append(time.perf_counter() - start)
                tokens += int(re.search(rb'"prompt_tokens": ?(\d+)', raw).group(1))

        await asyncio.gather(*(client(k) for k in range(concurrency)))
        wall = time.perf_counter() - t0
        cpu1 = cpu_seconds(pid)
        phases1, sim1 = phase_sums(await get("/metrics")), await device_clock(get, simulated)
    n = len(latencies)
    lat = sorted(latencies)
    pct = lambda q: 1e3 * lat[min(n - 1, int(q * n))] if n else None
    busy = (sim1["busy_s"] - sim0["busy_s"]) / (sim1["now"] - sim0["now"])
    per_request = {k: (phases1[k] - phases0.get(k, 0.0)) / max(n, 1) for k in phases1}
    steps = sim1["steps"] - sim0["steps"]
    shipped = (sim1["shipped_bytes"] - sim0["shipped_bytes"]) / max(steps, 1) if simulated else None
    return {"host_cpu_ms_per_request": 1e3 * (cpu1 - cpu0) / max(n, 1), "concurrency": concurrency, "requests": n,
            "errors": errors, "wall_s": wall, "device_busy": busy, "device_steps": steps,
            "output_kib_per_batch": shipped / 1024 if simulated else None,
            "docs_per_s": n * DOCS / wall, "tokens_per_s": tokens / wall,
            "p50_ms": pct(0.5), "p99_ms": pct(0.99), "phase_ms_per_request": {k: 1e3 * v for k, v in per_request.items()}}


def floor_ms(bodies: list[bytes], fmt: str, repeats: int = 5) -> dict:
    """CPU time per request, in this process: JSON decode (orjson) + tokenize (the tokenizer's fastest batch call,
    with truncation, ids read out) + encode the response (orjson from numpy); means over repeats."""
    import itertools

    import orjson
    from tokenizers import Tokenizer

    from jaxserve.checkpoint import loader

    tok = Tokenizer.from_file(str(loader.resolve(None) / "tokenizer.json"))  # $JAXSERVE_MODEL when carried
    tok.no_padding()
    tok.enable_truncation(256)
    vectors = np.random.default_rng(0).standard_normal((DOCS, 384)).astype(np.float32)
    decode, tokenize, encode = [], [], []
    clock = time.process_time  # CPU time of every thread of this process (the tokenizer's own threads too)
    for _ in range(repeats):
        for body in bodies[:20]:
            t0 = clock()
            texts = orjson.loads(body)["input"]
            t1 = clock()
            encodings = tok.encode_batch_fast(texts)
            np.fromiter(itertools.chain.from_iterable(e.ids for e in encodings), np.int32)
            t2 = clock()
            if fmt == "float":
                orjson.dumps({"data": [{"object": "embedding", "index": i, "embedding": v}
                                       for i, v in enumerate(vectors)]}, option=orjson.OPT_SERIALIZE_NUMPY)
            elif fmt == "base64":
                import base64

                orjson.dumps({"data": [{"object": "embedding", "index": i, "embedding": base64.b64encode(v.tobytes()).decode()}
                                       for i, v in enumerate(vectors)]})
            else:  # integers (jaxserve.http.api.quantize)
                orjson.dumps({"data": [{"object": "embedding", "index": i, "embedding": v}
                                       for i, v in enumerate(api.quantize(vectors, fmt))]},
                             option=orjson.OPT_SERIALIZE_NUMPY)
            t3 = clock()
            decode.append(t1 - t0)
            tokenize.append(t2 - t1)
            encode.append(t3 - t2)
    med = lambda xs: 1e3 * statistics.fmean(xs)  # process_time ticks coarsely: a mean, not a median
    out = {"decode": med(decode), "tokenize": med(tokenize), "encode": med(encode)}
    out["total"] = sum(out.values())
    return out


DOCS = 100


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

    def probe():
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

        prober = threading.Thread(target=probe)
        start = time.perf_counter()
        prober.start()
        await asyncio.gather(*(client() for _ in range(clients)))
        done.set()
        wall = time.perf_counter() - start
    prober.join()
    probes.sort()
    return {"route": probe, "clients": clients, "documents": size, "rounds": rounds, "probes": len(probes),
            "wall_s": wall,
            "health_max_ms": 1e3 * probes[-1], "health_p99_ms": 1e3 * probes[int(0.99 * (len(probes) - 1))],
            "health_p50_ms": 1e3 * probes[len(probes) // 2]}


def main() -> None:
    global DOCS
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--concurrency", default="1,2,4,8,16,32")
    ap.add_argument("--seconds", type=float, default=8.0, help="per concurrency level")
    ap.add_argument("--docs", type=int, default=100, help="documents per request")
    ap.add_argument("--tflops", type=float, default=DEFAULT_TFLOPS, help="simulated achieved device rate")
    ap.add_argument("--step-overhead-us", type=float, default=DEFAULT_STEP_OVERHEAD_US)
    ap.add_argument("--format", default="float", choices=api.ENCODING_FORMATS, help="/v1/embeddings' encoding_format")
    ap.add_argument("--d2h-gbps", type=float, default=DEFAULT_D2H_GBPS,
                    help="simulated device-to-host bandwidth for a batch's output")
    ap.add_argument("--full-slots", action="store_true",
                    help="ship every batch's K output slots (as before output chunks) instead of the ones it fills")
    ap.add_argument("--label", default="", help="a name for this run in the output (e.g. the commit)")
    ap.add_argument("--health-probe", action=argparse.BooleanOptionalAction, default=True,
                    help="afterwards, /health latency during 4 concurrent 1000-document float requests")
    ap.add_argument("--probe", default="embeddings", choices=sorted(PROBES),
                    help="the load /health is probed under: OpenAI embeddings, or (with --model) SPLADE's "
                         "/embed_sparse, multi-vector /v1/embeddings, /rerank")
    ap.add_argument("--probe-docs", type=int, default=1000, help="documents per request of the probe's load")
    ap.add_argument("--probe-rounds", type=int, default=10, help="requests each of the probe's 4 clients sends")
    ap.add_argument("--model", help="a checkpoint directory to serve instead of the bundled model (--engine real)")
    ap.add_argument("--out", default=str(ROOT / "results" / "host.json"))
    ap.add_argument("--table", help="bucket shapes from this file instead of the derived H200 table (to compare commits)")
    ap.add_argument("--save-table", help="write the table the server used to this file")
    ap.add_argument("--engine", default="sim", choices=["sim", "real"],
                    help="sim: a simulated device at --tflops; real: this machine's device (on a GPU host)")
    ap.add_argument("--serve", type=int, help=argparse.SUPPRESS)  # internal: run the server on this port
    ap.add_argument("--default-priority", default="auto", help=argparse.SUPPRESS)  # internal: the server's flag
    ap.add_argument("--sim-dims", help=argparse.SUPPRESS)  # internal: hidden,intermediate,layers of the step times
    ap.add_argument("--no-knee", action="store_true", help=argparse.SUPPRESS)  # internal: the memory-bound table
    args = ap.parse_args()
    if args.serve:
        sizes = tuple(int(x) for x in args.sim_dims.split(",")) if args.sim_dims else None
        serve(args.serve, args.tflops * 1e12, args.step_overhead_us * 1e-6, args.table, args.engine == "real",
              args.default_priority, sizes, not args.no_knee, args.d2h_gbps * 1e9, args.full_slots, args.model)
        return
    DOCS = args.docs
    with harness.bench_lock():
        measure(args)


def measure(args) -> None:
    docs = harness.documents(4000, seed=0)
    bodies = [json.dumps({"input": docs[i * DOCS % len(docs):][:DOCS], "model": "m", "encoding_format": args.format})
              .encode() for i in range(40)]
    if args.engine == "sim":
        print(f"SIMULATED device: step = {args.step_overhead_us:g} us + FLOPs / {args.tflops:g} TFLOP/s "
              f"(H200 dense bf16 peak {H200_BF16_DENSE_TFLOPS}); real server, tokenizer, planner, batcher, HTTP",
              flush=True)
    else:
        print("REAL device: the bundled model on this machine's accelerator, the server's derived table", flush=True)
    levels = [int(x) for x in args.concurrency.split(",") if x]  # none: the /health probe alone
    floor = floor_ms(bodies, args.format) if levels else None
    if floor:
        print(f"floor: CPU per request of {DOCS} documents (decode + tokenize + encode): "
              f"{floor['decode']:.2f} + {floor['tokenize']:.2f} + {floor['encode']:.2f} = {floor['total']:.2f} ms",
              flush=True)
    command = lambda port: ([sys.executable, __file__, "--serve", str(port), "--tflops", str(args.tflops),
                             "--step-overhead-us", str(args.step_overhead_us), "--engine", args.engine,
                             "--d2h-gbps", str(args.d2h_gbps)]
                            + (["--model", args.model] if args.model else [])
                            + (["--table", args.table] if args.table else [])
                            + (["--full-slots"] if args.full_slots else []))
    rows, probe = [], None
    with harness.server(command=command, quiet=False, timeout_s=300) as srv:
        url = srv.url
        table = json.loads(harness.get(url, "/info"))["buckets"]
        if args.save_table:
            Path(args.save_table).write_text(json.dumps(table, indent=1) + "\n")
        print("table: " + ", ".join(f"{b['batch']}x{b['seqlen']}" for b in table["buckets"]), flush=True)
        for c in levels:
            r = asyncio.run(run_level(url, srv.proc.pid, bodies, c, args.seconds, args.engine == "sim"))
            rows.append(r)
            phases = r["phase_ms_per_request"]
            print(f"concurrency {c:>3}: {r['requests']} requests, {r['errors']} errors, device busy "
                  f"{r['device_busy']:.0%}, {r['docs_per_s']:,.0f} docs/s, {r['tokens_per_s']:,.0f} tokens/s, "
                  f"p50 {r['p50_ms']:.1f} ms, p99 {r['p99_ms']:.1f} ms; "
                  + (f"output {r['output_kib_per_batch']:,.0f} KiB/batch; " if r["output_kib_per_batch"] is not None else "")
                  + f"server CPU {r['host_cpu_ms_per_request']:.2f} ms/request "
                  f"({r['host_cpu_ms_per_request'] / floor['total']:.2f}x the floor); phase wall ms/request: "
                  + ", ".join(f"{k} {v:.2f}" for k, v in phases.items()), flush=True)
        if args.health_probe:
            probe = asyncio.run(health_probe(url, docs, "float", size=args.probe_docs, rounds=args.probe_rounds,
                                             probe=args.probe))
            print(f"/health during {probe['clients']} concurrent requests of {probe['documents']} documents "
                  f"({args.probe}): "
                  f"{probe['probes']} probes, p50 {probe['health_p50_ms']:.1f} ms, p99 {probe['health_p99_ms']:.1f} ms, "
                  f"max {probe['health_max_ms']:.1f} ms", flush=True)
    harness.write_result(args.out, {"label": args.label, "simulated": args.engine == "sim", "tflops": args.tflops,
                                    "step_overhead_us": args.step_overhead_us, "docs": DOCS, "format": args.format,
                                    "floor_ms": floor, "rows": rows, "health_probe": probe})


if __name__ == "__main__":
    main()
