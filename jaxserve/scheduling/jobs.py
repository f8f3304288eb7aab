"""A request's work as the batches see it, and the two copies between jobs and batches. Pure numpy.

Glossary (one meaning each, everywhere):
- document: one input of a request (a text, or a pair for classifiers);
- sequence: one model input cut from a document (the document, or one
  window of a long one), special tokens included;
- row: one or more sequences side by side in one row of a batch, each in its
  own slot (segment ids 1..K, positions restarting per sequence);
- job: one request's sequences packed into rows (`planner.pack`), laid out
  here as batches take them (each row padded to its seqlen), so that batches
  are filled without per-sequence Python;
- batch (a dispatch): rows of one or more jobs at one bucket shape.

A job holds its inputs as its rows already laid out for a batch: each row
padded to its own seqlen, one after another (`Job.flat`, made by the
front-end, which scales with the cores). `assemble` (in the engine, the one
serial process) then copies a dispatch's rows into one [4, B, S] int32 array
(token ids, segment ids, positions, type ids: one host-to-device transfer) as
a block per run of rows of one seqlen, with no per-token index; `scatter`
copies the [B, k, D] output (the slots the batch fills) back into each job's
per-sequence output, in input order; `keep` puts what the engine kept of some
sequences' full outputs (SPLADE rows over the cap) into their jobs' `kept`.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
import pickle

import numpy as np

from jaxserve.runtime.buckets import Bucket
from jaxserve.scheduling.planner import Rows, read_only


def ragged_arange(starts: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """concatenate([arange(s, s + c) for s, c in zip(starts, counts)]), without a Python loop."""
    counts = np.asarray(counts, np.int64)
    total = int(counts.sum())
    if total == 0:
        return np.zeros(0, np.int64)
    ends = np.cumsum(counts)
    return np.repeat(np.asarray(starts, np.int64) - (ends - counts), counts) + np.arange(total)


ZERO = read_only(np.zeros(1, np.int64))


@dataclasses.dataclass(frozen=True)
class _Query:
    """What every one-sequence job of one length and seqlen shares (read-only): its length, its row's planes but
    the ids, its row's extent in its tokens and in `flat`. Made once, not per query: small arrays made per request
    are a measurable share of a front-end's CPU per one-document request (docs/benchmarks.md)."""

    lengths: np.ndarray  # [1]
    flat: np.ndarray  # [4, S]: ids 0 (a job's copy puts its own), segment 1, positions 0..L-1, type 0; then padding
    row_start: np.ndarray  # [2] 0, L
    pad_start: np.ndarray  # [2] 0, S


QUERY_SHARED_TOKENS = 512  # longer single sequences make their own (a shared [4, S] per length: a few MB in all)


def _query(length: int, seqlen: int) -> _Query:
    return _shared_query(length, seqlen) if length <= QUERY_SHARED_TOKENS else _made_query(length, seqlen)


def _made_query(length: int, seqlen: int) -> _Query:
    flat = np.zeros((4, seqlen), np.int32)
    flat[1, :length], flat[2, :length] = 1, np.arange(length)
    return _Query(read_only(np.array([length])), read_only(flat), read_only(np.array([0, length])),
                  read_only(np.array([0, seqlen])))


_shared_query = functools.cache(_made_query)


