"""A node's clock offset, estimated NTP-style from probes, on a fake clock.

Each exchange is played with a true offset and chosen legs: the probe leaves at t1 (the
coordinator's clock), reaches the agent after `out` seconds, waits `hold` there, and comes back
after `back`; the agent's clock reads `offset` seconds ahead. The estimate must find the offset
within its stated uncertainty, ignore a slow lopsided trip, start over after a clock step, and
keep its memory bounded however many samples come.
"""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from coordinator._clock_offset import (
    DRIFT,
    FAST_PROBES,
    PROBE_EVERY_S,
    STEP_AFTER,
    WINDOW,
    ClockOffset,
)

T0 = 1_700_000_000.0


class Exchanges:
    """A node whose clock reads `offset` ahead, probed on a fake clock."""

    def __init__(self, offset: float) -> None:
        self.clock = ClockOffset()
        self.offset = offset
        self.now = T0

    def play(
        self,
        out: float = 0.001,
        back: float = 0.001,
        hold: float = 0.0002,
        offset: float | None = None,
    ) -> bool:
        """One probe and its answer; True when the estimate took the sample."""
        if offset is not None:
            self.offset = offset
        self.now += PROBE_EVERY_S
        t1 = self.now
        assert self.clock.probe_due(t1)
        t2 = t1 + out + self.offset
        t3 = t2 + hold
        t4 = t1 + out + hold + back
        return self.clock.add(t1, t2, t3, t4)

    def covers(self, true_offset: float) -> bool:
        c = self.clock
        return abs(c.offset - true_offset) <= c.uncertainty_at(self.now) + 1e-6


def test_symmetric_trips_give_the_offset_exactly_within_half_the_round_trip() -> None:
    x = Exchanges(0.5)
    assert not x.clock.known and x.clock.offset == 0.0 and x.clock.uncertainty == 0.0
    assert x.play(out=0.010, back=0.010, hold=0.003)
    assert x.clock.known
    assert x.clock.offset == pytest.approx(0.5, abs=1e-6)
    # delay = 20 ms (the hold left out): +/- 10 ms.
    assert x.clock.uncertainty == pytest.approx(0.010, abs=1e-6)


def test_a_behind_clock_has_a_negative_offset() -> None:
    x = Exchanges(-0.5)
    x.play(out=0.002, back=0.002)
    assert x.clock.offset == pytest.approx(-0.5, abs=1e-6)


def test_an_asymmetric_trip_errs_by_half_the_difference_and_says_so() -> None:
    x = Exchanges(0.5)
    x.play(out=0.030, back=0.002)
    # The bias of a lopsided trip: (out - back) / 2 = 14 ms, within the +/- 16 ms stated.
    assert x.clock.offset == pytest.approx(0.5 + 0.014, abs=1e-6)
    assert x.clock.uncertainty == pytest.approx(0.016, abs=1e-6)
    assert x.covers(0.5)
    # A quick symmetric trip then wins (smallest delay), and the average moves toward it.
    x.play(out=0.001, back=0.001)
    assert abs(x.clock.offset - 0.5) < 0.014
    assert x.covers(0.5)


def test_a_delay_spike_is_ignored() -> None:
    x = Exchanges(0.5)
    for _ in range(4):
        x.play(out=0.001, back=0.001)
    before, sure = x.clock.offset, x.clock.uncertainty
    assert before == pytest.approx(0.5, abs=1e-6)
    # 800 ms stuck on the way out (a busy loop, a full outbox): its offset is 0.4 s off.
    assert x.play(out=0.800, back=0.001)
    assert x.clock.offset == before
    assert x.clock.uncertainty == pytest.approx(sure, abs=DRIFT * 2 * PROBE_EVERY_S)
    assert x.covers(0.5)


def test_the_smallest_delay_of_the_window_is_used_and_the_estimate_is_smoothed() -> None:
    x = Exchanges(0.5)
    x.play(out=0.004, back=0.002)  # +1 ms bias, the only sample: taken as it is
    assert x.clock.offset == pytest.approx(0.501, abs=1e-6)
    x.play(out=0.0005, back=0.0015)  # a better one, -0.5 ms bias: a quarter of the way there
    assert x.clock.offset == pytest.approx(0.501 + 0.25 * (0.4995 - 0.501), abs=1e-6)
    assert x.covers(0.5)


