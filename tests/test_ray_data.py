"""`jaxserve embed --ray` and `Embedder` on a small local Ray cluster: the single-process job's output, every row
exactly once, across a killed driver and a dead actor."""

import json
import os
import signal
import subprocess
import sys

import numpy as np
import pytest
import tiny
from conftest import TINY_TABLE, warm_encoder
from hypothesis import given
from hypothesis import strategies as st

from jaxserve.offline.corpus import Corpus
from jaxserve.offline.job import plan_ranges
from jaxserve.offline.sinks import ParquetSink

ray = pytest.importorskip("ray")
pq = pytest.importorskip("pyarrow.parquet")

ROWS, CHUNK = 300, 40

KILL_AFTER = """
import os, signal, sys
from jaxserve import cli
from jaxserve.integrations import ray_data

after, job = int(os.environ["KILL_AFTER_RANGES"]), ray_data.run_job


def run_job(*args, on_range, **kw):  # the driver dies as the N-th range comes back
    seen = []

    def counted(rows):
        on_range(rows)
        seen.append(rows)
        if len(seen) == after:
            os.kill(os.getpid(), signal.SIGKILL)

    return job(*args, on_range=counted, **kw)


ray_data.run_job = run_job
sys.exit(cli.main(sys.argv[1:]))
"""


@given(st.integers(1, 60), st.integers(1, 9), st.lists(st.tuples(st.integers(0, 59), st.integers(1, 12)), max_size=6),
       st.lists(st.integers(1, 59), max_size=4))
def test_plan_ranges_cover_each_row_left_once_never_crossing_a_finished_one_or_a_file(rows, block, finished, cuts):
    finished = [(s, min(n, rows - s)) for s, n in finished if s < rows]
    done = set()
    kept = []
    for s, n in sorted(finished):  # parts on disk never overlap: keep the first of two that would
        if not done & set(range(s, s + n)):
            kept.append((s, n))
            done |= set(range(s, s + n))
    planned = plan_ranges(rows, block, kept, cuts)
    rows_planned = [r for s, n in planned for r in range(s, s + n)]
    assert sorted(rows_planned) == sorted(set(range(rows)) - done) == rows_planned  # each once, in row order
    assert all(1 <= n <= block for _, n in planned)
    assert not any(s < c < s + n for s, n in planned for c in cuts)  # a range stays in one input file


@pytest.mark.parametrize("suffix", [".txt", ".jsonl", ".parquet"])
def test_corpus_reads_any_range_from_where_seek_puts_it(tmp_path, suffix):
    """A range read from its seek point is those rows of `records`, blank lines and row groups included."""
    docs = [f"doc {i}" for i in range(23)]
    path = tmp_path / f"c{suffix}"
    if suffix == ".parquet":
        import pyarrow as pa

        pq.write_table(pa.table({"t": docs, "k": list(range(23))}), path, row_group_size=5)
        corpus = Corpus(str(path), "t", "k")
    elif suffix == ".jsonl":
        path.write_text("".join(json.dumps({"text": d, "k": i}) + "\n" + "\n" * (i % 3 == 0) for i, d in
                                enumerate(docs)))
        corpus = Corpus(str(path), id_field="k")
    else:
        path.write_text("\n \u3000\n".join(docs) + "\n")  # blank lines, one of unicode space
        corpus = Corpus(str(path))
    want = list(corpus.records())
    assert len(want) == 23 and corpus.boundaries() == []
    starts = {0, 4, 5, 11, 20}
    seek = corpus.seek(starts)
    assert set(seek) == starts
    for s in starts:
        assert corpus.records_from(s, 3, seek[s]) == want[s : s + 3]


def write_corpus_dir(directory, docs, sizes) -> None:
    """`docs` (with ids k0, k1, ...) as a directory of files, in name order: JSONL, Parquet (row groups of 16)
    and JSONL again, each of its size, and a file that is not a corpus file."""
    import pyarrow as pa

    directory.mkdir()
    start = 0
    for i, n in enumerate(sizes):
        part = range(start, start + n)
        if i % 3 == 1:
            pq.write_table(pa.table({"body": [docs[j] for j in part], "key": [f"k{j}" for j in part]}),
                           directory / f"{i:02d}.parquet", row_group_size=16)
        else:
            (directory / f"{i:02d}.jsonl").write_text("".join(json.dumps({"body": docs[j], "key": f"k{j}"}) + "\n"
                                                                for j in part))
        start += n
    (directory / "README.md").write_text("not a corpus file\n")


