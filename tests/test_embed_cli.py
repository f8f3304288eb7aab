"""`jaxserve embed`: a corpus bigger than one request, streamed in order, resumable after a kill."""

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

import tiny
from conftest import TINY_TABLE
from jaxserve import Encoder


def rows_done(out) -> int:
    """What the interrupted run recorded as finished, read the way a resume reads it."""
    if out.suffix == ".npy":
        progress = out.with_name(out.name + ".progress")
        return json.loads(progress.read_text())["done"] if progress.exists() else 0
    parts = out.with_name(out.name + ".parts")
    names = [n for n in os.listdir(parts) if n.endswith(".parquet")] if parts.exists() else []
    return sum(int(n.split("-")[2].split(".")[0]) for n in names)


def load(out) -> np.ndarray:
    if out.suffix == ".npy":
        return np.load(out)
    import pyarrow.parquet as pq

    table = pq.read_table(out)
    assert table["row"].to_pylist() == list(range(table.num_rows))  # rows in input order
    return np.stack(table["embedding"].to_numpy(zero_copy_only=False))


@pytest.mark.parametrize("suffix", [".npy", ".parquet"])
def test_embed_streams_in_order_and_resumes_after_kill(tmp_path, suffix):
    path = tiny.write_checkpoint(tmp_path / "ckpt")
    table = tmp_path / "t.json"
    TINY_TABLE.save(table)
    docs = [f"the model {i} " + "jax " * (i % 13) for i in range(3000)]
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("\n".join(json.dumps({"text": d}) for d in docs) + "\n")
    out = tmp_path / f"vectors{suffix}"
    cmd = [sys.executable, "-m", "jaxserve.cli", "embed", "--input", str(corpus), "--output", str(out),
           "--model", str(path), "--buckets", str(table), "--chunk", "100"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and rows_done(out) < 500:
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    done = rows_done(out)
    assert 500 <= done < 3000
    resumed = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert f"resuming at row {done} of 3000" in resumed.stdout
    assert sorted(os.listdir(tmp_path)) == sorted(["ckpt", "t.json", "corpus.jsonl", out.name])  # no leftovers
    got = load(out)
    want = Encoder.from_pretrained(str(path), buckets=TINY_TABLE).embed(docs)
    assert got.shape == (3000, 32)
    np.testing.assert_allclose(got, want, atol=1e-5)


def test_embed_refuses_an_unknown_output_format(tmp_path):
    corpus = tmp_path / "c.txt"
    corpus.write_text("one\ntwo\n")
    path = tiny.write_checkpoint(tmp_path / "ckpt")
    table = tmp_path / "t.json"
    TINY_TABLE.save(table)
    run = subprocess.run([sys.executable, "-m", "jaxserve.cli", "embed", "--input", str(corpus), "--output",
                          str(tmp_path / "v.csv"), "--model", str(path), "--buckets", str(table)],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 2
    assert "--output must end in .npy or .parquet" in run.stderr
