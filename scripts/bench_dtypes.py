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
import json
import time
from pathlib import Path

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
    for name, (a, b, acc) in operands(m, k, n).items():
        f = jax.jit(lambda a, b, acc=acc: jnp.dot(a, b, preferred_element_type=acc))
        a, b = jax.device_put(a), jax.device_put(b)
        f(a, b).block_until_ready()
        runs[name] = (f, a, b)
    rates = {name: [] for name in runs}
    for _ in range(args.rounds):
        for name, (f, a, b) in runs.items():
            start = time.perf_counter()
            for _ in range(args.reps):
                f(a, b).block_until_ready()
            rates[name].append(2 * m * k * n * args.reps / (time.perf_counter() - start) / 1e9)
    base = np.median(rates["float32"])
    print(f"XLA matmul {m} x {k} x {n}, {args.rounds} interleaved rounds of {args.reps}")
    print(f"{'dtype':30} {'median GOP/s':>12} {'range':>12} {'vs float32':>10}")
    for name, r in rates.items():
        print(f"{name:30} {np.median(r):>12.1f} {min(r):>5.0f}-{max(r):<6.0f} {np.median(r) / base:>10.2f}x")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"shape": SHAPE, "gops": rates}, indent=1) + "\n")


if __name__ == "__main__":
    main()
