"""Warmup timing with injected clocks: the median of back-to-back runs, and the spin-up before them."""

from hypothesis import given
from hypothesis import strategies as st

from jaxserve.runtime import timing


class FakeDevice:
    """A run that takes the next of `durations` seconds on a fake clock."""

    def __init__(self, durations):
        self.durations, self.now, self.runs = list(durations), 0.0, 0

    def clock(self) -> float:
        return self.now

    def run(self) -> None:
        self.now += self.durations[self.runs % len(self.durations)]
        self.runs += 1


def test_median_of_runs_after_a_burn_in():
    # burn-in 9 s (a cold compile's first run) is not timed; one 5 s stall among 5 runs does not move the median
    dev = FakeDevice([9.0, 0.010, 0.012, 5.0, 0.011, 0.013])
    assert abs(timing.median_run_s(dev.run, 5, dev.clock) - 0.012) < 1e-12
    assert dev.runs == 6


@given(st.lists(st.floats(1e-6, 10.0), min_size=2, max_size=12))
def test_median_is_that_of_the_timed_runs(durations):
    dev = FakeDevice(durations)
    runs = len(durations) - 1
    got = timing.median_run_s(dev.run, runs, dev.clock)
    timed = sorted(durations[1:])
    mid = len(timed) // 2
    want = timed[mid] if len(timed) % 2 else (timed[mid - 1] + timed[mid]) / 2
    assert abs(got - want) <= 1e-9 * max(1.0, want)


def test_spin_up_runs_until_its_seconds_have_passed():
    dev = FakeDevice([0.03])
    assert timing.spin_up(dev.run, 0.2, dev.clock) == 7  # 6 runs reach 0.18 s, the 7th passes 0.2
    assert timing.spin_up(FakeDevice([0.0]).run, 0.2, FakeDevice([0.0]).clock, max_runs=50) == 50  # bounded
    assert timing.spin_up(dev.run, 0.0, dev.clock) == 0


def test_run_counts_by_platform():
    assert timing.timed_runs("gpu") >= 5 and timing.timed_runs("tpu") >= 5 and timing.timed_runs("cpu") >= 1
    assert timing.spin_up_s("gpu") > 0 and timing.spin_up_s("cpu") == 0
