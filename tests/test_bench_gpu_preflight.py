"""scripts/bench_gpu.sh's runs that stop early: without a GPU, and past --budget-s. A file of their own, beside
test_bench_gpu.py's dry run, so that the two run on different workers (each starts the preflight's imports)."""

from __future__ import annotations

import subprocess

from test_bench_gpu import ROOT, _env


def test_preflight_stops_without_a_gpu(tmp_path):
    """Without --dry-run the run needs a GPU: it stops at the preflight (exit 2) and says why."""
    env = _env(tmp_path) | {"JAX_PLATFORMS": "cpu"}
    proc = subprocess.run(["bash", "scripts/bench_gpu.sh", "--out", str(tmp_path / "out"), "--work", str(tmp_path / "w"),
                           "--stages", "preflight,minilm"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "PREFLIGHT FAILED" in proc.stdout and "not a GPU" in proc.stdout
    assert not (tmp_path / "out" / "minilm.json").exists()


def test_no_stage_starts_past_the_budget(tmp_path):
    """--budget-s bounds the whole command (a device command is killed at 600 s): a stage due after it is
    skipped, named in the log, and the run still ends well, without writing the checkpoints of skipped stages."""
    proc = subprocess.run(["bash", "scripts/bench_gpu.sh", "--dry-run", "--budget-s", "0.5", "--out", str(tmp_path / "o"),
                           "--work", str(tmp_path / "w"), "--stages", "preflight,minilm"], cwd=ROOT,
                          env=_env(tmp_path), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "## minilm skipped: the run's --budget-s 0.5 ran out" in proc.stdout
    assert not (tmp_path / "o" / "minilm.json").exists()
    assert not (tmp_path / "w" / "models").exists()  # no checkpoint written for a stage that will not run