@given(
    offset=st.floats(-100, 100),
    legs=st.lists(
        st.tuples(st.floats(0, 0.5), st.floats(0, 0.5), st.floats(0, 1)), min_size=1, max_size=40
    ),
)
def test_the_true_offset_is_always_within_the_stated_uncertainty(
    offset: float, legs: list[tuple[float, float, float]]
) -> None:
    x = Exchanges(offset)
    for out, back, hold in legs:
        x.play(out=out, back=back, hold=hold)
        # The clocks of this fake do not drift, and a trip's bound holds whatever its legs.
        assert x.covers(offset), (x.clock.offset, x.clock.uncertainty_at(x.now))


def test_a_clock_step_is_taken_after_a_run_of_disagreeing_samples_not_one() -> None:
    x = Exchanges(0.0)
    for _ in range(4):
        x.play()
    x.play(offset=0.5)  # one sample alone: could be a broken one
    assert x.clock.offset == pytest.approx(0.0, abs=1e-6)
    x.play(offset=0.0)
    for _ in range(STEP_AFTER - 1):
        x.play(offset=0.5)
    assert x.clock.offset == pytest.approx(0.0, abs=1e-6)
    x.play(offset=0.5)  # the run is long enough: the clock stepped
    assert x.clock.offset == pytest.approx(0.5, abs=1e-6)
    assert x.covers(0.5)


def test_memory_is_bounded_however_many_samples_come() -> None:
    x = Exchanges(0.25)
    for i in range(10_000):
        x.play(out=0.001 * (1 + i % 7), back=0.001, offset=0.25 + (0.5 if i % 97 == 0 else 0.0))
        assert x.clock.samples <= WINDOW + STEP_AFTER - 1
    assert not hasattr(x.clock, "__dict__")  # slots: nothing grows beside the rings
    assert x.clock.offset == pytest.approx(0.25, abs=0.001)


def test_probes_come_at_every_heartbeat_first_then_every_few_seconds() -> None:
    c = ClockOffset()
    now = T0
    for _ in range(FAST_PROBES):
        assert c.probe_due(now)
        now += 0.5
    assert not c.probe_due(now)
    assert not c.probe_due(now + PROBE_EVERY_S - 0.6)
    assert c.probe_due(now - 0.5 + PROBE_EVERY_S)
    assert c.probes == FAST_PROBES + 1


def test_while_the_coordinator_is_busy_the_fast_probes_wait_at_the_slower_pace() -> None:
    c = ClockOffset()
    now = T0
    assert c.probe_due(now, busy=True)  # the first goes at once, busy or not
    now += 0.5
    assert not c.probe_due(now, busy=True)
    assert not c.probe_due(T0 + PROBE_EVERY_S - 0.1, busy=True)
    assert c.probe_due(T0 + PROBE_EVERY_S, busy=True)  # never later than the slower pace
    now = T0 + PROBE_EVERY_S + 0.5
    for _ in range(FAST_PROBES - 2):  # not busy: the rest of the fast ones, beat by beat
        assert c.probe_due(now)
        now += 0.5
    assert not c.probe_due(now)
    assert c.probes == FAST_PROBES


@pytest.mark.parametrize(
    ("t1", "t2", "t3", "t4", "why"),
    [
        (T0 - 5, T0 + 0.5, T0 + 0.5, T0 + 0.01, "an answer to another probe"),
        (T0, math.nan, T0 + 0.5, T0 + 0.01, "not a number"),
        (T0, T0 + 0.5, T0 + math.inf, T0 + 0.01, "infinite"),
        (T0, T0 + 0.5, T0 + 0.4, T0 + 0.01, "a negative hold"),
        (T0, T0 + 0.5, T0 + 0.6, T0 + 0.01, "a hold longer than the round trip"),
        (T0, T0 + 0.5, T0 + 0.5, T0 - 0.01, "an answer before the probe"),
        (T0, T0 + 0.5, T0 + 0.5, T0 + 61, "a round trip over a minute"),
        (T0, T0 + 90_000, T0 + 90_000, T0 + 0.01, "a day off"),
    ],
)
def test_a_broken_sample_is_dropped(t1: float, t2: float, t3: float, t4: float, why: str) -> None:
    c = ClockOffset()
    assert c.probe_due(T0)
    assert not c.add(t1, t2, t3, t4), why
    assert not c.known
    # The probe is still awaited: its real answer counts.
    assert c.add(T0, T0 + 0.5, T0 + 0.5, T0 + 0.01)
    assert not c.add(T0, T0 + 0.5, T0 + 0.5, T0 + 0.01)  # a second answer to it does not
    assert c.offset == pytest.approx(0.495, abs=1e-6)
