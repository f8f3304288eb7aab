"""The host's own time per dispatch, as the pipeline pays it, for the batcher's choice of batch sizes.

The batcher covers waiting rows with the buckets that cost least, a dispatch costing `max(its run time, the
host's time per dispatch)` (`runtime.buckets.dispatch_s`). Warm-up measures the host's part as the engine's
copy in, launch and copy out (`warm.host_dispatch_s`), but a served batch also costs the pipeline's own
bookkeeping: forming it, assembling its rows, scattering its outputs, waking the threads before and after it.
On a fast device that bookkeeping is the larger part, and a cost model without it splits a large request into
many small batches (100 rows as 64 + 16 + 16 + 4), each paying it again.

`HostCost` keeps a moving average of the CPU time the prepare and respond threads spend per batch, and says
when it has moved far enough from the value the batcher plans with that the covers should be derived again
(at most once every `REPLAN_EVERY` batches). The cost follows the plan, and a steady load
of queries could flip the plan between two values at every chance (docs/benchmarks.md), so a replan that reverses
the one before goes half way (the geometric mean), and the next reversal waits twice as long (up to
`REPLAN_EVERY_MOST`) unless it is past the band squared: a plan that flips settles where a plan between the two
holds its own cost, and flips seldom where none does, while a change of load past the band squared is planned
within two replans.
A fixed value (`--host-dispatch-us`) turns the measuring off. Pure bookkeeping: the pipeline times, this decides.
"""

from __future__ import annotations

import dataclasses
import math

MIN_BATCHES = 64  # batches seen before the first estimate counts (the first ones run cold)
SMOOTHING = 0.05  # weight of each new batch in the moving average
# The estimate must move this far (either way) from the planned value to replan, and this many batches must have
# run since the last replan (for a reversal within the band squared, `HostCost.every`: doubled by each). The
# cost per batch follows the batch sizes it plans (larger batches take longer to assemble and scatter), so a narrow
# band flaps between two plans, each replan deriving the covers again: tens of milliseconds of the respond thread.
REPLAN_RATIO = 1.5
REPLAN_EVERY = 2000
REPLAN_EVERY_MOST = 16 * REPLAN_EVERY


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
    every: int = REPLAN_EVERY  # batches before a near reversal may replan: doubled by each reversal, reset by a move on
    moved: int = 0  # the last replan's direction: 1 up, -1 down (0: none yet)

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
        since = self.batches - self.replanned_at if self.replanned_at else math.inf
        if self.batches < MIN_BATCHES or since < REPLAN_EVERY:
            return None
        target = max(self.floor, self.estimate)
        if self.planned / REPLAN_RATIO <= target <= self.planned * REPLAN_RATIO:
            return None
        moved = 1 if target > self.planned else -1
        if moved == -self.moved:  # back the way the last replan came: the plan moving its own cost, or the load
            near = self.planned / REPLAN_RATIO**2 <= target <= self.planned * REPLAN_RATIO**2
            if near and since < self.every:
                return None
            target = math.sqrt(target * self.planned)  # half way; a change of load is planned whole the next time
            self.every = min(2 * self.every, REPLAN_EVERY_MOST)
        else:
            self.every = REPLAN_EVERY
        if target == self.planned:  # (a floor of 0)
            return None
        self.planned, self.replanned_at, self.moved = target, self.batches, moved
        return target
