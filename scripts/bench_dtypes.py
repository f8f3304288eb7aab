"""Matmul throughput of XLA on this machine per operand dtype: does a lower precision pay here?

    python scripts/bench_dtypes.py [--rounds 5] [--out results/dtypes.json]

float32, bfloat16 (bf16 result, and f32 accumulation via preferred_element_type)
and int8 with int32 accumulation, at the model's FFN shape (rows x 384 x 1536).
The dtypes are timed in interleaved rounds (median of each), so drift on a
shared machine hits them alike. A dtype only helps the long-document figure
where it beats float32 here by a wide margin.
"""

from __future__ import annotations

import argparse

import harness
import jax
import jax.numpy as jnp
import numpy as np

SHAPE = (1024, 384, 1536)  # a (4, 256) batch's rows x hidden x intermediate


def operands(m: int, k: int, n: int) -> dict:
    """name -> (a, b, accumulation dtype or None)."""
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((m, k), np.float32), rng.standard_normal((k, n), np.float32)
    as_int8 = lambda x: np.clip(np.round(x * 30), -127, 127).astype(np.int8)
    return {
        "float32": (a, b, None),
        "bfloat16": (a.astype(jnp.bfloat16), b.astype(jnp.bfloat16), None),
        "bfloat16, f32 accumulation": (a.astype(jnp.bfloat16), b.astype(jnp.bfloat16), jnp.float32),
        "int8, int32 accumulation": (as_int8(a), as_int8(b), jnp.int32),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--reps", type=int, default=10, help="matmuls per timing")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    m, k, n = SHAPE
    runs = {}
    with harness.bench_lock():
        for name, (a, b, acc) in operands(m, k, n).items():
            f = jax.jit(lambda a, b, acc=acc: jnp.dot(a, b, preferred_element_type=acc))
            a, b = jax.device_put(a), jax.device_put(b)
            f(a, b).block_until_ready()
            runs[name] = harness.timed(lambda f=f, a=a, b=b: [f(a, b).block_until_ready() for _ in range(args.reps)])
        seconds = harness.rounds(runs, args.rounds)  # interleaved: drift hits every dtype alike
    rates = {name: [2 * m * k * n * args.reps / t / 1e9 for t in ts] for name, ts in seconds.items()}
    base = np.median(rates["float32"])
    print(f"XLA matmul {m} x {k} x {n}, {args.rounds} interleaved rounds of {args.reps}")
    harness.print_table(["dtype", "median GOP/s", "range", "vs float32"],
                        [[name, f"{np.median(r):.1f}", f"{min(r):.0f}-{max(r):.0f}", f"{np.median(r) / base:.2f}x"]
                         for name, r in rates.items()])
    if args.out:
        harness.write_result(args.out, {"shape": SHAPE, "gops": rates})


if __name__ == "__main__":
    main()
