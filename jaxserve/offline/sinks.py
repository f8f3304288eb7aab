"""Where `jaxserve embed` writes: .npy, .parquet or (SPLADE) .jsonl, one sink family, resumable after a kill.

Every sink keeps only one chunk in memory and records progress only after a
chunk is safely on disk, so a killed run resumes at the first chunk that was
not finished. A run's state (input, fields, rows, the model's digest, dtype,
`--long`, prompt) is recorded with its progress and, once complete, in
OUTPUT.summary.json (v.npy.summary.json: each output its own): a partial or
finished output left by other arguments is refused (`check`, before any
compile), naming what differs, never silently mixed or overwritten; a finished
one with the same arguments is left as it is. Ids, when asked for, go in an
`id` column (Parquet), in each line (JSONL) or in a sidecar FILE.ids.jsonl
beside FILE.npy, one JSON value per row.
"""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import orjson

from jaxserve.errors import JaxserveError


class Sink:
    """One output: `check` (before any compile), `resume` -> rows already done, `write` each chunk in row order
    with its ids, `finish` with the run's summary. Subclasses say where partial progress is kept."""

    def __init__(self, path: str, state: dict, ids: bool):
        self.path, self.state, self.ids = path, state, ids
        self.rows, self.dim = state["rows"], state["dim"]
        self.summary_path = f"{path}.summary.json"
        self.complete = False

    def saved_state(self) -> dict | None:
        """The state a partial output recorded; None when there is none."""
        raise NotImplementedError

    def leftovers(self) -> str:
        """What to delete to start over."""
        raise NotImplementedError

    def check(self) -> bool:
        """Refuse an output written with other arguments, or by no recorded run (call before any compile).
        True when the output is already complete with these arguments: nothing is left to do."""
        directory = os.path.dirname(os.path.abspath(self.path))
        if not os.path.isdir(directory) or not os.access(directory, os.W_OK):
            raise JaxserveError(f"cannot write --output {self.path!r}: {directory} is not a writable directory")
        if os.path.exists(self.path) and not os.access(self.path, os.W_OK):
            raise JaxserveError(f"cannot write --output {self.path!r}: it exists and is read-only")
        saved = self.saved_state()
        if saved is not None:
            self._refuse_other(saved, "a partial run", self.leftovers())
            return False
        if not os.path.exists(self.path):
            return False
        finished = self._finished_state()
        if finished is None:
            raise JaxserveError(f"{self.path} exists, and no {self.summary_path} records the run that wrote it; "
                                f"delete it, or choose another --output")
        self._refuse_other(finished, "a finished run", self.path)
        self.complete = True
        return True

    def _refuse_other(self, saved: dict, what: str, leftovers: str) -> None:
        if saved == self.state:
            return
        keys = list(self.state) + [k for k in saved if k not in self.state]
        diff = ", ".join(f"{k} {saved.get(k)!r} (now {self.state.get(k)!r})" for k in keys
                         if saved.get(k) != self.state.get(k))
        raise JaxserveError(f"{self.path} holds {what} with other arguments: {diff}; rerun with those, "
                            f"or delete {leftovers} to start over")

    def _finished_state(self) -> dict | None:
        """The state OUTPUT.summary.json records for this output; None when it records none for it. An output
        finished by a jaxserve that named the summary by the stem (v.summary.json, shared by v.npy and v.parquet)
        is recognised by that file while it names this output; `summary_path` then points at it."""
        for path in (self.summary_path, os.path.splitext(self.path)[0] + ".summary.json"):
            try:
                with open(path) as f:
                    summary = json.load(f)
            except (OSError, ValueError):
                continue
            if (isinstance(summary, dict) and summary.get("output") == os.path.basename(self.path)
                    and isinstance(summary.get("state"), dict)):
                self.summary_path = path
                return summary["state"]
        return None

    def resume(self) -> int:
        """Rows already written by an earlier run with the same arguments (0 when starting fresh)."""
        if self.check():
            return self.rows
        return self._resume()

    def _resume(self) -> int:
        raise NotImplementedError

    def write(self, start: int, rows, ids: list | None = None) -> None:
        """Rows `start`.. of the output (vectors, or SPLADE's weight lists) and, with ids, theirs."""
        raise NotImplementedError

    def finish(self, summary: dict) -> None:
        """Make the output whole, record it as finished (the summary, with the state a rerun must match), then
        drop the partial run's files: a kill at any point leaves a resumable partial run or a finished one."""
        if self.complete:
            return
        self._seal()
        write_json_atomic(self.summary_path, {**summary, "output": os.path.basename(self.path), "state": self.state})
        self._drop_partial()

    def _seal(self) -> None:
        """Make the output whole (after the last chunk)."""

    def _drop_partial(self) -> None:
        raise NotImplementedError


