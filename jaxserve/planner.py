"""Planning: which sequences run together, in which bucket, in which row and slot.

Pure Python/numpy, no JAX: `plan()` decides, `assemble()` builds the arrays of
one planned batch, `scatter()` puts its outputs back in input order.

Padded: one sequence per row, each in the smallest seqlen that holds it.
Packed: several sequences share a row (first-fit decreasing, up to the
bucket's slots), each row then goes to the smallest seqlen that holds it. For
a packed table the planner tries each seqlen as the packing width, keeps the
padded plan as a candidate, and picks the cheapest plan that uses no more
dispatches than padding. Rows of one seqlen take the cheapest cover from the
seqlen's batch ladder (measured times once warm: the fastest batch sizes); a
batch that fits into spare rows of a larger seqlen's batch moves there, since
those rows are computed anyway. Cost: measured run times once warmed, else
padded tokens plus a per-dispatch overhead.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from jaxserve.buckets import Bucket, BucketTable

INPUT_NAMES = ("token_ids", "segment_ids", "positions", "type_ids")
# Without measured times, a dispatch costs its tokens plus this many: fewer
# dispatches win when the padded tokens are equal.
DISPATCH_OVERHEAD_TOKENS = 64


@dataclasses.dataclass(frozen=True)
class PlannedBatch:
    bucket: Bucket
    rows: tuple[tuple[int, ...], ...]  # per row, the indices of the sequences it holds (in slot order)

    def real_tokens(self, lengths) -> int:
        return sum(lengths[i] for row in self.rows for i in row)

    @property
    def padded_tokens(self) -> int:
        """What the dispatch computes: every row of the bucket, full or not."""
        return self.bucket.tokens

    @property
    def members(self) -> list[int]:
        return [i for row in self.rows for i in row]


@dataclasses.dataclass(frozen=True)
class Plan:
    lengths: tuple[int, ...]  # tokens per sequence, special tokens included
    batches: tuple[PlannedBatch, ...]
    pack_seqlen: int | None = None  # packing width; None = one sequence per row

    @property
    def layout(self) -> str:
        return "padded" if self.pack_seqlen is None else "packed"

    @property
    def real_tokens(self) -> int:
        return sum(self.lengths)

    @property
    def padded_tokens(self) -> int:
        return sum(b.padded_tokens for b in self.batches)

    @property
    def padding_ratio(self) -> float:
        """Share of the computed tokens that are padding."""
        return 1 - self.real_tokens / self.padded_tokens if self.padded_tokens else 0.0

    @property
    def dispatches(self) -> int:
        return len(self.batches)

    @property
    def predicted_s(self) -> float | None:
        """Sum of the buckets' measured run times; None if a bucket was never timed."""
        times = [b.bucket.run_s for b in self.batches]
        return None if any(t is None for t in times) else float(sum(times))

    def cost(self) -> tuple[float, int]:
        """(summed dispatch cost, dispatches): measured times if every bucket here was timed."""
        timed = self.predicted_s is not None
        return (sum(dispatch_cost(b.bucket, timed) for b in self.batches), self.dispatches)

    def summary(self, doc_of: list[int] | np.ndarray | None = None) -> dict:
        """The plan as plain data: per batch the bucket, its documents, real vs padded tokens; totals.

        `doc_of` maps each sequence to its document (chunked documents have several).
        """
        doc = (lambda i: int(doc_of[i])) if doc_of is not None else int
        return {
            "layout": self.layout,
            "pack_seqlen": self.pack_seqlen,
            "batches": [
                {
                    "bucket": {"batch": b.bucket.batch, "seqlen": b.bucket.seqlen, "slots": b.bucket.slots},
                    "rows_used": len(b.rows),
                    "documents": sorted({doc(i) for i in b.members}),
                    "real_tokens": b.real_tokens(self.lengths),
                    "padded_tokens": b.padded_tokens,
                    "predicted_s": b.bucket.run_s,
                }
                for b in self.batches
            ],
            "real_tokens": self.real_tokens,
            "padded_tokens": self.padded_tokens,
            "padding_ratio": self.padding_ratio,
            "dispatches": self.dispatches,
            "predicted_s": self.predicted_s,
        }


def plan(lengths: list[int], table: BucketTable, layout: str | None = None) -> Plan:
    """The plan for sequences of these lengths on this table (`layout` defaults to the table's)."""
    lengths = tuple(int(n) for n in lengths)
    padded = _finish(lengths, table, [[i] for i in range(len(lengths))], None)
    if (layout or table.layout) == "padded" or max(b.slots for b in table.buckets) == 1 or not lengths:
        return padded
    candidates = [padded] + [_pack(lengths, table, w) for w in table.seqlens if table.pick(w).slots > 1]
    allowed = [p for p in candidates if p.dispatches <= padded.dispatches]
    return min(allowed, key=Plan.cost)


