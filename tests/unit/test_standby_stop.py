"""Which stops a new round replaces (short grace at the agent) and which are final.

A failure with restarts left and a re-form for membership are replaced; the last failure, a
cancel, and a stale round are final, so the spec's stop_grace applies to them unchanged.
"""

from __future__ import annotations

from coordinator._cluster import StopRound
from tests.unit._cluster_driver import of_type
from tests.unit.test_cluster import failure, running_job


def test_a_failure_with_restarts_left_is_replaced_and_the_last_one_is_final() -> None:
    d = running_job(nodes=2, nproc=1, max_restarts=1, stop_grace=7)
    d.clear()
    d.exit("n0", 0, 1, failure=failure(0, 0, ts=d.now))
    stops = of_type(d.history, StopRound)
    assert stops and all(s.replaced and s.grace == 7 for s in stops)
    d.settle()
    assert d.attempt("j") == 1
    d.clear()
    d.exit("n1", 0, 1, failure=failure(1, 0, ts=d.now))
    stops = of_type(d.history, StopRound)
    assert stops and not any(s.replaced for s in stops)


def test_a_cancel_is_final() -> None:
    d = running_job(nodes=2, nproc=1, max_restarts=3)
    d.clear()
    d.cancel("j")
    stops = of_type(d.history, StopRound)
    assert stops and not any(s.replaced for s in stops)
