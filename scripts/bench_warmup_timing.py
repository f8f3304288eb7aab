"""What the timed runs per bucket cost a cold warmup: MiniLM's derived warmup with the CPU's run count at
1 (the count before jaxserve/runtime/timing.py) and at timing.TIMED_RUNS, alternating, a fresh Encoder each time.
Runs under the bench lock.

    .venv/bin/python scripts/bench_warmup_timing.py --rounds 2
"""

import argparse
import collections
import functools
import time

import harness

from jaxserve import Encoder
from jaxserve.runtime import device, timing


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--model", default=None)
    args = ap.parse_args()
    import jax

    platform = jax.devices()[0].platform
    done = collections.Counter()

    def warmup(runs: int) -> None:
        rnd, done[runs] = done[runs], done[runs] + 1
        timing.TIMED_RUNS[platform] = runs
        enc = Encoder.from_pretrained(args.model)
        start = time.perf_counter()
        table = enc.warmup()
        print(f"round {rnd} runs {runs}: warmup {time.perf_counter() - start:.1f} s, "
              f"timing {enc.engine.spent['timing']:.1f} s, compile {enc.engine.spent['compile']:.1f} s, "
              f"buckets {len(table.buckets)} (streams {device.streams()})", flush=True)

    with harness.bench_lock():
        harness.rounds({runs: functools.partial(warmup, runs) for runs in (1, timing.timed_runs(platform))},
                       args.rounds)


if __name__ == "__main__":
    main()
