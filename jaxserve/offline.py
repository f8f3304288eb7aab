"""Offline corpora: documents streamed through the buckets into .npy or .parquet, resumable after a kill.

Both sinks keep only one chunk of vectors in memory and record progress only
after a chunk is safely on disk, so a killed run resumes at the first chunk
that was not finished.
"""

from __future__ import annotations

import itertools
import json
import os
import shutil
from collections.abc import Callable, Iterable

import numpy as np

from jaxserve.errors import JaxserveError


class NpySink:
    """A memory-mapped [rows, dim] float32 .npy; progress in FILE.progress (atomic rename per chunk)."""

    def __init__(self, path: str, rows: int, dim: int, source: str):
        self.path, self.rows, self.dim, self.source = path, rows, dim, source
        self.progress = f"{path}.progress"
        self.out = None

    def resume(self) -> int:
        """Rows already written by an interrupted run of the same input (0 when starting fresh)."""
        if os.path.exists(self.progress) and os.path.exists(self.path):
            state = json.loads(open(self.progress).read())
            if state.get("input") == self.source and state.get("rows") == self.rows:
                self.out = np.lib.format.open_memmap(self.path, mode="r+")
                return state["done"]
        self.out = np.lib.format.open_memmap(self.path, mode="w+", dtype=np.float32, shape=(self.rows, self.dim))
        return 0

    def write(self, start: int, vectors: np.ndarray) -> None:
        self.out[start : start + len(vectors)] = vectors
        self.out.flush()
        _write_json_atomic(self.progress, {"input": self.source, "rows": self.rows, "done": start + len(vectors)})

    def finish(self) -> None:
        os.remove(self.progress)


class ParquetSink:
    """A Parquet file with columns `row` (int64) and `embedding` (fixed-size list of float32).

    Chunks land as part files in FILE.parts/ (each renamed into place when
    complete); `finish` streams them, one row group each, into FILE.
    """

    def __init__(self, path: str, rows: int, dim: int, source: str):
        try:
            import pyarrow  # noqa: F401
        except ImportError:
            raise JaxserveError("parquet output needs pyarrow: pip install 'jaxserve[parquet]'") from None
        self.path, self.rows, self.dim, self.source = path, rows, dim, source
        self.parts = f"{path}.parts"
        self.manifest = os.path.join(self.parts, "manifest.json")

    def resume(self) -> int:
        want = {"input": self.source, "rows": self.rows, "dim": self.dim}
        if os.path.exists(self.manifest) and json.loads(open(self.manifest).read()) == want:
            return sum(int(name.split("-")[2].split(".")[0]) for name in self._part_names())
        shutil.rmtree(self.parts, ignore_errors=True)
        os.makedirs(self.parts)
        _write_json_atomic(self.manifest, want)
        return 0

    def _part_names(self) -> list[str]:
        """part-START-COUNT.parquet, in row order."""
        return sorted(n for n in os.listdir(self.parts) if n.startswith("part-") and n.endswith(".parquet"))

    def _table(self, start: int, vectors: np.ndarray):
        import pyarrow as pa

        flat = pa.array(np.ascontiguousarray(vectors, dtype=np.float32).reshape(-1))
        return pa.table({
            "row": pa.array(np.arange(start, start + len(vectors), dtype=np.int64)),
            "embedding": pa.FixedSizeListArray.from_arrays(flat, self.dim),
        })

    def write(self, start: int, vectors: np.ndarray) -> None:
        import pyarrow.parquet as pq

        name = os.path.join(self.parts, f"part-{start:012d}-{len(vectors):09d}.parquet")
        pq.write_table(self._table(start, vectors), name + ".tmp")
        os.replace(name + ".tmp", name)

    def finish(self) -> None:
        import pyarrow.parquet as pq

        names = self._part_names()
        schema = pq.read_schema(os.path.join(self.parts, names[0])) if names else self._table(0, np.zeros(
            (0, self.dim), np.float32)).schema
        with pq.ParquetWriter(self.path + ".tmp", schema) as writer:
            for name in names:
                writer.write_table(pq.read_table(os.path.join(self.parts, name)))
        os.replace(self.path + ".tmp", self.path)
        shutil.rmtree(self.parts)


SINKS = {".npy": NpySink, ".parquet": ParquetSink}


def open_sink(path: str, rows: int, dim: int, source: str):
    ext = os.path.splitext(path)[1]
    if ext not in SINKS:
        raise JaxserveError(f"--output must end in {' or '.join(SINKS)}, not {path!r}")
    return SINKS[ext](path, rows, dim, source)


def embed_corpus(documents: Iterable[str], embed: Callable[[list[str]], np.ndarray], sink, start: int,
                 chunk: int, on_chunk: Callable[[int], None] = lambda n: None) -> None:
    """Embed `documents` from row `start` (what `sink.resume()` said) chunk by chunk into `sink`, then finish it."""
    done = start
    docs = itertools.islice(documents, start, None)
    while batch := list(itertools.islice(docs, chunk)):
        sink.write(done, embed(batch))
        done += len(batch)
        on_chunk(len(batch))
    sink.finish()


def _write_json_atomic(path: str, obj: dict) -> None:
    with open(path + ".tmp", "w") as f:
        json.dump(obj, f)
    os.replace(path + ".tmp", path)
