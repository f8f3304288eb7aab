"""scripts/harness.py's paired rounds, the benchmarks' way to compare: alternating order, one ratio per pair."""

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[1] / "scripts"))

from harness import paired_rounds  # noqa: E402


def test_paired_rounds_alternate_which_runs_first_and_ratio_each_pair():
    calls = []
    slow = lambda: (calls.append("ref"), time.sleep(0.02))
    fast = lambda: calls.append("cand")
    got = paired_rounds(slow, fast, 4)
    assert calls == ["ref", "cand", "cand", "ref", "ref", "cand", "cand", "ref"]
    assert got["rounds"] == 4 and len(got["ratios"]) == 4
    assert all(r > 1 for r in got["ratios"])  # reference/candidate: the sleeping side is the slower one
    assert got["min"] <= got["median"] <= got["max"]
