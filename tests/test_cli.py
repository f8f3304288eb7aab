"""`jaxserve buckets` and `jaxserve warmup` as a user runs them (subprocesses, tiny model)."""

import json
import re
import subprocess
import sys

from jaxserve.buckets import BucketTable


def jaxserve(*args, env=None):
    proc = subprocess.run(
        [sys.executable, "-m", "jaxserve.cli", *args], capture_output=True, text=True, timeout=300, env=env,
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def test_buckets_prints_memory_math_and_writes_table(tiny_checkpoint, tmp_path):
    model = str(tiny_checkpoint())
    out = jaxserve("buckets", "--model", model, "--ladder", "pow2", "--device-memory", str(32 * 2**20),
                   "--max-batch-tokens", "10000000", "--max-batch", "100000", "--write", str(tmp_path / "t.json"))
    assert "budget 0.03 GiB" in out and "memory" in out
    table = BucketTable.load(tmp_path / "t.json")
    assert table.seqlens == [16, 32, 64] and table.ladder == "pow2" and table.layout == "packed"
    for s in table.seqlens:
        *smaller, largest = table.at(s)
        assert largest.limited_by == "memory" and 0 < largest.compiled_bytes <= table.budget_bytes
        assert largest.slots == s // 8 and smaller and all(b.limited_by == "ladder" for b in smaller)


def test_warmup_fills_persistent_cache_and_second_start_hits_it(tiny_checkpoint, tmp_path):
    model = str(tiny_checkpoint())
    cache = tmp_path / "cache"
    args = ["warmup", "--model", model, "--seqlens", "16,64", "--max-batch", "4", "--cache-dir", str(cache)]
    first = jaxserve(*args, "--write", str(tmp_path / "warm.json"))
    built, hits = map(int, re.search(r"(\d+) executables built, (\d+) from the persistent cache", first).groups())
    assert built >= 4 and hits == 0
    assert len(list(cache.iterdir())) >= 4
    table = json.loads((tmp_path / "warm.json").read_text())
    assert [(b["batch"], b["seqlen"]) for b in table["buckets"]] == [(1, 16), (4, 16), (1, 64), (4, 64)]
    assert all(b["run_s"] > 0 and b["compile_s"] > 0 for b in table["buckets"])
    second = jaxserve(*args[:-2], "--cache-dir", str(cache), "--buckets", str(tmp_path / "warm.json"))
    built2, hits2 = map(int, re.search(r"(\d+) executables built, (\d+) from the persistent cache", second).groups())
    assert hits2 >= 4 and hits2 == built2  # every executable of the second start came from the cache
