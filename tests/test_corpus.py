"""jaxserve.offline.corpus without JAX: formats, field lookup, and the errors the checking pass names."""

import re

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from jaxserve.offline.corpus import Corpus, CorpusError


def test_plain_lines_and_jsonl_lines_mix_and_blank_lines_are_skipped(tmp_path):
    path = tmp_path / "c.txt"
    path.write_text('plain one\n\n{"text": "json two"}\n{"input": "json three"}\n')
    assert Corpus(str(path)).check() == 3
    assert list(Corpus(str(path)).texts()) == ["plain one", "json two", "json three"]


def test_named_field_and_ids(tmp_path):
    path = tmp_path / "c.jsonl"
    path.write_text('{"content": "a", "id": 7}\n{"content": "b", "id": "x"}\n')
    assert list(Corpus(str(path), "content", "id").records()) == [(7, "a"), ("x", "b")]
    with pytest.raises(CorpusError, match=r"c.jsonl:1: no field 'text' or 'input' \(it has 'content', 'id'\)"):
        Corpus(str(path)).check()
    with pytest.raises(CorpusError, match="c.jsonl:1: no id field 'key'"):
        Corpus(str(path), "content", "key").check()


def test_a_non_text_field_and_a_non_object_line_are_named(tmp_path):
    path = tmp_path / "c.jsonl"
    path.write_text('{"text": 3}\n')
    with pytest.raises(CorpusError, match="c.jsonl:1: field 'text' is a int, not text"):
        Corpus(str(path)).check()
    path.write_text('[1, 2]\n')
    with pytest.raises(CorpusError, match="c.jsonl:1: a JSON list"):
        Corpus(str(path)).check()


def test_parquet_reads_every_row_group_in_order_and_names_nulls(tmp_path):
    path = tmp_path / "c.parquet"
    texts = [f"doc {i}" for i in range(25)]
    pq.write_table(pa.table({"t": texts, "k": list(range(25))}), path, row_group_size=4)
    assert pq.ParquetFile(path).num_row_groups == 7
    corpus = Corpus(str(path), "t", "k")
    assert corpus.check() == 25
    assert list(corpus.records()) == list(zip(range(25), texts))
    pq.write_table(pa.table({"t": ["a", None]}), path)
    with pytest.raises(CorpusError, match="row 1: column 't' is null"):
        Corpus(str(path), "t").check()
    with pytest.raises(CorpusError, match="needs --field NAME"):
        Corpus(str(path)).check()


def test_parquet_ids_every_output_can_write_and_only_those(tmp_path):
    """A date or decimal id column passed the check and failed the .npy's ids file after warm-up, a uint64 one past
    int64 the .parquet's id column, a float NaN went into the ids file as `NaN` (not JSON): refused by the check,
    naming the column or the row. A categorical (dictionary)
    column of strings is read as its strings."""
    import datetime
    import decimal

    path = tmp_path / "c.parquet"
    for ids in (pa.array([datetime.date(2024, 1, 1)] * 2), pa.array([decimal.Decimal("1.5")] * 2),
                pa.array([b"a", b"b"])):
        pq.write_table(pa.table({"t": ["a", "b"], "k": ids}), path)
        with pytest.raises(CorpusError, match=re.escape(f"id column 'k' is {ids.type}: ids are strings or numbers")):
            Corpus(str(path), "t", "k").check()
    pq.write_table(pa.table({"t": ["a", "b", "c"], "k": pa.array([1, 2**63, 3], pa.uint64())}), path, row_group_size=2)
    with pytest.raises(CorpusError, match=f"c.parquet: row 1: its id {2**63} is outside int64"):
        Corpus(str(path), "t", "k").check()
    pq.write_table(pa.table({"t": ["a", "b"], "k": pa.array([2**63 - 1, 0], pa.uint64())}), path)
    assert Corpus(str(path), "t", "k").check() == 2
    pq.write_table(pa.table({"t": ["a", "b", "c"], "k": [0.5, 1.5, float("nan")]}), path, row_group_size=2)
    with pytest.raises(CorpusError, match="c.parquet: row 2: its id nan is not a finite number"):  # the ids file's NaN
        Corpus(str(path), "t", "k").check()
    pq.write_table(pa.table({"t": ["a", "b"], "k": [0.5, 1.5]}), path)
    assert Corpus(str(path), "t", "k").check() == 2
    pq.write_table(pa.table({"t": ["a", "b"], "k": pa.array(["x", "y"]).dictionary_encode()}), path)
    assert Corpus(str(path), "t", "k").check() == 2 and list(Corpus(str(path), "t", "k").records()) == [
        ("x", "a"), ("y", "b")]


def test_a_line_holding_only_a_byte_order_mark_is_no_row_to_any_reader(tmp_path):
    """The records skipped a first line of only a BOM while `boundaries` and `seek` counted it as a row: a Ray
    job's ranges then started a row late (their rows got other rows' text and id)."""
    directory = tmp_path / "in"
    directory.mkdir()
    (directory / "a.txt").write_text("\ufeff\nfirst doc\nsecond doc\n")
    (directory / "b.txt").write_text("third doc\nfourth doc\n")
    corpus = Corpus(str(directory))
    want = list(corpus.records())
    assert corpus.check() == 4 and [text for _, text in want] == ["first doc", "second doc", "third doc", "fourth doc"]
    assert corpus.boundaries() == [2]
    seek = corpus.seek(set(range(4)))
    for row in range(4):
        assert corpus.records_from(row, 1, seek[row]) == want[row : row + 1]