def test_a_directory_or_glob_is_its_files_in_name_order(tmp_path):
    docs = [f"doc {i}" for i in range(60)]
    write_corpus_dir(tmp_path / "d", docs, [25, 20, 15])
    for path in (tmp_path / "d", tmp_path / "d" / "*"):
        corpus = Corpus(str(path), "body", "key")
        assert [os.path.basename(f) for f in corpus.files()] == (
            ["00.jsonl", "01.parquet", "02.jsonl"] + (["README.md"] if "*" in str(path) else []))
    corpus = Corpus(str(tmp_path / "d"), "body", "key")
    assert corpus.check() == 60 and corpus.boundaries() == [25, 45]
    assert list(corpus.records()) == [(f"k{i}", d) for i, d in enumerate(docs)]
    seek = corpus.seek({0, 24, 25, 40, 45, 59})
    for s, n in [(0, 25), (24, 1), (25, 20), (40, 5), (45, 15), (59, 1)]:
        assert corpus.records_from(s, n, seek[s]) == [(f"k{i}", docs[i]) for i in range(s, s + n)]
    with pytest.raises(Exception, match="matches no corpus files"):
        Corpus(str(tmp_path / "none-*.jsonl")).check()


def test_parquet_parts_out_of_order_resume_in_row_order_and_seal_only_whole(tmp_path):
    """Parts a Ray run left out of order: the single-process resume keeps the prefix and drops the rest; an
    output whose parts do not tile the rows is refused, not sealed."""
    state = {"rows": 6, "dim": 2}
    sink = ParquetSink(str(tmp_path / "v.parquet"), state, ids=False)
    assert not sink.check() and sink.open_parts() == []
    for start in (0, 4):
        sink.write(start, np.full((2, 2), start, np.float32))
    assert sink.finished() == [(0, 2), (4, 2)]
    with pytest.raises(Exception, match="rows 2..4 have no part"):
        sink.finish({})
    assert not (tmp_path / "v.parquet").exists()
    again = ParquetSink(str(tmp_path / "v.parquet"), state, ids=False)
    assert again.resume() == 2 and again.finished() == [(0, 2)]


@pytest.mark.parametrize("extra,message", [
    (["--output", "v.npy", "--ray", "local"], "--ray writes .parquet"),
    (["--output", "v.parquet", "--ray-actors", "2"], "--ray-actors needs --ray"),
    (["--output", "v.parquet", "--ray", "local", "--ray-actors", "0"], "at least one actor"),
])
def test_ray_flags_are_checked_before_anything_runs(tmp_path, capsys, extra, message):
    from jaxserve import cli

    assert cli.main(["embed", "--input", str(tmp_path / "missing.txt"), *extra]) == 2
    assert message in capsys.readouterr().err


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """(address, checkpoint, table file, corpus, docs): a 4-CPU local cluster (2 actors and the warm-up task) and a
    corpus with ids in a directory of JSONL and Parquet files. The tiny model's warm artifact is saved in this run's cache first, so actors load it."""
    tmp = tmp_path_factory.mktemp("ray-data")
    path = tiny.write_checkpoint(tmp / "ckpt")
    TINY_TABLE.save(tmp / "t.json")
    docs = [f"the model {i} " + "jax " * (i % 13) for i in range(ROWS)]
    corpus = tmp / "corpus"
    write_corpus_dir(corpus, docs, [130, 100, 70])  # files that do not end on a range of CHUNK rows
    warm_encoder(path, TINY_TABLE)
    ray.init(num_cpus=4, include_dashboard=False, object_store_memory=80 * 2**20, log_to_driver=False)
    yield ray.get_runtime_context().gcs_address, path, tmp / "t.json", corpus, docs
    ray.shutdown()


