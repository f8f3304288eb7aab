"""Request classes in the batcher (interactive before bulk, EDF within a class, aging, admission) and their
parsing from a request, driven with explicit clocks: no JAX, no asyncio, no HTTP."""

import dataclasses
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxserve.http.api import ApiError
from jaxserve.http.classes import (
    INTERACTIVE_MAX_TOKENS,
    MIN_DEADLINE_MS,
    Ask,
    Policy,
    ask_of,
    decide,
    likely_interactive,
    parse_key,
    parse_route,
)
from jaxserve.runtime.buckets import dispatch_s, fixed
from jaxserve.scheduling.batcher import BULK, INTERACTIVE, Batcher, Classes, QueueFull, bulk_caps
from jaxserve.scheduling.pipeline import Pipeline

TABLE = fixed([(1, 16), (4, 16), (1, 64), (4, 64)], layout="packed")


def submit(b, job, seqlens, now, cls, deadline=math.inf):
    seqlens = np.asarray(seqlens)
    b.submit(job, seqlens, np.ones(len(seqlens), np.int64), now, cls, deadline)


def test_interactive_overtakes_queued_bulk():
    b = Batcher(TABLE, max_wait_s=0.005, max_queued=1_000_000)
    submit(b, 0, [64] * 40, now=0.0, cls=BULK)
    assert b.next_dispatch(0.0, device_idle=True).jobs == [0]  # bulk alone runs
    submit(b, 1, [16], now=0.01, cls=INTERACTIVE)
    d = b.next_dispatch(0.01, device_idle=False)  # the query is prepared behind the batch on the device
    assert d.reason == "interactive" and d.jobs[0] == 1
    assert d.bucket.shape == (1, 16)  # sized for the interactive rows, not the bulk backlog
    d = b.next_dispatch(0.5, device_idle=False)  # a query is likely: bulk cut to bulk_dispatch_s (none here)
    assert d.jobs == [0] and d.bucket.shape == (4, 64)


def test_interactive_spare_rows_take_bulk_rows():
    b = Batcher(TABLE, max_wait_s=0.005, max_queued=1_000_000)
    submit(b, 0, [16] * 10, now=0.0, cls=BULK)
    submit(b, 1, [16, 16, 16], now=0.1, cls=INTERACTIVE)
    d = b.next_dispatch(0.1, device_idle=True)
    assert d.bucket.shape == (4, 16) and d.jobs == [1, 0] and d.rows == 4


def test_deadline_first_within_class():
    b = Batcher(TABLE, max_wait_s=0.005, max_queued=1_000_000)
    submit(b, 0, [64], now=0.0, cls=INTERACTIVE, deadline=5.0)
    submit(b, 1, [64], now=0.1, cls=INTERACTIVE, deadline=0.5)
    submit(b, 2, [64], now=0.2, cls=INTERACTIVE)
    order = []
    while (d := b.next_dispatch(1.0, device_idle=True)) is not None:
        order += d.jobs
    assert order == [1, 0, 2]


def test_aged_bulk_takes_turns_with_queries():
    b = Batcher(TABLE, max_wait_s=0.005, max_queued=1_000_000, classes=Classes(max_bulk_wait_s=2.0))
    submit(b, 0, [64] * 8, now=0.0, cls=BULK)
    submit(b, 1, [64], now=2.5, cls=INTERACTIVE)
    submit(b, 2, [64], now=2.5, cls=INTERACTIVE)
    assert b.next_wakeup() == pytest.approx(0.005)
    d = b.next_dispatch(2.5, device_idle=False)
    assert d.jobs[0] == 1 and d.reason == "interactive"  # the queries first ...
    d = b.next_dispatch(2.5, device_idle=False)
    assert d.jobs[0] == 0 and d.reason == "aged" and d.lead == INTERACTIVE  # ... taking turns with aged rows ...
    assert b.next_dispatch(2.5, device_idle=False).jobs[0] == 2  # ... not waiting for all of them
    assert b.next_dispatch(2.5, device_idle=False, interactive_only=True) is None  # room for queries only: none
    submit(b, 4, [64], now=2.7, cls=INTERACTIVE)  # after query 2 it is the aged rows' turn, even in the room
    assert b.next_dispatch(2.7, device_idle=False, interactive_only=True).reason == "aged"  # kept for queries
    assert b.next_dispatch(2.7, device_idle=False, interactive_only=True).jobs[0] == 4


