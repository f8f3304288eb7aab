"""Attention kernels side by side: Pallas vs cuDNN vs XLA on packed rows (`--what kernels`, the default),
or dense vs blockwise inside a MiniLM-sized layer on this backend (`--what layer|attention`).

    python scripts/bench_attention.py --out attention.json            # on a GPU: the full grid
    python scripts/bench_attention.py --dry-run --out /tmp/a.json     # CPU, tiny sizes, well under a minute
    .venv/bin/python scripts/bench_attention.py --what layer --seqlens 256,512,1024,2048,4096 --tokens 8192

`--what kernels`: at each head_dim (default 32, 64, 128, 256) x seqlen (16 .. 8192)
one bf16 dispatch of `--tokens` tokens (batch = tokens // seqlen rows) of `--heads`
heads, rows packed as the server packs them (documents of random lengths back to
back, `slots_for(seqlen)` of them at most, then padding), through
`jaxserve.models.attention` exactly as a bucket runs it: `pallas` (the tile
`pallas_block` picks), `cudnn` (ragged offsets from the segment ids), `xla`
(dense up to seqlen 256, blockwise past it). The device is spun up first
(`--spin-s`); each case is compiled, run twice to warm, then timed as the median of
`--runs` (>= 5) launches, the implementations alternating per launch. Each
implementation's largest error against float32 dense attention on the real tokens
(row 0, every real token) is reported beside its time, so a first GPU run also says
whether a kernel is right. Times are host-observed (launch to `block_until_ready`),
so the smallest cases include ~tens of microseconds of dispatch.
A case that cannot run (no tile, no CUDA, a compile error) is recorded with its
reason as an error string and the grid goes on. On a CPU cuDNN is reported
unavailable, and Pallas runs in its interpreter only at `--dry-run` sizes.

`--what layer` times one MiniLM-sized BERT layer (attention + MLP, hidden 384,
12 heads, MLP 1536), `--what attention` the attention alone, dense vs blockwise.
Temp bytes are XLA's memory analysis of the compiled executable; time is the
median of `--runs` runs after one burn-in, the implementations alternating per
run. On a CPU the dense kernel's scores live in YNNPACK's scratch, which that
analysis does not count (at 1 x 4096 a layer's temp reads 94 MiB while the
process grows by ~1.6 GiB). `--block` sets the blockwise block for `--what attention` only.
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

import harness

from jaxserve.runtime.buckets import slots_for
from jaxserve.models import attention, bert
from jaxserve.models.attention import Kernel, Masks, Spec

KERNELS = ("pallas", "cudnn", "xla")
GRID_HEAD_DIMS = "32,64,128,256"
GRID_SEQLENS = "16,32,64,128,256,512,1024,2048,4096,8192"
DRY_HEAD_DIMS, DRY_SEQLENS, DRY_TOKENS, DRY_HEADS = "32,256", "64,128", 256, 2

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


def packed_segments(rng, batch: int, seqlen: int, slots: int) -> tuple[np.ndarray, np.ndarray]:
    """Segment ids and positions [B, S] as the planner lays rows out: up to `slots` documents of random
    lengths back to back from slot 0 (segment ids 1..K, positions from 0), then padding (segment 0)."""
    seg = np.zeros((batch, seqlen), np.int32)
    pos = np.zeros_like(seg)
    for r in range(batch):
        start = 0
        for d in range(slots):
            room = seqlen - start
            if room <= 0 or (d and rng.random() < 0.1):  # some rows end early: padding at the end
                break
            n = room if d == slots - 1 else int(rng.integers(1, max(2, min(room, 2 * seqlen // slots)) + 1))
            n = min(n, room)
            seg[r, start:start + n] = d + 1
            pos[r, start:start + n] = np.arange(n)
            start += n
    return seg, pos


def kernel_case(impl: str, h: int, seqlen: int, batch: int, heads: int, slots: int, spec: Spec, dry: bool):
    """(fn, why): the jitted attention of one implementation at this case, or why it cannot run here."""
    platform = jax.devices()[0].platform
    if impl == "cudnn":
        why = attention.cudnn_unfit(platform, h, "bfloat16")
        if why:
            return None, f"unavailable: {why}"
    if impl == "pallas":
        why = attention.pallas_unfit(seqlen, h, 2)
        if why:
            return None, f"unfit: {why}"
        if platform != "gpu" and not dry:
            return None, "skipped: Pallas runs on a CPU only in its interpreter, at --dry-run sizes"
    name = attention.xla_impl(seqlen) if impl == "xla" else impl
    packed = slots > 1

    def fn(q, k, v, seg, pos):
        return attention.attend(q, k, v, Masks(seg, pos, packed, Kernel(name, slots)), spec)
    return jax.jit(fn), ""


def kernels_main(args) -> None:
    spec = Spec(causal=args.causal)
    head_dims = [int(x) for x in (args.head_dims or (DRY_HEAD_DIMS if args.dry_run else GRID_HEAD_DIMS)).split(",")]
    seqlens = [int(x) for x in (args.seqlens or (DRY_SEQLENS if args.dry_run else GRID_SEQLENS)).split(",")]
    tokens = args.tokens or (DRY_TOKENS if args.dry_run else 32768)
    heads = args.heads or (DRY_HEADS if args.dry_run else 16)
    runs = max(5, args.runs)
    impls = args.impls.split(",") if args.impls else list(KERNELS)
    dev = jax.devices()[0]
    print(f"attention kernels, bf16, {spec}, {tokens} tokens per dispatch, {heads} heads, "
          f"{dev.platform} ({dev.device_kind}), jax {jax.__version__}; median of {runs} launches, ms")
    spin(args.spin_s)
    print(f"{'head_dim':>8} {'seqlen':>6} {'batch':>5} {'slots':>5} "
          + " ".join(f"{i + ' ms':>10} {i + ' err':>9}" for i in impls) + "  best")
    cases = []
    for h in head_dims:
        for seqlen in seqlens:
            case = one_kernel_case(args, impls, spec, h, seqlen, tokens, heads, runs)
            cases.append(case)
            cells = []
            for i in impls:
                r = case["results"][i]
                cells.append(f"{r['ms']:>10.3f} {r['max_abs_err']:>9.1e}" if r.get("ms") is not None
                             else f"{'-':>10} {'-':>9}")
            timed = {i: r["ms"] for i, r in case["results"].items() if r.get("ms") is not None}
            best = min(timed, key=timed.get) if timed else "-"
            print(f"{h:>8} {seqlen:>6} {case['batch']:>5} {case['slots']:>5} {' '.join(cells)}  {best}", flush=True)
            if args.out:  # written after every case: a run cut short keeps what it finished
                harness.write_result(args.out, dict(what="kernels", dtype="bfloat16", spec=str(spec), tokens=tokens, heads=heads,
                                                    runs=runs, platform=dev.platform, device_kind=dev.device_kind,
                                                    jax=jax.__version__, dry_run=args.dry_run, cases=cases),
                                     quiet=True)
    for case in cases:
        for i, r in case["results"].items():
            if r.get("error"):
                print(f"  head_dim {case['head_dim']} seqlen {case['seqlen']} {i}: {r['error']}")
    if args.out:
        print(f"wrote {args.out}")


def one_kernel_case(args, impls, spec, h, seqlen, tokens, heads, runs) -> dict:
    """One (head_dim, seqlen): every implementation compiled, checked against float32 dense, then timed."""
    batch = max(1, tokens // seqlen)
    slots = slots_for(seqlen, "packed")
    rng = np.random.default_rng(seqlen * 1000 + h)
    seg, pos = packed_segments(rng, batch, seqlen, slots)
    q, k, v = (jnp.asarray(rng.standard_normal((batch, seqlen, heads, h)), jnp.bfloat16) for _ in range(3))
    seg_d, pos_d = jnp.asarray(seg), jnp.asarray(pos)
    real = seg > 0
    flops = 4 * batch * heads * seqlen * seqlen * h / (2 if spec.causal else 1)  # dense-equivalent work
    case = dict(head_dim=h, seqlen=seqlen, batch=batch, heads=heads, slots=slots, real_tokens=int(real.sum()),
                dense_flops=flops, results={})
    want = None
    try:  # the reference: float32 dense attention of row 0 (its scores fit at every seqlen of the grid)
        q32, k32, v32 = (x[:1].astype(jnp.float32) for x in (q, k, v))
        ref = jax.jit(lambda q, k, v, s, p: attention.attend(q, k, v, Masks(s, p, slots > 1, "dense"), spec))
        want = np.asarray(ref(q32, k32, v32, seg_d[:1], pos_d[:1]))[real[:1]]
    except Exception as exc:  # errors are then left out, times are not
        case["reference_error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
    exes = {}
    for impl in impls:
        r = case["results"][impl] = dict(ms=None, max_abs_err=None, error=None)
        if impl == "pallas":
            r["tile"] = attention.pallas_block(seqlen, h, 2)
        if impl == "xla":
            r["implementation"] = attention.xla_impl(seqlen)
        fn, why = kernel_case(impl, h, seqlen, batch, heads, slots, spec, args.dry_run)
        if fn is None:
            r["error"] = why
            continue
        try:
            start = time.perf_counter()
            exe = fn.lower(q, k, v, seg_d, pos_d).compile()
            r["compile_s"] = time.perf_counter() - start
            out = exe(q, k, v, seg_d, pos_d)
            out.block_until_ready()
            exe(q, k, v, seg_d, pos_d).block_until_ready()  # second warm-up launch
            if want is not None:
                r["max_abs_err"] = float(np.abs(np.asarray(out[:1], np.float32)[real[:1]] - want).max())
            exes[impl] = exe
        except Exception as exc:
            r["error"] = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:300] if str(exc).strip() else ''}"
    def launch(impl, exe):
        def run() -> float | None:
            try:
                start = time.perf_counter()
                exe(q, k, v, seg_d, pos_d).block_until_ready()
                return time.perf_counter() - start
            except Exception as exc:
                case["results"][impl]["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
                return None
        return run

    # interleaved, so drift and other load hit every implementation alike
    times = harness.rounds({impl: launch(impl, exe) for impl, exe in exes.items()}, runs)
    for impl, ts in times.items():
        if None not in ts:
            ms = 1e3 * statistics.median(ts)
            case["results"][impl].update(ms=ms, times_ms=[1e3 * t for t in ts], tflops=flops / (ms * 1e-3) / 1e12)
    return case


def spin(seconds: float) -> None:
    """Busy the device for `seconds` first, so the first case is not timed on an idling clock."""
    if seconds <= 0:
        return
    x = jnp.ones((2048, 2048), jnp.bfloat16)
    f = jax.jit(lambda x: (x @ x).astype(jnp.bfloat16) * 1e-3)
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        x = f(x)
        x.block_until_ready()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--what", choices=("kernels", "layer", "attention"), default="kernels")
    ap.add_argument("--seqlens", help=f"comma-separated (kernels default {GRID_SEQLENS}; layer 256,512,1024,2048,4096)")
    ap.add_argument("--head-dims", help=f"kernels: comma-separated head dims (default {GRID_HEAD_DIMS})")
    ap.add_argument("--heads", type=int, help="kernels: attention heads (default 16)")
    ap.add_argument("--tokens", type=int, help="tokens per dispatch, batch = tokens // seqlen (default: kernels 32768, "
                    "layer 8192)")
    ap.add_argument("--impls", help=f"kernels: a subset of {','.join(KERNELS)}; layer: dense,blockwise")
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--window", type=int, default=None, help="layer/attention only")
    ap.add_argument("--block", type=int, default=attention.KEY_BLOCK, help="blockwise block (attention only)")
    ap.add_argument("--runs", type=int, default=5, help="timed launches per case (kernels: at least 5)")
    ap.add_argument("--spin-s", type=float, default=2.0, help="kernels: seconds of device work before timing")
    ap.add_argument("--dry-run", action="store_true", help=f"kernels: tiny sizes for a CPU (head_dims {DRY_HEAD_DIMS}, "
                    f"seqlens {DRY_SEQLENS}, {DRY_TOKENS} tokens, {DRY_HEADS} heads; Pallas interpreted)")
    ap.add_argument("--dense-max", type=int, default=4096, help="layer: skip dense above this seqlen (its S^2 memory)")
    ap.add_argument("--out", "--json", dest="out", help="write the raw numbers here (JSON)")
    args = ap.parse_args()
    with harness.bench_lock():
        if args.what == "kernels":
            if args.dry_run:
                args.spin_s = min(args.spin_s, 0.2)
            return kernels_main(args)
        args.seqlens = args.seqlens or "256,512,1024,2048,4096"
        args.tokens = args.tokens or 8192
        args.impls = args.impls or "dense,blockwise"
        layer_main(args)


def layer_main(args):
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
            found[impl] = dict(temp_bytes=temp, compile_s=compile_s, run=run)
        # interleaved, so load from other processes hits both alike
        times = harness.rounds({impl: r.pop("run") for impl, r in found.items()}, args.runs)
        for impl, r in found.items():
            r["ms"] = 1e3 * statistics.median(times[impl])
        cells = " ".join(f"{found[i]['temp_bytes'] / 2**20:>14.1f} {found[i]['ms']:>13.1f}" if i in found
                         else f"{'-':>14} {'-':>13}" for i in impls)
        ratio = (f"{found['blockwise']['ms'] / found['dense']['ms']:>15.2f}"
                 if {"dense", "blockwise"} <= set(found) else "")
        print(f"{seqlen:>7} {batch:>5} {cells} {ratio}", flush=True)
        rows.append(dict(seqlen=seqlen, batch=batch, **{i: found[i] for i in found}))
    if args.out:
        harness.write_result(args.out, dict(what=args.what, spec=str(spec), tokens=args.tokens, block=args.block,
                                            rows=rows), quiet=True)


if __name__ == "__main__":
    main()