class Job:
    """One request's sequences packed into rows, laid out as a batch takes them; its output fills in as its rows
    finish.

    `ids` [T] holds every sequence's token ids back to back (`offsets` [P + 1]),
    `types` the token type ids alike (sentence pairs) or None for zeros. `flat`
    [4, sum of the rows' seqlens] holds row r at `pad_start[r]`, padded with
    zeros to its seqlen; `row_start` and `seq_start` place rows and sequences
    among the job's real tokens (the index of a `tokens` output).
    `output`: `pooled` fills `out` [P, D], one vector per sequence; `tokens`
    fills `out` [T, D], one per token (TEI's /embed_all), in row order:
    `token_vectors(p)` gives sequence p's. `kept`: by sequence, what the engine
    kept of its full output where `out` could not hold it (a SPLADE row over the
    cap: `Engine.fetch_kept`), filled in the same pass.

    Across the link (`scheduling/link.py`) a job has no `out` in the engine
    process: `scatter` there gathers each batch's vectors for it, compact, and
    the front-end places them into its own `out` when they are first read (on
    the thread that reads them, which for a big response is not the event
    loop). The engine, the serial part, does one copy per vector instead of two
    and holds no output arrays.
    """

    def __init__(self, rows: Rows, ids: np.ndarray, offsets: np.ndarray, types: np.ndarray | None, out_dim: int,
                 output: str = "pooled"):
        self.rows = rows
        self.output = output
        if len(offsets) == 2:  # one sequence (a query): one row, slot 1, its tokens one slice of `ids`
            a, z = int(offsets[0]), int(offsets[1])
            query = _query(z - a, int(rows.seqlen[0]))
            lengths = query.lengths
            self.flat = query.flat.copy()  # [4, S]: segment 1, positions 0.., type 0, then padding
            self.flat[0, : z - a] = ids[a:z]
            if types is not None:
                self.flat[3, : z - a] = types[a:z]
            self.row_start, self.pad_start = query.row_start, query.pad_start
            self.seq_start, self.row_of, self.slot_of = ZERO, ZERO, ZERO
        else:
            lengths = offsets[1:] - offsets[:-1]
            order = rows.members  # sequences in row order
            in_order = lengths[order]
            src = ragged_arange(offsets[order], in_order)  # [T] each token's place in `ids`, row after row
            first = np.cumsum(in_order) - in_order  # each sequence's first token among the job's, in row order
            self.row_start = np.concatenate([[0], np.cumsum(rows.tokens)])  # [R + 1] each row's first token
            self.pad_start = np.concatenate([[0], np.cumsum(rows.seqlen)])  # [R + 1] each row's place in `flat`
            # [T] each token's column in `flat`: its place among the tokens, moved by the padding of the rows before
            at = np.arange(len(src)) + np.repeat(self.pad_start[:-1] - self.row_start[:-1], rows.tokens)
            slot = np.arange(len(order)) - np.repeat(rows.starts[:-1], rows.docs)  # each sequence's slot in its row
            self.flat = np.zeros((4, int(self.pad_start[-1])), np.int32)
            ids_plane, segments, positions, type_plane = self.flat
            ids_plane[at] = ids[src]  # each plane's values as int32 already: a scatter that casts is twice as slow
            segments[at] = np.repeat((slot + 1).astype(np.int32), in_order)
            positions[at] = np.arange(len(src), dtype=np.int32) - np.repeat(first.astype(np.int32), in_order)
            if types is not None:
                type_plane[at] = types[src]
            self.seq_start = np.empty(len(lengths), np.int64)  # each sequence's first token among the job's
            self.seq_start[order] = first
            # [P] by place in row order: each sequence's row and slot, so that `scatter` slices instead of searching
            self.row_of, self.slot_of = np.repeat(np.arange(rows.count), rows.docs), slot
        self.lengths = lengths
        size = int(self.row_start[-1]) if output == "tokens" else len(lengths)
        self._out: np.ndarray | None = np.zeros((size, out_dim), np.float32)  # [P, D] per sequence, or [T, D]
        # (where in `out`, vectors) per batch part: the engine's copy of a job gathers its outputs here, and the
        # front-end's holds them until `out` is read
        self.gathered: list[tuple[np.ndarray, np.ndarray]] = []
        self.remaining = len(lengths)  # sequences not yet done
        self.kept: dict[int, object] = {}

    @property
    def out(self) -> np.ndarray:
        """The outputs, with what came from the engine placed on this first read (a job's outputs are read by
        one thread at a time)."""
        if self.gathered:
            if len(self.gathered) == 1 and len(self._out) == 1:  # one vector (a query's): as it came, no copy
                self._out = self.gathered[0][1]
            else:
                place(self._out, self.gathered)
            self.gathered = []
        return self._out

    @property
    def out_shape(self) -> tuple[int, int]:
        return self._out.shape if self._out is not None else self._shape

    @property
    def out_size(self) -> int:
        """The outputs' floats, without placing them (what sizes a response)."""
        return math.prod(self.out_shape)

    def put(self, dst: np.ndarray, values: np.ndarray) -> None:
        """Outputs for sequences (or tokens) `dst`: written into `out`, or, in the engine's copy of a job from a
        front-end, kept as gathered for the front-end to place (`gathered`)."""
        if self._out is None:
            self.gathered.append((dst, values))
        else:
            self._out[dst] = values

    def receive(self, gathered: list[tuple[np.ndarray, np.ndarray]], kept: dict) -> None:
        """The front-end's job, finished by the engine: what it gathered, placed when `out` is read, and what was
        kept."""
        self.gathered, self.kept, self.remaining = gathered, kept, 0

    def __getstate__(self) -> tuple:
        """A job sent to the engine process (scheduling/link.py): its tokens and one array of all its indices
        (pickling ten small arrays each on its own cost a front-end more than the rest of the message); its
        outputs stay behind: the engine's copy has none, and gathers them (`put`) for the reply."""
        r = self.rows
        index = np.concatenate((r.lengths, r.members, r.starts, r.seqlen, self.row_start, self.pad_start,
                                self.seq_start, self.lengths, self.row_of, self.slot_of), dtype=np.int64)
        # raw buffers of known dtypes: a pickled array's dtype is rebuilt from its name on arrival, twice per job
        return (pickle.PickleBuffer(self.flat), pickle.PickleBuffer(index), len(self.lengths), len(r.seqlen),
                r.width, self.output, self.out_shape, self.remaining, self.kept)

    def __setstate__(self, state: tuple) -> None:
        flat, index, p, n_rows, width, self.output, out_shape, self.remaining, self.kept = state
        self.flat = np.frombuffer(flat, np.int32).reshape(4, -1)
        index = np.frombuffer(index, np.int64)
        parts, at = [], 0
        for n in (p, p, n_rows + 1, n_rows, n_rows + 1, n_rows + 1, p, p, p, p):  # in __getstate__'s order
            parts.append(index[at : at + n])
            at += n
        (lengths, members, starts, seqlen, self.row_start, self.pad_start, self.seq_start, self.lengths, self.row_of,
         self.slot_of) = parts
        self.rows = Rows(lengths, members, starts, seqlen, width)
        self._out, self._shape, self.gathered = None, tuple(out_shape), []  # outputs go back gathered

    def inputs_of(self, p: int) -> np.ndarray:
        """[4, L] sequence p's planes in `flat` (ids, segments, positions, types): for tests and reading a job."""
        a = int(self.seq_start[p])
        r = int(np.searchsorted(self.row_start, a, side="right")) - 1
        at = int(self.pad_start[r]) + a - int(self.row_start[r])
        return self.flat[:, at : at + int(self.lengths[p])]

    def token_vectors(self, p: int) -> np.ndarray:
        """[L, D] sequence p's token vectors (a `tokens` job)."""
        return self.out[self.seq_start[p] : self.seq_start[p] + self.lengths[p]]


