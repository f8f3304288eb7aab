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
from conftest import TINY_TABLE, warm_encoder


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
def test_embed_streams_in_order_and_resumes_after_kill_with_ids(tmp_path, suffix):
    path = tiny.write_checkpoint(tmp_path / "ckpt")
    table = tmp_path / "t.json"
    TINY_TABLE.save(table)
    docs = [f"the model {i} " + "jax " * (i % 13) for i in range(1500)]
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("\n".join(json.dumps({"body": d, "key": f"k{i}"}) for i, d in enumerate(docs)) + "\n")
    out = tmp_path / f"vectors{suffix}"
    cmd = [sys.executable, "-m", "jaxserve.cli", "embed", "--input", str(corpus), "--output", str(out),
           "--model", str(path), "--buckets", str(table), "--chunk", "100", "--field", "body", "--id-field", "key"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and rows_done(out) < 300:
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    done = rows_done(out)
    assert 300 <= done < 1500
    resumed = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=False)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert f"resuming at row {done} of 1500" in resumed.stdout
    extra = ["vectors.summary.json"] + (["vectors.ids.jsonl"] if suffix == ".npy" else [])
    assert sorted(os.listdir(tmp_path)) == sorted(["ckpt", "t.json", "corpus.jsonl", out.name] + extra)  # no leftovers
    if suffix == ".npy":
        got_ids = [json.loads(line) for line in (tmp_path / "vectors.ids.jsonl").read_text().splitlines()]
    else:
        import pyarrow.parquet as pq

        got_ids = pq.read_table(out)["id"].to_pylist()
    assert got_ids == [f"k{i}" for i in range(1500)]  # each id once, in row order, across the kill
    assert json.loads((tmp_path / "vectors.summary.json").read_text())["documents"] == 1500 - done
    got = load(out)
    want = warm_encoder(path, TINY_TABLE).embed(docs)
    assert got.shape == (1500, 32)
    np.testing.assert_allclose(got, want, atol=1e-5)


def test_embed_refuses_an_unknown_output_format(tmp_path):
    corpus = tmp_path / "c.txt"
    corpus.write_text("one\ntwo\n")
    path = tiny.write_checkpoint(tmp_path / "ckpt")
    table = tmp_path / "t.json"
    TINY_TABLE.save(table)
    run = subprocess.run([sys.executable, "-m", "jaxserve.cli", "embed", "--input", str(corpus), "--output",
                          str(tmp_path / "v.csv"), "--model", str(path), "--buckets", str(table)],
                         capture_output=True, text=True, timeout=300, check=False)
    assert run.returncode == 2
    assert "--output must end in .npy or .parquet" in run.stderr


def in_process(argv, capsys):
    """Run the CLI in this process: its exit status, stderr, and how many XLA compiles it did."""
    from jaxserve import cli
    from jaxserve.runtime.compiles import install, xla_compiles_total

    install()
    before = xla_compiles_total()
    code = cli.main(argv)
    return code, capsys.readouterr().err, xla_compiles_total() - before


BAD_INPUTS = {
    "missing": (None, "does not exist"),
    "empty": ("\n\n", "has no documents"),
    "not_json": ('{"text": "a"}\n{"text": \n', "c.jsonl:2: not JSON"),
    "no_field": ('{"text": "a"}\n{"content": "b", "n": 1}\n', "c.jsonl:2: no field 'text' or 'input' (it has 'content', 'n')"),
    "not_utf8": (b"caf\xe9\n", "c.jsonl:1: not UTF-8"),
}


@pytest.mark.parametrize("case", sorted(BAD_INPUTS))
def test_embed_bad_input_fails_before_any_compile(tmp_path, capsys, case):
    text, message = BAD_INPUTS[case]
    corpus = tmp_path / "c.jsonl"
    if isinstance(text, bytes):
        corpus.write_bytes(text)
    elif text is not None:
        corpus.write_text(text)
    code, err, compiles = in_process(["embed", "--input", str(corpus), "--output", str(tmp_path / "v.npy"),
                                      "--model", str(tmp_path / "no-model")], capsys)
    assert code == 2
    assert message in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert compiles == 0
    assert not (tmp_path / "v.npy").exists()


def test_explain_bad_input_fails_before_any_compile(tmp_path, capsys):
    corpus = tmp_path / "c.jsonl"
    corpus.write_text('{"content": "doc 0"}\n')
    code, err, compiles = in_process(["explain", str(corpus), "--model", str(tmp_path / "no-model")], capsys)
    assert (code, compiles) == (2, 0)
    assert "no field 'text' or 'input' (it has 'content'); name the text field with --field" in err