class Progress:
    """FILE.progress: the state, rows done and the appended file's length after the last finished chunk
    (rewritten atomically after each chunk)."""

    def __init__(self, output: str):
        self.output, self.path = output, f"{output}.progress"

    def read(self) -> dict | None:
        if not (os.path.exists(self.path) and os.path.exists(self.output)):
            return None
        with open(self.path) as f:
            return json.load(f)

    def write(self, state: dict, done: int, length: int) -> None:
        write_json_atomic(self.path, {"state": state, "done": done, "bytes": length})

    def remove(self) -> None:
        os.remove(self.path)


def start_lines(path: str, length: int | None) -> None:
    """An appended file of lines, cut back to `length` (what the last finished chunk left), or emptied (None)."""
    with open(path, "r+b" if length is not None else "wb") as f:
        f.truncate(length or 0)


def append_lines(path: str, data: bytes) -> int:
    """Append `data`, on disk before this returns; the file's length after it."""
    with open(path, "ab") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
        return f.tell()


class ProgressSink(Sink):
    """A sink written in place, its progress in FILE.progress."""

    def __init__(self, path: str, state: dict, ids: bool):
        super().__init__(path, state, ids)
        self.progress = Progress(path)

    def leftovers(self) -> str:
        return f"{self.path} and {self.progress.path}"

    def saved_state(self) -> dict | None:
        saved = self.progress.read()
        return None if saved is None else saved["state"]

    def _drop_partial(self) -> None:
        self.progress.remove()


class NpySink(ProgressSink):
    """A memory-mapped [rows, dim] float32 .npy."""

    def __init__(self, path: str, state: dict, ids: bool):
        super().__init__(path, state, ids)
        self.ids_path = os.path.splitext(path)[0] + ".ids.jsonl"
        self.out = None

    def _resume(self) -> int:
        saved = self.progress.read()
        if saved is not None and saved["state"] == self.state and (not self.ids or os.path.exists(self.ids_path)):
            self.out = np.lib.format.open_memmap(self.path, mode="r+")
            if self.ids:
                start_lines(self.ids_path, saved["bytes"])  # drop ids written after the last finished chunk
            return saved["done"]
        self.progress.write(self.state, 0, 0)  # first: it counts only once the output exists
        if self.ids:
            start_lines(self.ids_path, None)
        self.out = np.lib.format.open_memmap(self.path, mode="w+", dtype=np.float32, shape=(self.rows, self.dim))
        return 0

    def write(self, start: int, rows: np.ndarray, ids: list | None = None) -> None:
        self.out[start : start + len(rows)] = rows
        self.out.flush()
        length = append_lines(self.ids_path, "".join(json.dumps(i) + "\n" for i in ids).encode()) if self.ids else 0
        self.progress.write(self.state, start + len(rows), length)