def joined(jobs: list[Job]) -> Job:
    """One job of one-sequence jobs (queries that arrived together): sequence i is `jobs[i]`'s, each in its own row
    at its own seqlen, rows longest seqlen first as `pack` orders them. The engine then submits, forms, scatters
    and answers once for all of them, not once each; built from their flat tokens as they are (a few numpy calls
    however many there are: the front-end that joins them pays little for it)."""
    if any(len(j.lengths) != 1 or j.output != "pooled" for j in jobs):
        raise ValueError("only one-sequence jobs of pooled outputs are joined")
    widths = [j.flat.shape[1] for j in jobs]  # each query's one row, padded to its seqlen
    seqlen = np.array(widths, np.int64)
    order = np.argsort(-seqlen, kind="stable")  # row r holds sequence order[r]
    flat = np.concatenate([jobs[i].flat for i in order.tolist()], axis=1)
    lengths = np.concatenate([j.lengths for j in jobs])
    job = Job.__new__(Job)
    n = len(jobs)
    job.rows = Rows(lengths, order, np.arange(n + 1), seqlen[order], jobs[0].rows.width)
    job.output, job.flat, job.lengths = "pooled", flat, lengths
    job.row_start = np.concatenate(([0], np.cumsum(lengths[order])))
    job.pad_start = np.concatenate(([0], np.cumsum(job.rows.seqlen)))
    job.seq_start = np.empty(n, np.int64)
    job.seq_start[order] = job.row_start[:-1]
    job.row_of, job.slot_of = np.arange(n), np.zeros(n, np.int64)
    job._out = np.zeros((n, jobs[0].out_shape[1]), np.float32)
    job.gathered, job.remaining, job.kept = [], n, {}
    return job


def place(out: np.ndarray, gathered: list[tuple[np.ndarray, np.ndarray]]) -> None:
    """Each gathered part's vectors into `out` at its places (a front-end finishing a job the engine ran)."""
    for dst, values in gathered:
        out[dst] = values


def consecutive(rows: np.ndarray) -> bool:
    """Whether a part's rows (ascending: `Dispatch.parts`) follow one another in their job, as pack's order makes
    them: then their tokens, and their sequences' rows and slots, are one slice each."""
    return rows[-1] - rows[0] + 1 == len(rows)


def spanned(starts: np.ndarray, rows: np.ndarray) -> int:
    """sum(starts[r + 1] - starts[r] for r in rows): a part's tokens or sequences from their cumulative starts, as
    one subtraction where the rows are consecutive (numpy's sum of a small array costs more than the rest)."""
    if consecutive(rows):
        return int(starts[rows[-1] + 1] - starts[rows[0]])
    return int((starts[rows + 1] - starts[rows]).sum())


