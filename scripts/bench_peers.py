"""jaxserve against the tools users would pick instead, side by side in one run (same texts, model, machine).

    pip install -e '.[bench]'   # CPU torch + sentence-transformers, for the reference column
    python scripts/bench_peers.py [--n 512] [--rounds 4] [--out results/peers.json] [--no-http]

Workloads (the corpus, scripts/harness.py): short paragraphs, and long documents (docstrings
over 1500 characters, truncated at the model's 256 tokens). Columns:

- sentence-transformers `encode` at its best batch size (of 16, 32, 64, 128);
- a plain `jax.jit` of the same Flax model without buckets: batches of 32
  sorted by length and padded to their longest, so every new shape compiles
  (first pass: compiles included and counted; second pass: all cached);
- jaxserve in-process (`Encoder.embed`, warmed default table);
- jaxserve over HTTP (a `jaxserve serve` subprocess on loopback, requests of
  100 documents, 2 in flight).

Each column is timed on its own (best of 2), so a shared machine's drift between
columns lands in their ratio. `--rounds` then times sentence-transformers (at
its best batch size) and jaxserve in-process alternately, in pairs, and prints
the median of the per-pair ratios with their range: the figure to trust there.

Throughput is real (unpadded) tokens per second; "useful FLOP/s" counts the
model's matmuls on real tokens only (attention within each document) and is
set against the measured float32 matmul ceiling of this machine. The "bound"
line divides that ceiling by sentence-transformers' useful FLOP/s: no tool
computing the same FLOPs in float32 can beat it by more, so it says whether a
speed-up target is reachable on the machine at hand.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import harness
import numpy as np

ROOT = harness.ROOT


CEILING_SHAPES = [(4096, 384, 1536), (4096, 1536, 384), (4096, 384, 1152), (2048, 2048, 2048)]  # model-like and square


def matmul_ceiling() -> float:
    """Best float32 GFLOP/s of XLA's CPU matmul over CEILING_SHAPES."""
    import jax
    import jax.numpy as jnp

    f = jax.jit(lambda a, b: a @ b)
    return _best_gflops(lambda a, b: f(a, b).block_until_ready(), lambda m, k, n: (jnp.ones((m, k)), jnp.ones((k, n))))


def torch_matmul_ceiling() -> float | None:
    """The same for torch (the GEMMs sentence-transformers runs on): is the ceiling XLA's or the machine's?"""
    try:
        import torch
    except ImportError:
        return None
    device = torch_device()
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    return _best_gflops(lambda a, b: (a @ b, sync()), lambda m, k, n: (torch.ones(m, k, device=device),
                                                                      torch.ones(k, n, device=device)))


def torch_device() -> str:
    """Where sentence-transformers runs: the GPU when torch sees one (as jaxserve's JAX does), else the CPU.

    On a GPU, JAX's float32 matmuls use TF32 tensor cores by default and torch's do not: torch is
    set to TF32 too ("high"), so both compute the same arithmetic."""
    import torch

    if torch.cuda.is_available():
        torch.set_float32_matmul_precision("high")
        return "cuda"
    return "cpu"


def _best_gflops(matmul, operands, reps: int = 10) -> float:
    best = 0.0
    for m, k, n in CEILING_SHAPES:
        a, b = operands(m, k, n)
        matmul(a, b)
        start = time.perf_counter()
        for _ in range(reps):
            matmul(a, b)
        best = max(best, 2 * m * k * n * reps / (time.perf_counter() - start) / 1e9)
    return best


def timed(fn, repeats: int = 2) -> float:
    """Best of `repeats` runs (the first also warms caches)."""
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def load_sentence_transformer():
    """The model jaxserve loads (`$JAXSERVE_MODEL` or the bundled one) in sentence-transformers, or
    None without the `bench` extra."""
    try:
        from sentence_transformers import SentenceTransformer
    except ImportError:
        return None
    from jaxserve.checkpoint import loader

    return SentenceTransformer(str(loader.resolve(None)), device=torch_device())


def bench_sentence_transformers(model, texts: list[str]) -> dict:
    import torch

    model.encode(texts[:64], batch_size=32)
    results = {bs: timed(lambda: model.encode(texts, batch_size=bs, normalize_embeddings=True))
               for bs in (16, 32, 64, 128)}
    best = min(results, key=results.get)
    return {"seconds": results[best], "batch_size": best, "by_batch_size": results,
            "note": f"batch_size {best} (of {sorted(results)}), torch {torch.__version__}, "
                    + (f"{torch.cuda.get_device_name()}, TF32" if model.device.type == "cuda" else f"{torch.get_num_threads()} threads")}


def bench_plain_jit(enc, seqs: list[np.ndarray], batch: int = 32) -> dict:
    """Sorted by length, batches padded to their longest: one compile per new shape."""
    import jax

    from jaxserve.heads.forwards import embed_forward
    from jaxserve.runtime import compiles

    fn = jax.jit(lambda params, b: embed_forward(enc.module, enc.embedding_config, 1, params, b))
    order = np.argsort([len(s) for s in seqs])

    def run():
        for start in range(0, len(order), batch):
            idx = order[start : start + batch]
            longest = max(len(seqs[i]) for i in idx)
            ids = np.zeros((len(idx), longest), np.int32)
            for r, i in enumerate(idx):
                ids[r, : len(seqs[i])] = seqs[i]
            real = (np.arange(longest) < np.array([len(seqs[i]) for i in idx])[:, None]).astype(np.int32)
            b = {"token_ids": ids, "segment_ids": real, "type_ids": np.zeros_like(ids),
                 "positions": np.broadcast_to(np.arange(longest, dtype=np.int32), ids.shape).copy()}
            np.asarray(fn(enc.params, jax.device_put(b)))

    before = compiles.xla_compiles_total()
    start = time.perf_counter()
    run()
    first = time.perf_counter() - start
    compiled = compiles.xla_compiles_total() - before
    return {"seconds": timed(run, 1), "first_pass_s": first, "compiles": compiled,
            "note": f"{compiled} compiles in the first pass ({first:.1f} s)"}