def args_for(cluster, out, cwd=None) -> list[str]:
    """The job's arguments; with `cwd`, its paths relative to it (the driver's cwd, not its workers')."""
    _, path, table, corpus, _ = cluster
    rel = (lambda p: os.path.relpath(p, cwd)) if cwd else (lambda p: p)
    return ["--input", rel(corpus), "--output", rel(out), "--model", rel(path), "--buckets", table, "--chunk", CHUNK,
            "--field", "body", "--id-field", "key"]


@pytest.fixture(scope="module")
def single(cluster, tmp_path_factory):
    """The single-process job's output of the corpus (a table)."""
    from jaxserve import cli

    out = tmp_path_factory.mktemp("single") / "v.parquet"
    assert cli.main(["embed", *map(str, args_for(cluster, out))]) == 0
    return pq.read_table(out)


def assert_same_as_single(out, single) -> None:
    got = pq.read_table(out)
    assert got.column_names == single.column_names == ["row", "embedding", "id"]
    assert got["row"].to_pylist() == list(range(ROWS))  # every row once, in input order
    assert got["id"].to_pylist() == single["id"].to_pylist() == [f"k{i}" for i in range(ROWS)]
    np.testing.assert_allclose(np.stack(got["embedding"].to_numpy(zero_copy_only=False)),
                               np.stack(single["embedding"].to_numpy(zero_copy_only=False)), atol=1e-6)
    assert sorted(os.listdir(out.parent)) == sorted([out.name, out.name + ".summary.json"])  # no parts left


@pytest.mark.parametrize("batch_format", ["default", "pandas"])
def test_embedder_in_a_users_pipeline_adds_the_embedding_column(cluster, batch_format):
    """Batches of numpy arrays or (batch_format="pandas") DataFrames, whose index is the input frame's own."""
    _, path, _, _, docs = cluster
    import pandas as pd

    from jaxserve.integrations.ray_data import Embedder

    frame = pd.DataFrame({"body": docs[:50], "n": range(50)}, index=range(1000, 1050))
    ds = ray.data.from_pandas([frame[:25], frame[25:]]).map_batches(  # a block for each actor
        Embedder, fn_constructor_kwargs={"model": str(path), "column": "body", "table": TINY_TABLE},
        batch_size=16, batch_format=batch_format, compute=ray.data.ActorPoolStrategy(size=2), num_cpus=1)
    rows = sorted(ds.take_all(), key=lambda r: r["n"])
    assert [r["body"] for r in rows] == docs[:50]
    np.testing.assert_allclose(np.stack([r["embedding"] for r in rows]),
                               warm_encoder(path, TINY_TABLE).embed(docs[:50]), atol=1e-5)


def test_a_dead_actor_is_replaced_and_its_range_written_once(cluster, single, tmp_path):
    """The first actor to take the range at row 80 dies (os._exit, once: a marker file); Ray restarts it and
    retries the range, and the output is the single-process job's, each row once."""
    from jaxserve import Encoder
    from jaxserve.integrations import ray_data
    from jaxserve.offline.job import job_state

    _, path, _, corpus_path, _ = cluster
    marker = tmp_path / "died"

    class DiesOnce(ray_data.RangeEmbedder):
        def __call__(self, batch):
            if int(batch["start"][0]) == 2 * CHUNK and not marker.exists():
                marker.write_text(str(os.getpid()))
                os._exit(1)
            return super().__call__(batch)

    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the test's stage, sent to the actors whole
    corpus = Corpus(str(corpus_path), "body", "key")
    enc = Encoder.from_pretrained(str(path))
    out = tmp_path / "out" / "v.parquet"
    out.parent.mkdir()
    sink = ParquetSink(str(out), job_state(enc, corpus, corpus.check(), "truncate", None, None), ids=True)
    assert not sink.check()
    model = {"model": str(path), "table": TINY_TABLE, "prompt": sink.state["prompt"],
             "cache_dir": os.environ["JAXSERVE_CACHE_DIR"]}
    run = ray_data.run_job("unused: connected already", sink, corpus, model, CHUNK, actors=2, stage=DiesOnce)
    assert marker.exists()  # an actor did die on that range
    # files of 130, 100 and 70 rows in ranges of 40: 4 + 3 + 2; the retried range came back once
    assert (run.ranges, run.actors, run.summary.documents) == (9, 2, ROWS)
    assert_same_as_single(out, single)
    summary = json.loads((out.parent / "v.parquet.summary.json").read_text())
    assert summary["documents"] == ROWS and summary["ray"]["ranges"] == 9 and summary["state"] == sink.state


