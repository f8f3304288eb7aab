"""Packing: which sequences share a row, and the seqlen each row needs. Pure numpy, no JAX.

The planner only packs one request's sequences into rows; the batcher alone
forms batches, across requests (`jaxserve.scheduling.batcher`).

- padded layout: one sequence per row.
- packed layout: sequences share rows, best-fit decreasing into rows of the
  table's packing width (`pack_width`: its cheapest seqlen per token, measured
  once warm) and up to the seqlen's slots. A sequence longer than the width
  opens a row of its own seqlen, which shorter sequences may then join.

Each row then goes to the smallest seqlen that holds its tokens and its
number of sequences (slots).
"""

from __future__ import annotations

import bisect
import dataclasses
import functools

import numpy as np

from jaxserve.errors import TooLongError
from jaxserve.runtime.buckets import Bucket, BucketTable, dispatch_s

# Without measured times, a dispatch costs its tokens plus this many: fewer
# dispatches win when the padded tokens are equal.
DISPATCH_OVERHEAD_TOKENS = 64
# Packing width of a table never timed: rows of 128-256 tokens measured best for
# MiniLM on CPU; once warm, the table's own times decide (`pack_width`).
UNTIMED_PACK_WIDTH = 256


def read_only(a: np.ndarray) -> np.ndarray:
    """`a`, marked read-only: an array made once and shared by many requests, so that a write into it raises
    instead of changing another request's."""
    a.flags.writeable = False
    return a


@dataclasses.dataclass(frozen=True)
class Rows:
    """One request's sequences packed into rows."""

    lengths: np.ndarray  # [P] tokens of each sequence, special tokens included
    members: np.ndarray  # [P] sequence indices, row after row, in slot order
    starts: np.ndarray  # [R + 1] where each row's sequences start in `members`
    seqlen: np.ndarray  # [R] the smallest seqlen that holds each row
    width: int | None = None  # packing width; None: one sequence per row

    @property
    def count(self) -> int:
        return len(self.seqlen)

    @functools.cached_property
    def docs(self) -> np.ndarray:
        """[R] sequences per row."""
        return self.starts[1:] - self.starts[:-1]  # np.diff's own overhead is most of it at this size

    @functools.cached_property
    def tokens(self) -> np.ndarray:
        """[R] real tokens per row."""
        return row_tokens(self.lengths, self.members, self.starts)

    @property
    def layout(self) -> str:
        return "padded" if self.width is None else "packed"

    @property
    def real_tokens(self) -> int:
        return int(self.lengths.sum())

    def row_members(self, r: int) -> np.ndarray:
        return self.members[self.starts[r]:self.starts[r + 1]]


def pack(lengths, table: BucketTable, layout: str | None = None) -> Rows:
    """Rows for sequences of these lengths on this table (`layout` defaults to the table's), longest seqlen
    first: the rows a batch takes of one request at several seqlens are then one slice of its tokens. A sequence
    longer than the longest seqlen raises TooLongError: the input's fault (a request's 400), never a server's 500."""
    lengths = np.asarray(lengths, np.int64).reshape(-1)
    derived = _derived(table)
    width = derived.width if (layout or table.layout) == "packed" else None
    if len(lengths) == 1:  # one sequence (a query)
        return derived.query_rows(table, width, int(lengths[0]))
    if len(lengths) and lengths.max() > table.max_seqlen:
        raise TooLongError(f"no bucket holds {int(lengths.max())} tokens (largest seqlen {table.max_seqlen})")
    if width is None or not len(lengths):  # padded, or no sequences
        rows = None
        members = np.arange(len(lengths))
        starts = np.arange(len(lengths) + 1)
    else:
        rows = _best_fit_decreasing(lengths, table, width)
        members, starts = _flat(rows, len(lengths))
    seqlen = route(row_tokens(lengths, members, starts), starts[1:] - starts[:-1], table)
    if len(seqlen) > 1 and (seqlen[1:] > seqlen[:-1]).any():  # longest rows first: a seqlen's rows consecutive
        order = np.argsort(-seqlen, kind="stable")
        seqlen = seqlen[order]
        if rows is None:
            members = order
        else:
            members, starts = _flat([rows[r] for r in order.tolist()], len(lengths))
    return Rows(lengths, members, starts, seqlen, width)


