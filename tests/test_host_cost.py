"""The host's time per dispatch in the batcher's choice of batch sizes: measured as batches run, or given.

Pure parts (the moving average and when it replans, the covers' tie-breaks) without JAX; then the pipeline over
the simulated device, where the batch sizes a request runs as follow the host time planned with."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxserve.runtime.buckets import fixed
from jaxserve.scheduling import host_cost
from jaxserve.scheduling.batcher import Batcher, covers, merged_rows, plans
from jaxserve.scheduling.host_cost import HostCost
from jaxserve.scheduling.planner import cheapest_cover, cost_model, pack


def timed(run_s: dict[tuple[int, int], float], host_s: float):
    """A table with these (batch, seqlen) -> run times (recorded figures: nothing here is timed)."""
    t = fixed(list(run_s), layout="packed", host_dispatch_s=host_s)
    return dataclasses.replace(t, buckets=tuple(dataclasses.replace(b, run_s=run_s[b.shape]) for b in t.buckets))


def test_a_steady_host_time_is_planned_with_once_enough_batches_ran():
    h = HostCost(floor=30e-6)
    got = [h.observe(250e-6) for _ in range(host_cost.MIN_BATCHES + 5)]
    assert got[: host_cost.MIN_BATCHES - 1] == [None] * (host_cost.MIN_BATCHES - 1)  # too few batches yet
    assert [g for g in got if g is not None] == [pytest.approx(250e-6)]  # then once, and only once
    assert h.planned == pytest.approx(250e-6) and h.measured


def test_the_plan_never_goes_below_warm_up_and_a_given_value_never_moves():
    h = HostCost(floor=100e-6)
    assert all(h.observe(5e-6) is None for _ in range(500)) and h.planned == 100e-6  # below the floor: the floor
    given_ = HostCost(floor=100e-6, fixed=400e-6)
    assert given_.planned == 400e-6 and all(given_.observe(5e-3) is None for _ in range(500))
    assert given_.planned == 400e-6 and not given_.measured and given_.batches == 0


@settings(max_examples=100, deadline=None)
@given(st.floats(1e-6, 1e-3), st.lists(st.tuples(st.floats(1e-6, 5e-3), st.integers(1, 3000)), min_size=1, max_size=8))
def test_replans_only_when_the_estimate_leaves_the_band_property(floor, runs):
    """Runs of steady host times, long enough for several replans: the plan never goes below the floor, moves only
    when the estimate has left the band around it, and only towards it (the whole way, or half way back when it
    reverses the last move); two replans are REPLAN_EVERY batches apart at least."""
    h = HostCost(floor=floor)
    last, moved = None, 0  # batches at the last replan, its direction
    for seconds, n in runs:
        for _ in range(n):
            before = h.planned
            new = h.observe(seconds)
            assert h.planned >= floor and host_cost.REPLAN_EVERY <= h.every <= host_cost.REPLAN_EVERY_MOST
            if new is None:
                assert h.planned == before
                continue
            target = max(floor, h.estimate)
            assert h.batches >= host_cost.MIN_BATCHES and (last is None or h.batches - last >= host_cost.REPLAN_EVERY)
            assert not before / host_cost.REPLAN_RATIO <= target <= before * host_cost.REPLAN_RATIO
            assert new == h.planned and min(before, target) <= new <= max(before, target)
            now = 1 if target > before else -1
            assert new == (pytest.approx((target * before) ** 0.5) if now == -moved else target)
            last, moved = h.batches, now


def test_a_plan_stays_for_replan_every_batches_however_the_estimate_moves():
    h = HostCost(floor=10e-6)
    first = [h.observe(100e-6) for _ in range(host_cost.MIN_BATCHES)]
    assert first[-1] == pytest.approx(100e-6)
    # the cost per batch follows the plan (larger batches): it moves, but the plan waits REPLAN_EVERY batches
    assert all(h.observe(400e-6) is None for _ in range(host_cost.REPLAN_EVERY - 1))
    assert h.observe(400e-6) == pytest.approx(h.estimate) and h.planned > 300e-6


def test_a_plan_that_flips_its_own_cost_settles():
    """Each plan's batches cost what the other plan would want (a plan of 280 us measuring 430 and one of 430
    measuring 280): the plan settles between the two after one reversal instead of flipping at every chance."""
    h = HostCost(floor=10e-6)
    cost = lambda planned: 430e-6 if planned < 355e-6 else 280e-6
    plans_made = [p for _ in range(40 * host_cost.REPLAN_EVERY) if (p := h.observe(cost(h.planned))) is not None]
    assert len(plans_made) <= 3, plans_made
    assert plans_made[-1] == pytest.approx((430e-6 * 280e-6) ** 0.5, rel=0.05)
    assert 280e-6 * host_cost.REPLAN_RATIO > h.planned > 430e-6 / host_cost.REPLAN_RATIO  # both costs in its band


def test_a_plan_with_no_cost_of_its_own_flips_seldom():
    """No plan holds its own cost (600 us under a plan below 355, 200 over it): the old rule replanned at every
    chance (40 times in 80,000 batches); the waits now grow."""
    h = HostCost(floor=10e-6)
    cost = lambda planned: 600e-6 if planned < 355e-6 else 200e-6
    made = [h.batches for _ in range(40 * host_cost.REPLAN_EVERY) if h.observe(cost(h.planned)) is not None]
    assert len(made) <= 8, made
    assert h.every == host_cost.REPLAN_EVERY_MOST


@pytest.mark.parametrize("after", [3000e-6, 60e-6])
def test_a_change_of_load_after_flips_is_planned_within_two_replans(after):
    h = HostCost(floor=10e-6)
    cost = lambda planned: 600e-6 if planned < 355e-6 else 200e-6
    for _ in range(40 * host_cost.REPLAN_EVERY):  # flipping, its waits grown to the most
        h.observe(cost(h.planned))
    for _ in range(2 * host_cost.REPLAN_EVERY + 100):
        h.observe(after)
    assert h.planned == pytest.approx(after, rel=0.05)


def test_a_replan_the_same_way_waits_the_usual_while():
    h = HostCost(floor=10e-6)
    steps = [(100e-6, host_cost.MIN_BATCHES), (400e-6, host_cost.REPLAN_EVERY), (100e-6, host_cost.REPLAN_EVERY)]
    for seconds, n in steps:  # up, then back down: a reversal
        for _ in range(n):
            h.observe(seconds)
    assert h.every == 2 * host_cost.REPLAN_EVERY and h.moved == -1
    got = [h.observe(10e-6) for _ in range(2 * host_cost.REPLAN_EVERY)]  # down again: the load changed
    assert sum(g is not None for g in got) == 1 and h.every == host_cost.REPLAN_EVERY


# seqlen 64 on a fast device: 30 us of overhead plus the rows' FLOPs (the simulated H200's shape)
FAST = {(4, 64): 40e-6, (16, 64): 80e-6, (64, 64): 250e-6, (256, 64): 900e-6}


def test_a_host_time_over_the_small_buckets_makes_fewer_larger_batches():
    """100 rows: 64 + 16 + 16 + 4 while a dispatch costs the host 30 us; 64 + 64 at 250 us (each small batch would
    cost the host as much as a 64-row one runs)."""
    shapes = lambda table: [b.batch for b in cheapest_cover(100, table.at(64), cost_model(table))]
    assert shapes(timed(FAST, 30e-6)) == [64, 16, 16, 4]
    assert shapes(timed(FAST, 250e-6)) == [64, 64]


def test_equal_costs_go_to_fewer_dispatches_then_less_padding():
    # under the host's time every bucket costs the same: one row takes the smallest, not the largest
    table = timed(FAST, 1e-3)
    assert covers(table)[64][1].batch == 4 and covers(table)[64][20].batch == 64
    # linear run times (the same per row): fewer dispatches, the largest batch
    linear = timed({(8, 64): 0.016, (32, 64): 0.064, (128, 64): 0.256}, 1e-6)
    assert [b.batch for b in cheapest_cover(512, linear.at(64), cost_model(linear))] == [128] * 4  # not 16 x 32


# two seqlens, the simulated H200's shape: a 16-row batch at 128 runs in little more than a 4-row one
TWO = {(4, 32): 35e-6, (16, 32): 50e-6, (4, 128): 50e-6, (16, 128): 110e-6}


def _request_at_two_seqlens(host_s: float) -> list[tuple[tuple[int, int], int]]:
    """One request of 10 rows at seqlen 32 and 3 at 128 on an idle device: (bucket shape, rows) per dispatch."""
    table = timed(TWO, host_s)
    b = Batcher(table, max_wait_s=1.0, max_queued=10**6)
    b.submit(0, np.array([128] * 3 + [32] * 10), np.ones(13, np.int64), 0.0)
    out = []
    while (d := b.next_dispatch(0.0, device_idle=True)) is not None:
        assert len(d.parts) == 1  # its rows at both seqlens as one part, in the request's row order
        assert d.parts[0][1].tolist() == sorted(d.parts[0][1].tolist())
        out.append((d.bucket.shape, d.rows))
    return out


def test_a_host_time_over_the_run_times_sends_a_request_at_two_seqlens_in_one_dispatch():
    """Rows of a smaller seqlen join a larger seqlen's batch (padded up) when that costs less than a dispatch of
    their own: at 30 us per dispatch two dispatches are cheaper (50 + 50 us against 110); at 300 us one is."""
    assert _request_at_two_seqlens(30e-6) == [((4, 128), 3 + 1), ((16, 32), 9)]  # a spare row taken, as before
    assert _request_at_two_seqlens(300e-6) == [((16, 128), 13)]


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 16), st.lists(st.integers(0, 40), min_size=1, max_size=3), st.floats(1e-6, 1e-3))
def test_merging_never_costs_more_than_it_saves_property(rows, smaller, host_s):
    table = timed(TWO | {(4, 8): 30e-6, (16, 8): 40e-6}, host_s)
    plan = plans(table)
    waiting = list(zip((32, 8), smaller))
    sized = merged_rows(128, rows, waiting, 16, plan)
    assert rows <= sized <= max(rows, 16)
    # what joined is paid for: the bigger batch's extra cost is at most what the smaller seqlens' own covers cost
    own = sum(plan[s][1][min(n, 16)] for s, n in waiting)
    assert plan[128][1][sized] - plan[128][1][rows] <= own + 1e-12


async def _dispatches(pipeline, rows: int) -> list:
    """Run one job of `rows` one-sequence rows at seqlen 64 through `pipeline`; the batch shapes it ran as."""
    from jaxserve.scheduling.jobs import Job
    from jaxserve.scheduling.planner import pack

    lengths = np.full(rows, 40)
    job = Job(pack(lengths, pipeline.tables["pooled"]), np.ones(40 * rows, np.int32),
              np.arange(0, 40 * rows + 1, 40), None, 4)
    timing = await pipeline.run(job)
    return [shape for shape, *_ in timing.batches]


async def test_the_pipeline_plans_with_a_given_host_time_and_reports_it(tiny_checkpoint):
    """`host_dispatch_s` given (`--host-dispatch-us`): the covers use it from the first batch; /info's figures."""
    from jaxserve import Encoder
    from jaxserve.runtime.simulated import SimSpec, simulated_engine
    from jaxserve.scheduling.pipeline import Pipeline

    enc = Encoder.from_pretrained(str(tiny_checkpoint(max_seq_length=64)))
    sim = simulated_engine(enc.engine, enc.model_config, 64, 4, SimSpec(tflops=400, sizes=(768, 3072, 12)))
    table = sim.table
    ran, explained = {}, {}
    for host_s in (None, 1e-3):
        pipeline = Pipeline(sim, table, 0.001, None, streams=1, host_dispatch_s=host_s)
        await pipeline.start()
        try:
            rows = pack(np.full(100, 40), table)
            explained[host_s] = [tuple(b["bucket"][k] for k in ("batch", "seqlen"))
                                 for b in pipeline.explain(rows, None, "pooled", 0.0)["batches"]]
            ran[host_s] = await _dispatches(pipeline, 100)
            info = pipeline.host_dispatch
        finally:
            await pipeline.stop()
        assert explained[host_s] == ran[host_s]  # ?explain=1 predicts the batches the pipeline forms
        if host_s is None:
            assert info["source"] == "measured" and info["planned_s"] == table.host_dispatch_s == info["warmup_s"]
            assert info["batches_measured"] == len(ran[None])
        else:
            assert info == {"planned_s": 1e-3, "source": "given", "measured_s": None, "batches_measured": 0,
                            "warmup_s": table.host_dispatch_s}
    want = lambda host_s: [b.batch for b in cheapest_cover(
        100, table.at(64), cost_model(dataclasses.replace(table, host_dispatch_s=host_s or table.host_dispatch_s)))]
    assert [shape[0] for shape in ran[None]] == want(None) and [shape[0] for shape in ran[1e-3]] == want(1e-3)
    assert len(ran[1e-3]) < len(ran[None])  # the host's cost per dispatch counted: fewer, larger batches