def test_embed_unwritable_output_and_mismatched_resume_fail_before_warmup(tmp_path, capsys):
    path = tiny.write_checkpoint(tmp_path / "ckpt")
    corpus = tmp_path / "c.txt"
    corpus.write_text("one\ntwo\n")
    base = ["embed", "--input", str(corpus), "--model", str(path)]
    code, err, compiles = in_process(base + ["--output", str(tmp_path / "nodir" / "v.npy")], capsys)
    assert (code, compiles) == (2, 0) and "is not a writable directory" in err
    out = tmp_path / "v.parquet"
    (tmp_path / "v.parquet.parts").mkdir()
    (tmp_path / "v.parquet.parts" / "manifest.json").write_text(json.dumps(
        {"input": str(corpus), "rows": 7, "dim": 32, "field": None, "id_field": None}))
    code, err, compiles = in_process(base + ["--output", str(out)], capsys)
    assert (code, compiles) == (2, 0)
    assert "partial run with other arguments: rows 7 (now 2)" in err


def test_embed_parquet_round_trip_with_ids_and_summary(tmp_path, capsys):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tiny.write_checkpoint(tmp_path / "ckpt")
    table = tmp_path / "t.json"
    TINY_TABLE.save(table)
    docs = [f"doc {i} " + "jax " * (i % 7) for i in range(50)]
    ids = [f"id-{i:03d}" for i in range(50)]
    corpus = tmp_path / "c.parquet"
    pq.write_table(pa.table({"body": docs, "key": ids, "other": list(range(50))}), corpus, row_group_size=8)
    out = tmp_path / "v.parquet"
    code, err, _ = in_process(["embed", "--input", str(corpus), "--field", "body", "--id-field", "key", "--output",
                               str(out), "--model", str(path), "--buckets", str(table), "--chunk", "16"], capsys)
    assert code == 0, err
    got = pq.read_table(out)
    assert got["id"].to_pylist() == ids
    want = warm_encoder(path, TINY_TABLE).embed(docs)
    np.testing.assert_allclose(load(out), want, atol=1e-5)
    summary = json.loads((tmp_path / "v.summary.json").read_text())
    assert summary["documents"] == 50 and summary["tokens"] > 50 and 0 <= summary["padding"] < 1
    assert set(summary) == {"documents", "tokens", "seconds", "docs_per_s", "tokens_per_s", "padding"}


def test_embed_parquet_input_needs_a_field_column(tmp_path, capsys):
    import pyarrow as pa
    import pyarrow.parquet as pq

    corpus = tmp_path / "c.parquet"
    pq.write_table(pa.table({"body": ["a"]}), corpus)
    code, err, compiles = in_process(["embed", "--input", str(corpus), "--field", "text", "--output",
                                      str(tmp_path / "v.npy"), "--model", str(tmp_path / "m")], capsys)
    assert (code, compiles) == (2, 0) and "no column 'text' (it has body)" in err


def test_embed_corpus_tokenizes_the_next_chunk_while_this_one_runs_in_order(tmp_path):
    """The device stage of chunk i waits until chunk i+1's prepare has begun on the other thread (it would time
    out and fail were the stages one after another); rows land in input order; a resume starts where it says."""
    import threading

    from jaxserve.offline.job import Stages, embed_corpus
    from jaxserve.offline.sinks import open_sink

    texts = [f"doc {i}" for i in range(10)]
    started: dict[int, threading.Event] = {i: threading.Event() for i in range(0, 10, 3)}
    threads = set()

    def prepare(chunk):
        first = int(chunk[0].split()[1])
        threads.add(threading.current_thread().name)
        started[first].set()
        return first, len(chunk)

    def run(prepared):
        first, n = prepared
        if first + 3 < 10:
            assert started[first + 3].wait(30), "the next chunk was not prepared while this one ran"
        return np.arange(first, first + n, dtype=np.float32)[:, None].repeat(2, 1), n, n

    out = tmp_path / "out.npy"
    sink = open_sink(str(out), {"input": "x", "rows": 10, "dim": 2}, ids=True)
    summary = embed_corpus(enumerate(texts), Stages(prepare, run), sink, sink.resume(), 3)
    assert summary.documents == 10 and threading.current_thread().name not in threads
    np.testing.assert_array_equal(np.load(out)[:, 0], np.arange(10))
    assert [json.loads(x) for x in (tmp_path / "out.ids.jsonl").read_text().split()] == list(range(10))

    out2 = tmp_path / "resumed.npy"
    sink = open_sink(str(out2), {"input": "x", "rows": 10, "dim": 2}, ids=False)
    sink.resume()
    sink.write(0, np.zeros((4, 2), np.float32))  # a killed run's first finished chunk
    sink = open_sink(str(out2), {"input": "x", "rows": 10, "dim": 2}, ids=False)
    for e in started.values():
        e.clear()
    started.update({i: threading.Event() for i in range(4, 10, 3)})
    summary = embed_corpus(enumerate(texts), Stages(prepare, run), sink, sink.resume(), 3)
    assert summary.documents == 6
    np.testing.assert_array_equal(np.load(out2)[:, 0], [0, 0, 0, 0, 4, 5, 6, 7, 8, 9])
