"""`jaxserve embed`: a corpus bigger than one request, streamed in order, resumable after a kill."""

import json
import signal
import subprocess
import sys
import time

import numpy as np

import tiny
from conftest import TINY_TABLE
from jaxserve import Encoder


def test_embed_streams_in_order_and_resumes_after_kill(tmp_path):
    path = tiny.write_checkpoint(tmp_path / "ckpt")
    table = tmp_path / "t.json"
    TINY_TABLE.save(table)
    docs = [f"the model {i} " + "jax " * (i % 13) for i in range(3000)]
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("\n".join(json.dumps({"text": d}) for d in docs) + "\n")
    out = tmp_path / "vectors.npy"
    cmd = [sys.executable, "-m", "jaxserve.cli", "embed", "--input", str(corpus), "--output", str(out),
           "--model", str(path), "--buckets", str(table), "--chunk", "100"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    progress = tmp_path / "vectors.npy.progress"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if progress.exists() and json.loads(progress.read_text())["done"] >= 500:
            break
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    done = json.loads(progress.read_text())["done"]
    assert 500 <= done < 3000
    resumed = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert f"resuming at row {done} of 3000" in resumed.stdout
    assert not progress.exists()
    got = np.load(out)
    want = Encoder.from_pretrained(str(path), buckets=TINY_TABLE).embed(docs)
    assert got.shape == (3000, 32)
    np.testing.assert_allclose(got, want, atol=1e-5)
