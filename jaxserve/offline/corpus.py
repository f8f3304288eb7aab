"""Reading corpora for `jaxserve embed` and `explain`: plain lines, JSONL, Parquet; checked before any compile.

`Corpus.check()` reads the whole input once (streaming) and raises a
`CorpusError` naming the line and what to do, so a bad corpus fails in
seconds instead of after warmup. `Corpus.records()` then streams (id, text)
pairs; Parquet is read one row group at a time.
"""

from __future__ import annotations

import dataclasses
import glob
import itertools
import json
import math
import os
from collections.abc import Iterator
from dataclasses import dataclass

from jaxserve.errors import JaxserveError

JSONL_SUFFIXES = (".jsonl", ".ndjson")
CORPUS_SUFFIXES = (".parquet", *JSONL_SUFFIXES, ".txt")  # the files of a directory given as the input
DEFAULT_FIELDS = ("text", "input")


class CorpusError(JaxserveError):
    """An input file that cannot be embedded as given."""


ID_KINDS = {bool: "boolean", int: "integer", float: "number", str: "string", type(None): "null"}  # JSON's scalars
INT64 = range(-2**63, 2**63)  # a Parquet output's integer id column


def _unicode(value: str, what: str) -> None:
    """Refuse a lone surrogate: JSON can escape one ("\\ud800"), UTF-8 cannot hold it, so neither the tokenizer
    nor any sink takes it."""
    try:
        value.encode()
    except UnicodeEncodeError as exc:
        raise CorpusError(f"{what} holds a lone surrogate (U+{ord(value[exc.start]):04X} at character {exc.start}), "
                          "which UTF-8 cannot hold: fix that text in the file") from None


def _check_id(value, where: str) -> None:
    """An id every sink can write (an `id` column, a JSON line): a JSON scalar, an integer in int64, a finite
    number (Python's json reads NaN and Infinity, which JSON cannot hold), a string UTF-8 can hold."""
    if type(value) not in ID_KINDS:
        raise CorpusError(f"{where}: its id is a JSON {type(value).__name__}: ids are strings or numbers")
    if type(value) is float and not math.isfinite(value):
        raise CorpusError(f"{where}: its id {value} is not a finite number, which JSON (a .npy's ids file, a .jsonl "
                          "output) cannot hold: give the ids as finite numbers or strings")
    if type(value) is int and value not in INT64:
        raise CorpusError(f"{where}: its id {value} is outside int64 (what an output's integer id column holds): "
                          "give the ids as strings")
    if type(value) is str:
        _unicode(value, f"{where}: its id")