def test_aged_bulk_backlog_does_not_hold_a_query():
    """The query lost on a slow machine: bulk rows queued more device time than `max_bulk_wait_s`, so they aged;
    aged rows went into the interactive queue due at their aging time, ahead of every query without a deadline,
    and a query waited until the whole aged backlog had run (forever, under steady bulk load)."""
    b = Batcher(TABLE, max_wait_s=0.005, max_queued=1_000_000, classes=Classes(max_bulk_wait_s=30.0))
    for job in range(20):  # two clients' backlog of 1000-paragraph requests, more than 30 s of a slow device
        submit(b, job, [64] * 50 + [16] * 50, now=job * 0.5, cls=BULK)
    now = 40.0
    assert b.next_dispatch(now, device_idle=False).reason == "aged"  # aged rows lead while no query waits
    submit(b, 99, [16], now=now, cls=INTERACTIVE)
    assert 99 in b.next_dispatch(now, device_idle=False).jobs  # the query leaves with the next batch


def test_bulk_cannot_fill_the_queue_against_interactive():
    b = Batcher(TABLE, max_wait_s=0.005, max_queued=6400, classes=Classes(bulk_share=0.75))  # 100 rows of 64
    submit(b, 0, [64] * 70, now=0.0, cls=BULK)
    with pytest.raises(QueueFull, match="bulk"):
        submit(b, 1, [64] * 10, now=0.0, cls=BULK)
    submit(b, 2, [64] * 30, now=0.0, cls=INTERACTIVE)  # the reserved quarter is still there
    assert b.waiting() == {"interactive": 30 * 64, "bulk": 70 * 64}


def test_a_lone_bulk_request_the_size_of_the_queue_leaves_the_quarter_to_queries():
    """A bulk request larger than the bulk limit (up to the whole queue: a request of the most inputs at the largest
    seqlen may be that large) is admitted when no bulk waits; it used to take the queries' quarter too, and every
    query got 429 until it had drained. Queries now still have their quarter beside it."""
    b = Batcher(TABLE, max_wait_s=0.005, max_queued=6400, classes=Classes(bulk_share=0.75))  # 100 rows of 64
    submit(b, 0, [64] * 100, now=0.0, cls=BULK)  # alone: admitted
    for job in range(1, 26):  # the reserved quarter: 25 rows of 64
        submit(b, job, [64], now=0.0, cls=INTERACTIVE)
    with pytest.raises(QueueFull):
        submit(b, 26, [64], now=0.0, cls=INTERACTIVE)
    assert b.waiting() == {"interactive": 25 * 64, "bulk": 100 * 64}  # the worst case: max_queued + its quarter
    b = Batcher(TABLE, max_wait_s=0.005, max_queued=6400, classes=Classes(bulk_share=0.75))
    submit(b, 0, [64], now=0.0, cls=BULK)
    with pytest.raises(QueueFull, match="waits only alone: split it"):  # said, as it may wait long for that
        submit(b, 1, [64] * 80, now=0.0, cls=BULK)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from([INTERACTIVE, BULK]), st.integers(1, 100), st.booleans()), max_size=40))
def test_admission_keeps_the_interactive_quarter_property(jobs):
    """Whatever arrives and leaves: a job of interactive tokens that fit in the quarter beside those waiting is
    admitted; bulk tokens pass the bulk limit only as one job alone; at most max_queued plus the quarter wait."""
    b = Batcher(TABLE, max_wait_s=0.005, max_queued=6400, classes=Classes(bulk_share=0.75))
    limit, reserve = b.bulk_limit(), 6400 - b.bulk_limit()
    for jid, (cls, rows, dispatch) in enumerate(jobs):
        before = dict(b.waiting())
        try:
            submit(b, jid, [64] * rows, 0.0, cls)
        except QueueFull:
            assert not (cls == INTERACTIVE and before["interactive"] + 64 * rows <= reserve)
        else:
            assert cls == INTERACTIVE or b.queued_by[BULK] <= limit or before["bulk"] == 0
        assert b.queued <= 6400 + reserve
        if dispatch:
            b.next_dispatch(0.0, device_idle=True)


