"""Reading corpora for `jaxserve embed` and `explain`: plain lines, JSONL, Parquet; checked before any compile.

`Corpus.check()` reads the whole input once (streaming) and raises a
`CorpusError` naming the line and what to do, so a bad corpus fails in
seconds instead of after warmup. `Corpus.records()` then streams (id, text)
pairs; Parquet is read one row group at a time.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import dataclass

from jaxserve.errors import JaxserveError

JSONL_SUFFIXES = (".jsonl", ".ndjson")
DEFAULT_FIELDS = ("text", "input")


class CorpusError(JaxserveError):
    """An input file that cannot be embedded as given."""


@dataclass(frozen=True)
class Corpus:
    path: str
    field: str | None = None  # JSONL/Parquet text field; None: `text` (or `input`) for JSONL, required for Parquet
    id_field: str | None = None  # carried into the output; None: no ids

    @property
    def parquet(self) -> bool:
        return self.path.endswith(".parquet")

    def check(self) -> int:
        """Read everything once; the number of documents, or a CorpusError."""
        if not os.path.isfile(self.path):
            raise CorpusError(f"input {self.path!r} does not exist (or is not a file)")
        if not os.access(self.path, os.R_OK):
            raise CorpusError(f"input {self.path!r} is not readable: check its permissions")
        if self.parquet:
            count = self._check_parquet()
        else:
            count = sum(1 for _ in self.records())
        if count == 0:
            raise CorpusError(f"input {self.path!r} has no documents (only blank lines, or no rows)")
        return count

    def records(self) -> Iterator[tuple[object, str]]:
        """(id or None, text) per document, in file order."""
        return self._parquet_records() if self.parquet else self._line_records()

    def texts(self) -> Iterator[str]:
        return (text for _, text in self.records())

    def _line_records(self) -> Iterator[tuple[object, str]]:
        jsonl = self.path.endswith(JSONL_SUFFIXES) or self.field is not None or self.id_field is not None
        with open(self.path, "rb") as f:
            for number, raw in enumerate(f, 1):
                try:
                    line = raw.decode("utf-8").rstrip("\r\n")
                except UnicodeDecodeError as exc:
                    raise CorpusError(f"{self.path}:{number}: not UTF-8 (byte {exc.start}); re-encode the file "
                                      "as UTF-8, e.g. iconv -f latin1 -t utf-8") from None
                if not line.strip():
                    continue
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
        if self.id_field is not None and self.id_field not in obj:
            raise CorpusError(f"{where}: no id field {self.id_field!r} (it has {has})")
        return (obj[self.id_field] if self.id_field else None), obj[name]

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

    def _check_parquet(self) -> int:
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
        start = 0
        for group in range(pf.num_row_groups):
            table = pf.read_row_group(group, columns=self._columns())
            for name in self._columns():
                if table[name].null_count:
                    row = start + table[name].to_pylist().index(None)
                    raise CorpusError(f"{self.path}: row {row}: column {name!r} is null")
            start += table.num_rows
        return pf.metadata.num_rows

    def _parquet_records(self) -> Iterator[tuple[object, str]]:
        pf = self._parquet_file()
        for group in range(pf.num_row_groups):  # one row group in memory at a time
            table = pf.read_row_group(group, columns=self._columns())
            texts = table[self.field].to_pylist()
            ids = table[self.id_field].to_pylist() if self.id_field else [None] * len(texts)
            yield from zip(ids, texts)