@dataclass(frozen=True)
class Corpus:
    path: str
    field: str | None = None  # JSONL/Parquet text field; None: `text` (or `input`) for JSONL, required for Parquet
    id_field: str | None = None  # carried into the output; None: no ids

    @property
    def parquet(self) -> bool:
        return self.path.endswith(".parquet")

    def files(self) -> list[str]:
        """The input's files, in row order: the file itself; a directory's corpus files (`CORPUS_SUFFIXES`, not
        hidden) or a glob's matches, sorted by name."""
        if os.path.isdir(self.path):
            return sorted(os.path.join(self.path, n) for n in os.listdir(self.path)
                          if n.endswith(CORPUS_SUFFIXES) and not n.startswith((".", "_")))
        if not os.path.exists(self.path) and any(c in self.path for c in "*?["):
            return sorted(f for f in glob.glob(self.path) if os.path.isfile(f))
        return [self.path]

    def _each(self) -> list[Corpus]:
        """One corpus per file, in row order (none matched: a CorpusError)."""
        files = self.files()
        if not files:
            raise CorpusError(f"input {self.path!r} matches no corpus files (a directory's {', '.join(CORPUS_SUFFIXES)}"
                              " files, or a glob's matches)")
        return [dataclasses.replace(self, path=f) for f in files]

    def check(self) -> int:
        """Read everything once; the number of documents, or a CorpusError. A file of a directory or glob may be
        empty (an empty shard), the whole input not; the ids must be of one type (the output's id column is)."""
        total, kinds = 0, set()
        for one in self._each():
            count, ids = one._check_file()
            total, kinds = total + count, kinds | ids
        if total == 0:
            raise CorpusError(f"input {self.path!r} has no documents (only blank lines, or no rows)")
        if len(kinds) > 1:
            raise CorpusError(f"id field {self.id_field!r} holds {' and '.join(sorted(kinds))} values: give every "
                              "row an id of one type (the output's id column has one)")
        return total

    def _check_file(self) -> tuple[int, set[str]]:
        """This file's documents and the types of its ids."""
        if not os.path.isfile(self.path):
            raise CorpusError(f"input {self.path!r} does not exist (or is not a file)")
        if not os.access(self.path, os.R_OK):
            raise CorpusError(f"input {self.path!r} is not readable: check its permissions")
        if self.parquet:
            return self._check_parquet()
        count, kinds = 0, set()
        for ident, _ in self.records():  # each JSON record's id and text checked as it is read (`_json_record`)
            count += 1
            if self.id_field is not None:
                kinds.add(ID_KINDS[type(ident)])
        return count, kinds

    def records(self) -> Iterator[tuple[object, str]]:
        """(id or None, text) per document, in file order (a file after another: `files`)."""
        return itertools.chain.from_iterable(
            one._parquet_records() if one.parquet else one._line_records() for one in self._each())

    def texts(self) -> Iterator[str]:
        return (text for _, text in self.records())

    def boundaries(self) -> list[int]:
        """The row each file after the first starts at (a range read by `records_from` stays in one file): from
        Parquet metadata, or a count of a line file's documents (`_lines`: no JSON parsing)."""
        rows, starts = 0, []
        for one in self._each()[:-1]:
            if one.parquet:
                rows += one._parquet_file().metadata.num_rows
            else:
                rows += sum(1 for _ in one._lines())
            starts.append(rows)
        return starts

    def seek(self, starts: set[int]) -> dict[int, tuple[str, int, int]]:
        """Where reading begins for each row in `starts` (row numbers from 0), for `records_from`: so a worker
        reads its own range without reading the rows before it. (file, row group, its first row) from a
        Parquet file's metadata; (file, byte offset, lines before) from one streaming pass over a line file."""
        found: dict[int, tuple[str, int, int]] = {}
        row = 0
        for one in self._each():
            if one.parquet:
                meta = one._parquet_file().metadata
                for group in range(meta.num_row_groups):
                    rows = meta.row_group(group).num_rows
                    found.update((s, (one.path, group, row)) for s in starts if row <= s < row + rows)
                    row += rows
                continue
            for number, offset, _ in one._lines():
                if row in starts:
                    found[row] = (one.path, offset, number - 1)
                row += 1
        return found

    def records_from(self, start: int, count: int, at: tuple[str, int, int]) -> list[tuple[object, str]]:
        """Rows `start`..`start + count` of one file as `records` gives them, read from `at` (`seek`'s for
        `start`)."""
        path, a, b = at
        one = dataclasses.replace(self, path=path)
        if one.parquet:
            return list(itertools.islice(one._parquet_records(a), start - b, start - b + count))
        return list(itertools.islice(one._line_records(a, b), count))

    def _lines(self, offset: int = 0, lines_before: int = 0) -> Iterator[tuple[int, int, str]]:
        """(line number, byte offset, text) of each line of this file that holds a document, from `offset`: UTF-8
        without its line end and, on the file's first line, a byte-order mark (Windows' editors write one); blank
        lines skipped. The one rule of what a row is: `_line_records` reads these, `boundaries` and `seek` count
        them."""
        with open(self.path, "rb") as f:
            f.seek(offset)
            for number, raw in enumerate(f, lines_before + 1):
                try:
                    line = raw.decode("utf-8").rstrip("\r\n")
                except UnicodeDecodeError as exc:
                    raise CorpusError(f"{self.path}:{number}: not UTF-8 (byte {exc.start}); re-encode the file "
                                      "as UTF-8, e.g. iconv -f latin1 -t utf-8") from None
                if offset == 0:
                    line = line.removeprefix("\ufeff")
                if line.strip():
                    yield number, offset, line
                offset += len(raw)

    def _line_records(self, offset: int = 0, lines_before: int = 0) -> Iterator[tuple[object, str]]:
        jsonl = self.path.endswith(JSONL_SUFFIXES) or self.field is not None or self.id_field is not None
        for number, _, line in self._lines(offset, lines_before):
            if jsonl or line.lstrip().startswith("{"):
                yield self._json_record(number, line)
            else:
                yield None, line

    def _json_record(self, number: int, line: str) -> tuple[object, str]:
        where = f"{self.path}:{number}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise CorpusError(f"{where}: not JSON ({exc.msg} at column {exc.colno}); "
                              "JSONL needs one JSON object per line") from None
        if not isinstance(obj, dict):
            raise CorpusError(f"{where}: a JSON {type(obj).__name__}, not an object with a text field")
        fields = [self.field] if self.field else list(DEFAULT_FIELDS)
        name = next((f for f in fields if f in obj), None)
        has = ", ".join(map(repr, obj)) or "none"
        if name is None:
            raise CorpusError(f"{where}: no field {' or '.join(map(repr, fields))} (it has {has}); "
                              "name the text field with --field")
        if not isinstance(obj[name], str):
            raise CorpusError(f"{where}: field {name!r} is a {type(obj[name]).__name__}, not text")
        _unicode(obj[name], f"{where}: field {name!r}")
        if self.id_field is None:
            return None, obj[name]
        if self.id_field not in obj:
            raise CorpusError(f"{where}: no id field {self.id_field!r} (it has {has})")
        _check_id(obj[self.id_field], where)
        return obj[self.id_field], obj[name]

    def _parquet_file(self):
        try:
            import pyarrow as pa
            import pyarrow.parquet as pq
        except ImportError:
            raise CorpusError("parquet input needs pyarrow: pip install 'jaxserve[parquet]'") from None
        try:
            return pq.ParquetFile(self.path)
        except (pa.ArrowException, OSError) as exc:  # not Parquet, or cut short
            raise CorpusError(f"input {self.path!r} is not a readable Parquet file: {exc}") from None

    def _columns(self) -> list[str]:
        return [self.field] + ([self.id_field] if self.id_field else [])

    def _check_parquet(self) -> tuple[int, set[str]]:
        import pyarrow as pa

        pf = self._parquet_file()
        schema = pf.schema_arrow
        if self.field is None:
            raise CorpusError(f"parquet input needs --field NAME (its columns: {', '.join(schema.names)})")
        for name in self._columns():
            if name not in schema.names:
                raise CorpusError(f"{self.path}: no column {name!r} (it has {', '.join(schema.names)})")
        kind = schema.field(self.field).type
        if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)):
            raise CorpusError(f"{self.path}: column {self.field!r} is {kind}, not text")
        ids = self._parquet_id_kind(schema)
        # each id checked where a value of the type may be one no output writes: a NaN or infinity, a uint64 past int64
        each_id = ids == "number" or ids == "integer" and pa.types.is_uint64(schema.field(self.id_field).type)
        start = 0
        for group in range(pf.num_row_groups):
            table = pf.read_row_group(group, columns=self._columns())
            for name in self._columns():
                if table[name].null_count:
                    row = start + table[name].to_pylist().index(None)
                    raise CorpusError(f"{self.path}: row {row}: column {name!r} is null")
            if each_id:
                for row, value in enumerate(table[self.id_field].to_pylist()):
                    _check_id(value, f"{self.path}: row {start + row}")
            start += table.num_rows
        return pf.metadata.num_rows, {ids} if ids else set()

    def _parquet_id_kind(self, schema) -> str | None:
        """The id column's type as `ID_KINDS` names it; one no sink writes every value of (a date, a decimal, bytes,
        a list) is refused."""
        import pyarrow as pa

        if self.id_field is None:
            return None
        kind = schema.field(self.id_field).type
        value = kind.value_type if pa.types.is_dictionary(kind) else kind  # a categorical column: its values
        for test, name in ((pa.types.is_integer, "integer"), (pa.types.is_floating, "number"),
                           (pa.types.is_boolean, "boolean"), (pa.types.is_string, "string"),
                           (pa.types.is_large_string, "string")):
            if test(value):
                return name
        raise CorpusError(f"{self.path}: id column {self.id_field!r} is {kind}: ids are strings or numbers (what every "
                          "output can write); cast the column, e.g. to string")

    def _parquet_records(self, first_group: int = 0) -> Iterator[tuple[object, str]]:
        pf = self._parquet_file()
        for group in range(first_group, pf.num_row_groups):  # one row group in memory at a time
            table = pf.read_row_group(group, columns=self._columns())
            texts = table[self.field].to_pylist()
            ids = table[self.id_field].to_pylist() if self.id_field else [None] * len(texts)
            yield from zip(ids, texts)
