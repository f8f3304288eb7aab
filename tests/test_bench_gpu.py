"""scripts/bench_gpu.sh cannot rot before a GPU appears: its dry run runs every stage here, on the CPU.

The fake `nvidia-smi` below stands in for the one tool no CPU machine has; everything else is real
(servers on loopback, transformers-written checkpoints, sentence-transformers as the peer)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

import bench_gpu  # noqa: E402

FAKE_SMI = """#!/usr/bin/env bash
# nvidia-smi -L, and the query loop bench_gpu.py's sampler runs (200 ms apart)
if [ "$1" = "-L" ]; then echo "GPU 0: Fake GPU (UUID: GPU-0)"; exit 0; fi
i=0
while true; do echo "$((i % 100)), $((1000 + i)), 1980"; i=$((i + 1)); sleep 0.2; done
"""


def _env(tmp_path: Path) -> dict:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    smi = bin_dir / "nvidia-smi"
    smi.write_text(FAKE_SMI)
    smi.chmod(0o755)
    return {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "PYTHON": sys.executable}


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("gpu")
    out = tmp / "out"
    proc = subprocess.run(["bash", "scripts/bench_gpu.sh", "--dry-run", "--out", str(out), "--work", str(tmp / "work"),
                           "--peak-tflops", "1"], cwd=ROOT, env=_env(tmp), capture_output=True, text=True, timeout=900)
    return proc, out


def test_dry_run_runs_every_stage(dry_run):
    proc, out = dry_run
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    stages = ["preflight", "attention", "workers", *bench_gpu.MODELS]
    assert sorted(p.stem for p in out.glob("*.json")) == sorted(stages)
    assert "0 stage(s) failed" in (out / "log.txt").read_text()
    pre = json.loads((out / "preflight.json").read_text())
    assert pre["problems"] == [] and pre["platform"] == "cpu" and pre["nvidia_smi"] and pre["outside_pins"] == []


@pytest.mark.parametrize("model", list(bench_gpu.MODELS))
def test_dry_run_model_stage(dry_run, model):
    """Start cold then warm (0 compiles, the same table), saturation, load levels with GPU samples
    and MFU, and sentence-transformers as the peer on the same documents."""
    _, out = dry_run
    rec = json.loads((out / f"{model}.json").read_text())
    assert "error" not in rec, rec
    assert rec["cold"]["xla_compiles"] > 0 and rec["warm"]["xla_compiles"] == 0
    assert rec["warm"]["startup"]["table"]["source"] == "artifact"
    assert [b[:3] for b in rec["cold"]["table"]] == [b[:3] for b in rec["warm"]["table"]] != []
    assert 1 < rec["tokens_per_doc"] < 128 and rec["flops_per_token"] > 0
    for row in rec["saturation"] + rec["load"]:
        assert row["ok"] > 0 and row["errors"] == 0 and row["docs_per_s"] > 0
        assert row["p50_ms"] <= row["p99_ms"]
        assert row["mfu"] == pytest.approx(row["tokens_per_s"] * rec["flops_per_token"] / 1e12)
        assert row["gpu"]["samples"] > 0 and row["gpu"]["sm_clock_mean_mhz"] == 1980
    assert rec["saturation_docs_per_s"] == max(r["docs_per_s"] for r in rec["saturation"])
    assert len(rec["load"]) >= 1
    peers = rec["peers"]
    assert peers["sentence_transformers"]["dtype"] == "bfloat16"
    assert peers["st_best_batch"] in bench_gpu.DRY.peer_batches
    assert peers["jaxserve_in_process"]["min_cosine_vs_st"] > 0.99  # float32 here against bfloat16 torch


def test_attention_stage(dry_run):
    _, out = dry_run
    rec = json.loads((out / "attention.json").read_text())
    assert "error" not in rec, rec
    assert rec["cases"] and all(set(c["results"]) == {"pallas", "cudnn", "xla"} for c in rec["cases"])
    assert all(c["results"]["xla"]["ms"] > 0 for c in rec["cases"])  # cuDNN needs CUDA: an error string here


def test_workers_stage(dry_run):
    """The --workers sweep: bench_host.py on the real engine at each count, its levels and projection recorded."""
    _, out = dry_run
    rec = json.loads((out / "workers.json").read_text())
    assert "error" not in rec, rec
    assert rec["workers"] == [1, 2]
    host = rec["bench_host"]
    assert host["engine"] == "real" and sorted({r["workers"] for r in host["rows"]}) == [1, 2]
    assert all(r["requests"] > 0 and r["cpu_ms_per_request"] for r in host["rows"])
    assert {p["cores"] for p in host["projection"]} == {8, 16, 32}


def test_worker_counts_follow_the_auto_rule():
    assert bench_gpu.worker_counts(2) == [1]
    assert bench_gpu.worker_counts(16) == [1, 2, 4, 8, 14]
    assert bench_gpu.worker_counts(64) == [1, 2, 4, 8, 16, 32, 62]
    assert bench_gpu.worker_counts(96, most=2) == [1, 2]


def test_missing_names_each_module():
    assert bench_gpu.missing(["json", "no_such_module_jaxserve"]) == [
        "no_such_module_jaxserve (ModuleNotFoundError: No module named 'no_such_module_jaxserve')"]


def test_out_of_time_names_the_limit_that_ran_out():
    import time
    from argparse import Namespace

    now = time.monotonic()
    args = Namespace(deadline=now + 1000, budget_s=1000)
    assert bench_gpu.out_of_time(args, bench_gpu.GPU, now) == ""
    assert "stage's 450 s" in bench_gpu.out_of_time(args, bench_gpu.GPU, now - 451)
    assert "--budget-s 1000" in bench_gpu.out_of_time(Namespace(deadline=now + 60, budget_s=1000), bench_gpu.GPU, now)


def test_workers_stage_cut_keeps_the_levels_it_printed(tmp_path, monkeypatch):
    """A sweep cut by its time limit keeps bench_host's printed levels (its JSON comes only at the end), and
    --workers-counts picks the counts. subprocess.run stands in: the real sweep takes minutes to reach a cut."""
    import time
    from argparse import Namespace

    seen = {}

    def cut(cmd, **kw):
        seen["cmd"] = cmd
        raise subprocess.TimeoutExpired(cmd, kw["timeout"], output=b"== size checkpoint, --workers 1\nlevel 1\n")

    monkeypatch.setattr(bench_gpu.subprocess, "run", cut)
    args = Namespace(work=tmp_path, minilm=str(tmp_path), deadline=time.monotonic() + 600, workers_counts="1,3")
    rec = bench_gpu.stage_workers(args, bench_gpu.GPU, {"cpus": 16})
    assert rec["workers"] == [1, 3] and seen["cmd"][seen["cmd"].index("--workers") + 1] == "1,3"
    assert "stopped after" in rec["cut"] and "level 1" in rec["stdout"]
