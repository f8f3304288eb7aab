"""`jaxserve embed`: a corpus bigger than one request, streamed in order, resumable after a kill."""

import json
import os
import re
import signal
import subprocess
import sys

import numpy as np
import pytest
import tiny
from conftest import TINY_TABLE, warm_encoder

KILL_AT = """
import os, signal, sys
from jaxserve import cli
from jaxserve.offline import sinks

at = int(os.environ["KILL_AT_ROW"])
atomic, parquet_write = sinks.write_json_atomic, sinks.ParquetSink.write


def write_json_atomic(path, obj):  # rows up to `at` are on disk; killed before their progress is recorded
    if obj.get("done") == at:
        os.kill(os.getpid(), signal.SIGKILL)
    atomic(path, obj)


def write(self, start, rows, ids=None):  # a part file is renamed into place whole: killed just after it
    parquet_write(self, start, rows, ids)
    if start + len(rows) == at:
        os.kill(os.getpid(), signal.SIGKILL)


sinks.write_json_atomic, sinks.ParquetSink.write = write_json_atomic, write
sys.exit(cli.main(sys.argv[1:]))
"""


def embed_cmd(args) -> list[str]:
    return [sys.executable, "-m", "jaxserve.cli", "embed", *map(str, args)]


def run(args) -> subprocess.CompletedProcess:
    """`jaxserve embed ARGS` in its own process."""
    return subprocess.run(embed_cmd(args), capture_output=True, text=True, timeout=300, check=False)


def run_killed(args, at: int) -> subprocess.CompletedProcess:
    """`jaxserve embed ARGS` in its own process, SIGKILLed as rows up to `at` are written: a .npy's or .jsonl's
    lines for them on disk, their progress not yet recorded; a .parquet's part file just renamed into place."""
    return subprocess.run([sys.executable, "-c", KILL_AT, "embed", *map(str, args)], capture_output=True, text=True,
                          timeout=300, check=False, env={**os.environ, "KILL_AT_ROW": str(at)})


def load(out) -> np.ndarray:
    if out.suffix == ".npy":
        return np.load(out)
    import pyarrow.parquet as pq

    table = pq.read_table(out)
    assert table["row"].to_pylist() == list(range(table.num_rows))  # rows in input order
    return np.stack(table["embedding"].to_numpy(zero_copy_only=False))


@pytest.mark.parametrize("suffix,resumes_at", [(".npy", 200), (".parquet", 300)])
def test_embed_streams_in_order_and_resumes_after_kill_with_ids(tmp_path, suffix, resumes_at):
    """Killed at row 300: a .npy's chunk 200..300 was on disk but not recorded, so it is redone (its ids cut
    back); a .parquet's part was whole. A rerun of the finished job leaves it as it is."""
    path = tiny.write_checkpoint(tmp_path / "ckpt")
    table = tmp_path / "t.json"
    TINY_TABLE.save(table)
    docs = [f"the model {i} " + "jax " * (i % 13) for i in range(600)]
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("\n".join(json.dumps({"body": d, "key": f"k{i}"}) for i, d in enumerate(docs)) + "\n")
    out = tmp_path / f"vectors{suffix}"
    args = ["--input", corpus, "--output", out, "--model", path, "--buckets", table, "--chunk", "100", "--field",
            "body", "--id-field", "key"]
    killed = run_killed(args, 300)
    assert killed.returncode == -signal.SIGKILL, killed.stdout + killed.stderr
    resumed = run(args)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert f"resuming at row {resumes_at} of 600" in resumed.stdout
    extra = [f"{out.name}.summary.json"] + (["vectors.ids.jsonl"] if suffix == ".npy" else [])
    assert sorted(os.listdir(tmp_path)) == sorted(["ckpt", "t.json", "corpus.jsonl", out.name] + extra)  # no leftovers
    if suffix == ".npy":
        got_ids = [json.loads(line) for line in (tmp_path / "vectors.ids.jsonl").read_text().splitlines()]
    else:
        import pyarrow.parquet as pq

        got_ids = pq.read_table(out)["id"].to_pylist()
    assert got_ids == [f"k{i}" for i in range(600)]  # each id once, in row order, across the kill
    summary = json.loads((tmp_path / f"{out.name}.summary.json").read_text())
    assert summary["documents"] == 600 - resumes_at and summary["output"] == out.name
    got = load(out)
    want = warm_encoder(path, TINY_TABLE).embed(docs)
    assert got.shape == (600, 32)
    np.testing.assert_allclose(got, want, atol=1e-5)
    written = out.read_bytes()
    again = run(args)
    assert again.returncode == 0, again.stderr
    assert f"{out} is already complete: 600 rows" in again.stdout
    assert out.read_bytes() == written and json.loads((tmp_path / f"{out.name}.summary.json").read_text()) == summary