def _flat(rows: list[list[int]], n: int) -> tuple[np.ndarray, np.ndarray]:
    """Rows of sequence indices -> (members, starts)."""
    members = np.fromiter((i for row in rows for i in row), np.int64, n)
    return members, np.concatenate([[0], np.cumsum([len(row) for row in rows])])


def row_tokens(lengths: np.ndarray, members: np.ndarray, starts: np.ndarray) -> np.ndarray:
    """[R] tokens per row."""
    if not len(members):
        return np.zeros(0, np.int64)
    return np.add.reduceat(lengths[members], starts[:-1])


def route(tokens: np.ndarray, docs: np.ndarray, table: BucketTable) -> np.ndarray:
    """[R] the smallest seqlen holding each row's tokens and documents (vectorised `table.pick`)."""
    seqlens = np.asarray(table.seqlens)
    slots = np.asarray(table.slots_by_seqlen)  # non-decreasing (the table checks): searchsorted takes it
    i = np.maximum(np.searchsorted(seqlens, tokens, side="left"), np.searchsorted(slots, docs, side="left"))
    if len(i) and i.max() >= len(seqlens):
        r = int(np.argmax(i >= len(seqlens)))
        raise ValueError(f"no bucket holds {int(tokens[r])} tokens in {int(docs[r])} sequences "
                         f"(largest seqlen {table.max_seqlen})")
    return seqlens[i]


def _best_fit_decreasing(lengths: np.ndarray, table: BucketTable, width: int) -> list[list[int]]:
    """Longest first, each into the open row with the least room that still holds it."""
    rows: list[list[int]] = []
    open_rows: list[tuple[int, int]] = []  # (tokens left, row), sorted: rows with room and a free slot
    slots_left: list[int] = []
    order = np.argsort(-lengths, kind="stable")
    # the row each sequence would open: the smallest seqlen holding it, at least the width
    where = np.searchsorted(table.seqlens, np.maximum(lengths[order], width), side="left")
    open_seqlen = np.asarray(table.seqlens)[where].tolist()
    open_slots = np.asarray(table.slots_by_seqlen)[where].tolist()
    for i, n, seqlen, slots in zip(order.tolist(), lengths[order].tolist(), open_seqlen, open_slots):
        k = bisect.bisect_left(open_rows, (n, -1))
        if k < len(open_rows):
            room, r = open_rows.pop(k)
            rows[r].append(i)
            slots_left[r] -= 1
        else:
            r, room = len(rows), seqlen
            rows.append([i])
            slots_left.append(slots - 1)
        if slots_left[r] > 0 and room - n > 0:
            bisect.insort(open_rows, (room - n, r))
    return rows


def pack_width(table: BucketTable) -> int | None:
    """The seqlen packed rows are filled to: the cheapest per token among seqlens with several slots.

    Untimed tables use the largest such seqlen up to UNTIMED_PACK_WIDTH. Once per table (`_derived`).
    """
    return _derived(table).width


def _width(table: BucketTable) -> int | None:
    multi = [s for s in table.seqlens if table.at(s)[-1].slots > 1]
    if not multi:
        return None
    if all(b.run_s is not None for b in table.buckets):
        return min(multi, key=lambda s: (min(dispatch_s(b, table.host_dispatch_s) / b.tokens for b in table.at(s)), -s))
    fitting = [s for s in multi if s <= UNTIMED_PACK_WIDTH]
    return max(fitting) if fitting else min(multi)


