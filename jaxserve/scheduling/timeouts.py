"""Requests' timeouts on one event loop, from one timer for all of them.

A request's own timer (`loop.call_later`, cancelled when it is answered) was
one of the larger items of a small request's path in a front-end process;
an entry in a dict, added and removed, costs a fraction of it. The timer
fires at the earliest expiry still pending, fails every future whose time is
up with TimeoutError, and is set again for the next one.
"""

from __future__ import annotations

import asyncio
import math

CLOCK_SLACK_S = 1e-3  # the loop's timers fire to the millisecond: a future due within this is due now


class Timeouts:
    """Futures that fail with TimeoutError unless they are done, or `discard`ed, within their timeout."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self._loop = loop
        self._expiry: dict[asyncio.Future, float] = {}  # the loop's clock
        self._timer: asyncio.TimerHandle | None = None
        self._due = math.inf  # when the timer fires

    def add(self, future: asyncio.Future, timeout_s: float | None) -> None:
        """Fail `future` after `timeout_s` (None: never)."""
        if timeout_s is None:
            return
        expiry = self._loop.time() + timeout_s
        self._expiry[future] = expiry
        if expiry < self._due:  # only a timeout shorter than those pending moves the timer
            self._arm(expiry)

    def discard(self, future: asyncio.Future) -> None:
        """`future` is answered (or its caller gone): its timeout no longer applies."""
        self._expiry.pop(future, None)

    def __len__(self) -> int:
        return len(self._expiry)

    def _arm(self, when: float) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._due = when
        self._timer = self._loop.call_at(when, self._sweep)

    def _sweep(self) -> None:
        self._timer, self._due = None, math.inf
        now = self._loop.time() + CLOCK_SLACK_S
        for future in [f for f, expiry in self._expiry.items() if expiry <= now]:
            del self._expiry[future]
            if not future.done():
                future.set_exception(TimeoutError())
        if self._expiry:
            self._arm(min(self._expiry.values()))
