"""Where `jaxserve embed` writes: .npy or .parquet sinks, resumable after a kill, and SPLADE's JSON Lines.

Both dense sinks keep only one chunk of vectors in memory and record progress only
after a chunk is safely on disk, so a killed run resumes at the first chunk
that was not finished. A partial output left by other arguments is refused
(`check`, before any compile) rather than silently overwritten. Ids, when
asked for, go in an `id` column (Parquet) or a JSONL sidecar FILE.ids.jsonl
beside the .npy, one JSON value per row.
"""

from __future__ import annotations

import itertools
import json
import os
import shutil

import numpy as np
import orjson

from jaxserve.errors import JaxserveError


class Sink:
    """What both sinks share: the run's state (what a resume must match) and the ids flag."""

    def __init__(self, path: str, state: dict, ids: bool):
        self.path, self.state, self.ids = path, state, ids
        self.rows, self.dim = state["rows"], state["dim"]

    def saved_state(self) -> dict | None:
        """The state a partial output recorded; None when there is none."""
        raise NotImplementedError

    def check(self) -> None:
        """Refuse a partial output written with other arguments (call before any compile)."""
        directory = os.path.dirname(os.path.abspath(self.path))
        if not os.path.isdir(directory) or not os.access(directory, os.W_OK):
            raise JaxserveError(f"cannot write --output {self.path!r}: {directory} is not a writable directory")
        if os.path.exists(self.path) and not os.access(self.path, os.W_OK):
            raise JaxserveError(f"cannot write --output {self.path!r}: it exists and is read-only")
        saved = self.saved_state()
        if saved is not None and saved != self.state:
            diff = ", ".join(f"{k} {saved.get(k)!r} (now {v!r})" for k, v in self.state.items() if saved.get(k) != v)
            raise JaxserveError(f"{self.path} holds a partial run with other arguments: {diff}; rerun with those, "
                                f"or delete {self.leftovers()} to start over")


class NpySink(Sink):
    """A memory-mapped [rows, dim] float32 .npy; progress in FILE.progress (atomic rename per chunk)."""

    def __init__(self, path: str, state: dict, ids: bool):
        super().__init__(path, state, ids)
        self.progress = f"{path}.progress"
        self.ids_path = os.path.splitext(path)[0] + ".ids.jsonl"
        self.out = None

    def leftovers(self) -> str:
        return f"{self.path} and {self.progress}"

    def _saved(self) -> dict | None:
        if not (os.path.exists(self.progress) and os.path.exists(self.path)):
            return None
        return json.loads(open(self.progress).read())

    def saved_state(self) -> dict | None:
        saved = self._saved()
        return None if saved is None else saved["state"]

    def resume(self) -> int:
        """Rows already written by an interrupted run of the same arguments (0 when starting fresh)."""
        saved = self._saved()
        if saved is not None and saved["state"] == self.state and (not self.ids or os.path.exists(self.ids_path)):
            self.out = np.lib.format.open_memmap(self.path, mode="r+")
            if self.ids:
                with open(self.ids_path, "r+b") as f:
                    f.truncate(saved["ids_bytes"])  # drop ids written after the last finished chunk
            return saved["done"]
        self.out = np.lib.format.open_memmap(self.path, mode="w+", dtype=np.float32, shape=(self.rows, self.dim))
        if self.ids:
            open(self.ids_path, "wb").close()
        return 0

    def write(self, start: int, vectors: np.ndarray, ids: list | None = None) -> None:
        self.out[start : start + len(vectors)] = vectors
        self.out.flush()
        ids_bytes = 0
        if self.ids:
            with open(self.ids_path, "ab") as f:
                f.write("".join(json.dumps(i) + "\n" for i in ids).encode())
                f.flush()
                os.fsync(f.fileno())
                ids_bytes = f.tell()
        write_json_atomic(self.progress, {"state": self.state, "done": start + len(vectors), "ids_bytes": ids_bytes})

    def finish(self) -> None:
        os.remove(self.progress)