def test_no_interactive_is_fifo_as_before():
    b = Batcher(TABLE, max_wait_s=1.0, max_queued=100_000)
    submit(b, 0, [16, 16, 16, 16], now=0.0, cls=BULK)
    assert b.next_dispatch(0.0, device_idle=False).reason == "full"  # no interactive work: prepared ahead


def timed(run_s: dict[tuple[int, int], float], host_s: float = 0.001):
    """A table with these (batch, seqlen) -> run times (recorded figures: nothing here is timed)."""
    t = fixed(list(run_s), layout="packed", host_dispatch_s=host_s)
    return dataclasses.replace(t, buckets=tuple(dataclasses.replace(b, run_s=run_s[b.shape]) for b in t.buckets))


# seqlen 64: linear past batch 8 (16 ms per 8 rows); seqlen 16: batch 1 is slow per token, batch 64 long
TIMED = timed({(1, 16): 0.004, (8, 16): 0.005, (64, 16): 0.04, (1, 64): 0.003, (8, 64): 0.016,
               (32, 64): 0.064, (128, 64): 0.256})


def test_bulk_caps_by_time_and_efficiency():
    assert bulk_caps(TIMED, 0.1, 0.9) == {16: 64, 64: 32}  # the largest batch predicted within 100 ms
    assert bulk_caps(TIMED, 0.02, 0.9) == {16: 8, 64: 8}
    # within 4 ms only batch 1 fits (at 16: 4k tokens/s, a sixth of the best): instead the first efficient batch
    assert bulk_caps(TIMED, 0.004, 0.9) == {16: 8, 64: 8}
    assert bulk_caps(TIMED, 0.004, 0.0) == {16: 1, 64: 1}
    assert bulk_caps(TIMED, math.inf, 0.9) == {16: 64, 64: 128}  # no limit: the largest batch
    assert bulk_caps(TABLE, 0.001, 0.9) == {16: 4, 64: 4}  # untimed: the largest batch


def test_short_bulk_batches_while_a_query_is_likely():
    b = Batcher(TIMED, max_wait_s=0.005, max_queued=10_000_000, classes=Classes(bulk_dispatch_s=0.1))
    submit(b, 0, [64] * 500, now=0.0, cls=BULK)
    assert b.next_dispatch(0.0, device_idle=True).bucket.shape == (128, 64)  # no query yet: the largest batch
    submit(b, 1, [16], now=0.01, cls=INTERACTIVE)
    assert b.next_dispatch(0.01, device_idle=True).jobs[0] == 1
    d = b.next_dispatch(0.02, device_idle=True)  # a query is likely for 1 s: bulk batches of <= 100 ms
    assert d.bucket.shape == (32, 64) and dispatch_s(d.bucket, TIMED.host_dispatch_s) <= 0.1
    assert b.next_dispatch(1.5, device_idle=True).bucket.shape == (128, 64)  # none for 1 s: large again


class TwoOutputs:
    """The part of an engine a pipeline's batchers are made from: a table per output (pooled, token vectors)."""

    def __init__(self):
        self.tables = {"pooled": TIMED, "tokens": TIMED}


