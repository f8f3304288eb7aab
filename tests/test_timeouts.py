"""Requests' timeouts from one timer (`scheduling/timeouts.py`), on a clock the test moves: nothing here waits."""

from __future__ import annotations

import asyncio

from hypothesis import given, settings
from hypothesis import strategies as st

from jaxserve.scheduling.timeouts import CLOCK_SLACK_S, Timeouts


class Clock:
    """The two things Timeouts asks of its loop, `time` and `call_at`, on a clock that moves only when told."""

    def __init__(self):
        self.now = 0.0
        self.timers: list[list] = []  # [when, callback, cancelled]

    def time(self) -> float:
        return self.now

    def call_at(self, when, callback):
        timer = [when, callback, False]
        self.timers.append(timer)
        return Handle(timer)

    def pending(self) -> list[float]:
        return [t[0] for t in self.timers if not t[2]]

    def advance(self, to: float) -> None:
        """Move to `to`, firing each timer due by then, in order."""
        while due := sorted((t for t in self.timers if not t[2] and t[0] <= to), key=lambda t: t[0]):
            timer = due[0]
            timer[2] = True
            self.now = max(self.now, timer[0])
            timer[1]()
        self.now = to


class Handle:
    def __init__(self, timer):
        self._timer = timer

    def cancel(self):
        self._timer[2] = True


async def test_a_future_not_done_in_time_fails_and_one_answered_does_not():
    loop = asyncio.get_running_loop()
    clock = Clock()
    t = Timeouts(clock)
    late, answered, gone = loop.create_future(), loop.create_future(), loop.create_future()
    for f in (late, answered, gone):
        t.add(f, 5.0)
    assert clock.pending() == [5.0]  # one timer for all three
    answered.set_result("vector")
    t.discard(answered)
    t.discard(gone)  # its caller went away
    clock.advance(4.9)
    assert not late.done() and not gone.done()
    clock.advance(5.0)
    assert isinstance(late.exception(), TimeoutError)
    assert answered.result() == "vector" and not gone.done() and len(t) == 0 and clock.pending() == []


async def test_no_timeout_adds_nothing():
    clock = Clock()
    t = Timeouts(clock)
    t.add(asyncio.get_running_loop().create_future(), None)
    assert len(t) == 0 and clock.pending() == []


async def test_a_shorter_timeout_moves_the_timer_and_the_longer_one_still_fires():
    loop = asyncio.get_running_loop()
    clock = Clock()
    t = Timeouts(clock)
    slow, fast = loop.create_future(), loop.create_future()
    t.add(slow, 60.0)
    clock.advance(1.0)
    t.add(fast, 0.5)
    assert clock.pending() == [1.5]
    clock.advance(1.5)
    assert isinstance(fast.exception(), TimeoutError) and not slow.done()
    assert clock.pending() == [60.0]  # set again for the next one
    clock.advance(60.0)
    assert isinstance(slow.exception(), TimeoutError) and len(t) == 0


async def test_a_future_done_before_its_time_is_left_as_it_is():
    loop = asyncio.get_running_loop()
    clock = Clock()
    t = Timeouts(clock)
    f = loop.create_future()
    t.add(f, 1.0)
    f.set_exception(ValueError("its batch failed"))  # answered, not yet discarded when the timer fires
    clock.advance(2.0)
    assert isinstance(f.exception(), ValueError) and len(t) == 0


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.floats(0, 10), st.sampled_from([0.5, 1.0, 30.0]), st.booleans()), max_size=40),
       st.floats(0, 50))
def test_each_future_fails_when_its_time_is_up_to_the_millisecond_property(arrivals, end):
    """Futures added at increasing times with one of a few timeouts, some answered at once: at any time, a future
    not answered has failed if its time is up, and not if its time is further than the timer's slack away (within
    the slack either is on time: a sweep fails what is due within it, and whether a sweep came that near the end
    depends on the other expiries); one timer is set at most."""
    loop = asyncio.new_event_loop()
    try:
        clock = Clock()
        t = Timeouts(clock)
        added = []
        for at, timeout_s, answered in sorted(arrivals):
            clock.advance(max(clock.now, at))
            f = loop.create_future()
            t.add(f, timeout_s)
            if answered:
                f.set_result(None)
                t.discard(f)
            added.append((clock.now + timeout_s, answered, f))
            assert len(clock.pending()) <= 1
        clock.advance(max(clock.now, end))
        for expiry, answered, f in added:
            failed = f.done() and not answered
            if not answered and clock.now < expiry <= clock.now + CLOCK_SLACK_S:
                continue  # within the slack of now: failed or not, on time
            assert failed == (not answered and expiry <= clock.now)
            if failed:
                assert isinstance(f.exception(), TimeoutError)
        if len(t):  # the timer is set no later than the earliest time still to come (a discard leaves it be)
            (due,) = clock.pending()
            assert due <= min(e for e, a, f in added if not f.done()) + 1e-9
    finally:
        loop.close()
