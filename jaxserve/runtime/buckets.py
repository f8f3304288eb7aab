"""The bucket table: the fixed set of (batch, seqlen) shapes every forward runs at.

Per seqlen there is a largest batch (what the memory budget and token cap
allow) and, optionally, a ladder of smaller batches (1, 4, 16, ...) so that a
request's last rows need not pay for a full batch of padding rows.

Pure data and arithmetic (no JAX): routing, the seqlen ladders, the analytic
memory estimate and the derivation of each seqlen's batch from a memory
budget. The compiled figure comes in through `measure`, a callable the engine
supplies (XLA's memory analysis of the compiled bucket), so the derivation is
testable with a fake.
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
import itertools
import json
import math
from pathlib import Path
from typing import Callable

from jaxserve.dims import ModelDims
from jaxserve.errors import TableError

LADDERS = ("default", "max", "pow2", "fine")
LAYOUTS = ("padded", "packed")  # one document per row, or several (segment ids)
MAX_SLOTS = 32  # most documents one packed row holds
MIN_TOKENS_PER_SLOT = 8  # a row of S tokens gets S // 8 slots: room for short documents
INPUT_NAMES = ("token_ids", "segment_ids", "positions", "type_ids")  # the rows of a batch's [4, B, S] array
BATCH_LADDER_STEP = 4  # smaller batches per seqlen: max, then 1, 4, 16, ...


class ShapeError(ValueError):
    """A batch whose shape is not one of the table's buckets."""


@dataclasses.dataclass(frozen=True)
class Bucket:
    batch: int  # rows per dispatch
    seqlen: int  # tokens per row
    slots: int = 1  # documents per row (1 = one document per row, padded)
    estimated_bytes: int = 0  # analytic: weights + activations
    compiled_bytes: int = 0  # XLA memory analysis: arguments + outputs + temporaries
    limited_by: str = ""  # what stopped the batch growing: memory, tokens, max_batch, throughput (its knee)
    compile_s: float | None = None  # measured at warmup
    run_s: float | None = None  # measured at warmup (median of a few runs)
    attention: str = ""  # the attention implementation its executable runs (dense, blockwise, pallas, cudnn)
    attention_fallback: str = ""  # why the implementations tried before it were not used ("; "-separated)

    @property
    def shape(self) -> tuple[int, int]:
        return (self.batch, self.seqlen)

    @property
    def tokens(self) -> int:
        """The bucket's padded cost: what one dispatch computes."""
        return self.batch * self.seqlen


