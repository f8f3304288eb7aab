"""Paired rounds: the way to compare two configurations on a shared, noisy machine."""

from __future__ import annotations

import time

import numpy as np


def paired_rounds(reference, candidate, rounds: int) -> dict:
    """Time `reference()` and `candidate()` back to back `rounds` times, alternating which goes
    first: per-pair ratios reference/candidate, so drift between pairs cancels."""
    ratios = []
    for r in range(rounds):
        seconds = {}
        for name in (("ref", "cand") if r % 2 == 0 else ("cand", "ref")):
            start = time.perf_counter()
            (reference if name == "ref" else candidate)()
            seconds[name] = time.perf_counter() - start
        ratios.append(seconds["ref"] / seconds["cand"])
    return {"rounds": rounds, "median": float(np.median(ratios)), "min": min(ratios), "max": max(ratios),
            "ratios": ratios}
