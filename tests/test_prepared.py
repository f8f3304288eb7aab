"""The prepared queue and the batcher together, as the pipeline drives them (`prepared.room`), on a simulated
device with an explicit clock: no JAX, no threads."""

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxserve.runtime.buckets import fixed
from jaxserve.scheduling.batcher import BULK, INTERACTIVE, Batcher, Classes, Dispatch
from jaxserve.scheduling.prepared import PreparedQueue, room

TABLE = fixed([(1, 16), (4, 16), (1, 64), (4, 64)], layout="packed")


def dispatch(lead: int, oldest: float) -> Dispatch:
    return Dispatch(TABLE.buckets[0], ((0, np.arange(1)),), "x", oldest, (lead,), lead)


def test_interactive_first_bulk_in_order_stops_last():
    q = PreparedQueue(max_bulk_wait_s=30.0)
    q.put(dispatch(BULK, 0.0), "bulk-1")
    q.put(None, "stop")
    q.put(dispatch(INTERACTIVE, 1.0), "query")
    q.put(dispatch(BULK, 0.5), "bulk-2")
    assert [q.take(1.0)[1] for _ in range(4)] == ["query", "bulk-1", "bulk-2", "stop"]


def test_a_parked_bulk_batch_ages_ahead_of_later_queries():
    """A bulk batch prepared before a stream of queries used to wait for a slot no query wanted: never, under
    steady interactive load. Once its oldest row has waited `max_bulk_wait_s` it runs before later queries."""
    q = PreparedQueue(max_bulk_wait_s=30.0)
    q.put(dispatch(BULK, 0.0), "bulk")
    q.put(dispatch(INTERACTIVE, 29.0), "query-1")
    assert q.take(29.0)[1] == "query-1"
    q.put(dispatch(INTERACTIVE, 31.0), "query-2")
    assert q.take(31.0)[1] == "bulk"


def test_room():
    assert [room(n, 2) for n in range(5)] == ["any", "any", "any", "interactive", None]


D = 0.1  # seconds each batch runs on the simulated device, one after another


@settings(max_examples=120, deadline=None)
@given(queries=st.lists(st.integers(0, 3), min_size=1, max_size=40), bulk=st.lists(st.sampled_from([16, 64]),
       min_size=1, max_size=40), max_inflight=st.integers(1, 3), age=st.floats(0.3, 2.0),
       late_bulk=st.integers(0, 20))
def test_every_bulk_row_runs_within_the_bound(queries, bulk, max_inflight, age, late_bulk):
    """Under any pattern of interactive arrivals (`queries[i]` one-row queries at step i, repeated: up to three
    times what the device runs, so queries may never stop waiting), every bulk row reaches the device within
    `max_bulk_wait_s + (2 * bulk rows + max_inflight + 3) * D` of its arrival: once aged it takes every other
    batch formed, and a prepared bulk batch ages in the prepared queue too."""
    b = Batcher(TABLE, max_wait_s=0.005, max_queued=10**9, classes=Classes(max_bulk_wait_s=age))
    ready = PreparedQueue(age)
    arrived = {}

    def bulk_job(job, seqlens, now):
        b.submit(job, np.array(seqlens), np.ones(len(seqlens), np.int64), now, BULK)
        arrived[job] = now

    bulk_job(0, bulk, 0.0)
    pending = {(0, r) for r in range(len(bulk))} | {(1, 0), (1, 1)}  # job 1: a second bulk job, arriving later
    bound = age + (2 * len(pending) + max_inflight + 3) * D
    on_device: list[Dispatch] = []
    now, step, jid = 0.0, 0, 2
    while pending:
        if step == late_bulk:
            bulk_job(1, [64, 16], now)
        now = round(now + D, 9)
        step += 1
        if on_device:
            on_device.pop(0)  # one batch finished
        for _ in range(queries[step % len(queries)]):
            b.submit(jid, np.array([16]), np.ones(1, np.int64), now, INTERACTIVE)
            jid += 1
        while (space := room(len(on_device) + len(ready), max_inflight)) is not None:
            d = b.next_dispatch(now, device_idle=len(on_device) + len(ready) < max_inflight,
                                interactive_only=space == "interactive")
            if d is None:
                break
            ready.put(d, d)
        while len(on_device) < max_inflight and len(ready):
            d, _ = ready.take(now)
            on_device.append(d)
            for job, rows in d.parts:
                for r in rows:
                    if (job, int(r)) in pending:
                        pending.discard((job, int(r)))
                        assert now - arrived[job] <= bound + 1e-9, (job, r, now, bound)
        assert now <= bound + late_bulk * D + D, f"bulk rows left at {now}: {sorted(pending)}"