class JsonlSink(ProgressSink):
    """SPLADE's JSON Lines, one line per row: its non-zero weights [{"index", "value"}] in index order, or with
    ids {"id": ID, "weights": [...]}. Appended a chunk at a time; a resume cuts the file back to the length the
    last finished chunk left."""

    def _resume(self) -> int:
        saved = self.progress.read()
        if saved is not None and saved["state"] == self.state:
            start_lines(self.path, saved["bytes"])
            return saved["done"]
        self.progress.write(self.state, 0, 0)  # first: it counts only once the output exists
        start_lines(self.path, None)
        return 0

    def write(self, start: int, rows: list, ids: list | None = None) -> None:
        lines = ([orjson.dumps({"id": i, "weights": r}) for i, r in zip(ids, rows, strict=True)] if self.ids
                 else [orjson.dumps(r) for r in rows])
        length = append_lines(self.path, b"\n".join(lines) + b"\n" if lines else b"")
        self.progress.write(self.state, start + len(rows), length)


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
        if not os.path.exists(self.manifest):
            return None
        with open(self.manifest) as f:
            return json.load(f)

    def _resume(self) -> int:
        """The rows from 0 the parts hold without a gap; parts past a gap (a Ray job's, which finish out of order)
        are dropped, since a run in row order redoes them in its own chunks."""
        done = 0
        for start, count in self.open_parts():
            if start != done:
                os.remove(os.path.join(self.parts, f"part-{start:012d}-{count:09d}.parquet"))
            else:
                done += count
        return done

    def open_parts(self) -> list[tuple[int, int]]:
        """Start writing parts: those of an earlier run with the same arguments are kept (`finished`), anything
        else there is cleared. Call after `check`."""
        if self.saved_state() == self.state:
            return self.finished()
        shutil.rmtree(self.parts, ignore_errors=True)
        os.makedirs(self.parts)
        write_json_atomic(self.manifest, self.state)
        return []

    def _part_names(self) -> list[str]:
        """part-START-COUNT.parquet, in row order."""
        return sorted(n for n in os.listdir(self.parts) if n.startswith("part-") and n.endswith(".parquet"))

    def finished(self) -> list[tuple[int, int]]:
        """(start, count) of every part on disk, in row order: the rows a resume skips. Parts may finish out of
        order (the Ray job's workers write them), so they need not make a prefix."""
        return [(int(n.split("-")[1]), int(n.split("-")[2].split(".")[0])) for n in self._part_names()]

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

    def write(self, start: int, rows: np.ndarray, ids: list | None = None) -> None:
        import pyarrow.parquet as pq

        name = os.path.join(self.parts, f"part-{start:012d}-{len(rows):09d}.parquet")
        temporary = f"{name}.{os.getpid()}.tmp"  # its own per writer: a retried range may race the first try
        pq.write_table(self._table(start, rows, ids), temporary)
        os.replace(temporary, name)  # the same name whatever writes it: a range lands once

    def _seal(self) -> None:
        import pyarrow.parquet as pq

        names, expected = self._part_names(), 0
        for start, count in self.finished():  # every row once: the parts tile the rows
            if start != expected:
                raise JaxserveError(f"{self.parts}: rows {expected}..{start} have no part (or two parts overlap "
                                    "there); not sealing an output with rows missing or twice")
            expected += count
        if expected != self.rows:
            raise JaxserveError(f"{self.parts}: the parts hold {expected} rows, not {self.rows}; not sealing")
        schema = pq.read_schema(os.path.join(self.parts, names[0])) if names else self._table(
            0, np.zeros((0, self.dim), np.float32), []).schema
        with pq.ParquetWriter(self.path + ".tmp", schema) as writer:
            for name in names:
                writer.write_table(pq.read_table(os.path.join(self.parts, name)))
        os.replace(self.path + ".tmp", self.path)

    def _drop_partial(self) -> None:
        shutil.rmtree(self.parts)


SINKS = {".npy": NpySink, ".parquet": ParquetSink, ".jsonl": JsonlSink}
SPARSE_SUFFIX = ".jsonl"  # the sink of sparse (SPLADE) models; the others take dense vectors


def sink_class(path: str):
    ext = os.path.splitext(path)[1]
    if ext not in SINKS:
        raise JaxserveError(f"--output must end in .npy or .parquet (a sparse model: {SPARSE_SUFFIX}), not {path!r}")
    return SINKS[ext]


def open_sink(path: str, state: dict, ids: bool = False) -> Sink:
    """The sink for `path`; `state` (input, rows, dim, field, model, ...) is what a resume must match."""
    return sink_class(path)(path, state, ids)


def write_json_atomic(path: str, obj: dict) -> None:
    """Write JSON to a temporary file renamed over `path`: a reader sees the old file or the new one, whole."""
    with open(path + ".tmp", "w") as f:
        json.dump(obj, f)
    os.replace(path + ".tmp", path)
