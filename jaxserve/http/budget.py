"""The in-flight byte budget: what the request bodies being handled occupy, counted as they become (a compressed
body at its inflated size), shared by the event loop and the threads that inflate bodies."""

from __future__ import annotations

import threading


class ByteBudget:
    """At most `limit` bytes held at once by all requests' `Charge`s; one request alone may pass it (its size is
    --max-body-bytes' to refuse, with 413). `peak` is the most ever held."""

    def __init__(self, limit: int):
        self.limit = limit
        self.held = 0
        self.peak = 0
        self._lock = threading.Lock()

    def charge(self) -> Charge:
        return Charge(self)


class Charge:
    """One request's share of the budget: taken as its body arrives and inflates, given back all at once. A
    thread still inflating the body of a request that has ended (its client left) is refused more."""

    def __init__(self, budget: ByteBudget):
        self.budget = budget
        self.held = 0
        self.closed = False

    def take(self, n: int) -> bool:
        """Hold `n` more bytes if they fit (False, and nothing taken, if not)."""
        b = self.budget
        with b._lock:
            if self.closed or (b.held + n > b.limit and b.held > self.held):  # others hold bytes too
                return False
            b.held += n
            b.peak = max(b.peak, b.held)
            self.held += n
            return True

    def release(self) -> None:
        b = self.budget
        with b._lock:
            b.held -= self.held
            self.held = 0
            self.closed = True
