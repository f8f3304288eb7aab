"""Memory-bound bucket tables for a model on a device it is not running on: no weights, no device.

    .venv/bin/python scripts/memory_tables.py buckets/configs/qwen3-embedding-0.6b.json \\
        --name qwen3-embedding-0.6b --device-memory 80000000000:h100 141000000000:h200 --write-dir buckets

The config is a checkpoint's config.json (a path, or the JSON itself inline);
the weights are abstract (`jax.ShapeDtypeStruct`s from the family's
`param_shapes`), so nothing is downloaded and no memory is used for them. For
each device size the table comes from `jaxserve.runtime.buckets.derive`, the same
derivation the server runs, with XLA's memory analysis of each compiled
candidate bucket (this machine's compiler: the CPU's here) as the check. As
on an accelerator (`jaxserve.runtime.device`), no token or row cap: memory alone stops
each seqlen's batch. The script prints each table and, per seqlen, the batch
memory allows.

What is compiled (`forward`): the family's encoder and `jaxserve.heads.pooling.pool`
on a dict of four [B, S] int32 arrays, as the engine runs it.

With `--target gpu` (the default) three things make the CPU compiler's figure
stand in for a GPU's; each is printed with the table:
- Attention: a GPU runs a fused kernel (cuDNN's or Pallas', `attention.plan`), which the
  CPU compiler cannot compile; its stand-in is `blockwise` at every seqlen: no
  [S, S] buffer either, and slightly more temporaries than the fused kernel.
- XLA CPU runs bfloat16 matmuls in float32 and keeps a float32 copy of every
  bfloat16 weight matrix for the whole forward (2x the layers' weights: 26 GB
  for an 8B model). A GPU multiplies in bfloat16. That copy, measured as the
  temporaries of a 1-row, 16-token bucket, is taken off every figure.
- XLA CPU hands some fusions to a library (YNNPACK) whose scratch memory its
  analysis does not count (a dense attention's [B, N, S, S] scores among them).
  The script turns those library fusions off (`--xla_cpu_experimental_ynn_fusion_type=`)
  so that every buffer is in the analysis, as a GPU compiler's would be.
`--target cpu` compiles what a CPU runs (`attention.xla_impl`) and
takes nothing off (library fusions stay off: their scratch is real memory).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from functools import partial
from pathlib import Path

INPUTS = ("token_ids", "segment_ids", "positions", "type_ids")
DTYPES = ("float32", "bfloat16", "float16")
MAX_SEQLEN = 32768  # longest seqlen tabled by default (the longest context the families serve)
PROBE = (1, 16)  # (batch, seqlen) whose temporaries are the compiler's own fixed cost


def forward(module, pooling: str, slots: int, params, batch: dict):
    """What one bucket runs: four [B, S] int32 inputs -> [B, K, D] pooled float32 vectors."""
    from jaxserve.heads.pooling import pool

    hidden = module.apply({"params": params}, batch["token_ids"], batch["segment_ids"], batch["positions"],
                          batch["type_ids"], packed=slots > 1)  # [B, S, D]
    return pool(pooling, hidden, batch["segment_ids"], batch["positions"], slots)


def read_config(source: str) -> dict:
    """config.json from a path, or the JSON dict itself."""
    text = source if source.lstrip().startswith("{") else Path(source).read_text()
    return json.loads(text)


def implementation(target: str, seqlen: int) -> str:
    """The attention compiled for `target`: on a GPU blockwise stands in for the fused kernels."""
    from jaxserve.models import attention

    return "blockwise" if target == "gpu" else attention.xla_impl(seqlen)


class Compiled:
    """Compiles each (batch, seqlen, slots) once with abstract weights; reports XLA's bytes."""

    def __init__(self, family, cfg, dtype, pooling: str, target: str, layout: str, cache: Path | None = None):
        import jax

        self.family, self.cfg, self.dtype, self.pooling, self.target = family, cfg, dtype, pooling, target
        self.params = family.param_shapes(cfg, dtype)
        self.weights_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(self.params))
        self.cache = cache
        self.seen: dict[tuple[int, int, int], dict] = {}
        if cache and cache.exists():
            self.seen = {tuple(int(x) for x in k.split(",")): v for k, v in json.loads(cache.read_text()).items()}
        # The compiler's own fixed temporaries (XLA CPU's float32 weight copies), taken off for a GPU.
        from jaxserve.runtime.buckets import slots_for

        probe = self.analysis(*PROBE, slots_for(PROBE[1], layout))["temp"]
        self.taken_off = probe if target == "gpu" else 0

    def analysis(self, batch: int, seqlen: int, slots: int) -> dict:
        import jax
        import jax.numpy as jnp

        key = (batch, seqlen, slots)
        if key not in self.seen:
            module = self.family.encoder(self.cfg, self.dtype, attention=implementation(self.target, seqlen))
            inputs = {name: jax.ShapeDtypeStruct((batch, seqlen), jnp.int32) for name in INPUTS}
            start = time.perf_counter()
            exe = jax.jit(partial(forward, module, self.pooling, slots)).lower(self.params, inputs).compile()
            m = exe.memory_analysis()
            self.seen[key] = dict(
                arguments=m.argument_size_in_bytes, outputs=m.output_size_in_bytes, temp=m.temp_size_in_bytes,
                alias=m.alias_size_in_bytes, compile_s=time.perf_counter() - start,
            )
            if self.cache:  # after every compile: a run cut off resumes where it stopped
                self.cache.write_text(json.dumps({",".join(map(str, k)): v for k, v in self.seen.items()}))
        return self.seen[key]

    def bucket_bytes(self, batch: int, seqlen: int, slots: int) -> int:
        """Arguments (weights included) + outputs + temporaries, as the engine counts a bucket,
        less the compiler's own fixed temporaries where they stand for a GPU."""
        a = self.analysis(batch, seqlen, slots)
        return a["arguments"] + a["outputs"] + a["temp"] - a["alias"] - self.taken_off


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("config", help="config.json: a path, or the JSON dict inline")
    ap.add_argument("--name", required=True, help="file name prefix, e.g. qwen3-embedding-0.6b")
    ap.add_argument("--device-memory", nargs="+", required=True, metavar="BYTES[:LABEL]",
                    help="device sizes, each with an optional label for the file name (80000000000:h100)")
    ap.add_argument("--dtype", choices=DTYPES, default="bfloat16")
    ap.add_argument("--pooling", default="lasttoken")
    ap.add_argument("--target", choices=("gpu", "cpu"), default="gpu", help="the device the table is for")
    ap.add_argument("--max-seqlen", type=int, help=f"default: the model's max positions, at most {MAX_SEQLEN}")
    ap.add_argument("--seqlens", help="comma-separated, instead of the ladder")
    ap.add_argument("--ladder", choices=("default", "max", "pow2", "fine"), default="default")
    ap.add_argument("--layout", choices=("padded", "packed"), default="packed")
    ap.add_argument("--headroom", type=float, help="share of the device memory to fill (default: jaxserve's)")
    ap.add_argument("--max-batch-tokens", type=int, help="default: none (as on an accelerator)")
    ap.add_argument("--max-batch", type=int, help="default: none")
    ap.add_argument("--batch-multiple", type=int, default=8)
    ap.add_argument("--write-dir", type=Path, help="write {name}-{label}-memory.json here")
    ap.add_argument("--cache", type=Path, help="keep each compiled shape's analysis in this JSON file and reuse "
                    "it: a long run (Qwen3-8B: hours on 2 cores) resumes after an interruption. Only for the same "
                    "config, dtype, pooling, target and jax version")
    args = ap.parse_args()

    # Before JAX starts: every buffer in XLA's analysis (see the docstring).
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_cpu_experimental_ynn_fusion_type=").strip()
    import jax
    import jax.numpy as jnp

    from jaxserve.runtime import buckets
    from jaxserve.runtime.buckets import format_table
    from jaxserve.runtime.device import UNCAPPED, budget_bytes
    from jaxserve.models import family_of

    raw = read_config(args.config)
    family = family_of(raw)
    cfg = family.configure(raw)
    dtype = jnp.dtype(args.dtype)
    compiled = Compiled(family, cfg, dtype, args.pooling, args.target, args.layout, args.cache)
    max_len = args.max_seqlen or min(cfg.max_positions, MAX_SEQLEN)
    seqlens = [int(s) for s in args.seqlens.split(",")] if args.seqlens else buckets.ladder(args.ladder, max_len)
    compiler = jax.devices()[0].platform
    print(f"{args.name} ({cfg.model_type}): {cfg.num_layers} layers, hidden {cfg.hidden_size}, weights "
          f"{compiled.weights_bytes / 2**30:.2f} GiB in {args.dtype}; seqlens {seqlens[0]}..{seqlens[-1]} "
          f"({len(seqlens)}, {args.layout}); for a {args.target} (attention {implementation(args.target, seqlens[-1])} "
          f"at {seqlens[-1]}), {compiler} compiler's analysis less {compiled.taken_off / 2**30:.2f} GiB of its own "
          f"fixed temporaries")
    for spec in args.device_memory:
        memory, _, label = spec.partition(":")
        memory = int(float(memory))
        label = label or f"{memory // 10**9}gb"
        table = buckets.derive(
            seqlens, cfg.dims(dtype.itemsize), compiled.weights_bytes,
            budget_bytes(memory, args.headroom), compiled.bucket_bytes,
            max_batch_tokens=args.max_batch_tokens or UNCAPPED, max_batch=args.max_batch or UNCAPPED,
            multiple=args.batch_multiple, layout=args.layout, ladder="custom" if args.seqlens else args.ladder,
            device=f"{args.target} ({label}, {memory} bytes) from the {compiler} compiler's analysis less "
                   f"{compiled.taken_off} bytes of its fixed temporaries; {args.dtype}",
            device_memory=memory,
        )
        print()
        print(format_table(table))
        limited = [(b.seqlen, b.batch) for b in table.buckets if b.limited_by == "memory"]
        print(f"{label}: memory limits {len(limited)} of {len(table.seqlens)} seqlens: "
              + ", ".join(f"{s} x {b}" for s, b in limited))
        if args.write_dir:
            path = args.write_dir / f"{args.name}-{label}-memory.json"
            table.save(path)
            print(f"wrote {path}")
    print(f"compiled {len(compiled.seen)} shapes in {sum(a['compile_s'] for a in compiled.seen.values()):.0f} s")


if __name__ == "__main__":
    main()
