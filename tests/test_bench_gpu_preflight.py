"""scripts/bench_gpu.sh's runs that stop early (without a GPU, past --budget-s), what its preflight checks, and its
packing of what the GPU machine lacks. A file of their own, beside test_bench_gpu.py's dry run, so that the two run
on different workers (each starts the preflight's imports)."""

from __future__ import annotations

import subprocess

from test_bench_gpu import ROOT, _env, bench_gpu


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


def test_pack_runs_on_the_project_environment(tmp_path):
    """`bash scripts/bench_gpu.sh --pack .carry`, as docs/benchmarks.md says to run it here: packing reads the
    bundled MiniLM with safetensors and jaxserve, so it runs on make's .venv, not on whatever python3 the PATH
    finds first (here a stand-in that fails if called). PACK_WHEELS= leaves out the wheels' download (the
    registry)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "python3").write_text("#!/usr/bin/env bash\necho called >> \"$(dirname \"$0\")/called\"\nexit 1\n")
    (bin_dir / "python3").chmod(0o755)
    env = {k: v for k, v in _env(tmp_path).items() if k != "PYTHON"}
    env |= {"PATH": f"{bin_dir}:{env['PATH']}", "PACK_WHEELS": ""}
    proc = subprocess.run(["bash", "scripts/bench_gpu.sh", "--pack", str(tmp_path / "carry")], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert not (bin_dir / "called").exists()
    packed = tmp_path / "carry" / "minilm"
    assert (packed / "model.f16.safetensors").stat().st_size > 40 * 2**20 and (packed / "config.json").exists()
    assert not list((tmp_path / "carry" / "wheels").iterdir())


def test_the_preflight_checks_every_run_time_dependency():
    """The preflight's imports (`bench_gpu.REQUIRED`) cover pyproject.toml's dependencies: one added to the
    package and missing from the GPU image (pybase64 was) stops the run in seconds at the preflight, naming
    it, not at a server's start minutes into the device's time."""
    from test_bench_gpu import bench_gpu

    modules = {req.name.lower().replace("-", "_") for req in bench_gpu.run_time_requirements()}
    assert modules and modules <= set(bench_gpu.REQUIRED), modules - set(bench_gpu.REQUIRED)


def test_the_preflight_names_versions_outside_pyprojects_pins(tmp_path):
    """The GPU image's own packages run the code there: one outside pyproject.toml's specifiers is named (and the
    run goes on), one that is not installed is left to the import check, a marker that excludes this machine is
    skipped. This environment, installed from pyproject.toml, is inside its own pins."""
    from test_bench_gpu import bench_gpu

    assert bench_gpu.outside_pins() == []
    fake = tmp_path / "pyproject.toml"
    fake.write_text('[project]\ndependencies = ["numpy<1", "aiohttp>=3.0", "no-such-package>=1",\n'
                    '                "orjson<1; sys_platform == \'no-such-platform\'"]\n')
    assert [p.split()[0] for p in bench_gpu.outside_pins(fake)] == ["numpy"]


def test_a_child_sharing_the_gpu_sets_the_pool_fraction_by_the_name_jaxlib_reads():
    """XLA_CLIENT_MEM_FRACTION (jaxlib 0.11 and later, the GPU image's included); never with the older
    XLA_PYTHON_CLIENT_MEM_FRACTION beside it, which jaxlib refuses at the GPU backend's start (the image may
    set either)."""
    for given in ({}, {"XLA_PYTHON_CLIENT_MEM_FRACTION": "0.9"}, {"XLA_CLIENT_MEM_FRACTION": "0.9", "PATH": "/bin"}):
        env = bench_gpu.gpu_share(given, 0.4)
        assert env["XLA_CLIENT_MEM_FRACTION"] == "0.4" and "XLA_PYTHON_CLIENT_MEM_FRACTION" not in env
        assert all(env[k] == v for k, v in given.items() if "MEM_FRACTION" not in k)