@dataclasses.dataclass(frozen=True)
class BucketTable:
    buckets: tuple[Bucket, ...]  # sorted by (seqlen, batch)
    ladder: str = "default"
    layout: str = "padded"
    device: str = ""
    device_memory: int = 0  # the device's limit the budget was taken from
    budget_bytes: int = 0  # headroom * device_memory
    weights_bytes: int = 0
    max_batch_tokens: int = 0
    dropped: tuple[tuple[int, str], ...] = ()  # seqlens left out, with the reason
    host_dispatch_s: float | None = None  # the host's time per dispatch, measured at warmup (None: HOST_DISPATCH_S)

    def __post_init__(self):
        shapes = [(b.seqlen, b.batch) for b in self.buckets]
        if not shapes:
            raise TableError("a bucket table needs at least one bucket")
        if shapes != sorted(set(shapes)):
            raise TableError(f"bucket shapes must be distinct and sorted by (seqlen, batch), got {shapes}")
        small = [b for b in self.buckets if min(b.batch, b.seqlen, b.slots) < 1]
        if small:
            raise TableError(f"bucket batch, seqlen and slots must be at least 1, got {small[0]}")
        for s in set(b.seqlen for b in self.buckets):
            if len({b.slots for b in self.at(s)}) != 1:
                raise TableError(f"buckets at seqlen {s} disagree on slots")
        slots = self.slots_by_seqlen
        if any(a > b for a, b in itertools.pairwise(slots)):
            raise TableError(f"slots must not decrease as the seqlen grows (a longer row holds as many sequences "
                             f"as a shorter one: routing relies on it), got {dict(zip(self.seqlens, slots))}")

    # The lookups below run per row on the request path: computed once per table (frozen, so they never go stale).

    @functools.cached_property
    def _by_seqlen(self) -> dict[int, list[Bucket]]:
        out: dict[int, list[Bucket]] = {}
        for b in self.buckets:
            out.setdefault(b.seqlen, []).append(b)
        return out

    @functools.cached_property
    def seqlens(self) -> list[int]:
        return sorted(self._by_seqlen)

    @functools.cached_property
    def slots_by_seqlen(self) -> tuple[int, ...]:
        """Per seqlen (ascending), the most sequences a row there holds: never fewer at a longer seqlen."""
        return tuple(self._by_seqlen[s][-1].slots for s in self.seqlens)

    @property
    def max_seqlen(self) -> int:
        return self.buckets[-1].seqlen

    def at(self, seqlen: int) -> list[Bucket]:
        """The buckets of one seqlen, smallest batch first."""
        return list(self._by_seqlen.get(seqlen, ()))

    def pick(self, length: int, docs: int = 1) -> Bucket:
        """The largest-batch bucket at the smallest seqlen that holds `length` tokens in `docs` documents."""
        seqlens = self.seqlens
        i = bisect.bisect_left(seqlens, length)
        while i < len(seqlens) and self._by_seqlen[seqlens[i]][-1].slots < docs:
            i += 1
        if i == len(seqlens):
            raise ValueError(f"no bucket holds {length} tokens in {docs} document(s) (largest seqlen {self.max_seqlen})")
        return self._by_seqlen[seqlens[i]][-1]

    def to_json(self) -> dict:
        d = dataclasses.asdict(self)
        d["buckets"] = [dataclasses.asdict(b) for b in self.buckets]
        d["dropped"] = [{"seqlen": s, "reason": r} for s, r in self.dropped]
        return d

    @classmethod
    def from_json(cls, d: dict) -> "BucketTable":
        fields = {f.name for f in dataclasses.fields(Bucket)}
        buckets = tuple(Bucket(**{k: v for k, v in b.items() if k in fields}) for b in d["buckets"])
        dropped = tuple((x["seqlen"], x["reason"]) for x in d.get("dropped", []))
        top = {f.name for f in dataclasses.fields(cls)} - {"buckets", "dropped"}
        return cls(buckets=buckets, dropped=dropped, **{k: v for k, v in d.items() if k in top})

    def save(self, path: Path) -> None:
        Path(path).write_text(json.dumps(self.to_json(), indent=1) + "\n")

    @classmethod
    def load(cls, path: Path) -> "BucketTable":
        return cls.from_json(json.loads(Path(path).read_text()))


# ---- seqlen ladders ----

def pow2_ladder(max_len: int, min_len: int = 16) -> list[int]:
    """16, 32, 64, ... up to max_len (max_len itself always included)."""
    out, s = [], min_len
    while s < max_len:
        out.append(s)
        s *= 2
    return out + [max_len]


def fine_ladder(max_len: int, step: int = 16) -> list[int]:
    """Every `step` tokens up to max_len."""
    return list(range(step, max_len, step)) + [max_len]


def geometric_ladder(max_len: int, min_len: int = 16) -> list[int]:
    """Powers of two up to 64, then steps of about 1.5x (96, 128, 192, 256, 384, 512).

    Worst-case padding 33% instead of 50% for long documents, where padding
    costs most, for a couple more shapes to compile.
    """
    out = [s for s in pow2_ladder(max_len, min_len) if s <= 64 and s < max_len]
    s = 64
    while s < max_len:
        s2 = s * 3 // 2
        out += [x for x in (s2, 2 * s) if x < max_len]
        s *= 2
    return out + [max_len]


def ladder(name: str, max_len: int) -> list[int]:
    if name == "max":
        return [max_len]
    if name == "fine":
        return fine_ladder(max_len)
    if name == "pow2":
        return pow2_ladder(max_len)
    if name == "default":
        return geometric_ladder(max_len)
    raise ValueError(f"unknown ladder {name!r}; choose from {', '.join(LADDERS)}")