@dataclasses.dataclass
class _Derived:
    """What packing reads of a table on every request, worked out once per table: computed per request, the
    packing width alone cost a front-end a measurable share of a one-document request's CPU."""

    width: int | None  # `pack_width`
    queries: dict[tuple[int | None, int], Rows] = dataclasses.field(default_factory=dict)  # by (width, length)

    def query_rows(self, table: BucketTable, width: int | None, length: int) -> Rows:
        """The Rows of one sequence of `length` tokens: made once per width and length, then shared by every
        query of that length (their arrays read-only), not five small arrays made per query."""
        rows = self.queries.get((width, length))
        if rows is None:
            if length > table.max_seqlen:
                raise TooLongError(f"no bucket holds {length} tokens (largest seqlen {table.max_seqlen})")
            arrays = (np.array([length]), np.zeros(1, np.int64), np.arange(2), np.array([table.pick(length).seqlen]))
            rows = self.queries[(width, length)] = Rows(*map(read_only, arrays), width)
        return rows


_derived_of: dict[int, tuple[BucketTable, _Derived]] = {}  # by table (identity): a server has one or two


def _derived(table: BucketTable) -> _Derived:
    known = _derived_of.get(id(table))
    if known is None or known[0] is not table:
        if len(_derived_of) >= 64:  # tables made in a loop (tests, benchmarks): forget them all, keep memory bounded
            _derived_of.clear()
        known = _derived_of[id(table)] = (table, _Derived(_width(table)))
    return known[1]


# ---- the cost of dispatches (used by the batcher to choose batch sizes) ----

def dispatch_cost(bucket: Bucket, timed: bool, host_s: float | None = None) -> float:
    """A dispatch's cost: its measured time (at least the host's per dispatch, `host_s`) once warmed, else its
    tokens plus a fixed overhead."""
    return dispatch_s(bucket, host_s) if timed else bucket.tokens + DISPATCH_OVERHEAD_TOKENS


def cost_model(table: BucketTable):
    """`dispatch_cost` for this table: timed only if every bucket of it was."""
    timed = all(b.run_s is not None for b in table.buckets)
    return lambda b: dispatch_cost(b, timed, table.host_dispatch_s)


def cheapest_covers(options: list[Bucket], cost, most: int,
                    with_costs: bool = False) -> list[Bucket | None] | tuple[list[Bucket | None], list[float]]:
    """For 0..`most` rows of one seqlen: the first (largest) bucket of the cheapest cover (`with_costs`: and each
    cover's cost, which the batcher weighs against another seqlen's).

    Dynamic programming once per table; the batcher then looks it up per dispatch.
    With measured times this picks the batch sizes with the best throughput
    (on a CPU, cache effects often make the smaller ones faster).
    """
    # per row count: (cost, dispatches, rows run, its first bucket); among equal costs fewer dispatches (less host
    # work), then fewer rows run (less padding: the buckets under the host's time per dispatch all cost the same)
    best: list[tuple[float, int, int, Bucket | None]] = [(0.0, 0, 0, None)] * (most + 1)
    costs = [cost(b) for b in options]
    for x in range(1, most + 1):
        candidates = []
        for b, c in zip(options, costs):
            rest_cost, dispatches, rows, _ = best[max(0, x - b.batch)]
            candidates.append((c + rest_cost, dispatches + 1, rows + b.batch, b))
        best[x] = min(candidates, key=lambda t: (round(t[0], 12), t[1], t[2]))  # costs equal to the picosecond tie
    first: list[Bucket | None] = [None] * (most + 1)
    for x in range(1, most + 1):  # the cover's largest bucket goes first
        n, largest = x, best[x][3]
        while n > 0:
            b = best[n][3]
            largest = b if b.batch > largest.batch else largest
            n -= min(b.batch, n)
        first[x] = largest
    return (first, [t[0] for t in best]) if with_costs else first


def cheapest_cover(n_rows: int, options: list[Bucket], cost) -> list[Bucket]:
    """The batch sizes (of one seqlen's ladder) that hold `n_rows` rows at the least cost, largest first."""
    covers = cheapest_covers(options, cost, n_rows)
    out = []
    while n_rows > 0:
        b = covers[n_rows]
        out.append(b)
        n_rows -= min(b.batch, n_rows)
    return out
