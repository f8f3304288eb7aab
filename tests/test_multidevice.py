"""Data parallel over two (forced) CPU devices: same results as one device, one compile per bucket, none after."""

import json
import os
import subprocess
import sys
import textwrap

import tiny

SCRIPT = textwrap.dedent("""
    import sys
    sys.path.insert(0, "tests")
    import jax, numpy as np, tiny
    from pathlib import Path
    from jaxserve import Encoder
    from jaxserve.runtime import compiles
    assert len(jax.devices()) == 2, jax.devices()
    path = tiny.write_checkpoint(Path(sys.argv[1]))
    docs = ["the model " * (i % 11) + f"doc {i}" for i in range(61)]
    one = Encoder.from_pretrained(str(path), devices=1)
    two = Encoder.from_pretrained(str(path), devices="all")
    kw = dict(ladder="pow2", layout="packed", max_batch=8, max_batch_tokens=512)
    t1 = one.warmup(one.derive_table(**kw))
    before = compiles.xla_compiles_total()
    t2 = two.warmup(two.derive_table(**kw))
    assert all(b.batch % 2 == 0 for b in t2.buckets), [b.shape for b in t2.buckets]
    assert max(b.batch for b in t2.buckets) == 2 * max(b.batch for b in t1.buckets)
    assert compiles.xla_compiles_total() - before == len(t2.buckets), (compiles.xla_compiles_total() - before, [b.shape for b in t2.buckets], [b.shape for b in t1.buckets])  # one compile per bucket for the mesh
    before = compiles.xla_compiles_total()
    a, b = one.embed(docs), two.embed(docs)
    for n in (1, 2, 3, 17):
        np.testing.assert_allclose(two.embed(docs[:n]), a[:n], atol=1e-5)
    assert compiles.xla_compiles_total() == before
    np.testing.assert_allclose(a, b, atol=1e-5)
    print("ok", len(t2.buckets), "buckets")
""")


def test_two_device_mesh_equals_one_device(tmp_path):
    env = {"XLA_FLAGS": "--xla_force_host_platform_device_count=2", "PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1"}
    out = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path / "ckpt")], capture_output=True, text=True,
                         timeout=600, env=env)
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.startswith("ok")


def test_warmup_makes_the_artifact_of_a_multi_device_serve(tmp_path):
    """`jaxserve warmup --devices 2` warms the mesh's table (batches a multiple of 2) and saves its artifact; the
    next start with `--devices 2` loads it and compiles nothing (the device count is part of the artifact's key,
    so a warmup without the flag made an artifact no multi-device serve could use)."""
    model = str(tiny.write_checkpoint(tmp_path / "ckpt"))
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=2", "HF_HUB_OFFLINE": "1"}
    args = [sys.executable, "-m", "jaxserve.cli", "warmup", "--model", model, "--seqlens", "16,64", "--max-batch", "8",
            "--no-embed-all", "--cache-dir", str(tmp_path / "cache"), "--devices", "2"]
    runs = [subprocess.run([*args, "--write", str(tmp_path / f"{i}.json")], capture_output=True, text=True,
                           timeout=300, env=env) for i in range(2)]
    assert all(r.returncode == 0 for r in runs), [r.stderr[-2000:] for r in runs]
    assert "table: derived" in runs[0].stdout and "saved" in runs[0].stdout
    assert "table: artifact" in runs[1].stdout and "0 executables built" in runs[1].stdout
    table = json.loads((tmp_path / "1.json").read_text())
    assert table == json.loads((tmp_path / "0.json").read_text())
    assert all(b["batch"] % 2 == 0 for b in table["buckets"]), table["buckets"]