@pytest.mark.parametrize("query_on, bulk_on", [("pooled", "tokens"), ("tokens", "pooled"), ("pooled", "pooled")])
def test_a_query_on_one_output_cuts_every_outputs_bulk_batches(query_on, bulk_on):
    """One device runs both outputs' batches, so a query on one waits behind the other's bulk batches too: a
    BGE-M3 server indexing through /embed_m3 (token vectors) ran full-size bulk batches while queries on
    /v1/embeddings (pooled) waited, each batcher watching only its own queries."""
    pipeline = Pipeline(TwoOutputs(), TIMED, 0.005, 10_000_000, classes=Classes(bulk_dispatch_s=0.1))
    query, bulk = pipeline.batchers[query_on], pipeline.batchers[bulk_on]
    submit(bulk, 0, [64] * 500, now=0.0, cls=BULK)
    assert bulk.next_dispatch(0.0, device_idle=True).bucket.shape == (128, 64)  # no query yet: the largest batch
    submit(query, 1, [16], now=0.01, cls=INTERACTIVE)
    assert query.next_dispatch(0.01, device_idle=True).jobs == [1]
    assert bulk.next_dispatch(0.02, device_idle=True).bucket.shape == (32, 64)  # one arrived within 1 s: cut
    assert bulk.next_dispatch(1.5, device_idle=True).bucket.shape == (128, 64)  # none for 1 s: large again
    submit(query, 2, [16], now=1.6, cls=INTERACTIVE)
    if query is not bulk:  # a query waiting (for longer than 1 s) on the other output cuts them too
        assert bulk.next_dispatch(3.0, device_idle=True).bucket.shape == (32, 64)
    assert query.next_dispatch(3.0, device_idle=True).jobs == [2]
    assert bulk.next_dispatch(3.0, device_idle=True).bucket.shape == (128, 64)


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.sampled_from([INTERACTIVE, BULK]), st.integers(1, 60), st.floats(0.0, 0.8)),
                min_size=1, max_size=30),
       st.sampled_from([0.004, 0.02, 0.1, math.inf]))
def test_bulk_batches_within_the_cap_property(jobs, limit):
    """While an interactive row arrived within `likely_s`, no bulk-led batch is larger than its seqlen's cap;
    every row is still dispatched exactly once."""
    classes = Classes(bulk_dispatch_s=limit)
    caps = bulk_caps(TIMED, limit, classes.bulk_efficiency)
    b = Batcher(TIMED, max_wait_s=0.005, max_queued=10_000_000, classes=classes)
    now, last_query, want, got = 0.0, -math.inf, 0, 0
    for jid, (cls, n, gap) in enumerate(jobs):
        now += gap
        submit(b, jid, [64] * n, now, cls)
        want += n
        last_query = now if cls == INTERACTIVE else last_query
        while (d := b.next_dispatch(now, device_idle=True)) is not None:
            got += d.rows
            if d.reason != "interactive" and now - last_query < classes.likely_s:
                assert d.bucket.batch <= caps[d.bucket.seqlen]
    while (d := b.next_dispatch(now := now + 0.5, device_idle=True)) is not None:
        got += d.rows
    assert got == want


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.sampled_from([INTERACTIVE, BULK]), st.lists(st.sampled_from([16, 64]), min_size=1,
                                                                           max_size=9),
                          st.one_of(st.none(), st.floats(0.01, 5.0)), st.floats(0.0, 0.5)),
                min_size=1, max_size=25),
       st.floats(0.5, 4.0))
