"""Timing compiled buckets at warmup so that the knee follows the device, not its clock.

A GPU idles at a fraction of its clock (an H100/H200 at 345 MHz against 1980 under
load) and ramps up only after some milliseconds of work; the warmup compiles for
seconds between timings, so the device is cold whenever timing begins. Two
things keep that out of the table:
- a spin-up: the largest compiled bucket runs back to back for `SPIN_UP_S`
  before a round of timings (accelerators only; a CPU's clock is up after the
  burn-in run);
- per bucket one burn-in run and `runs` back-to-back timed runs, their median
  (one slow run, a clock step or a stray host stall, does not move it).

Pure logic: the run and the clock are callables, so tests time with fake clocks.
"""

from __future__ import annotations

import statistics
import time
from typing import Callable

TIMED_RUNS = {"cpu": 5}  # timed runs per bucket, by platform (default `ACCELERATOR_TIMED_RUNS`)
ACCELERATOR_TIMED_RUNS = 7
SPIN_UP_S = {"cpu": 0.0}  # seconds of spin-up before a round of timings, by platform (default below)
ACCELERATOR_SPIN_UP_S = 0.2
SPIN_UP_MAX_RUNS = 1000  # a bound on the spin-up's runs, whatever the clock says

Clock = Callable[[], float]


def timed_runs(platform: str) -> int:
    return TIMED_RUNS.get(platform, ACCELERATOR_TIMED_RUNS)


def spin_up_s(platform: str) -> float:
    return SPIN_UP_S.get(platform, ACCELERATOR_SPIN_UP_S)


def median_run_s(run: Callable[[], object], runs: int, clock: Clock = time.perf_counter) -> float:
    """One burn-in `run()`, then `runs` timed back to back -> the median of their durations (seconds).
    `run` must return only when the device is done (block on its result)."""
    run()
    times = []
    for _ in range(max(1, runs)):
        start = clock()
        run()
        times.append(clock() - start)
    return statistics.median(times)


def spin_up(run: Callable[[], object], seconds: float, clock: Clock = time.perf_counter,
            max_runs: int = SPIN_UP_MAX_RUNS) -> int:
    """`run()` back to back until `seconds` have passed (at most `max_runs` times) -> the runs made."""
    if seconds <= 0:
        return 0
    start, n = clock(), 0
    while n < max_runs and clock() - start < seconds:
        run()
        n += 1
    return n
