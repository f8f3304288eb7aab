"""Counters, gauges and histograms as plain numbers: every process's metrics.

The engine is the one serial process of a `--workers N` server, so what it spends per job caps every
front-end; a front-end's CPU per one-document request is what one-document requests per core come to. A
prometheus_client child spends microseconds per update (its checks, a lock per value, a Python loop over a
histogram's buckets, and with several processes a write to a memory-mapped file); the pipeline makes about
four updates per job and a dozen per batch, a front-end eight per request. Here an update is a dict lookup
and an add, under one lock where several threads update (the engine's), without where one does (a front-end's
event loop). The values become Prometheus metric families only when /metrics asks
(`families`), from `snapshot`s of plain data that cross the engine's link as they are, several processes'
added up (`combined`).
"""

from __future__ import annotations

import bisect
import dataclasses
import itertools
import math
import threading
from collections.abc import Iterable

from prometheus_client import generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.utils import floatToGoString

KINDS = {"counter": CounterMetricFamily, "gauge": GaugeMetricFamily, "histogram": HistogramMetricFamily}


@dataclasses.dataclass(frozen=True)
class Spec:
    """One metric: its name (a counter's without `_total`), kind, help text and label names; a histogram's
    bucket bounds. `zeros`: label values shown, at zero, before their first update (an unlabelled metric
    always is)."""

    name: str
    kind: str  # "counter", "gauge" or "histogram"
    doc: str
    labels: tuple[str, ...] = ()
    bounds: tuple[float, ...] = ()
    zeros: tuple[tuple[str, ...], ...] = ()

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"kind must be one of {', '.join(KINDS)}, not {self.kind!r}")
        if self.kind == "histogram" and list(self.bounds) != sorted(set(self.bounds)):
            raise ValueError(f"{self.name}: bucket bounds must increase")

    def fresh(self):
        """A value before any update: 0, or a histogram's [sum, count in each bucket, count over the last]."""
        return [0.0] * (len(self.bounds) + 2) if self.kind == "histogram" else 0.0


class Tally:
    """The values of `specs`, by (name, label values). Safe to update from any thread; `one_thread`: updated from
    one thread only (a front-end's, from its event loop), so that an update takes no lock (a large part of an
    update's cost)."""

    def __init__(self, specs: Iterable[Spec], one_thread: bool = False):
        self.specs = tuple(specs)
        self._lock = threading.Lock()
        self._values: dict[tuple[str, tuple[str, ...]], float | list[float]] = {}
        for spec in self.specs:
            for labels in spec.zeros if spec.labels else ((),):
                self._values[(spec.name, labels)] = spec.fresh()
        if one_thread:
            self.add, self.observe = self._add, self._observe

    def add(self, spec: Spec, amount: float, labels: tuple[str, ...] = ()) -> None:
        """A counter goes up by `amount`."""
        with self._lock:
            self._add(spec, amount, labels)

    def _add(self, spec: Spec, amount: float, labels: tuple[str, ...] = ()) -> None:
        key = (spec.name, labels)
        self._values[key] = self._values.get(key, 0.0) + amount

    def set(self, spec: Spec, value: float, labels: tuple[str, ...] = ()) -> None:
        """A gauge reads `value` (or a counter kept elsewhere, read when it is shown)."""
        with self._lock:
            self._values[(spec.name, labels)] = value

    def observe(self, spec: Spec, value: float, labels: tuple[str, ...] = (), count: int = 1) -> None:
        """A histogram counts `value` (`count` times) in the first bucket whose bound is at least `value`
        (Prometheus's `le`)."""
        with self._lock:
            self._observe(spec, value, labels, count)

    def _observe(self, spec: Spec, value: float, labels: tuple[str, ...] = (), count: int = 1) -> None:
        key = (spec.name, labels)
        if (v := self._values.get(key)) is None:
            v = self._values[key] = spec.fresh()
        v[0] += value * count
        v[bisect.bisect_left(spec.bounds, value) + 1] += count

    def snapshot(self) -> dict[tuple[str, tuple[str, ...]], float | list[float]]:
        """Every value now, as plain data (a copy: later updates do not change it)."""
        with self._lock:
            return {k: v.copy() if isinstance(v, list) else v for k, v in self._values.items()}


def families(specs: Iterable[Spec], snapshot: dict) -> list[Metric]:
    """`snapshot`'s values as Prometheus metric families, one per spec, label values in sorted order."""
    by_name: dict[str, list] = {}
    for (name, labels), value in sorted(snapshot.items()):
        by_name.setdefault(name, []).append((labels, value))
    out = []
    for spec in specs:
        family = KINDS[spec.kind](spec.name, spec.doc, labels=spec.labels)
        for labels, value in by_name.get(spec.name, ()):
            if spec.kind == "histogram":
                counts = itertools.accumulate(value[1:])
                family.add_metric(labels, [(floatToGoString(b), c) for b, c in zip((*spec.bounds, math.inf), counts)],
                                  sum_value=value[0])
            else:
                family.add_metric(labels, value)
        out.append(family)
    return out


def combined(*snapshots: dict) -> dict:
    """Snapshots of several processes as one: a series in several is added up (counters, histograms), a series in
    one (a gauge: only the engine keeps any) is as it was. The inputs are left as they are."""
    out: dict = {}
    for snapshot in snapshots:
        for key, value in snapshot.items():
            if (have := out.get(key)) is None:
                out[key] = value.copy() if isinstance(value, list) else value
            elif isinstance(have, list):
                out[key] = [a + b for a, b in zip(have, value)]
            else:
                out[key] = have + value
    return out


def exposition(shown: list[Metric]) -> bytes:
    """Metric families in Prometheus's text format."""
    return generate_latest(_Collected(shown))


class _Collected:
    """Metric families already collected, as `generate_latest` reads a registry."""

    def __init__(self, shown: list[Metric]):
        self._shown = shown

    def collect(self) -> list[Metric]:
        return self._shown