def test_properties(jobs, max_bulk_wait):
    """Every row is dispatched exactly once and an idle device never idles with work queued; a batch led by
    bulk rows leaves only with no interactive row waiting, unless those bulk rows have aged; no bulk row
    waits past its aging time plus the batches of rows due before it; an aged one leads only aged rows."""
    b = Batcher(TABLE, max_wait_s=0.005, max_queued=10_000_000, classes=Classes(max_bulk_wait_s=max_bulk_wait))
    now, want, meta = 0.0, set(), {}
    for jid, (cls, seqlens, budget, gap) in enumerate(jobs):
        now += gap
        submit(b, jid, seqlens, now, cls, math.inf if budget is None else now + budget)
        meta[jid] = (cls, now)
        want |= {(jid, r) for r in range(len(seqlens))}
    got = []
    while b.queued_rows:
        now += 0.01
        d = b.next_dispatch(now, device_idle=True)
        assert d is not None
        rows = [(job, int(r)) for job, rs in d.parts for r in rs]
        got += rows
        left = {j for j, _ in want - set(got)}
        lead_cls, lead_t = meta[rows[0][0]]
        if d.reason == "aged":
            assert lead_cls == BULK and now - lead_t >= max_bulk_wait and d.lead == INTERACTIVE
        elif d.reason != "interactive":
            assert lead_cls == BULK and not any(meta[j][0] == INTERACTIVE for j in left)
        else:
            assert lead_cls == INTERACTIVE
        assert now < 1000
    assert sorted(got) == sorted(want)


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.floats(0.01, 10.0), st.sampled_from([16, 64])), min_size=2, max_size=20))
def test_edf_property(jobs):
    """Interactive single-row jobs queued together leave in deadline order (ties: arrival)."""
    b = Batcher(TABLE, max_wait_s=0.005, max_queued=10_000_000)
    for jid, (budget, s) in enumerate(jobs):
        submit(b, jid, [s], 0.0, INTERACTIVE, budget)
    order = []
    while (d := b.next_dispatch(0.0, device_idle=True)) is not None:
        order += [j for j, _ in d.parts]
    # within each seqlen, deadline order; across seqlens, each batch is led by the earliest deadline left
    for s in (16, 64):
        mine = [j for j in order if jobs[j][1] == s]
        assert mine == sorted(mine, key=lambda j: (jobs[j][0], j))


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 30), st.integers(1, 30), st.floats(0.5, 3.0))
def test_no_starvation_under_steady_interactive(n_bulk, n_inter, age):
    """A bulk row is served by the second dispatch after it aged (the first is a query's), even when queries keep
    arriving."""
    b = Batcher(TABLE, max_wait_s=0.005, max_queued=10_000_000, classes=Classes(max_bulk_wait_s=age))
    submit(b, 0, [64] * n_bulk, 0.0, BULK)
    now, jid, served = 0.0, 1, None
    while served is None:
        now += 0.1
        submit(b, jid, [64] * 4, now, INTERACTIVE)  # a full batch of queries every step
        jid += 1
        d = b.next_dispatch(now, device_idle=True)
        if 0 in d.jobs:
            served = now
    assert served <= age + 0.2 + 1e-9


def test_ask_parsing_and_defaults():
    assert ask_of({"priority": -5}, {}) == Ask(INTERACTIVE, None, "body")
    assert ask_of({"priority": 3, "deadline_ms": 200}, {}) == Ask(BULK, 200.0, "body")
    assert ask_of({}, {"X-Jaxserve-Priority": "bulk", "X-Jaxserve-Deadline-Ms": "150"}) == Ask(BULK, 150.0, "header")
    assert ask_of({"input": "x"}, {}) == Ask()
    for bad in ({"priority": "soon"}, {"priority": True}, {"deadline_ms": -1}, {"deadline_ms": "x"}):
        with pytest.raises(ApiError) as err:
            ask_of(bad, {})
        assert err.value.status == 400
    assert decide(Ask(), 1, 10) == (INTERACTIVE, "auto") and decide(Ask(), 9, 10) == (BULK, "auto")
    assert decide(Ask(), 1, 10, Policy(default="bulk")) == (BULK, "default")
    assert decide(Ask(INTERACTIVE, source="body"), 1000, 10) == (BULK, "size")  # too large to be interactive
    assert decide(Ask(INTERACTIVE, source="body"), 2, INTERACTIVE_MAX_TOKENS + 1) == (BULK, "size")


@pytest.mark.parametrize("body", [{"priority": "s" * 200_000}, {"priority": [1] * 100_000}, {"deadline_ms": "9" * 200_000 + "x"},
                                  {"deadline_ms": [[[]]] * 50_000}])
def test_a_wrong_priority_or_deadline_is_shown_cut_short(body):
    """The value was echoed whole (a 200 KB 400 body), as docs/api.md says it never is."""
    with pytest.raises(ApiError) as err:
        ask_of(body, {})
    assert err.value.status == 400 and len(err.value.message) < 300


def test_a_deadline_is_never_shorter_than_the_floor():
    """A client cannot always jump to the front of its class with ever-shorter deadlines."""
    assert ask_of({"deadline_ms": 0.001}, {}).deadline_ms == MIN_DEADLINE_MS
    assert ask_of({}, {"X-Jaxserve-Deadline-Ms": "1"}).deadline_ms == MIN_DEADLINE_MS
    assert ask_of({"deadline_ms": 5000}, {}).deadline_ms == 5000


