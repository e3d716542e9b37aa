"""A node's clock as the coordinator measures it: its offset from the coordinator's clock, and
how sure that is, from probes answered over the node's session, NTP-style.

One exchange gives four times: the coordinator sends a probe at t1 (its clock), the agent reads
it at t2 and answers at t3 (the agent's clock), the coordinator reads the answer at t4. Then

    offset = ((t2 - t1) + (t3 - t4)) / 2     how far the node's clock is ahead
    delay  = (t4 - t1) - (t3 - t2)           the round trip, the agent's hold left out

and whatever the two legs of the trip took, the true offset is within offset +/- delay / 2
(RFC 5905, section 8). A slow or lopsided trip (a busy loop, a queued outbox) only widens that
interval; so, as NTP's clock filter does, the estimate rests on the sample with the smallest
delay among the last few, whose age adds the clocks' possible drift to its distance. Each new
best sample moves the estimate by an exponential average, so that one sample does not jerk it;
a run of samples that all disagree with it is a step of the node's clock (a VM resumed, an NTP
step) and the estimate starts over from them.

Pure: times are parameters, state is bounded (a fixed number of samples per node), nothing is
written anywhere: a restarted coordinator measures again, which takes one probe.
"""

from __future__ import annotations

import math

__all__ = [
    "DRIFT",
    "PROBE_EVERY_S",
    "WINDOW",
    "ClockOffset",
]

WINDOW = 8
"""Samples kept per node (NTP's clock filter keeps 8)."""
DRIFT = 15e-6
"""How fast two clocks may drift apart, seconds per second: NTP's PHI (15 ppm)."""
EMA_WEIGHT = 0.25
"""The weight of a new best sample in the estimate."""
STEP_AFTER = 3
"""Consecutive samples that disagree with the estimate that make it start over (a clock step)."""
FAST_PROBES = 4
"""Probes sent at every heartbeat after a session opens, before the slower pace (the first at
once; the others only while the coordinator is not busy, see `ClockOffset.probe_due`)."""
PROBE_EVERY_S = 10.0
"""Seconds between two probes once the first FAST_PROBES were sent."""
MAX_TRIP_S = 60.0
"""A sample whose round trip, or whose hold at the agent, took longer is dropped."""
MAX_OFFSET_S = 86_400.0
"""A sample claiming a larger offset is dropped (no clock worth correcting is a day off)."""
MIN_UNCERTAINTY_S = 1e-6
"""The least uncertainty claimed: a measured offset is never exact."""
_NEGATIVE_DELAY_SLACK_S = 1e-3
"""A round trip that comes out shorter than the agent's hold by at most this much (each clock
read has its own granularity) counts as an instant one; more is a broken sample."""


