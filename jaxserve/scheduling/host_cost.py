"""The host's own time per dispatch, as the pipeline pays it, for the batcher's choice of batch sizes.

The batcher covers waiting rows with the buckets that cost least, a dispatch costing `max(its run time, the
host's time per dispatch)` (`runtime.buckets.dispatch_s`). Warm-up measures the host's part as the engine's
copy in, launch and copy out (`warm.host_dispatch_s`), but a served batch also costs the pipeline's own
bookkeeping: forming it, assembling its rows, scattering its outputs, waking the threads before and after it.
On a fast device that bookkeeping is the larger part, and a cost model without it splits a large request into
many small batches (100 rows as 64 + 16 + 16 + 4), each paying it again.

`HostCost` keeps a moving average of the CPU time the prepare and respond threads spend per batch, and says
when it has moved far enough from the value the batcher plans with that the covers should be derived again
(at most once every `REPLAN_EVERY` batches).
A fixed value (`--host-dispatch-us`) turns the measuring off. Pure bookkeeping: the pipeline times, this decides.
"""

from __future__ import annotations

import dataclasses

MIN_BATCHES = 64  # batches seen before the first estimate counts (the first ones run cold)
SMOOTHING = 0.05  # weight of each new batch in the moving average
# The estimate must move this far (either way) from the planned value to replan, and this many batches must have
# run since the last replan. The cost per batch follows the batch sizes it plans (larger batches take longer to
# assemble and scatter), so a narrow band flaps between two plans (seen: 320 <-> 410 us, a replan every few
# hundred batches, each deriving the covers again: milliseconds of the respond thread).
REPLAN_RATIO = 1.5
REPLAN_EVERY = 2000


@dataclasses.dataclass
class HostCost:
    """`floor`: the table's own host time per dispatch (warm-up's), below which the plan never goes; `fixed`: a
    given value, planned with from the start and never changed."""

    floor: float
    fixed: float | None = None
    estimate: float | None = None  # moving average of the pipeline's CPU per batch (None: too few batches yet)
    batches: int = 0
    planned: float = dataclasses.field(init=False)
    replanned_at: int = 0  # `batches` at the last replan

    def __post_init__(self):
        self.planned = self.floor if self.fixed is None else self.fixed

    @property
    def measured(self) -> bool:
        return self.fixed is None

    def observe(self, seconds: float) -> float | None:
        """One batch's host time -> the host time per dispatch to plan with from now, when it changed (None: keep
        the plan)."""
        if self.fixed is not None:
            return None
        self.batches += 1
        self.estimate = seconds if self.estimate is None else (1 - SMOOTHING) * self.estimate + SMOOTHING * seconds
        if self.batches < MIN_BATCHES or (self.replanned_at and self.batches - self.replanned_at < REPLAN_EVERY):
            return None
        target = max(self.floor, self.estimate)
        if target > self.planned * REPLAN_RATIO or target < self.planned / REPLAN_RATIO:
            self.planned, self.replanned_at = target, self.batches
            return target
        return None