def test_killed_driver_resumes_without_redoing_finished_ranges_or_duplicating_rows(cluster, single, tmp_path):
    """`jaxserve embed --ray` (a driver process of its own, joining the cluster, given paths relative to its
    working directory) is SIGKILLed as its 3rd range comes back, and one finished range's part is taken away (a
    range in flight); the rerun skips every part on disk, fills the gap, and the output is the single-process
    job's."""
    address = cluster[0]
    out = tmp_path / "v.parquet"
    args = [*args_for(cluster, out, cwd=tmp_path), "--ray", address, "--ray-actors", "2"]
    killed = subprocess.run([sys.executable, "-c", KILL_AFTER, "embed", *map(str, args)], capture_output=True,
                            text=True, timeout=300, check=False, env={**os.environ, "KILL_AFTER_RANGES": "3"},
                            cwd=tmp_path)
    assert killed.returncode == -signal.SIGKILL, killed.stdout + killed.stderr
    parts = [p for p in sorted(os.listdir(tmp_path / "v.parquet.parts")) if p.endswith(".parquet")]
    assert len(parts) >= 3  # at least the three ranges that came back (Ray Data runs ahead of the driver)
    gap = parts.pop(1)  # as if that range had been in flight: a gap before a finished range
    os.remove(tmp_path / "v.parquet.parts" / gap)
    resumed = subprocess.run([sys.executable, "-m", "jaxserve.cli", "embed", *map(str, args)], capture_output=True,
                             text=True, timeout=300, check=False, cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    skipped = int(resumed.stdout.split("resuming: ")[1].split(" of ")[0])
    on_disk = sum(int(p.split("-")[2].split(".")[0]) for p in parts if p.endswith(".parquet"))
    assert skipped >= on_disk > 0  # (a killed job's actor may finish a range before Ray stops it)
    summary = json.loads((tmp_path / "v.parquet.summary.json").read_text())
    gap_rows = int(gap.split("-")[2].split(".")[0])
    assert gap_rows <= summary["documents"] == ROWS - skipped  # the gap was filled; finished ranges were not redone
    assert_same_as_single(out, single)
    again = subprocess.run([sys.executable, "-m", "jaxserve.cli", "embed", *map(str, args)], capture_output=True,
                           text=True, timeout=300, check=False, cwd=tmp_path)
    assert again.returncode == 0 and f"v.parquet is already complete: {ROWS} rows" in again.stdout


def test_embedder_refuses_a_null_text_naming_its_row(tmp_path):
    """A null (None from Arrow, NaN from pandas) is not embedded as the word "None" (or "nan"): the batch fails
    naming the column and the row, as `jaxserve embed` refuses nulls. Called as map_batches calls it, no cluster:
    with a dict of arrays, and with a pandas DataFrame."""
    import pandas as pd

    from jaxserve.errors import JaxserveError
    from jaxserve.integrations.ray_data import Embedder

    embedder = Embedder(model=str(tiny.write_checkpoint(tmp_path / "ckpt")), column="body", table=TINY_TABLE,
                        cache_dir=str(tmp_path / "cache"))
    out = embedder({"body": np.array(["a", "b"], dtype=object), "id": np.array([7, 8])})
    assert out["embedding"].shape[0] == 2 and out["id"].tolist() == [7, 8]
    for null in (None, float("nan")):
        with pytest.raises(JaxserveError, match=r"column 'body' is (None|nan), not text, in row 1 of this batch "
                                                r"\(its other columns: id=8\)"):
            embedder({"body": np.array(["a", null, "c"], dtype=object), "id": np.array([7, 8, 9])})
    # a pandas batch (batch_format="pandas") keeps its frame's index: the row is its position (a KeyError before)
    with pytest.raises(JaxserveError, match=r"column 'body' is (None|nan), not text, in row 1 of this batch \(its "
                                            r"other columns: id=8\)"):
        embedder(pd.DataFrame({"body": ["a", None, "c"], "id": [7, 8, 9]}, index=[40, 41, 42]))