def test_resume_refuses_another_model_dtype_long_or_prompt_and_never_mixes(tmp_path, capsys):
    """Two seeded checkpoints of one shape (the same `model_digest`: it leaves weight values out): a partial run of
    A rerun with B exits 2 naming the model, old and new, and leaves the file alone, as does a finished one; a
    rerun with another dtype, --long or prompt names each; resumed with A, the file is all A's."""
    a, b = tiny.write_checkpoint(tmp_path / "a", seed=0), tiny.write_checkpoint(tmp_path / "b", seed=1)
    table = tmp_path / "t.json"
    TINY_TABLE.save(table)
    docs = [f"document {i} of the batch " + "jax " * (i % 9) for i in range(400)]
    corpus = tmp_path / "c.txt"
    corpus.write_text("\n".join(docs) + "\n")
    out, progress = tmp_path / "v.npy", tmp_path / "v.npy.progress"
    args = ["--input", corpus, "--output", out, "--buckets", table, "--chunk", "100"]
    assert run_killed(args + ["--model", a], 300).returncode == -signal.SIGKILL
    partial = (out.read_bytes(), progress.read_bytes())

    other = run(args + ["--model", b])
    assert other.returncode == 2, other.stdout + other.stderr
    assert re.search(r"v\.npy holds a partial run with other arguments: model '[0-9a-f]{16}' \(now '[0-9a-f]{16}'\); "
                     r"rerun with those", other.stderr), other.stderr
    assert (out.read_bytes(), progress.read_bytes()) == partial
    code, err, compiles = in_process(["embed", *map(str, args), "--model", str(a), "--dtype", "bfloat16", "--long",
                                      "error", "--prompt", "query: "], capsys)
    assert (code, compiles) == (2, 0)
    assert "arguments: dtype 'float32' (now 'bfloat16'), long 'truncate' (now 'error'), prompt None (now 'query: ');" \
        in err
    assert (out.read_bytes(), progress.read_bytes()) == partial

    resumed = run(args + ["--model", a])
    assert resumed.returncode == 0 and "resuming at row 200 of 400" in resumed.stdout, resumed.stderr
    want_a, want_b = (warm_encoder(m, TINY_TABLE).embed(docs) for m in (a, b))
    assert np.abs(want_a - want_b).max() > 0.1  # a file mixing the two would show
    np.testing.assert_allclose(np.load(out), want_a, atol=1e-5)
    code, err, compiles = in_process(["embed", *map(str, args), "--model", str(b)], capsys)
    assert (code, compiles) == (2, 0) and "v.npy holds a finished run with other arguments: model" in err
    corpus.write_text("\n".join(d.upper() for d in docs) + "\n")  # rewritten in place, as many rows
    os.utime(corpus, ns=(0, 0))
    code, err, compiles = in_process(["embed", *map(str, args), "--model", str(a)], capsys)
    assert (code, compiles) == (2, 0) and "finished run with other arguments: input_file '" in err
    np.testing.assert_allclose(np.load(out), want_a, atol=1e-5)


@pytest.fixture(scope="module")
def splade_path(tmp_path_factory):
    from test_sparse import splade_checkpoint

    return splade_checkpoint(tmp_path_factory.mktemp("splade"))


