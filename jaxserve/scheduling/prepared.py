"""The prepared queue: batches copied to the device and waiting for a device slot, in the order they will run.

A batch led by interactive rows (`Dispatch.lead`) runs before any bulk-led
one prepared earlier, so a query does not wait behind a parked bulk batch.
A bulk-led batch whose oldest row has waited `max_bulk_wait_s` ranks as
interactive, in the order it was prepared: under any stream of interactive
batches it runs after at most the batches prepared before it. A stop (no
dispatch) runs after every batch. Pure bookkeeping: the pipeline's device
threads take from it under their own lock, passing `now`.
"""

from __future__ import annotations

import itertools

from jaxserve.scheduling.batcher import BULK, INTERACTIVE, Dispatch

STOP = BULK + 1  # a stop's rank: after every prepared batch


class PreparedQueue:
    def __init__(self, max_bulk_wait_s: float):
        self.max_bulk_wait_s = max_bulk_wait_s
        self._items: list[tuple[int, Dispatch | None, object]] = []  # (order prepared, dispatch, payload)
        self._count = itertools.count()

    def __len__(self) -> int:
        return len(self._items)

    def put(self, d: Dispatch | None, payload: object) -> None:
        """A prepared batch (`d` None: a stop)."""
        self._items.append((next(self._count), d, payload))

    def rank(self, d: Dispatch | None, now: float) -> int:
        if d is None:
            return STOP
        return INTERACTIVE if d.lead == INTERACTIVE or now - d.oldest >= self.max_bulk_wait_s else BULK

    def take(self, now: float) -> tuple[Dispatch | None, object]:
        """The batch to run next (IndexError when none waits)."""
        best = min(range(len(self._items)), key=lambda i: (self.rank(self._items[i][1], now), self._items[i][0]))
        _, d, payload = self._items.pop(best)
        return d, payload


def room(in_pipeline: int, max_inflight: int) -> str | None:
    """What may be prepared with `in_pipeline` batches prepared or on the device: "any" batch while there is room
    on the device or for one batch ready behind it; "interactive" for one more (a query is prepared at once and
    takes the next device slot ahead of the bulk batch prepared; aged bulk rows take their turn there too,
    `Batcher.next_dispatch`); else None."""
    if in_pipeline <= max_inflight:
        return "any"
    return "interactive" if in_pipeline <= max_inflight + 1 else None
