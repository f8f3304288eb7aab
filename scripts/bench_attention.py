"""Dense vs blockwise attention on this backend: compiled temp memory and time per seqlen.

    .venv/bin/python scripts/bench_attention.py --seqlens 256,512,1024,2048,4096 --tokens 8192

At each seqlen the batch is `tokens // seqlen` rows of one document each, so
every row of the table computes the same number of tokens. `--what layer`
times one MiniLM-sized BERT layer (attention + MLP, hidden 384, 12 heads,
MLP 1536), `--what attention` the attention alone. Temp bytes are XLA's
memory analysis of the compiled executable; time is the median of `--runs`
runs after one burn-in, the implementations alternating per run. On a CPU the
dense kernel's scores live in YNNPACK's scratch, which that analysis does not
count (at 1 x 4096 a layer's temp reads 94 MiB while the process grows by
~1.6 GiB). `--block` sets the blockwise block for `--what attention` only.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.models import attention, bert
from jaxserve.models.attention import Masks, Spec

MINILM = bert.Config("bert", vocab_size=30522, hidden_size=384, num_layers=1, num_heads=12, intermediate_size=1536,
                     max_position_embeddings=512, type_vocab_size=2)


def forward(what: str, impl: str, spec: Spec, block: int):
    """(params, x [B, S, D], segment ids, positions) -> [B, S, D] through one layer or its attention."""
    c = MINILM
    if what == "layer":
        module = bert.Block(c, jnp.float32)
        return lambda params, x, seg, pos: module.apply({"params": params}, x, Masks(seg, pos, True, impl))

    def attend_only(params, x, seg, pos):
        b, s, _ = x.shape
        q, k, v = jnp.split(x.reshape(b, s, c.num_heads, c.head_dim) @ params, 3, axis=-1)  # [B, S, N, H] each
        masks = Masks(seg, pos, True, impl)
        if impl == "blockwise":
            return attention._blockwise(q / c.head_dim ** 0.5, k, v, masks, spec, block=block)
        return attention.attend(q, k, v, masks, spec)
    return attend_only


def measure(what: str, impl: str, spec: Spec, block: int, batch: int, seqlen: int, runs: int):
    c = MINILM
    rng = np.random.default_rng(0)
    if what == "layer":
        x0 = jnp.zeros((1, 8, c.hidden_size), jnp.float32)
        ids = jnp.ones((1, 8), jnp.int32)
        params = bert.Block(c, jnp.float32).init(jax.random.key(0), x0, Masks(ids, ids - 1))["params"]
    else:
        params = jnp.asarray(rng.standard_normal((c.head_dim, 3 * c.head_dim)).astype(np.float32) * 0.2)
    x = jnp.asarray(rng.standard_normal((batch, seqlen, c.hidden_size)).astype(np.float32))
    seg = jnp.ones((batch, seqlen), jnp.int32)
    pos = jnp.tile(jnp.arange(seqlen, dtype=jnp.int32), (batch, 1))
    fn = jax.jit(forward(what, impl, spec, block))
    start = time.perf_counter()
    exe = fn.lower(params, x, seg, pos).compile()
    compile_s = time.perf_counter() - start
    temp = exe.memory_analysis().temp_size_in_bytes
    exe(params, x, seg, pos).block_until_ready()  # burn-in

    def run() -> float:
        start = time.perf_counter()
        exe(params, x, seg, pos).block_until_ready()
        return time.perf_counter() - start
    return exe, temp, compile_s, run


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seqlens", default="256,512,1024,2048,4096")
    ap.add_argument("--tokens", type=int, default=8192, help="tokens per dispatch (batch = tokens // seqlen)")
    ap.add_argument("--impls", default="dense,blockwise")
    ap.add_argument("--what", choices=("layer", "attention"), default="layer")
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--window", type=int, default=None)
    ap.add_argument("--block", type=int, default=attention.KEY_BLOCK, help="blockwise block (attention only)")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--dense-max", type=int, default=4096, help="skip dense above this seqlen (its S^2 memory)")
    ap.add_argument("--json", help="write the raw numbers here")
    args = ap.parse_args()
    spec = Spec(causal=args.causal, window=args.window)
    impls = args.impls.split(",")
    print(f"{args.what}, {spec}, {args.tokens} tokens per dispatch, block {args.block}, {jax.devices()[0].platform}")
    print(f"{'seqlen':>7} {'batch':>5} " + " ".join(f"{i + ' MiB':>14} {i + ' ms':>13}" for i in impls)
          + f" {'blockwise/dense':>15}")
    rows = []
    for seqlen in map(int, args.seqlens.split(",")):
        batch = max(1, args.tokens // seqlen)
        found = {}
        for impl in impls:
            if impl == "dense" and seqlen > args.dense_max:
                continue
            exe, temp, compile_s, run = measure(args.what, impl, spec, args.block, batch, seqlen, args.runs)
            found[impl] = dict(temp_bytes=temp, compile_s=compile_s, run=run, times=[])
        for _ in range(args.runs):  # alternate, so load from other processes hits both alike
            for r in found.values():
                r["times"].append(r["run"]())
        for r in found.values():
            r["ms"] = 1e3 * statistics.median(r.pop("times"))
            del r["run"]
        cells = " ".join(f"{found[i]['temp_bytes'] / 2**20:>14.1f} {found[i]['ms']:>13.1f}" if i in found
                         else f"{'-':>14} {'-':>13}" for i in impls)
        ratio = (f"{found['blockwise']['ms'] / found['dense']['ms']:>15.2f}"
                 if {"dense", "blockwise"} <= set(found) else "")
        print(f"{seqlen:>7} {batch:>5} {cells} {ratio}", flush=True)
        rows.append(dict(seqlen=seqlen, batch=batch, **{i: found[i] for i in found}))
    if args.json:
        with open(args.json, "w") as f:
            raw = dict(what=args.what, spec=str(spec), tokens=args.tokens, block=args.block, rows=rows)
            json.dump(raw, f, indent=1)


if __name__ == "__main__":
    main()