async def test_the_pipeline_measures_its_host_time_and_replans(tiny_checkpoint, monkeypatch):
    """Measured: after MIN_BATCHES batches the plan is the pipeline's own CPU per batch (at least warm-up's)."""
    from jaxserve import Encoder
    from jaxserve.runtime.simulated import SimSpec, simulated_engine
    from jaxserve.scheduling.pipeline import Pipeline

    monkeypatch.setattr(host_cost, "MIN_BATCHES", 8)
    enc = Encoder.from_pretrained(str(tiny_checkpoint(max_seq_length=64)))
    sim = simulated_engine(enc.engine, enc.model_config, 64, 4, SimSpec(tflops=400))
    pipeline = Pipeline(sim, sim.table, 0.001, None, streams=1)
    await pipeline.start()
    try:
        for _ in range(12):
            await _dispatches(pipeline, 1)
        info = pipeline.host_dispatch  # each batch counted before its job was answered
    finally:
        await pipeline.stop()
    assert info["source"] == "measured" and info["batches_measured"] == 12 and info["measured_s"] > 0
    assert info["planned_s"] >= info["warmup_s"] == sim.table.host_dispatch_s
    # whatever was measured, the batcher covers its rows as the planned host time says
    assert pipeline.batcher.covers == covers(dataclasses.replace(sim.table, host_dispatch_s=info["planned_s"]))