def bench_http(texts: list[str], table_file: Path, per_request: int = 100, in_flight: int = 2) -> dict:
    import asyncio

    import aiohttp

    async def main(url):
        async with aiohttp.ClientSession() as s:
            return min([await harness.post_all(s, url, texts, per_request, in_flight) for _ in range(2)])

    with harness.server("--buckets", str(table_file)) as srv:
        seconds = asyncio.run(main(srv.url))
    return {"seconds": seconds, "note": f"requests of {per_request}, {in_flight} in flight, loopback"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=512, help="documents per workload")
    ap.add_argument("--out", default=str(ROOT / "results" / "peers.json"))
    ap.add_argument("--buckets", default=str(ROOT / "buckets" / "minilm-cpu-default.json"))
    ap.add_argument("--no-http", action="store_true")
    ap.add_argument("--rounds", type=int, default=4,
                    help="paired rounds of sentence-transformers against jaxserve in-process (0: none)")
    args = ap.parse_args()
    with harness.bench_lock():
        measure(args)


def measure(args) -> None:
    import jax

    from jaxserve import Encoder

    enc = Encoder.from_pretrained(None, buckets=args.buckets)
    st_model = load_sentence_transformer()
    ceiling, torch_ceiling = matmul_ceiling(), torch_matmul_ceiling()
    workloads = {
        "short paragraphs": harness.sample("paragraphs", args.n),
        "long documents": harness.sample("docstrings", args.n, min_chars=1500),
    }
    device = jax.devices()[0]
    xla_device = device.platform if device.device_kind == device.platform else f"{device.platform}, {device.device_kind}"
    report = {"jax_device": xla_device,
              "matmul_ceiling_gflops": ceiling, "torch_matmul_ceiling_gflops": torch_ceiling, "workloads": {}}
    print(f"float32 matmul ceiling (XLA {xla_device}): {ceiling:.1f} GFLOP/s"
          + (f"; torch's: {torch_ceiling:.1f} GFLOP/s" if torch_ceiling else ""))
    for name, texts in workloads.items():
        seqs = enc.tokenizer.encode(texts)
        lengths = [len(s) for s in seqs]
        tokens, flops = sum(lengths), enc.dims.forward_flops(lengths)  # real tokens only, attention per document
        rows = {
            "sentence-transformers": bench_sentence_transformers(st_model, texts) if st_model else None,
            "plain jax.jit (no buckets)": bench_plain_jit(enc, seqs),
            "jaxserve in-process": {"seconds": timed(lambda: enc.embed(texts)), "note": f"table {Path(args.buckets).name}"},
        }
        if not args.no_http:
            rows["jaxserve HTTP"] = bench_http(texts, Path(args.buckets))
        ref = rows["sentence-transformers"]
        print(f"\n{name}: {len(texts)} documents, {tokens} real tokens (mean {np.mean(lengths):.0f}), "
              f"{flops / 1e9:.1f} useful GFLOP")
        print(f"{'':28} {'seconds':>8} {'tokens/s':>9} {'vs s-t':>7} {'GFLOP/s':>8} {'of ceiling':>10}  note")
        for tool, r in rows.items():
            if r is None:
                print(f"{tool:28} {'(not installed: pip install -e .[bench])':>40}")
                continue
            r.update(tokens_per_s=tokens / r["seconds"], useful_gflops=flops / r["seconds"] / 1e9)
            r["of_ceiling"] = r["useful_gflops"] / ceiling
            r["vs_sentence_transformers"] = ref["seconds"] / r["seconds"] if ref else None
            vs = f"{r['vs_sentence_transformers']:.2f}x" if ref else "-"
            print(f"{tool:28} {r['seconds']:>8.2f} {r['tokens_per_s']:>9.0f} {vs:>7} {r['useful_gflops']:>8.1f} "
                  f"{r['of_ceiling']:>10.0%}  {r['note']}")
        bound = ceiling / ref["useful_gflops"] if ref else None
        if bound:
            print(f"{'bound':28} {bound:.2f}x sentence-transformers for any tool doing these FLOPs in float32 "
                  "at the ceiling")
        paired = None
        if ref and args.rounds > 0:
            paired = harness.paired_rounds(
                lambda: st_model.encode(texts, batch_size=ref["batch_size"], normalize_embeddings=True),
                lambda: enc.embed(texts), args.rounds)
            print(f"{'paired rounds':28} jaxserve in-process {paired['median']:.2f}x sentence-transformers "
                  f"(median of {paired['rounds']} alternating pairs; range {paired['min']:.2f}-{paired['max']:.2f}x)")
        report["workloads"][name] = {"documents": len(texts), "tokens": tokens, "useful_gflop": flops / 1e9,
                                     "bound_vs_sentence_transformers": bound, "paired_in_process": paired,
                                     "results": rows}
    print()
    harness.write_result(args.out, report)


if __name__ == "__main__":
    main()