class ClockOffset:
    """The offset of one node's clock from the coordinator's, and its uncertainty.

    `offset`: seconds the node's clock is ahead (negative: behind); `uncertainty_at(now)`: +/-
    seconds around it. Before any sample both are unknown (`known` is False) and a node's times
    are taken at their word. Memory is bounded: at most WINDOW samples and STEP_AFTER samples
    that disagree, whatever is fed.
    """

    __slots__ = (
        "_awaiting",
        "_delays",
        "_estimate",
        "_next",
        "_offsets",
        "_pending",
        "_probed_at",
        "_times",
        "_used_at",
        "probes",
    )

    def __init__(self) -> None:
        # Three parallel fixed-size rings (offset, delay, t4): nothing is allocated per sample.
        self._offsets = [0.0] * WINDOW
        self._delays = [math.inf] * WINDOW
        self._times = [-math.inf] * WINDOW
        self._next = 0
        self._estimate: float | None = None
        self._used_at = -math.inf
        """t4 of the best sample last folded into the estimate."""
        self._pending: list[tuple[float, float, float]] = []
        """(offset, delay, t4) of the latest samples that all disagree with the estimate."""
        self._probed_at = -math.inf
        self._awaiting: float | None = None
        """t1 of the probe whose answer is awaited (None: none is)."""
        self.probes = 0
        """Probes sent so far."""

    # ---- probes --------------------------------------------------------------------------------

    def probe_due(self, now: float, busy: bool = False) -> bool:
        """Whether a probe should go now; if so, it is taken as sent at `now` (its t1).

        `busy`: the coordinator is busy with what users wait for (a round forming, its nodes
        reporting): the fast probes after the first wait, at the slower pace, until it is not.
        Their round trips would measure the coordinator's queues rather than the clock, and
        their messages would compete with the round's."""
        if (self.probes >= FAST_PROBES or (busy and self.probes)) and (
            now - self._probed_at < PROBE_EVERY_S
        ):
            return False
        self._probed_at = self._awaiting = now
        self.probes += 1
        return True

    # ---- samples -------------------------------------------------------------------------------

    def add(self, t1: float, t2: float, t3: float, t4: float) -> bool:
        """Take one exchange (see the module); False when it is not a sample worth keeping.

        `t1` must be the time of the latest probe sent (`probe_due`), exactly as it was sent: an
        answer to an older probe, to none, or a second answer to one is dropped.
        """
        if t1 != self._awaiting or not all(map(math.isfinite, (t1, t2, t3, t4))):
            return False
        trip, hold = t4 - t1, t3 - t2
        if not (0.0 <= trip <= MAX_TRIP_S and 0.0 <= hold <= MAX_TRIP_S):
            return False
        delay = trip - hold
        if delay < -_NEGATIVE_DELAY_SLACK_S:
            return False
        delay = max(delay, 0.0)
        offset = ((t2 - t1) + (t3 - t4)) / 2
        if abs(offset) > MAX_OFFSET_S:
            return False
        self._awaiting = None
        if self._estimate is not None and self._disagrees(offset, delay, t4):
            # Kept apart: a sample alone that disagrees is a bad one, a run of them is a step.
            self._pending.append((offset, delay, t4))
            if len(self._pending) >= STEP_AFTER:
                self._start_over()
            return True
        self._pending.clear()
        self._keep(offset, delay, t4)
        best = self._best(t4)
        if self._times[best] > self._used_at:
            self._used_at = self._times[best]
            found = self._offsets[best]
            est = self._estimate
            self._estimate = found if est is None else est + EMA_WEIGHT * (found - est)
        return True

    def _keep(self, offset: float, delay: float, t4: float) -> None:
        i = self._next
        self._offsets[i], self._delays[i], self._times[i] = offset, delay, t4
        self._next = (i + 1) % WINDOW

    def _disagrees(self, offset: float, delay: float, now: float) -> bool:
        """The sample's interval and the estimate's do not overlap."""
        assert self._estimate is not None
        return abs(offset - self._estimate) > delay / 2 + self.uncertainty_at(now)

    def _start_over(self) -> None:
        """The clock stepped: every sample but the disagreeing run is forgotten, and the
        estimate starts again from the best of that run."""
        for i in range(WINDOW):
            self._delays[i], self._times[i] = math.inf, -math.inf
        self._next = 0
        for sample in self._pending:
            self._keep(*sample)
        self._pending.clear()
        best = self._best(max(self._times))
        self._estimate = self._offsets[best]
        self._used_at = self._times[best]

    def _best(self, now: float) -> int:
        """The index of the kept sample with the smallest distance: half its delay plus the
        drift since it was taken."""
        best, least = 0, math.inf
        for i in range(WINDOW):
            if self._times[i] == -math.inf:
                continue
            distance = self._delays[i] / 2 + DRIFT * max(0.0, now - self._times[i])
            if distance < least:
                best, least = i, distance
        return best

    # ---- what it says --------------------------------------------------------------------------

    @property
    def known(self) -> bool:
        return self._estimate is not None

    @property
    def offset(self) -> float:
        """Seconds the node's clock is ahead of the coordinator's; 0.0 when not known."""
        return self._estimate if self._estimate is not None else 0.0

    def uncertainty_at(self, now: float) -> float:
        """+/- seconds of `offset` at `now`: the best sample's half delay, the drift since it was
        taken, and how far the averaged estimate is from it; 0.0 when not known."""
        if self._estimate is None:
            return 0.0
        best = self._best(now)
        return max(
            MIN_UNCERTAINTY_S,
            self._delays[best] / 2
            + DRIFT * max(0.0, now - self._times[best])
            + abs(self._estimate - self._offsets[best]),
        )

    @property
    def uncertainty(self) -> float:
        """`uncertainty_at` the time of the latest sample (0.0 when not known)."""
        return self.uncertainty_at(max(self._times)) if self._estimate is not None else 0.0

    @property
    def samples(self) -> int:
        """Samples held now: at most WINDOW, plus at most STEP_AFTER - 1 that disagree."""
        return sum(1 for t in self._times if t != -math.inf) + len(self._pending)
