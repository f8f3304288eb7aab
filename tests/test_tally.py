"""The engine's metrics tally: the same exposition as prometheus_client's own metrics for the same updates."""

import pickle
import threading

from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from jaxserve.http.metrics import DISPATCH_BUCKETS, LATENCY_BUCKETS, EngineMetrics, ServerMetrics
from jaxserve.http.tally import Spec, Tally, combined, exposition, families

LABELS = st.sampled_from(["a", "b", "c"])
VALUES = st.one_of(st.floats(0, 100, allow_nan=False), st.sampled_from([0.0, *LATENCY_BUCKETS, 1e9]))


def _text(exposed: bytes) -> list[str]:
    """An exposition's lines, without prometheus_client's `_created` samples (the tally keeps no creation time),
    sorted (prometheus_client shows a family's series as first updated, the tally by label values)."""
    return sorted(line for line in exposed.decode().splitlines() if "_created" not in line)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["counter", "gauge", "histogram"]), LABELS, VALUES), max_size=40),
       st.booleans())
def test_the_tally_shows_what_prometheus_client_shows_for_the_same_updates(updates, one_thread):
    """Also a tally updated from one thread only (a front-end's), which takes no lock."""
    specs = {"counter": Spec("t_count", "counter", "c", ("k",)), "gauge": Spec("t_gauge", "gauge", "g", ("k",)),
             "histogram": Spec("t_hist", "histogram", "h", ("k",), tuple(float(b) for b in LATENCY_BUCKETS))}
    tally = Tally(specs.values(), one_thread=one_thread)
    r = CollectorRegistry()
    theirs = {"counter": Counter("t_count", "c", ["k"], registry=r), "gauge": Gauge("t_gauge", "g", ["k"], registry=r),
              "histogram": Histogram("t_hist", "h", ["k"], buckets=LATENCY_BUCKETS, registry=r)}
    for kind, label, value in updates:
        child = theirs[kind].labels(label)
        if kind == "counter":
            tally.add(specs[kind], value, (label,))
            child.inc(value)
        elif kind == "gauge":
            tally.set(specs[kind], value, (label,))
            child.set(value)
        else:
            tally.observe(specs[kind], value, (label,))
            child.observe(value)
    # the snapshot crosses the engine's link as plain data
    snapshot = pickle.loads(pickle.dumps(tally.snapshot()))
    assert _text(exposition(families(specs.values(), snapshot))) == _text(generate_latest(r))


def test_unlabelled_metrics_and_named_zeros_show_before_any_update():
    specs = [Spec("u_total", "counter", "u"), Spec("u_hist", "histogram", "h", bounds=(1.0,)),
             Spec("u_out", "counter", "o", ("outcome",), zeros=(("met",), ("missed",)))]
    text = "\n".join(_text(exposition(families(specs, Tally(specs).snapshot()))))
    assert "u_total 0.0" in text and 'u_hist_bucket{le="+Inf"} 0.0' in text
    assert 'u_out_total{outcome="met"} 0.0' in text and 'u_out_total{outcome="missed"} 0.0' in text


def test_updates_from_many_threads_are_all_counted():
    spec, hist = Spec("n", "counter", "n"), Spec("h", "histogram", "h", bounds=(0.5,))
    tally = Tally([spec, hist])

    def work():
        for _ in range(20_000):
            tally.add(spec, 1)
            tally.observe(hist, 1.0)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    snap = tally.snapshot()
    assert snap[("n", ())] == 80_000 and snap[("h", ())] == [80_000.0, 0, 80_000]


def test_a_snapshot_is_a_copy():
    hist = Spec("h", "histogram", "h", bounds=(1.0,))
    tally = Tally([hist])
    snap = tally.snapshot()
    tally.observe(hist, 0.5)
    assert snap[("h", ())] == [0.0, 0, 0] and tally.snapshot()[("h", ())] == [0.5, 1, 0]


def test_bad_specs_are_refused():
    for bad in (dict(kind="summary"), dict(kind="histogram", bounds=(2.0, 1.0))):
        try:
            Spec("x", **{"doc": "x", **bad})
        except ValueError:
            continue
        raise AssertionError(f"accepted {bad}")


def test_server_metrics_show_the_engines_in_the_same_families():
    """One process's /metrics: the HTTP layer's phases and the engine's share the phase family, shown once."""
    from prometheus_client.parser import text_string_to_metric_families

    server, engine = ServerMetrics(), EngineMetrics()
    server.phase("tokenize", 0.002)
    engine.phase("device", 0.004)
    engine.dispatch_time(0, DISPATCH_BUCKETS[3])
    engine.sequences("submitted", 3)
    waiting = [42]
    engine.watch_queue(lambda: waiting[0])  # the pipeline's tokens waiting, read when shown
    text = server.render(engine.snapshot()).decode()
    fams = list(text_string_to_metric_families(text))
    names = [f.name for f in fams]
    assert len(names) == len(set(names))
    phases = next(f for f in fams if f.name == "jaxserve_phase_seconds")
    counts = {s.labels["phase"]: s.value for s in phases.samples if s.name.endswith("_count")}
    assert counts == {"tokenize": 1.0, "device": 1.0}
    assert 'jaxserve_sequences_total{outcome="submitted"} 3.0' in text
    assert "jaxserve_xla_compiles_total" in text and "jaxserve_queue_depth 42.0" in text
    waiting[0] = 0
    assert "jaxserve_queue_depth 0.0" in server.render(engine.snapshot()).decode()
    # the engine unreachable: the HTTP layer's own metrics, no engine series
    alone = server.render(None).decode()
    assert 'phase="tokenize"' in alone and "jaxserve_sequences_total" not in alone


def test_a_joined_job_counts_as_the_requests_it_answers():
    """A job of joined queries (`jobs.joined`) is several requests: the engine's per-request histograms and deadline
    counts take each of them."""
    from jaxserve.scheduling.pipeline import RequestTiming

    engine = EngineMetrics()
    engine.finished(RequestTiming(submitted=1.0, first_dispatch=1.25, done=1.5, cls=0, requests=3))
    engine.finished(RequestTiming(submitted=2.0, first_dispatch=2.0, done=2.1, cls=0, deadline_s=1.0))
    text = ServerMetrics().render(engine.snapshot()).decode()
    assert 'jaxserve_class_request_seconds_count{class="interactive"} 4.0' in text
    assert 'jaxserve_class_request_seconds_sum{class="interactive"} 1.6' in text  # 3 x 0.5 + 0.1
    assert 'jaxserve_class_queue_wait_seconds_count{class="interactive"} 4.0' in text
    assert 'jaxserve_deadlines_total{class="interactive",outcome="met"} 1.0' in text


def test_combined_adds_up_processes_snapshots_and_leaves_them_as_they_were():
    """Several processes' metrics as one (/metrics with several front-ends): counters and histograms add up, a
    series only one process has (the engine's gauges) stays as it is."""
    counter, hist = ("c", ("x",)), ("h", ())
    a = {counter: 1.0, hist: [0.5, 1.0, 0.0], ("g", ()): 7.0}
    b = {counter: 2.0, hist: [0.25, 0.0, 1.0], ("c", ("y",)): 3.0}
    out = combined(a, b, {})
    assert out == {counter: 3.0, hist: [0.75, 1.0, 1.0], ("g", ()): 7.0, ("c", ("y",)): 3.0}
    assert a[hist] == [0.5, 1.0, 0.0] and b[hist] == [0.25, 0.0, 1.0]  # inputs untouched
    out[hist][0] = 9.0
    assert a[hist][0] == 0.5  # and not shared with the output
