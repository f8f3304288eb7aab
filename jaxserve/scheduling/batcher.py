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
smaller ones. Rows of a smaller seqlen also count towards the batch size when
running them padded up in this batch costs less than their own dispatch (a
dispatch costs at least the host's time: `merged_rows`). The caller passes
`now`.

Request classes (`Classes`): interactive rows leave at once, ahead of bulk
ones, whatever the window; a bulk row that has waited `max_bulk_wait_s`
("aged") goes first among bulk rows and takes every other dispatch while
interactive rows wait, so neither class starves the other.
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
import math

import numpy as np

from jaxserve.runtime.buckets import Bucket, BucketTable, dispatch_s
from jaxserve.scheduling.planner import cheapest_covers, cost_model, read_only

INTERACTIVE, BULK = 0, 1  # request classes, in the order they are served
ONE_ROW = read_only(np.zeros(1, np.int64))  # the row indices of a one-row job
CLASSES = ("interactive", "bulk")


@dataclasses.dataclass(frozen=True)
class Run:
    """Consecutive rows of one job at one seqlen, waiting together."""

    job: int
    rows: np.ndarray  # the job's row indices
    docs: np.ndarray  # sequences in each of those rows
    enqueued: float
    cls: int = INTERACTIVE
    deadline: float = math.inf  # when its request wants its answer (absolute); EDF within a class
    aged: bool = False  # a bulk run that waited `Classes.max_bulk_wait_s`: first among bulk runs, oldest first

    def split(self, k: int) -> tuple[Run, Run]:
        keep = (self.enqueued, self.cls, self.deadline, self.aged)  # the constructor: a third of `replace`'s cost
        return Run(self.job, self.rows[:k], self.docs[:k], *keep), Run(self.job, self.rows[k:], self.docs[k:], *keep)

    @property
    def key(self) -> tuple[bool, float, float, int]:
        return (not self.aged, -math.inf if self.aged else self.deadline, self.enqueued, self.job)


@dataclasses.dataclass(frozen=True)
class Dispatch:
    bucket: Bucket
    parts: tuple[tuple[int, np.ndarray], ...]  # (job, its row indices, ascending) in batch-row order
    reason: str  # interactive, aged, window, full or idle
    oldest: float  # when its oldest row was queued
    classes: tuple[int, ...] = (0,)  # the request classes of its rows
    lead: int = 0  # its rank on the device: the class it was formed for (INTERACTIVE for aged bulk rows' turn)

    @property
    def rows(self) -> int:
        return sum(len(r) for _, r in self.parts)

    @property
    def jobs(self) -> list[int]:
        return list(dict.fromkeys(job for job, _ in self.parts))


def covers(table: BucketTable) -> dict[int, list[Bucket | None]]:
    """Per seqlen, for 0..largest rows waiting: the batch size to dispatch."""
    return {s: first for s, (first, _) in plans(table).items()}


@functools.lru_cache(maxsize=32)
def plans(table: BucketTable) -> dict[int, tuple[list[Bucket | None], list[float]]]:
    """Per seqlen, for 0..largest rows waiting: the batch size to dispatch and the cost of covering them all
    (once per table: every request's explain and every in-process run makes a batcher)."""
    cost = cost_model(table)
    return {s: cheapest_covers(table.at(s), cost, table.at(s)[-1].batch, with_costs=True) for s in table.seqlens}


def merged_rows(seqlen: int, rows: int, smaller: list[tuple[int, int]], most: int,
                plan: dict[int, tuple[list, list[float]]]) -> int:
    """The rows a batch at `seqlen` is sized for: its own `rows`, plus rows of the `smaller` seqlens ((seqlen,
    rows waiting), larger first) wherever running them padded up in it costs no more than their own cover (at
    most `most` in all). Their cover's cost counts the host's time per dispatch, so when that time exceeds the
    buckets' run times a request's rows at several seqlens leave in one dispatch instead of one per seqlen."""
    cost = plan[seqlen][1]
    for s, n in smaller:
        own = plan[s][1]
        n = min(n, len(own) - 1)  # beyond its largest batch the rest leave in dispatches of their own anyway
        k = min(n, most - rows)
        if k <= 0:
            break
        if cost[rows + k] <= cost[rows] + own[n] - own[n - k]:
            rows += k
    return rows


def _by_seqlen(seqlens: np.ndarray, docs: np.ndarray) -> list[tuple[int, np.ndarray, np.ndarray]]:
    """A job's rows by seqlen: (seqlen, row indices, their sequences per row). `planner.pack` puts each seqlen's
    rows in one range (longest first), so a range's rows are an arange and its docs a slice; any other order is
    grouped by value. The ranges' bounds come from a loop over a list: for a few dozen rows, run cold once per job,
    it costs the engine less than numpy's calls on small arrays do (docs/benchmarks.md)."""
    if len(seqlens) <= 1:  # a query's one row, or none (an empty request)
        return [(int(s), ONE_ROW, docs) for s in seqlens.tolist()]
    every = seqlens.tolist()
    bounds = [0, *(i for i in range(1, len(every)) if every[i] != every[i - 1]), len(every)]
    values = [every[a] for a in bounds[:-1]]
    if len(set(values)) == len(values):
        return [(s, np.arange(a, z), docs[a:z]) for s, a, z in zip(values, bounds, bounds[1:])]
    return [(s, rows, docs[rows]) for s in np.unique(seqlens).tolist() for rows in [np.flatnonzero(seqlens == s)]]


def by_job(runs: list[Run]) -> tuple[tuple[int, np.ndarray], ...]:
    """A batch's runs as one part per job, in order of each job's first run, its rows ascending: a request's rows
    at several seqlens in one batch are assembled, scattered and counted once, not once per seqlen, and rows
    consecutive in the job are one slice of its tokens and outputs (`jobs.assemble`, `jobs.scatter`). Any row
    order within a batch is as good as another (each row is whole)."""
    rows: dict[int, list[np.ndarray]] = {}
    for r in runs:
        rows.setdefault(r.job, []).append(r.rows)
    return tuple((job, rs[0] if len(rs) == 1 else np.sort(np.concatenate(rs))) for job, rs in rows.items())


class QueueFull(Exception):
    """More tokens would wait than the queue allows; try again later."""


class TooLarge(Exception):
    """A job with more tokens than the whole queue holds: retrying cannot help."""


QUEUE_DEVICE_S = 2.0  # the default queue: this many seconds of device work at the table's best measured rate
MIN_QUEUE_TOKENS = 2**18  # ... but at least this many tokens (a full request of 1024 inputs of 256 tokens) ...
MAX_QUEUE_TOKENS = 2**24  # ... and at most this many (16 bytes each: 256 MiB, 5/4 with queries: `_admit`)


def queue_tokens(table: BucketTable, device_s: float = QUEUE_DEVICE_S) -> int:
    """The default bound of the queue, in tokens: `device_s` of work at the table's fastest bucket (timed at
    warmup, host cost per dispatch included), clamped to [MIN_QUEUE_TOKENS, MAX_QUEUE_TOKENS]. An untimed
    table gets the minimum."""
    rates = [b.tokens / dispatch_s(b, table.host_dispatch_s) for b in table.buckets if b.run_s is not None]
    best = int(device_s * max(rates)) if rates else 0
    return min(MAX_QUEUE_TOKENS, max(MIN_QUEUE_TOKENS, best))


@dataclasses.dataclass(frozen=True)
class Classes:
    """How the batcher treats request classes (see docs/design.md, "Request classes").

    `max_bulk_wait_s`: a bulk row that has waited this long goes first among bulk rows and takes turns with
    interactive ones (aging: nothing starves); prepared batches age the same way (`prepared.PreparedQueue`).
    `likely_s`: after an interactive row arrived, this long counts as "interactive work likely" (bulk batches
    are then cut to `bulk_dispatch_s`; the service hands a prepared interactive batch to the device before any
    prepared bulk one).
    `bulk_share`: the part of the queue (in tokens) bulk rows may fill; the rest is kept for interactive ones.
    `bulk_dispatch_s`: while interactive work is likely, a batch of bulk rows is at most the largest of its
    seqlen's batches predicted to run this long (a query arriving then waits for about one such dispatch, not
    for the largest batch memory allows) ...
    `bulk_efficiency`: ... unless that batch's tokens/s is below this share of the seqlen's best, when it is the
    smallest batch that reaches it (bulk throughput is not traded away for the cap).
    """

    max_bulk_wait_s: float = 30.0
    likely_s: float = 1.0
    bulk_share: float = 1.0
    bulk_dispatch_s: float = math.inf
    bulk_efficiency: float = 0.9


@functools.lru_cache(maxsize=32)
def bulk_caps(table: BucketTable, dispatch_limit_s: float, efficiency: float) -> dict[int, int]:
    """Per seqlen, the most rows a bulk-led batch takes while interactive work is likely (`Classes`); an untimed
    seqlen keeps its largest batch."""
    caps = {}
    for s in table.seqlens:
        ladder = table.at(s)
        if any(b.run_s is None for b in ladder):
            caps[s] = ladder[-1].batch
            continue
        rate = {b.batch: b.tokens / dispatch_s(b, table.host_dispatch_s) for b in ladder}
        within = [b.batch for b in ladder if dispatch_s(b, table.host_dispatch_s) <= dispatch_limit_s]
        cap = max(within, default=ladder[0].batch)
        if rate[cap] < efficiency * max(rate.values()):  # too short to run efficiently: the first batch that does
            cap = max(cap, min(b for b, r in rate.items() if r >= efficiency * max(rate.values())))
        caps[s] = cap
    return caps


class Interactive:
    """Interactive work on one device, which several batchers may feed (a server's pooled and token outputs): when
    an interactive job last arrived at any of them, and the batchers whose waiting interactive rows count. A query
    on one output waits behind the bulk batches of every output, so it cuts them all short (`Classes.likely_s`)."""

    def __init__(self):
        self.last = -math.inf  # when an interactive job last arrived
        self.batchers: list[Batcher] = []

    def likely(self, now: float, likely_s: float) -> bool:
        return now - self.last < likely_s or any(b.has_interactive() for b in self.batchers)


class Batcher:
    def __init__(self, table: BucketTable, max_wait_s: float, max_queued: int, classes: Classes = Classes(),
                 interactive: Interactive | None = None):
        self.table = table
        self.max_wait_s = max_wait_s
        # tokens waiting, counted as the device will run them: each row at its seqlen (padding in the row included),
        # so the bound is an amount of device work, whatever the documents' lengths
        self.max_queued = max_queued
        self.classes = classes
        # per class, per seqlen: runs in (deadline, enqueued) order
        self._queues: list[dict[int, list[Run]]] = [{s: [] for s in table.seqlens} for _ in CLASSES]
        # per class, per seqlen: runs with a deadline; without any, a queue is in arrival order (aged runs first,
        # the oldest of all) and its head is its oldest run: finding it costs O(1), not a scan of every run
        self._timed = [dict.fromkeys(table.seqlens, 0) for _ in CLASSES]
        self._rows = [dict.fromkeys(table.seqlens, 0) for _ in CLASSES]  # rows waiting per class, seqlen
        self._largest = {s: table.at(s)[-1].batch for s in table.seqlens}
        self._bulk_cap = bulk_caps(table, classes.bulk_dispatch_s, classes.bulk_efficiency)
        self.plan = plans(table)  # per seqlen: (covers, their costs); replaced when the host's time is measured
        self.queued = 0  # tokens waiting
        self.queued_by = [0, 0]  # tokens waiting per class (a promoted bulk row still counts as bulk)
        # shared with the other batchers of its device (None: a device of its own)
        self.interactive = Interactive() if interactive is None else interactive
        self.interactive.batchers.append(self)
        self._aged_turn = False  # an interactive-led batch left while aged bulk rows waited: theirs is next
        self._age_at = math.inf  # no waiting bulk row ages before this (`_age`)

    @property
    def covers(self) -> dict[int, list[Bucket | None]]:
        return {s: first for s, (first, _) in self.plan.items()}

    @property
    def queued_rows(self) -> int:
        return sum(sum(r.values()) for r in self._rows)

    def bulk_limit(self) -> int:
        return max(1, int(self.max_queued * self.classes.bulk_share))

    def submit(self, job: int, seqlens: np.ndarray, docs: np.ndarray, now: float, cls: int = BULK,
               deadline: float = math.inf) -> None:
        """Queue one job's rows (their seqlens and sequences per row), all or nothing."""
        runs = _by_seqlen(seqlens, docs)
        n = sum(s * len(rows) for s, rows, _ in runs)  # tokens at their rows' seqlens
        self.within(n)
        self._admit(n, cls)
        if cls == INTERACTIVE:
            self.interactive.last = now
        for s, rows, run_docs in runs:
            run = Run(job, rows, run_docs, now, cls, deadline)
            bisect.insort(self._queues[cls][s], run, key=lambda r: r.key)
            self._timed[cls][s] += deadline < math.inf
            self._rows[cls][s] += len(rows)
        self.queued += n
        self.queued_by[cls] += n
        if cls == BULK:
            self._age_at = min(self._age_at, now + self.classes.max_bulk_wait_s)

    def within(self, n: int) -> None:
        """Raise TooLarge where a job of `n` tokens (its rows at their seqlens) is more than the whole queue holds."""
        if n > self.max_queued:
            raise TooLarge(f"the request needs {n} tokens (its rows at their seqlens); the queue holds at most "
                           f"{self.max_queued}")

    def _admit(self, n: int, cls: int) -> None:
        """Raise QueueFull unless `n` more tokens of class `cls` may wait. Bulk tokens may fill `bulk_limit`, and a
        bulk job larger than that (up to the whole queue: a request of the most inputs at the largest seqlen may be
        that large) may wait alone, with no other bulk tokens; interactive tokens may fill the rest of the queue,
        and the reserved part (`max_queued - bulk_limit`) always, however many bulk tokens wait. So queries are never
        refused for room a bulk job holds, and at most `max_queued + max_queued - bulk_limit` tokens wait."""
        reserve = self.max_queued - self.bulk_limit()
        if cls == INTERACTIVE and self.queued_by[INTERACTIVE] + n <= reserve:
            return
        if self.queued + n > self.max_queued:
            raise QueueFull(f"{self.queued} tokens are waiting; {n} more would pass the limit of {self.max_queued}")
        if cls == BULK and self.queued_by[BULK] + n > self.bulk_limit() and self.queued_by[BULK] > 0:
            alone = "; a request over the bulk limit waits only alone: split it to wait with others" \
                if n > self.bulk_limit() else ""
            raise QueueFull(f"{self.queued_by[BULK]} bulk tokens are waiting; {n} more would pass the bulk limit of "
                            f"{self.bulk_limit()} (the rest of the queue is kept for interactive requests){alone}")

    def cancel(self, job: int) -> int:
        """Drop a job's waiting rows (its client went away); returns how many sequences were dropped."""
        dropped = tokens = 0
        for c, queues in enumerate(self._queues):
            for s, q in queues.items():
                gone = [r for r in q if r.job == job]
                if gone:
                    queues[s] = [r for r in q if r.job != job]
                    self._rows[c][s] -= sum(len(r.rows) for r in gone)
                    self._timed[c][s] -= sum(r.deadline < math.inf for r in gone)
                    for r in gone:
                        dropped += int(r.docs.sum())
                        tokens += len(r.rows) * s
                        self.queued_by[r.cls] -= len(r.rows) * s
        self.queued -= tokens
        return dropped

    def backlog(self, cls: int | None = None) -> list[tuple[int, int]]:
        """(seqlen, rows) waiting, per seqlen: of every class, or those a new `cls` row waits behind."""
        classes = range(len(CLASSES)) if cls is None or cls == BULK else [INTERACTIVE]
        rows = {s: sum(self._rows[c][s] for c in classes) for s in self.table.seqlens}
        return [(s, n) for s, n in rows.items() if n]

    def waiting(self) -> dict[str, int]:
        """Tokens waiting per class."""
        return dict(zip(CLASSES, self.queued_by))

    def oldest(self) -> float | None:
        """When the oldest waiting row was queued (None with nothing queued)."""
        heads = [self._first(c, s) for c, queues in enumerate(self._queues) for s, q in queues.items() if q]
        return min(heads) if heads else None

    def _first(self, cls: int, seqlen: int) -> float:
        """When the oldest run of a non-empty queue was queued: its head's time, unless deadlines reordered it."""
        q = self._queues[cls][seqlen]
        return min(r.enqueued for r in q) if self._timed[cls][seqlen] else q[0].enqueued

    def _first_young(self, seqlen: int) -> float | None:
        """When the oldest bulk run at `seqlen` not yet aged was queued (None: none); aged runs lead a queue
        without deadlines, so this reads only past them."""
        q = self._queues[BULK][seqlen]
        if self._timed[BULK][seqlen]:
            return min((r.enqueued for r in q if not r.aged), default=None)
        return next((r.enqueued for r in q if not r.aged), None)

    def next_wakeup(self) -> float | None:
        """When the next thing changes without a new arrival: a window closes or a bulk row ages (None: idle)."""
        oldest = self.oldest()
        if oldest is None:
            return None
        times = [oldest + self.max_wait_s]
        bulk = [t for s in self.table.seqlens if (t := self._first_young(s)) is not None]
        if bulk:
            times.append(min(bulk) + self.classes.max_bulk_wait_s)
        return min(times)

    def has_interactive(self) -> bool:
        """Interactive rows waiting (a dispatch now would lead with them)."""
        return any(self._rows[INTERACTIVE].values())

    def interactive_likely(self, now: float) -> bool:
        """Interactive rows wait, or one arrived within `likely_s`, at this batcher or another of its device."""
        return self.interactive.likely(now, self.classes.likely_s)

    def _age(self, now: float) -> None:
        """Bulk rows that waited `max_bulk_wait_s` go first among bulk rows, oldest first, and take turns with
        interactive ones (`next_dispatch`): no row starves, and none outranks a query. Skipped before `_age_at`,
        the earliest a waiting young row can age (rows leaving only make it later), not scanned per dispatch."""
        if now < self._age_at:
            return
        young = []
        for s, q in self._queues[BULK].items():
            t = self._first_young(s) if q else None
            if t is not None and now - t >= self.classes.max_bulk_wait_s:
                q = [dataclasses.replace(r, aged=True) if now - r.enqueued >= self.classes.max_bulk_wait_s else r
                     for r in q]
                self._queues[BULK][s] = sorted(q, key=lambda r: r.key)
                t = self._first_young(s)  # the oldest row still young, if any
            if t is not None:
                young.append(t)
        self._age_at = min(young, default=math.inf) + self.classes.max_bulk_wait_s

    def next_dispatch(self, now: float, device_idle: bool, interactive_only: bool = False) -> Dispatch | None:
        """Interactive rows first, at once (earliest deadline first), their spare rows filled with bulk rows; bulk
        rows alone by window, full or idle, and while interactive work is likely at most `Classes.bulk_dispatch_s`
        long. Aged bulk rows take every other dispatch while interactive rows wait, so neither class starves
        (`interactive_only`: the caller has room only for an interactive batch, or aged rows' turn)."""
        self._age(now)
        first = lambda hs: min(hs, key=lambda h: (h[0], -h[1]))  # earliest; ties: larger seqlen
        most = self._bulk_cap if self.interactive_likely(now) else self._largest
        aged = [(q[0].enqueued, s) for s, q in self._queues[BULK].items() if q and q[0].aged]
        inter = [(q[0].key, s) for s, q in self._queues[INTERACTIVE].items() if q]
        if aged and (self._aged_turn if inter else not interactive_only):
            # their turn, or no query waits: aged rows lead, ranked as interactive on the device (a turn may take
            # the room kept for queries, or under steady queries aged rows would never get room)
            self._aged_turn = False
            _, seqlen = first(aged)
            return self._form(seqlen, BULK, "aged", now, most[seqlen], lead=INTERACTIVE)
        if inter:
            # an interactive row never waits for a window: it is prepared for the next device slot at once
            self._aged_turn = bool(aged)
            _, seqlen = first(inter)
            return self._form(seqlen, INTERACTIVE, "interactive", now)
        if interactive_only:
            return None
        # a seqlen's oldest row, wherever the deadline order put it, decides its window (as `next_wakeup` does)
        heads = [(self._first(BULK, s), s) for s, q in self._queues[BULK].items() if q]
        if not heads:
            return None
        expired = [h for h in heads if now - h[0] >= self.max_wait_s]
        full = [h for h in heads if self._rows[BULK][h[1]] >= most[h[1]]]
        if expired:
            (_, seqlen), reason = first(expired), "window"
        elif full:
            (_, seqlen), reason = first(full), "full"
        elif device_idle:
            (_, seqlen), reason = first(heads), "idle"
        else:
            return None
        return self._form(seqlen, BULK, reason, now, most[seqlen])

    def _form(self, seqlen: int, cls: int, reason: str, now: float, most: int | None = None,
              lead: int | None = None) -> Dispatch:
        """A batch at `seqlen` led by class `cls`'s rows, of at most `most` rows (default: the largest batch);
        spare rows from later classes and smaller seqlens. `lead`: its rank on the device (default `cls`)."""
        rows = sum(self._rows[c][seqlen] for c in range(cls, len(CLASSES)))
        first_rows = self._rows[cls][seqlen]
        most = self._largest[seqlen] if most is None else most
        smaller = [(s, n) for s in reversed(self.table.seqlens) if s < seqlen and (n := self._rows[cls][s])]
        sized = merged_rows(seqlen, min(first_rows if cls == INTERACTIVE else rows, most), smaller, most, self.plan)
        bucket = self.plan[seqlen][0][sized]
        if bucket.batch > most:  # the cheapest cover of `most` rows may start with a larger batch
            bucket = max((b for b in self.table.at(seqlen) if b.batch <= most), key=lambda b: b.batch)
        parts: list[Run] = []
        spare = bucket.batch
        for c in range(cls, len(CLASSES)):
            order = sorted((s for s in self._queues[c] if s <= seqlen and self._queues[c][s]),
                           key=lambda s: (s != seqlen, self._queues[c][s][0].key, -s))
            for s in order:
                if spare == 0:
                    break
                taken = self._take(c, s, spare, bucket.slots)
                spare -= sum(len(r.rows) for r in taken)
                parts += taken
                for r in taken:
                    self.queued -= len(r.rows) * s
                    self.queued_by[r.cls] -= len(r.rows) * s
        oldest = min(r.enqueued for r in parts)
        return Dispatch(bucket, by_job(parts), reason, oldest, tuple(sorted({r.cls for r in parts})),
                        cls if lead is None else lead)

    def _take(self, cls: int, seqlen: int, most: int, slots: int) -> list[Run]:
        """Up to `most` rows from the head of one class's seqlen queue, whole runs first, the last one split."""
        q = self._queues[cls][seqlen]
        taken = []
        while q and most > 0 and q[0].docs.max() <= slots:
            run = q.pop(0)
            if len(run.rows) > most:
                run, rest = run.split(most)
                q.insert(0, rest)
            else:
                self._timed[cls][seqlen] -= run.deadline < math.inf
            taken.append(run)
            most -= len(run.rows)
            self._rows[cls][seqlen] -= len(run.rows)
        return taken