CLASS = st.sampled_from([None, "interactive", "bulk"])


@given(body=CLASS, header=CLASS, key=CLASS, route=CLASS, default=st.sampled_from(["auto", "interactive", "bulk"]),
       sequences=st.integers(1, 100), tokens=st.integers(1, 10_000))
def test_key_and_route_are_ceilings(body, header, key, route, default, sequences, tokens):
    """What a request asks (body, else header) wins unless its key or route grants less (a ceiling: a client may
    demote itself, never promote); asking nothing, it gets its key's or route's class, else the server's default,
    else auto; over the interactive limits it is bulk whatever it asked."""
    ask = ask_of({} if body is None else {"priority": body}, {} if header is None else {"X-Jaxserve-Priority": header},
                 key, route)
    policy = Policy(default=default)
    cls, source = decide(ask, sequences, tokens, policy)
    asked = body or header
    granted = [c for c in (key, route) if c is not None]
    if "bulk" in granted or asked == "bulk":
        assert cls == BULK
    if "bulk" in granted and asked == "interactive":
        assert source in ("api_key", "route")  # the promotion was refused, and /v1/plan says by whom
    if cls == INTERACTIVE:
        assert sequences <= policy.max_sequences and tokens <= policy.max_tokens
        assert asked == "interactive" or (asked is None and (granted or [None])[0] in ("interactive", None))
    if sequences > policy.max_sequences or tokens > policy.max_tokens:
        assert cls == BULK
    if asked is None and not granted and default == "bulk":
        assert (cls, source) == (BULK, "default")
    if asked is None and not granted and default == "auto":
        assert source == "auto"


def test_key_and_route_specs():
    assert parse_key("sk-abc") == ("sk-abc", None)
    assert parse_key("sk-abc=bulk") == ("sk-abc", "bulk") and parse_key(" ix=Interactive ") == ("ix", "interactive")
    assert parse_key("c2VjcmV0==") == ("c2VjcmV0==", None)  # base64 padding is part of the key
    assert parse_key("a=b=bulk") == ("a=b", "bulk")
    assert parse_route("/embed=bulk") == ("/embed", "bulk")
    for bad in ("/embed", "embed=bulk", "/embed=urgent"):
        with pytest.raises(ValueError):
            parse_route(bad)


def test_likely_interactive_before_tokenizing():
    """Only a request that may run as interactive, of a small body, is tokenized on the interactive thread."""
    most = 2**16
    assert likely_interactive(Ask(), 8, most_bytes=most) and not likely_interactive(Ask(), 9, most_bytes=most)
    assert not likely_interactive(Ask(BULK), 1, most_bytes=most)
    assert not likely_interactive(Ask(INTERACTIVE), 1000, most_bytes=most)  # asking does not make it small
    assert not likely_interactive(Ask(INTERACTIVE, body_bytes=most + 1), 1, most_bytes=most)  # 8 huge inputs
    assert not likely_interactive(Ask(ceiling=BULK, ceiling_from="api_key"), 1, most_bytes=most)
    assert not likely_interactive(Ask(), 1, Policy(default="bulk"), most_bytes=most)


def test_a_routes_ceiling_holds_on_every_path_that_serves_it():
    """`--route-priority` on one name of a route holds on its others, and on the route a path such as TEI's `/`
    runs; the strictest of several applies; a route no one named has none."""
    from jaxserve.http.classes import route_ceilings, route_class

    routes = route_ceilings({"/v1/embeddings": "bulk", "/embed": "bulk", "/score": "interactive", "/v1/score": "bulk"})
    assert route_class(routes, "/embeddings") == "bulk"
    assert route_class(route_ceilings({"/v2/embed": "bulk"}), "/v1/embed") == "bulk"  # Cohere's v1 and v2
    assert route_class(routes, "/", "/embed") == route_class(routes, "/invocations", "/embed") == "bulk"
    assert route_class(routes, "/score") == route_class(routes, "/v1/score") == "bulk"
    assert route_class(routes, "/", "/predict") is None and route_class(routes, "/rerank") is None
    assert route_class(route_ceilings({"/": "bulk"}), "/invocations", "/predict") == "bulk"