def test_sparse_jsonl_output_has_ids_resumes_after_kill_and_survives_reruns(splade_path, tmp_path, capsys):
    """SPLADE's .jsonl is one of the offline sinks: {id, weights} lines with --id-field, killed with a chunk's
    lines on disk but unrecorded and resumed without duplicates, a rerun with the same arguments a no-op and one
    with others refused, the file untouched."""
    from test_sparse import PACKED

    table = tmp_path / "t.json"
    PACKED.save(table)
    docs = [f"the query {i} " + "of the model " * (i % 5) for i in range(40)]
    corpus = tmp_path / "c.jsonl"
    corpus.write_text("\n".join(json.dumps({"body": d, "key": i * 10}) for i, d in enumerate(docs)) + "\n")
    out = tmp_path / "w.jsonl"
    args = ["--input", corpus, "--output", out, "--model", splade_path, "--buckets", table, "--chunk", "8",
            "--field", "body"]
    assert run_killed(args + ["--id-field", "key"], 24).returncode == -signal.SIGKILL
    assert len(out.read_text().splitlines()) == 24  # the killed chunk's lines are there, unrecorded
    resumed = run(args + ["--id-field", "key"])
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert "resuming at row 16 of 40" in resumed.stdout and f"wrote {out}: 40 sparse rows" in resumed.stdout
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert [line["id"] for line in lines] == [i * 10 for i in range(40)]  # each once, in order, across the kill
    want = warm_encoder(splade_path, PACKED).embed_sparse(docs)
    for line, w in zip(lines, want, strict=True):
        assert [e["index"] for e in line["weights"]] == [e["index"] for e in w]
        np.testing.assert_allclose([e["value"] for e in line["weights"]], [e["value"] for e in w], rtol=1e-4,
                                   atol=1e-6)
    assert sorted(os.listdir(tmp_path)) == ["c.jsonl", "t.json", "w.jsonl", "w.jsonl.summary.json"]  # no leftovers
    written = out.read_bytes()

    again = run(args + ["--id-field", "key"])
    assert again.returncode == 0 and f"{out} is already complete: 40 rows" in again.stdout, again.stderr
    code, err, compiles = in_process(["embed", *map(str, args)], capsys)
    assert (code, compiles) == (2, 0) and "w.jsonl holds a finished run with other arguments: id_field 'key' (now None)" in err
    code, err, compiles = in_process(["embed", *map(str, args), "--long", "chunk"], capsys)
    assert (code, compiles) == (2, 0) and "--long chunk does not apply" in err
    assert out.read_bytes() == written


def test_an_output_no_recorded_run_wrote_is_refused_not_overwritten(tmp_path):
    """Whatever the sink: a file already at --output without a summary naming it is someone's data."""
    from jaxserve.errors import JaxserveError
    from jaxserve.offline.sinks import open_sink

    for name in ("v.npy", "v.parquet", "v.jsonl"):
        out = tmp_path / name
        out.write_bytes(b"someone's data\n")
        with pytest.raises(JaxserveError, match=f"and no .*{name}.summary.json records the run that wrote it"):
            open_sink(str(out), {"input": "x", "rows": 2, "dim": 2}).resume()
        assert out.read_bytes() == b"someone's data\n"


def test_outputs_of_one_stem_keep_their_own_summaries(tmp_path):
    """v.npy, v.parquet and v.jsonl finished one after another: a rerun of each finds it finished (they shared
    v.summary.json, so only the last one written was; the others were "written by no recorded run"). An output
    finished when the summary was named by the stem is still recognised by that file, while it names the output."""
    from jaxserve.errors import JaxserveError
    from jaxserve.offline.job import embed_corpus
    from jaxserve.offline.sinks import open_sink

    state = {"input": "x", "rows": 3, "dim": 2}
    for name in ("v.npy", "v.parquet", "v.jsonl"):
        rows = (lambda n: [[]] * n) if name.endswith(".jsonl") else (lambda n: np.ones((n, 2), np.float32))
        sink = open_sink(str(tmp_path / name), state)
        embed_corpus(((None, f"doc {i}") for i in range(3)), lambda texts, rows=rows: (rows(len(texts)), 1, 1), sink,
                     sink.resume(), 2)
    for name in ("v.npy", "v.parquet", "v.jsonl"):
        sink = open_sink(str(tmp_path / name), state)
        assert sink.check() and sink.summary_path == str(tmp_path / f"{name}.summary.json")

    (tmp_path / "v.npy.summary.json").rename(tmp_path / "v.summary.json")  # as the stem-named version wrote it
    sink = open_sink(str(tmp_path / "v.npy"), state)
    assert sink.check() and sink.summary_path == str(tmp_path / "v.summary.json")
    (tmp_path / "v.jsonl.summary.json").unlink()  # v.summary.json names v.npy, not v.jsonl
    with pytest.raises(JaxserveError, match="v.jsonl exists, and no .*v.jsonl.summary.json records the run"):
        open_sink(str(tmp_path / "v.jsonl"), state).check()


def test_embed_refuses_an_unknown_output_format(tmp_path):
    corpus = tmp_path / "c.txt"
    corpus.write_text("one\ntwo\n")
    path = tiny.write_checkpoint(tmp_path / "ckpt")
    table = tmp_path / "t.json"
    TINY_TABLE.save(table)
    refused = run(["--input", corpus, "--output", tmp_path / "v.csv", "--model", path, "--buckets", table])
    assert refused.returncode == 2
    assert "--output must end in .npy or .parquet (a sparse model: .jsonl)" in refused.stderr


def in_process(argv, capsys):
    """Run the CLI in this process: its exit status, stderr, and how many XLA compiles it did."""
    from jaxserve import cli
    from jaxserve.runtime.compiles import install, xla_compiles_total

    install()
    before = xla_compiles_total()
    code = cli.main(argv)
    return code, capsys.readouterr().err, xla_compiles_total() - before