def assemble(bucket: Bucket, parts, jobs: dict[int, Job]) -> tuple[np.ndarray, int]:
    """([4, B, S] int32, real tokens): each part's rows (job, row indices) in consecutive batch rows; the rest zeros.

    A run of rows consecutive in their job and of one seqlen w is one block of its `flat`, [4, n, w] as it lies:
    one copy, as pack's order makes every part of one seqlen. Rows of jobs no longer in `jobs` (cancelled) stay
    padding."""
    b, s = bucket.shape
    out = np.zeros((4, b, s), np.int32)
    first = real = 0
    for job_id, rows in parts:
        job = jobs.get(job_id)
        if job is not None and len(rows) == 1:  # one row (a small request's): two slices
            r = rows[0]
            a, z = job.pad_start[r], job.pad_start[r + 1]
            out[:, first, : z - a] = job.flat[:, a:z]
            real += int(job.row_start[r + 1] - job.row_start[r])
        elif job is not None:
            widths = job.rows.seqlen[rows]  # [n] each row's width in `flat`
            w = int(widths[0])
            if consecutive(rows) and (widths == w).all():
                runs = ((0, len(rows), w),)
            else:  # cut where the rows stop being consecutive or change seqlen
                cuts = [0, *(np.flatnonzero((np.diff(rows) != 1) | (widths[1:] != widths[:-1])) + 1).tolist(),
                        len(rows)]
                runs = tuple((i, j, int(widths[i])) for i, j in itertools.pairwise(cuts))
            for i, j, w in runs:
                a = job.pad_start[rows[i]]
                out[:, first + i : first + j, :w] = job.flat[:, a : a + (j - i) * w].reshape(4, j - i, w)
            real += spanned(job.row_start, rows)
        first += len(rows)
    return out, real


def most_per_row(parts, jobs: dict[int, Job]) -> int:
    """The most sequences any of a dispatch's rows holds (0: all its jobs are gone): the output slots to copy back."""
    return max((int(job.rows.docs[rows].max()) for job_id, rows in parts
                if (job := jobs.get(job_id)) is not None and len(rows)), default=0)


def keep(parts, kept: dict | None, jobs: dict[int, Job]) -> None:
    """A batch's kept full outputs {(batch row, slot): value} (`Engine.fetch_kept`) -> the `kept` of the sequences
    in those slots (before `scatter`, which finishes their jobs). Python per kept sequence only: a few, and only
    in a batch that has them."""
    first = 0
    for job_id, rows in parts:
        if kept and (job := jobs.get(job_id)) is not None:
            r = job.rows
            for (b, k), value in kept.items():
                if first <= b < first + len(rows):
                    job.kept[int(r.members[r.starts[rows[b - first]] + k])] = value
        first += len(rows)


def scatter(parts, result: np.ndarray, jobs: dict[int, Job]) -> list[int]:
    """Copy a batch's outputs to its jobs: [B, k, D] per sequence (k at least the sequences of its fullest row),
    or [B, S, D] per token for `tokens` jobs.

    Returns the jobs now complete (in order, once each)."""
    done = []
    first = 0
    for job_id, rows in parts:
        job = jobs.get(job_id)
        if job is not None:
            r = job.rows
            if job.output == "tokens":
                s = result.shape[1]
                tokens = job.row_start[rows + 1] - job.row_start[rows]
                src = ragged_arange((first + np.arange(len(rows))) * s, tokens)
                job.put(ragged_arange(job.row_start[rows], tokens), result.reshape(-1, result.shape[-1])[src])
                n = spanned(r.starts, rows)
            elif len(rows) == 1:  # one row: its sequences are its first slots
                a, z = int(r.starts[rows[0]]), int(r.starts[rows[0] + 1])
                job.put(r.members[a:z], result[first, : z - a])
                n = z - a
            elif consecutive(rows):
                a, z = int(r.starts[rows[0]]), int(r.starts[rows[-1] + 1])
                job.put(r.members[a:z], result[job.row_of[a:z] + (first - rows[0]), job.slot_of[a:z]])
                n = z - a
            else:
                counts = r.starts[rows + 1] - r.starts[rows]
                seq = r.members[ragged_arange(r.starts[rows], counts)]
                slot = ragged_arange(np.zeros(len(rows), np.int64), counts)
                job.put(seq, result[np.repeat(first + np.arange(len(rows)), counts), slot])
                n = int(counts.sum())
            job.remaining -= n
            if job.remaining == 0:
                done.append(job_id)
        first += len(rows)
    return done
