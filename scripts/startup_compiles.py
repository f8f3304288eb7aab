"""How many executables a start compiles, before and after lazy derivation, for models on a device they are not on.

    .venv/bin/python scripts/startup_compiles.py buckets/configs/*.json --device-memory 105750000000 \\
        --out results/startup_compiles.json

No weights and no compiler: memory comes from the analytic estimate
(`ModelDims.activation_bytes`, what the derivation bounds its candidates
with) and timings from the simulated H200 of `jaxserve.runtime.simulated` (FLOPs at
400 TFLOP/s plus 30 us a step, the host's time per dispatch as the floor), so
the counts are exact for the algorithms and repeatable; on a real device the
knee comes from its own timings.
- before: the previous derivation compiled every bucket of the memory-filling
  ladder (`buckets.derive` with no token cap: largest batch and 1, 4, 16, ...
  below it) plus its probe of each seqlen's largest batch, all before timing.
- after: `jaxserve.runtime.derivation` climbs each ladder (token cap
  `ACCELERATOR_MAX_BATCH_TOKENS`) and stops one step past the knee.
Both add one token-output executable per seqlen (/embed_all).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import harness

# The longest input each model's sentence-transformers config serves (else its positions, at most 32768).
MAX_SEQ_LENGTH = {"all-minilm-l6-v2": 256, "bge-base-en-v1.5": 512, "embeddinggemma-300m": 2048}
MAX_SEQLEN = 32768


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("configs", nargs="+", type=Path)
    ap.add_argument("--device-memory", type=float, default=0.75 * 141e9, help="bytes (default: an H200's JAX pool)")
    ap.add_argument("--dtype-bytes", type=int, default=2, help="bfloat16, as on accelerators")
    ap.add_argument("--tflops", type=float, default=400)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()

    from jaxserve.runtime.simulated import SimSpec, step_seconds
    from jaxserve.runtime import buckets, derivation, device
    from jaxserve.runtime.device import ACCELERATOR_MAX_BATCH_TOKENS, UNCAPPED
    from jaxserve.models import family_of

    budget = device.budget_bytes(args.device_memory)
    rows = []
    print(f"device memory {args.device_memory / 1e9:.1f} GB (budget {budget / 1e9:.1f} GB), simulated "
          f"{args.tflops:g} TFLOP/s, bf16")
    print(f"{'model':>22} {'seqlens':>7} {'before':>7} {'after':>6} {'kept':>5} {'largest before':>15} "
          f"{'largest after':>14}")
    for path in args.configs:
        raw = json.loads(path.read_text())
        cfg = family_of(raw).configure(raw)
        dims = cfg.dims(args.dtype_bytes)
        weights = 2 * sum(_param_count(cfg, family_of(raw)))
        max_len = MAX_SEQ_LENGTH.get(path.stem, min(cfg.max_positions, MAX_SEQLEN))
        seqlens = buckets.ladder("default", max_len)
        old = buckets.derive(seqlens, dims, weights, budget, None, max_batch_tokens=UNCAPPED, max_batch=UNCAPPED,
                             multiple=8, layout="packed", batch_ladder=True)
        before = len(old.buckets) + len(old.seqlens) + len(old.seqlens)  # ladder, probes, token outputs

        step_s = lambda bucket: step_seconds(dims, bucket, args.tflops * 1e12, SimSpec(args.tflops).step_overhead_us * 1e-6)
        ladders = derivation.climbs(seqlens, dims, weights, budget, ACCELERATOR_MAX_BATCH_TOKENS, UNCAPPED,
                                    multiple=8, layout="packed")
        derivation.climb(ladders, lambda shapes: [weights + dims.activation_bytes(*s) for s in shapes], step_s)
        new = derivation.table_of(ladders, dims, weights, budget_bytes=budget, layout="packed")
        after = sum(len(c.compiled) for c in ladders) + len(new.seqlens)
        biggest = lambda t: max(b.tokens for b in t.buckets)
        row = {"model": path.stem, "seqlens": len(seqlens), "before": before, "after": after,
               "kept": len(new.buckets), "largest_tokens_before": biggest(old), "largest_tokens_after": biggest(new)}
        rows.append(row)
        print(f"{row['model']:>22} {row['seqlens']:>7} {before:>7} {after:>6} {row['kept']:>5} "
              f"{biggest(old):>15,} {biggest(new):>14,}")
    if args.out:
        harness.write_result(args.out, {"device_memory": args.device_memory, "tflops": args.tflops, "rows": rows})


def _param_count(cfg, family):
    import jax
    import jax.numpy as jnp

    return [x.size for x in jax.tree.leaves(family.param_shapes(cfg, jnp.bfloat16))]


if __name__ == "__main__":
    main()
