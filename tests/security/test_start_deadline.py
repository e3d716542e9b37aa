"""A round whose workers never start fails on a deadline instead of holding its slots forever.

Before the fix nothing timed out an assigned round: an agent that dropped the Assign (as it did
for a job id it judged invalid) while still heartbeating left the job RUNNING, and its slots
taken, for good. Now `ClusterConfig.start_timeout` bounds the time from the assignment until
every worker of a node reported started; past it the round fails with a platform failure per
late rank, spending one restart of the budget per round however many ranks were late.
"""

from __future__ import annotations

import pytest

from client.model import FailureCategory, JobState, WorkerState
from coordinator._cluster import AssignRound, ClusterConfig, RequestPort, StopRound
from coordinator.cli import _parser
from coordinator.server import CoordinatorConfig
from tests.unit._cluster_driver import Driver, of_type

TIMEOUT = 120.0


def _driver() -> Driver:
    return Driver(ClusterConfig(heartbeat_interval=1.0, lease=5.0, start_timeout=TIMEOUT))


def _assign_but_never_start(d: Driver, late: set[str]) -> list[AssignRound]:
    """Play the agents up to the Assign; nodes in `late` take it and never report a start."""
    dropped: list[AssignRound] = []
    for _ in range(100):
        if not d.pending:
            return dropped
        eff = d.pending.pop(0)
        if isinstance(eff, AssignRound) and eff.node in late:
            dropped.append(eff)
        elif isinstance(eff, RequestPort | AssignRound):
            d._answer(eff)
    raise AssertionError("the cluster did not settle")


def test_the_default_start_timeout_is_bounded_and_must_be_positive() -> None:
    assert 0 < ClusterConfig().start_timeout <= 600
    with pytest.raises(ValueError, match="start_timeout"):
        ClusterConfig(start_timeout=0)


def test_an_assignment_nobody_starts_fails_the_job_as_a_platform_failure() -> None:
    d = _driver()
    d.connect("a", slots=2)
    d.submit("j", nproc_per_node=2)
    assert len(_assign_but_never_start(d, {"a"})) == 1
    assert d.state("j") == JobState.RUNNING
    d.advance(TIMEOUT - 2)  # heartbeats go on: only the missing start can end this
    assert d.state("j") == JobState.RUNNING
    stops = of_type(d.advance(3), StopRound)
    assert [s.node for s in stops] == ["a"]
    assert "start timeout" in stops[0].reason
    assert "did not start within 120 s" in d.reason("j")
    d.settle()
    assert d.state("j") == JobState.FAILED
    result = d.cluster.job_result("j")
    assert result is not None and result.state == WorkerState.FAILED
    assert set(result.failures) == {0, 1}
    assert {f.category for f in result.failures.values()} == {FailureCategory.PLATFORM}
    assert all("start timeout" in f.message for f in result.failures.values())
    assert "start_timeout" in d.event_kinds("j")
    assert d.cluster.nodes()[0].slots_used == 0


def test_a_round_that_times_out_on_every_node_spends_one_restart() -> None:
    d = _driver()
    for n in ("a", "b", "c"):
        d.connect(n, slots=2)
    d.submit("j", nproc_per_node=2, min_nodes=3, max_nodes=3, max_restarts=2)
    _assign_but_never_start(d, {"a", "b", "c"})
    d.advance(TIMEOUT + 1)
    d.settle()  # the stop is confirmed; the job goes back to the queue for attempt 1
    assert d.attempt("j") == 1
    # Attempt 1 starts everywhere: no second timeout of the same round can spend more.
    d.advance(2)
    d.settle()
    assert d.state("j") == JobState.RUNNING
    d.advance(3 * TIMEOUT)
    assert d.attempt("j") == 1
    assert d.state("j") == JobState.RUNNING


def test_a_slow_start_within_the_deadline_is_not_a_failure() -> None:
    d = _driver()
    d.connect("a", slots=1)
    d.submit("j")
    (late,) = _assign_but_never_start(d, {"a"})
    d.advance(TIMEOUT - 1)
    d.pending.append(late)  # the agent reports its workers started just in time
    d.settle()
    d.advance(3 * TIMEOUT)
    assert d.state("j") == JobState.RUNNING
    assert "start_timeout" not in d.event_kinds("j")


def test_coordinator_serve_takes_the_start_timeout_flag() -> None:
    assert _parser().parse_args(["serve"]).start_timeout == CoordinatorConfig().start_timeout
    assert _parser().parse_args(["serve", "--start-timeout", "300"]).start_timeout == 300.0
    with pytest.raises(ValueError, match="start_timeout"):
        CoordinatorConfig(state_dir=":memory:", start_timeout=-1).validate()