def slots_for(seqlen: int, layout: str) -> int:
    """Documents per row: 1 when padded; when packed, room for short documents."""
    if layout == "padded":
        return 1
    if layout == "packed":
        return max(1, min(MAX_SLOTS, seqlen // MIN_TOKENS_PER_SLOT))
    raise ValueError(f"unknown layout {layout!r}; choose from {', '.join(LAYOUTS)}")


# ---- memory math ----

def upper_bound(seqlen: int, slots: int, dims: ModelDims, weights_bytes: int, budget_bytes: int,
                max_batch_tokens: int, max_batch: int, devices: int = 1) -> tuple[int, str]:
    """The largest batch a seqlen may have before anything is compiled, and what limits it: the analytic
    memory estimate, the token cap (it batches rows, never splits one) or the row cap."""
    per_row = dims.activation_bytes(1, seqlen, slots)
    free = budget_bytes - weights_bytes
    limits = {
        "memory": devices * (free // per_row) if free > 0 else 0,
        "tokens": devices * max(1, max_batch_tokens // seqlen),
        "max_batch": devices * max_batch,
    }
    limited_by = min(limits, key=limits.get)
    return limits[limited_by], limited_by


def within_budget(batch: int, compiled_bytes: int, budget_bytes: int, below: tuple[int, int]) -> int:
    """The largest batch that the line through `below` (a smaller batch and its bytes, within the budget) and
    (`batch`, `compiled_bytes`, over it) keeps within `budget_bytes`. Only the bytes past `below`'s grow with
    the batch: a proportional shrink of the whole figure, weights included, lands over the budget again
    whenever the weights are a large share of it."""
    b0, c0 = below
    if budget_bytes <= c0:  # the weights alone fill the budget
        return b0
    return b0 + (budget_bytes - c0) * (batch - b0) // (compiled_bytes - c0)


def batch_fitter(multiple: int, devices: int) -> Callable[[int], int]:
    """Rounds a batch down to the batch multiple; 0 where it cannot split evenly over the devices."""
    multiple = multiple * devices // math.gcd(multiple, devices)

    def fit(n: int) -> int:
        b = round_down(n, multiple)
        return b if b % devices == 0 else 0
    return fit


def round_down(n: int, multiple: int) -> int:
    return n if n < multiple else n - n % multiple


Measure = Callable[[int, int, int], int]  # (batch, seqlen, slots) -> compiled bytes (weights included)


def derive(
    seqlens: list[int],
    dims: ModelDims,
    weights_bytes: int,
    budget_bytes: int,
    measure: Measure | None,
    max_batch_tokens: int,
    max_batch: int = 256,
    multiple: int = 1,
    layout: str = "padded",
    batch_ladder: bool = False,
    devices: int = 1,
    **table_fields,
) -> BucketTable:
    """For each seqlen, the largest batch that fits the budget (weights + compiled peak).

    The analytic estimate proposes a batch; the compiled figure checks it, and
    while it is over budget the batch shrinks to what the bytes past the weights allow (`within_budget`)
    and is checked again.
    A seqlen where not even batch 1 fits is dropped, with the reason kept.
    With `batch_ladder`, each seqlen also gets batches 1, 4, 16, ... below the largest.
    With several `devices` (batch sharded across them), the budget and caps are per
    device, `measure` reports one device's bytes, and every batch is a multiple of
    the device count.
    """
    fit = batch_fitter(multiple, devices)
    buckets, dropped = [], []
    for seqlen in seqlens:
        slots = slots_for(seqlen, layout)
        batch, limited_by = upper_bound(seqlen, slots, dims, weights_bytes, budget_bytes, max_batch_tokens, max_batch,
                                        devices)
        batch = fit(batch)
        by_tokens = devices * max(1, max_batch_tokens // seqlen)
        compiled = 0
        while batch >= 1:
            compiled = (measure(batch, seqlen, slots) if measure
                        else weights_bytes + dims.activation_bytes(batch // devices, seqlen, slots))
            if compiled <= budget_bytes:
                break
            limited_by = "memory"
            batch = fit(min(within_budget(batch, compiled, budget_bytes, (0, weights_bytes)), batch - 1))
        if batch < 1:
            dropped.append((seqlen, f"batch 1 needs more than the budget of {budget_bytes} bytes"))
            continue
        if limited_by == "memory" and measure and compiled < 0.95 * budget_bytes:
            # The estimate was pessimistic: grow toward the budget once, if the compiled figure agrees.
            grown = fit(min(int(batch * budget_bytes / compiled), by_tokens, devices * max_batch))
            if grown > batch and (grown_bytes := measure(grown, seqlen, slots)) <= budget_bytes:
                batch, compiled = grown, grown_bytes
        # Smaller batches fit if the largest does; their compiled bytes are filled in at warmup.
        smaller = sorted({fit(b) for b in batch_sizes(batch)[:-1]} - {0, batch}) if batch_ladder else []
        for b in smaller + [batch]:
            buckets.append(Bucket(
                batch=b, seqlen=seqlen, slots=slots,
                estimated_bytes=weights_bytes + dims.activation_bytes(b // devices, seqlen, slots),
                compiled_bytes=compiled if b == batch else 0,
                limited_by=limited_by if b == batch else "ladder",
            ))
    if not buckets:
        raise ValueError(
            f"the memory budget ({budget_bytes} bytes, weights {weights_bytes}) fits no bucket at seqlens {seqlens}"
        )
    return BucketTable(
        buckets=tuple(buckets), layout=layout, budget_bytes=budget_bytes, weights_bytes=weights_bytes,
        max_batch_tokens=max_batch_tokens, dropped=tuple(dropped), **table_fields,
    )


class TableTooLarge(TableError):
    """A table with buckets over this device's memory budget: a given one, or one derived for a larger device's
    memory (`--device-memory`) and about to run here (the CLI prints it without a traceback)."""


GIVEN_REMEDY = "Derive a table on this device (--buckets auto, or `jaxserve buckets --write FILE`), or shrink these."


def check_fits(compiled: list[Bucket], budget_bytes: int, weights_bytes: int, fit: Callable[[int], int],
               budget_rule: str = "", remedy: str = GIVEN_REMEDY) -> None:
    """Raise `TableTooLarge` naming every bucket whose compiled bytes (this device's compiler) exceed the budget,
    with per seqlen the largest batch that fits: estimated from its largest bucket's figure, the bytes past
    the weights taken as linear in the batch, rounded by `fit` (the device's batch multiple); `remedy` ends it."""
    over = [b for b in compiled if b.compiled_bytes > budget_bytes]
    if not over:
        return
    fits = []
    for s in sorted({b.seqlen for b in over}):
        worst = max((b for b in over if b.seqlen == s), key=lambda b: b.batch)
        batch = fit(min(within_budget(worst.batch, worst.compiled_bytes, budget_bytes, (0, weights_bytes)),
                        worst.batch - 1))
        fits.append(f"seqlen {s}: batch {batch}" if batch >= 1 else f"seqlen {s}: none")
    raise TableTooLarge(
        f"the bucket table does not fit this device: {len(over)} bucket(s) need more than the budget of "
        f"{budget_bytes} bytes{f' ({budget_rule})' if budget_rule else ''}, weights {weights_bytes}: "
        + ", ".join(f"batch {b.batch} x seqlen {b.seqlen} needs {b.compiled_bytes}" for b in over)
        + ". Largest batches that fit (estimated): " + ", ".join(fits) + ". " + remedy)


def batch_sizes(largest: int) -> list[int]:
    """1, 4, 16, ... below `largest`, then `largest` itself.

    Steps of 4 (not 2) keep the compile count down; on the corpus of
    scripts/plan_stats.py the packed padding ratio is 1.2% either way.
    """
    out, b = [], 1
    while b < largest:
        out.append(b)
        b *= BATCH_LADDER_STEP
    return out + [largest]


def fixed(seqlen_batches: list[tuple[int, int]], layout: str = "padded", **table_fields) -> BucketTable:
    """A table from explicit (batch, seqlen) pairs (tests, hand-written tables)."""
    pairs = sorted(seqlen_batches, key=lambda x: (x[1], x[0]))
    return BucketTable(
        buckets=tuple(Bucket(batch=b, seqlen=s, slots=slots_for(s, layout)) for b, s in pairs),
        ladder="custom", layout=layout, **table_fields,
    )


def format_table(table: BucketTable) -> str:
    """The table with its memory math, one line per bucket; "-" where XLA's figure is not measured (a bucket the
    derivation did not compile: its estimate only)."""
    mb = lambda n: f"{n / 2**20:9.1f}"
    lines = [
        f"ladder {table.ladder}, layout {table.layout}, on {table.device or '?'}: device memory {table.device_memory / 2**30:.2f} GiB, "
        f"budget {table.budget_bytes / 2**30:.2f} GiB, weights {table.weights_bytes / 2**20:.1f} MiB, "
        f"max_batch_tokens {table.max_batch_tokens}",
        f"{'seqlen':>7} {'batch':>6} {'slots':>5} {'tokens':>8} {'est MiB':>9} {'XLA MiB':>9} {'budget%':>7} "
        f"{'limited by':>10} {'compile s':>9} {'run ms':>8} attention",
    ]
    for b in table.buckets:
        measured = b.compiled_bytes and table.budget_bytes
        xla = f"{mb(b.compiled_bytes)} {100 * b.compiled_bytes / table.budget_bytes:>6.1f}%" if measured else \
            f"{'-':>9} {'-':>7}"
        lines.append(
            f"{b.seqlen:>7} {b.batch:>6} {b.slots:>5} {b.tokens:>8} {mb(b.estimated_bytes)} {xla} {b.limited_by:>10} "
            f"{'' if b.compile_s is None else f'{b.compile_s:.2f}':>9} {'' if b.run_s is None else f'{1e3 * b.run_s:.1f}':>8}"
            f" {b.attention}{' (fell back: ' + b.attention_fallback + ')' if b.attention_fallback else ''}"
        )
    for seqlen, reason in table.dropped:
        lines.append(f"{seqlen:>7} dropped: {reason}")
    return "\n".join(lines)


# ---- batches by measured throughput ----

THROUGHPUT_GAIN = 0.05  # a larger batch (4x the rows) must be this much faster per token to be worth its latency
# The host's own time per dispatch. Host and device overlap, so a dispatch takes max(device time, host time): on
# a fast device a batch too small to cover it leaves the device waiting for the host. The engine measures it at
# warmup (`warm.host_dispatch_s`, kept in the table as `host_dispatch_s`); this is the figure for a table that
# never had it measured (a table file with run times), from one CPU (docs/benchmarks.md).
HOST_DISPATCH_S = 0.5e-3


def host_time(host_s: float | None) -> float:
    """The host's time per dispatch to plan with: a table's measured figure, or HOST_DISPATCH_S where it has none."""
    return HOST_DISPATCH_S if host_s is None else host_s


def dispatch_s(bucket: Bucket, host_s: float | None = None) -> float:
    """A timed bucket's time per dispatch in the pipeline: its run time, or the host's if that is longer."""
    return max(bucket.run_s, host_time(host_s))


def pays(bigger: Bucket, smaller: Bucket, gain: float = THROUGHPUT_GAIN, host_s: float | None = None) -> bool:
    """Whether the bigger batch of a seqlen is `gain` faster per token than the smaller one (both timed)."""
    return bigger.tokens / dispatch_s(bigger, host_s) >= (1 + gain) * smaller.tokens / dispatch_s(smaller, host_s)


def throughput_knee(table: BucketTable, gain: float = THROUGHPUT_GAIN) -> BucketTable:
    """Per seqlen, the batch ladder up to its throughput knee (needs run times).

    Walking each seqlen's batches from the smallest, the largest kept is the
    last one the next did not beat by `gain` in tokens per second: past it a
    batch only adds latency and memory. Memory bounds the largest batch a
    seqlen may have; measured throughput picks the one it gets.
    """
    kept: list[Bucket] = []
    for s in table.seqlens:
        ladder = table.at(s)
        if any(b.run_s is None for b in ladder):
            raise ValueError(f"the buckets at seqlen {s} were never timed")
        top = 0
        while top + 1 < len(ladder) and pays(ladder[top + 1], ladder[top], gain, table.host_dispatch_s):
            top += 1
        kept += ladder[:top]
        largest = ladder[top]
        kept.append(largest if top == len(ladder) - 1 else dataclasses.replace(largest, limited_by="throughput"))
    return dataclasses.replace(table, buckets=tuple(kept))
