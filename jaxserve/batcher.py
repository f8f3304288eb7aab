"""The batching queue: a small state machine between the request handlers and the device worker.

Requests arrive as rows (one or several packed sequences each) already routed
to the smallest seqlen that holds them. Rows wait per seqlen. A dispatch
leaves when

- a seqlen has rows for its largest batch ("full"),
- or its oldest row has waited `max_wait_s` ("window"),
- or the device is idle with work queued ("idle": never idle the device
  waiting for a window).

The oldest row goes first among candidates. A dispatch takes the cheapest
batch size from the seqlen's batch ladder for the rows it has, and its spare
rows are filled with waiting rows of smaller seqlens (they fit, and spare rows
are computed anyway). No JAX, no asyncio, no HTTP: the caller passes `now`.
"""

from __future__ import annotations

import collections
import dataclasses

from jaxserve.buckets import Bucket, BucketTable
from jaxserve.planner import cheapest_cover, cost_model


@dataclasses.dataclass(frozen=True)
class QueuedRow:
    request: int  # the request it belongs to
    pieces: tuple[int, ...]  # the request's sequence indices in this row, in slot order
    tokens: int
    seqlen: int  # the smallest seqlen that holds it
    enqueued: float


@dataclasses.dataclass(frozen=True)
class Dispatch:
    bucket: Bucket
    rows: tuple[QueuedRow, ...]
    reason: str  # full, window or idle


class QueueFull(Exception):
    """More sequences would wait than the queue allows; try again later."""


class Batcher:
    def __init__(self, table: BucketTable, max_wait_s: float, max_queued: int):
        self.table = table
        self.max_wait_s = max_wait_s
        self.max_queued = max_queued  # sequences (documents, or chunks of one) waiting
        self._queues: dict[int, collections.deque[QueuedRow]] = {s: collections.deque() for s in table.seqlens}
        self._cost = cost_model(table)
        self.queued = 0

    @property
    def queued_rows(self) -> int:
        return sum(len(q) for q in self._queues.values())

    def submit(self, request: int, rows: list[tuple[tuple[int, ...], int]], now: float) -> None:
        """Queue one request's rows, each (sequence indices, tokens); all or nothing."""
        n = sum(len(pieces) for pieces, _ in rows)
        if self.queued + n > self.max_queued:
            raise QueueFull(f"{self.queued} sequences are waiting; {n} more would pass the limit of {self.max_queued}")
        for pieces, tokens in rows:
            seqlen = self.table.pick(tokens, docs=len(pieces)).seqlen
            self._queues[seqlen].append(QueuedRow(request, tuple(pieces), tokens, seqlen, now))
        self.queued += n

    def cancel(self, request: int) -> int:
        """Drop a request's waiting rows (its client went away); returns how many sequences were dropped."""
        dropped = 0
        for seqlen, q in self._queues.items():
            keep = [r for r in q if r.request != request]
            dropped += sum(len(r.pieces) for r in q if r.request == request)
            self._queues[seqlen] = collections.deque(keep)
        self.queued -= dropped
        return dropped

    def backlog(self) -> list[tuple[int, int]]:
        """(seqlen, rows) waiting, per seqlen."""
        return [(s, len(q)) for s, q in self._queues.items() if q]

    def next_deadline(self) -> float | None:
        """When the oldest waiting row's window closes (None with nothing queued)."""
        oldest = [q[0].enqueued for q in self._queues.values() if q]
        return min(oldest) + self.max_wait_s if oldest else None

    def next_dispatch(self, now: float, device_idle: bool) -> Dispatch | None:
        waiting = [s for s, q in self._queues.items() if q]
        if not waiting:
            return None
        oldest = lambda s: self._queues[s][0].enqueued
        full = [s for s in waiting if len(self._queues[s]) >= self.table.at(s)[-1].batch]
        expired = [s for s in waiting if now - oldest(s) >= self.max_wait_s]
        if full:
            seqlen, reason = min(full, key=oldest), "full"
        elif expired:
            seqlen, reason = min(expired, key=oldest), "window"
        elif device_idle:
            seqlen, reason = min(waiting, key=oldest), "idle"
        else:
            return None
        q = self._queues[seqlen]
        options = self.table.at(seqlen)
        bucket = cheapest_cover(min(len(q), options[-1].batch), options, self._cost)[0]
        rows = [q.popleft() for _ in range(min(bucket.batch, len(q)))]
        rows += self._fill_spare(bucket, bucket.batch - len(rows))
        self.queued -= sum(len(r.pieces) for r in rows)
        return Dispatch(bucket, tuple(rows), reason)

    def _fill_spare(self, bucket: Bucket, spare: int) -> list[QueuedRow]:
        """Oldest rows of smaller seqlens that fit the bucket's rows and slots."""
        taken: list[QueuedRow] = []
        while spare > 0:
            fits = [s for s, q in self._queues.items() if q and s < bucket.seqlen and len(q[0].pieces) <= bucket.slots]
            if not fits:
                break
            taken.append(self._queues[min(fits, key=lambda s: self._queues[s][0].enqueued)].popleft())
            spare -= 1
        return taken
