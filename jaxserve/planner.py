"""Planning: which sequences run together, in which bucket, in which row and slot.

Pure Python/numpy, no JAX: `plan()` decides, `assemble()` builds the arrays of
one planned batch, and the engine runs them.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from jaxserve.buckets import Bucket, BucketTable


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


def plan_padded(lengths: list[int], table: BucketTable) -> list[PlannedBatch]:
    """One sequence per row, each in the smallest bucket that holds it; input order within a bucket."""
    by_bucket: dict[int, list[int]] = {}
    for i, n in enumerate(lengths):
        by_bucket.setdefault(table.pick(n).seqlen, []).append(i)
    batches = []
    for bucket in table.buckets:
        idx = by_bucket.get(bucket.seqlen, [])
        for start in range(0, len(idx), bucket.batch):
            batches.append(PlannedBatch(bucket, tuple((i,) for i in idx[start : start + bucket.batch])))
    return batches


def assemble(planned: PlannedBatch, seqs: list[np.ndarray]) -> dict[str, np.ndarray]:
    """The [B, S] input arrays of one batch: segment ids 1..k per row, positions restarting per sequence."""
    shape = planned.bucket.shape
    out = {k: np.zeros(shape, np.int32) for k in ("token_ids", "segment_ids", "positions", "type_ids")}
    for r, row in enumerate(planned.rows):
        col = 0
        for slot, i in enumerate(row, start=1):
            n = len(seqs[i])
            out["token_ids"][r, col : col + n] = seqs[i]
            out["segment_ids"][r, col : col + n] = slot
            out["positions"][r, col : col + n] = np.arange(n)
            col += n
    return out


def scatter(planned: PlannedBatch, pooled: np.ndarray, out: np.ndarray) -> None:
    """Copy each sequence's vector from the batch output [B, K, D] into its place in `out`."""
    for r, row in enumerate(planned.rows):
        for slot, i in enumerate(row):
            out[i] = pooled[r, slot]
