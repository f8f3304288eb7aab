"""The batching queue: the one place batches are formed, a small state machine with no JAX, asyncio or HTTP.

Jobs (one request's rows, packed by the planner) arrive with each row routed
to the smallest seqlen that holds it. Rows wait per seqlen, as runs (a job's
consecutive rows of one seqlen, split when a batch takes part of one). A
dispatch leaves when

- the oldest row of some seqlen has waited `max_wait_s` ("window"); the
  oldest such row goes first, so no row waits behind a seqlen that is always
  full for longer than the rows queued ahead of it take to run;
- else a seqlen has rows for its largest batch ("full");
- else the device is about to idle with work queued ("idle": never idle the
  device waiting for a window).

A dispatch takes the cheapest batch size from the seqlen's batch ladder for
the rows it has (looked up, computed once per table), and its spare rows are
filled with waiting rows of smaller seqlens (they fit, and spare rows are
computed anyway). Ties go to the larger seqlen, whose spare rows can absorb
smaller ones. The caller passes `now`.
"""

from __future__ import annotations

import collections
import dataclasses
import functools

import numpy as np

from jaxserve.buckets import Bucket, BucketTable
from jaxserve.planner import cheapest_covers, cost_model


@dataclasses.dataclass(frozen=True)
class Run:
    """Consecutive rows of one job at one seqlen, waiting together."""

    job: int
    rows: np.ndarray  # the job's row indices
    docs: np.ndarray  # sequences in each of those rows
    enqueued: float

    def split(self, k: int) -> tuple["Run", "Run"]:
        return (Run(self.job, self.rows[:k], self.docs[:k], self.enqueued),
                Run(self.job, self.rows[k:], self.docs[k:], self.enqueued))


@dataclasses.dataclass(frozen=True)
class Dispatch:
    bucket: Bucket
    parts: tuple[tuple[int, np.ndarray], ...]  # (job, its row indices) in batch-row order
    reason: str  # window, full or idle
    oldest: float  # when its oldest row was queued

    @property
    def rows(self) -> int:
        return sum(len(r) for _, r in self.parts)

    @property
    def jobs(self) -> list[int]:
        return list(dict.fromkeys(job for job, _ in self.parts))


@functools.lru_cache(maxsize=32)
def covers(table: BucketTable) -> dict[int, list[Bucket | None]]:
    """Per seqlen, for 0..largest rows waiting: the batch size to dispatch (once per table: every
    request's explain and every in-process run makes a batcher)."""
    cost = cost_model(table)
    return {s: cheapest_covers(table.at(s), cost, table.at(s)[-1].batch) for s in table.seqlens}


class QueueFull(Exception):
    """More sequences would wait than the queue allows; try again later."""


class TooLarge(Exception):
    """A job with more sequences than the whole queue holds: retrying cannot help."""


class Batcher:
    def __init__(self, table: BucketTable, max_wait_s: float, max_queued: int):
        self.table = table
        self.max_wait_s = max_wait_s
        self.max_queued = max_queued  # sequences (documents, or chunks of one) waiting
        self._queues: dict[int, collections.deque[Run]] = {s: collections.deque() for s in table.seqlens}
        self._rows = dict.fromkeys(table.seqlens, 0)  # rows waiting per seqlen
        self._largest = {s: table.at(s)[-1].batch for s in table.seqlens}
        self.covers = covers(table)
        self.queued = 0

    @property
    def queued_rows(self) -> int:
        return sum(self._rows.values())

    def submit(self, job: int, seqlens: np.ndarray, docs: np.ndarray, now: float) -> None:
        """Queue one job's rows (their seqlens and sequences per row), all or nothing."""
        n = int(docs.sum())
        if n > self.max_queued:
            raise TooLarge(f"the request has {n} sequences; the queue holds at most {self.max_queued}")
        if self.queued + n > self.max_queued:
            raise QueueFull(f"{self.queued} sequences are waiting; {n} more would pass the limit of {self.max_queued}")
        for s in np.unique(seqlens).tolist():
            rows = np.flatnonzero(seqlens == s)
            self._queues[s].append(Run(job, rows, docs[rows], now))
            self._rows[s] += len(rows)
        self.queued += n

    def cancel(self, job: int) -> int:
        """Drop a job's waiting rows (its client went away); returns how many sequences were dropped."""
        dropped = 0
        for s, q in self._queues.items():
            if any(r.job == job for r in q):
                gone = [r for r in q if r.job == job]
                self._queues[s] = collections.deque(r for r in q if r.job != job)
                self._rows[s] -= sum(len(r.rows) for r in gone)
                dropped += sum(int(r.docs.sum()) for r in gone)
        self.queued -= dropped
        return dropped

    def backlog(self) -> list[tuple[int, int]]:
        """(seqlen, rows) waiting, per seqlen."""
        return [(s, n) for s, n in self._rows.items() if n]

    def oldest(self) -> float | None:
        """When the oldest waiting row was queued (None with nothing queued)."""
        heads = [q[0].enqueued for q in self._queues.values() if q]
        return min(heads) if heads else None

    def next_deadline(self) -> float | None:
        """When the oldest waiting row's window closes (None with nothing queued)."""
        oldest = self.oldest()
        return None if oldest is None else oldest + self.max_wait_s

    def next_dispatch(self, now: float, device_idle: bool) -> Dispatch | None:
        heads = [(q[0].enqueued, s) for s, q in self._queues.items() if q]
        if not heads:
            return None
        first = lambda hs: min(hs, key=lambda h: (h[0], -h[1]))  # oldest; ties: larger seqlen
        expired = [h for h in heads if now - h[0] >= self.max_wait_s]
        full = [h for h in heads if self._rows[h[1]] >= self._largest[h[1]]]
        if expired:
            (oldest, seqlen), reason = first(expired), "window"
        elif full:
            (oldest, seqlen), reason = first(full), "full"
        elif device_idle:
            (oldest, seqlen), reason = first(heads), "idle"
        else:
            return None
        bucket = self.covers[seqlen][min(self._rows[seqlen], self._largest[seqlen])]
        parts = self._take(seqlen, bucket.batch, bucket.slots)
        spare = bucket.batch - sum(len(r.rows) for r in parts)
        for s in sorted((s for s in self._queues if s < seqlen and self._queues[s]),
                        key=lambda s: (self._queues[s][0].enqueued, -s)):
            if spare == 0:
                break
            taken = self._take(s, spare, bucket.slots)
            spare -= sum(len(r.rows) for r in taken)
            parts += taken
        self.queued -= sum(int(r.docs.sum()) for r in parts)
        return Dispatch(bucket, tuple((r.job, r.rows) for r in parts), reason, oldest)

    def _take(self, seqlen: int, most: int, slots: int) -> list[Run]:
        """Up to `most` rows from the head of one seqlen's queue, whole runs first, the last one split."""
        q = self._queues[seqlen]
        taken = []
        while q and most > 0 and q[0].docs.max() <= slots:
            run = q.popleft()
            if len(run.rows) > most:
                run, rest = run.split(most)
                q.appendleft(rest)
            taken.append(run)
            most -= len(run.rows)
            self._rows[seqlen] -= len(run.rows)
        return taken