BAD_INPUTS = {  # case: (the file, the message, more arguments)
    "missing": (None, "does not exist", []),
    "empty": ("\n\n", "has no documents", []),
    "not_json": ('{"text": "a"}\n{"text": \n', "c.jsonl:2: not JSON", []),
    "no_field": ('{"text": "a"}\n{"content": "b", "n": 1}\n', "c.jsonl:2: no field 'text' or 'input' (it has 'content', 'n')",
                 []),
    "not_utf8": (b"caf\xe9\n", "c.jsonl:1: not UTF-8", []),
    "lone_surrogate": ('{"text": "a"}\n{"text": "bad \\ud800 x"}\n', "c.jsonl:2: field 'text' holds a lone surrogate",
                       []),
    "lone_surrogate_id": ('{"text": "a", "id": "a\\udc00"}\n', "c.jsonl:1: its id holds a lone surrogate (U+DC00",
                          ["--id-field", "id"]),
    "id_past_int64": ('{"text": "a", "id": 18446744073709551616}\n',
                      "c.jsonl:1: its id 18446744073709551616 is outside int64", ["--id-field", "id"]),
    "id_nan": ('{"text": "a", "id": 1.5}\n{"text": "b", "id": NaN}\n',  # Python's json reads NaN: the ids file got it
               "c.jsonl:2: its id nan is not a finite number", ["--id-field", "id"]),
    "id_infinity": ('{"text": "a", "id": -Infinity}\n', "c.jsonl:1: its id -inf is not a finite number",
                    ["--id-field", "id"]),
}


@pytest.mark.parametrize("case", sorted(BAD_INPUTS))
def test_embed_bad_input_fails_before_any_compile(tmp_path, capsys, case):
    text, message, more = BAD_INPUTS[case]
    corpus = tmp_path / "c.jsonl"
    if isinstance(text, bytes):
        corpus.write_bytes(text)
    elif text is not None:
        corpus.write_text(text)
    code, err, compiles = in_process(["embed", "--input", str(corpus), "--output", str(tmp_path / "v.npy"),
                                      "--model", str(tmp_path / "no-model"), *more], capsys)
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
    assert "partial run with other arguments: input_file None (now '" in err and ", rows 7 (now 2), " in err


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
    summary = json.loads((tmp_path / "v.parquet.summary.json").read_text())
    assert summary["documents"] == 50 and summary["tokens"] > 50 and 0 <= summary["padding"] < 1
    assert set(summary) == {"documents", "tokens", "seconds", "docs_per_s", "tokens_per_s", "padding", "output",
                            "state"}
    state = summary["state"]
    assert state == {"input": str(corpus), "input_file": state["input_file"], "rows": 50, "dim": 32, "field": "body",
                     "id_field": "key", "model": state["model"], "dtype": "float32", "long": "truncate",
                     "prompt_name": None, "prompt": None}
    assert state["input_file"].startswith(f"{corpus.stat().st_size} bytes, modified ")


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


def test_a_bad_document_names_its_chunk_and_says_what_lets_the_job_go_on(tmp_path):
    """A tokenizer's "input N" counts from the chunk's first row: the message says which row that is. The rows
    before it stay written, but a rerun with the same arguments stops there again and one with another --long is
    refused as a partial run with other arguments, so the message names what to delete to start over (it said
    "a rerun resumes there")."""
    from jaxserve.errors import InputError, JaxserveError
    from jaxserve.offline.job import Stages, embed_corpus
    from jaxserve.offline.sinks import open_sink

    def prepare(texts):
        if "bad" in texts:
            raise InputError(f"input {texts.index('bad')} has 402 tokens")
        return len(texts)

    texts = ["a"] * 5 + ["bad"] + ["a"] * 3
    state, out = {"input": "x", "rows": 9, "dim": 2, "long": "error"}, str(tmp_path / "v.npy")
    stages = Stages(prepare, lambda n: (np.ones((n, 2), np.float32), n, n))
    for _ in range(2):  # the first run, then its rerun
        sink = open_sink(out, state)
        with pytest.raises(InputError, match=r"^in the chunk from row 3: input 2 has 402 tokens; the rows before it "
                           r"are written, but a rerun with these arguments stops here again .* delete "
                           f"{re.escape(out)} and {re.escape(out)}.progress and start over with --long truncate"):
            embed_corpus(enumerate(texts), stages, sink, sink.resume(), 3)
    assert open_sink(out, state).resume() == 3
    with pytest.raises(JaxserveError, match="partial run with other arguments: long 'error' \\(now 'truncate'\\)"):
        open_sink(out, {**state, "long": "truncate"}).resume()