class ParquetSink(Sink):
    """A Parquet file with columns `row` (int64), `embedding` (fixed-size list of float32) and, with ids, `id`.

    Chunks land as part files in FILE.parts/ (each renamed into place when
    complete); `finish` streams them, one row group each, into FILE.
    """

    def __init__(self, path: str, state: dict, ids: bool):
        try:
            import pyarrow  # noqa: F401
        except ImportError:
            raise JaxserveError("parquet output needs pyarrow: pip install 'jaxserve[parquet]'") from None
        super().__init__(path, state, ids)
        self.parts = f"{path}.parts"
        self.manifest = os.path.join(self.parts, "manifest.json")

    def leftovers(self) -> str:
        return self.parts

    def saved_state(self) -> dict | None:
        return json.loads(open(self.manifest).read()) if os.path.exists(self.manifest) else None

    def resume(self) -> int:
        if self.saved_state() == self.state:
            return sum(int(name.split("-")[2].split(".")[0]) for name in self._part_names())
        shutil.rmtree(self.parts, ignore_errors=True)
        os.makedirs(self.parts)
        write_json_atomic(self.manifest, self.state)
        return 0

    def _part_names(self) -> list[str]:
        """part-START-COUNT.parquet, in row order."""
        return sorted(n for n in os.listdir(self.parts) if n.startswith("part-") and n.endswith(".parquet"))

    def _table(self, start: int, vectors: np.ndarray, ids: list | None):
        import pyarrow as pa

        flat = pa.array(np.ascontiguousarray(vectors, dtype=np.float32).reshape(-1))
        columns = {
            "row": pa.array(np.arange(start, start + len(vectors), dtype=np.int64)),
            "embedding": pa.FixedSizeListArray.from_arrays(flat, self.dim),
        }
        if self.ids:
            columns["id"] = pa.array(ids)
        return pa.table(columns)

    def write(self, start: int, vectors: np.ndarray, ids: list | None = None) -> None:
        import pyarrow.parquet as pq

        name = os.path.join(self.parts, f"part-{start:012d}-{len(vectors):09d}.parquet")
        pq.write_table(self._table(start, vectors, ids), name + ".tmp")
        os.replace(name + ".tmp", name)

    def finish(self) -> None:
        import pyarrow.parquet as pq

        names = self._part_names()
        schema = pq.read_schema(os.path.join(self.parts, names[0])) if names else self._table(
            0, np.zeros((0, self.dim), np.float32), []).schema
        with pq.ParquetWriter(self.path + ".tmp", schema) as writer:
            for name in names:
                writer.write_table(pq.read_table(os.path.join(self.parts, name)))
        os.replace(self.path + ".tmp", self.path)
        shutil.rmtree(self.parts)


SINKS = {".npy": NpySink, ".parquet": ParquetSink}


def sink_class(path: str):
    ext = os.path.splitext(path)[1]
    if ext not in SINKS:
        raise JaxserveError(f"--output must end in {' or '.join(SINKS)}, not {path!r}")
    return SINKS[ext]


def open_sink(path: str, state: dict, ids: bool = False) -> Sink:
    """The sink for `path`; `state` (input, rows, dim, field, ...) is what a resume must match."""
    return sink_class(path)(path, state, ids)


def write_sparse_jsonl(documents, embed, output: str, chunk: int) -> int:
    """`jaxserve embed` for a SPLADE model: `chunk` documents at a time through `embed`, one JSON line per
    document (its [{"index", "value"}] list), in input order. Returns the rows written."""
    if not output.endswith(".jsonl"):
        raise JaxserveError(f"a sparse model's embeddings are written as JSON Lines: --output must end in .jsonl, "
                         f"not {output!r}")
    rows = 0
    docs = iter(documents)
    with open(output, "wb") as f:
        while batch := list(itertools.islice(docs, chunk)):
            for weights in embed(batch):
                f.write(orjson.dumps(weights) + b"\n")
            rows += len(batch)
    return rows


def write_json_atomic(path: str, obj: dict) -> None:
    """Write JSON to a temporary file renamed over `path`: a reader sees the old file or the new one, whole."""
    with open(path + ".tmp", "w") as f:
        json.dump(obj, f)
    os.replace(path + ".tmp", path)