def _pack(lengths: tuple[int, ...], table: BucketTable, width: int) -> Plan:
    """First-fit decreasing into rows `width` tokens wide (longer sequences open wider rows)."""
    rows: list[list[int]] = []
    room: list[tuple[int, int]] = []  # per row: tokens left, slots left
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        n = lengths[i]
        for r, (tokens_left, slots_left) in enumerate(room):
            if n <= tokens_left and slots_left > 0:
                rows[r].append(i)
                room[r] = (tokens_left - n, slots_left - 1)
                break
        else:
            opener = table.pick(max(n, width))
            rows.append([i])
            room.append((opener.seqlen - n, opener.slots - 1))
    return _finish(lengths, table, rows, width)


def _finish(lengths, table: BucketTable, rows: list[list[int]], width: int | None) -> Plan:
    """Rows -> each in its smallest seqlen -> batches (cheapest batch sizes) -> spare rows filled."""
    cost = cost_model(table)
    by_seqlen: dict[int, list[tuple[int, ...]]] = {}
    for row in rows:
        seqlen = table.pick(sum(lengths[i] for i in row), docs=len(row)).seqlen
        by_seqlen.setdefault(seqlen, []).append(tuple(row))
    batches: list[tuple[Bucket, list[tuple[int, ...]]]] = []
    for seqlen in table.seqlens:
        batches += _split(by_seqlen.get(seqlen, []), table.at(seqlen), cost)
    _fill_spare_rows(batches)
    return Plan(lengths, tuple(PlannedBatch(b, tuple(r)) for b, r in batches if r), width)


def dispatch_cost(bucket: Bucket, timed: bool) -> float:
    """A dispatch's cost: its measured time once warmed, else its tokens plus a fixed overhead."""
    return bucket.run_s if timed else bucket.tokens + DISPATCH_OVERHEAD_TOKENS


def cost_model(table: BucketTable):
    """`dispatch_cost` for this table: timed only if every bucket of it was."""
    timed = all(b.run_s is not None for b in table.buckets)
    return lambda b: dispatch_cost(b, timed)


def cheapest_cover(n_rows: int, options: list[Bucket], cost) -> list[Bucket]:
    """The batch sizes (of one seqlen's ladder) that hold `n_rows` rows at the least cost, largest first."""
    best = [(0.0, None)] * (n_rows + 1)  # best[x]: cheapest (cost, first bucket) covering x rows
    for x in range(1, n_rows + 1):
        best[x] = min(((cost(b) + best[max(0, x - b.batch)][0], b) for b in options), key=lambda t: (t[0], -t[1].batch))
    cover = []
    while n_rows > 0:
        cover.append(best[n_rows][1])
        n_rows -= min(cover[-1].batch, n_rows)
    return sorted(cover, key=lambda b: -b.batch)


def _split(rows, options: list[Bucket], cost) -> list[tuple[Bucket, list]]:
    """Rows of one seqlen -> the cheapest batch sizes that hold them all.

    With measured times this picks, per seqlen, the batch sizes with the best
    throughput (on a CPU, cache effects often make the smaller ones faster).
    """
    out, start = [], 0
    for bucket in cheapest_cover(len(rows), options, cost):
        out.append((bucket, rows[start : start + bucket.batch]))
        start += bucket.batch
    return out


def _fill_spare_rows(batches: list[tuple[Bucket, list]]) -> None:
    """Move a batch into the spare rows of a batch at a larger seqlen, which computes them anyway."""
    for small, rows in batches:
        if not rows:
            continue
        for big, big_rows in batches:
            if (big.seqlen > small.seqlen and big.batch - len(big_rows) >= len(rows) and big_rows
                    and big.slots >= max(map(len, rows))):
                big_rows.extend(rows)
                rows.clear()
                break


def assemble(planned: PlannedBatch, seqs: list[np.ndarray], types: list[np.ndarray] | None = None) -> dict[str, np.ndarray]:
    """The [B, S] input arrays of one batch: segment ids 1..k per row, positions restarting per sequence.

    `types`: token type ids per sequence (sentence pairs); zeros when None."""
    shape = planned.bucket.shape
    out = {k: np.zeros(shape, np.int32) for k in INPUT_NAMES}
    for r, row in enumerate(planned.rows):
        col = 0
        for slot, i in enumerate(row, start=1):
            n = len(seqs[i])
            out["token_ids"][r, col : col + n] = seqs[i]
            out["segment_ids"][r, col : col + n] = slot
            out["positions"][r, col : col + n] = np.arange(n)
            if types is not None:
                out["type_ids"][r, col : col + n] = types[i]
            col += n
    return out


def scatter(planned: PlannedBatch, pooled: np.ndarray, out: np.ndarray) -> None:
    """Copy each sequence's vector from the batch output [B, K, D] into its place in `out`."""
    for r, row in enumerate(planned.rows):
        for slot, i in enumerate(row):
            out[i] = pooled[r, slot]