def test_a_sparse_models_long_error_stop_suggests_only_truncate(splade_path, tmp_path):
    """A SPLADE model refuses `--long chunk` (its weights are per sequence), yet its `--long error` stop said
    "start over with --long truncate or chunk"."""
    from test_sparse import PACKED

    from jaxserve.errors import InputError
    from jaxserve.offline.job import embed_corpus, encoder_embed
    from jaxserve.offline.sinks import open_sink

    enc = warm_encoder(splade_path, PACKED)
    sink = open_sink(str(tmp_path / "w.jsonl"), {"input": "x", "rows": 2, "dim": None, "long": "error"})
    with pytest.raises(InputError, match=r"start over with --long truncate \(a document over the model's limit\)"):
        embed_corpus(enumerate(["a", "the query " * 400]), encoder_embed(enc, "error", None), sink, 0, 2)


def test_a_chunk_of_no_documents_is_refused(tmp_path, capsys):
    """`--chunk 0` once finished at once, recording an all-zero .npy as complete (later runs: "already complete")."""
    from jaxserve import cli

    with pytest.raises(SystemExit) as exit_:
        cli.main(["embed", "--input", str(tmp_path / "c.txt"), "--output", str(tmp_path / "v.npy"), "--chunk", "0"])
    assert exit_.value.code == 2 and "--chunk: must be a whole number of at least 1" in capsys.readouterr().err
    assert not (tmp_path / "v.npy").exists()


def test_an_input_that_changes_during_the_run_is_never_recorded_finished(tmp_path):
    """Fewer documents than at the start (a .npy kept zero rows for the rest and said "complete"), or more (a
    .jsonl went on writing): refused, and no summary records the output as finished."""
    from jaxserve.errors import InputError
    from jaxserve.offline.job import embed_corpus
    from jaxserve.offline.sinks import open_sink

    run = lambda texts: (np.ones((len(texts), 2), np.float32), len(texts), len(texts))
    for n, out in ((3, tmp_path / "short.npy"), (7, tmp_path / "long.npy")):
        sink = open_sink(str(out), {"input": "x", "rows": 5, "dim": 2})
        with pytest.raises(InputError, match="changed during the run"):
            embed_corpus(((None, f"doc {i}") for i in range(n)), run, sink, sink.resume(), 2)
        assert not (tmp_path / f"{out.name}.summary.json").exists()


def test_corpus_checks_ids_of_one_type_a_bom_and_empty_shards(tmp_path):
    """ids of two JSON types (a Parquet output's id column has one: its sealing failed after the whole run) are
    refused by the check; a UTF-8 byte-order mark is not part of the first document; an empty file of a directory
    is an empty shard, not a refused input (the whole input empty still is)."""
    from jaxserve.offline.corpus import Corpus, CorpusError

    mixed = tmp_path / "mixed.jsonl"
    mixed.write_text('{"text": "a", "k": 1}\n{"text": "b", "k": 2}\n{"text": "c", "k": "x"}\n')
    with pytest.raises(CorpusError, match="integer and string"):
        Corpus(str(mixed), None, "k").check()
    (tmp_path / "nested.jsonl").write_text('{"text": "a", "k": [1]}\n')
    with pytest.raises(CorpusError, match="ids are strings or numbers"):
        Corpus(str(tmp_path / "nested.jsonl"), None, "k").check()
    bom = tmp_path / "bom.json"
    bom.write_bytes(b'\xef\xbb\xbf{"text": "a"}\n{"text": "b"}\n')
    assert list(Corpus(str(bom)).records()) == [(None, "a"), (None, "b")]
    shards = tmp_path / "shards"
    shards.mkdir()
    (shards / "a.jsonl").write_text('{"text": "a"}\n')
    (shards / "b.txt").write_text("\n")
    assert Corpus(str(shards)).check() == 1
    (shards / "a.jsonl").write_text("")
    with pytest.raises(CorpusError, match="has no documents"):
        Corpus(str(shards)).check()


def test_an_output_in_the_input_directory_is_refused(tmp_path, capsys):
    """Its ids, progress and summary files would be read as input by a rerun (which then could not resume)."""
    from jaxserve import cli

    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "a.jsonl").write_text('{"text": "a", "k": "1"}\n')
    assert cli.main(["embed", "--input", str(tmp_path / "d"), "--output", str(tmp_path / "d" / "v.npy"),
                     "--id-field", "k"]) == 2
    assert "in a directory the input reads from" in capsys.readouterr().err
