"""Drains in the coordinator's state machine: a drained node gets no new round, its rounds are
replaced without spending a restart, and their workers get a notice, then SIGTERM, then SIGKILL
on the timeline the coordinator decides. Scripted fake nodes, a fake clock."""

from __future__ import annotations

import json

import pytest

from client.model import JobState
from client.node_protocol import DrainRequest, RunningGroup
from coordinator._cluster import (
    AssignRound,
    DrainAccepted,
    NodeChanged,
    StopRound,
)
from coordinator._cluster_drain import drain_timeline
from coordinator._cluster_records import STOP_MARGIN_S

from ._cluster_driver import Driver, nodes_of, of_type


def running(nodes: int = 3, **kw: object) -> Driver:
    d = Driver()
    for i in range(nodes):
        d.connect(f"n{i}", addr=f"10.0.0.{i + 1}", slots=1)
    kw.setdefault("min_nodes", 1)
    kw.setdefault("max_nodes", nodes)
    kw.setdefault("last_call_timeout", 0.0)
    kw.setdefault("max_restarts", 0)
    d.submit("j", nproc_per_node=1, **kw)
    d.settle()
    assert d.state("j") == JobState.RUNNING
    return d


def node_state(d: Driver, name: str) -> str:
    return {n.name: n.state for n in d.cluster.nodes()}[name]


def members(d: Driver, job: str = "j") -> list[str]:
    return [m.node for m in d.cluster.job_status(job).members]


def test_the_timeline_gives_the_notice_at_once_and_sigterm_a_grace_before_the_deadline() -> None:
    # A 90 s deadline, a 30 s stop_grace: 60 s on with the notice, SIGTERM, SIGKILL at 90 s.
    assert drain_timeline(30.0, 90.0, 1000.0) == (1060.0, 1090.0)
    # A deadline shorter than the grace: SIGTERM at once, SIGKILL at the deadline.
    assert drain_timeline(10.0, 1.0, 1000.0) == (1000.0, 1001.0)
    # No deadline: the job's own stop_grace, SIGTERM at once.
    assert drain_timeline(30.0, None, 1000.0) == (1000.0, 1030.0)


def test_a_drain_replaces_the_round_without_a_restart_and_tells_every_rank_first() -> None:
    d = running(nodes=3, min_nodes=2, stop_grace=30.0)
    d.clear()
    t0 = d.now
    d._take(d.cluster.drain("n2", 90.0, d.now))
    stops = of_type(d.history, StopRound)
    # Every member of the round, not only the drained node: the whole round is replaced.
    assert sorted(s.node for s in stops) == ["n0", "n1", "n2"]
    assert {(s.notice, s.term_after, s.grace, s.drain_node, s.replaced) for s in stops} == {
        (True, 60.0, 30.0, "n2", True)
    }
    assert "node n2 is draining (an operator asked)" in stops[0].reason
    assert d.state("j") == JobState.STOPPING
    assert "node n2 is draining" in d.reason("j")
    assert "node_draining" in d.event_kinds("j")
    d.settle()
    # Re-formed on the two others, attempt 0: no restart spent (max_restarts=0).
    assert (d.state("j"), d.attempt("j"), d.round("j")) == (JobState.RUNNING, 0, 2)
    assert members(d) == ["n0", "n1"]
    assert d.now == t0


def test_the_stop_waits_as_long_as_the_drains_deadline() -> None:
    d = running(nodes=2, stop_grace=5.0)
    for n in d.nodes.values():
        n.auto_stop = False
    d._take(d.cluster.drain("n1", 60.0, d.now))
    d.advance(5.0 + STOP_MARGIN_S + 1)
    # The job's own grace and margin passed, not the drain's 60 s: still stopping.
    assert d.state("j") == JobState.STOPPING
    d.advance(60.0)
    d.settle()
    assert d.state("j") == JobState.RUNNING and members(d) == ["n0"]


def test_a_worker_that_leaves_after_the_notice_is_neither_a_failure_nor_a_success() -> None:
    d = running(nodes=2, stop_grace=10.0)
    for n in d.nodes.values():
        n.auto_stop = False
    d._take(d.cluster.drain("n1", 90.0, d.now))
    # Each rank saw the notice, checkpointed and exited 0 by itself, long before SIGTERM.
    d.exit("n0", 0, 0)
    d.exit("n1", 0, 0)
    assert all(w.state.value == "STOPPED" for w in d.cluster.job_status("j").workers)
    d.group_stopped("n0", "j", 1)
    d.group_stopped("n1", "j", 1)
    d.settle()
    # Replaced at once, without waiting for the deadline; nothing failed, nothing succeeded.
    assert (d.state("j"), d.attempt("j"), d.round("j")) == (JobState.RUNNING, 0, 2)
    (attempt,) = d.cluster.job_attempts("j")
    assert attempt.failures == () and "draining" in attempt.end_reason


def test_a_failure_during_the_notice_spends_no_restart() -> None:
    d = running(nodes=2, stop_grace=10.0)
    for n in d.nodes.values():
        n.auto_stop = False
    d._take(d.cluster.drain("n1", 90.0, d.now))
    d.exit("n0", 0, 1)  # its peer left; its collective broke
    d.group_stopped("n0", "j", 1)
    d.group_stopped("n1", "j", 1)
    d.settle()
    assert (d.state("j"), d.attempt("j")) == (JobState.RUNNING, 0)


def test_no_new_round_goes_to_a_drained_node_until_it_is_undrained() -> None:
    d = Driver()
    d.connect("n0", addr="10.0.0.1")
    d.connect("n1", addr="10.0.0.2")
    d._take(d.cluster.drain("n0", None, d.now))
    assert node_state(d, "n0") == "drained"
    d.submit("a", nproc_per_node=1, min_nodes=1, max_nodes=2, last_call_timeout=0.0)
    d.settle()
    assert members(d, "a") == ["n1"]
    d.submit("b", nproc_per_node=1, min_nodes=1, max_nodes=1, last_call_timeout=0.0)
    d.settle()
    assert d.state("b") == JobState.QUEUED  # n0 has room, but it is drained
    d.clear()
    d._take(d.cluster.undrain("n0", d.now))
    assert of_type(d.history, NodeChanged) == [NodeChanged("n0")]
    d.settle()
    assert d.state("b") == JobState.RUNNING and members(d, "b") == ["n0"]
    assert node_state(d, "n0") == "live"


def test_a_drain_that_leaves_fewer_than_min_nodes_waits_for_nodes() -> None:
    d = running(nodes=2, min_nodes=2)
    d._take(d.cluster.drain("n1", 5.0, d.now))
    d.settle()
    assert (d.state("j"), d.attempt("j")) == (JobState.QUEUED, 0)
    assert "1/2 nodes" in d.reason("j") and "(drained: n1)" in d.reason("j")
    d.connect("n2", addr="10.0.0.3")
    d.settle()
    assert (d.state("j"), d.attempt("j")) == (JobState.RUNNING, 0)
    assert members(d) == ["n0", "n2"]


def test_a_drained_node_is_draining_while_its_workers_run_then_drained() -> None:
    d = running(nodes=2, stop_grace=10.0)
    d.nodes["n1"].auto_stop = False
    d._take(d.cluster.drain("n1", 30.0, d.now))
    d.settle()
    (n1,) = [n for n in d.cluster.nodes() if n.name == "n1"]
    assert n1.state == "draining"
    assert n1.drain_reason == "an operator asked"
    assert n1.drain_deadline == d.now + 30.0 and n1.drained_since == d.now
    assert not n1.drain_by_agent
    d.group_stopped("n1", "j", 1)
    d.settle()
    assert node_state(d, "n1") == "drained"
    assert node_state(d, "n0") == "live"
    assert members(d) == ["n0"]


def test_a_drain_is_kept_across_a_coordinator_restart_with_its_timeline() -> None:
    d = running(nodes=2, stop_grace=30.0)
    for n in d.nodes.values():
        n.auto_stop = False
    d._take(d.cluster.drain("n1", 90.0, d.now, reason="spot reclaim"))
    d.advance(10.0)
    nodes = [json.loads(json.dumps(x)) for x in d.cluster.dump_nodes()]
    jobs = [json.loads(json.dumps(d.cluster.dump_job("j")))]
    d2 = Driver(t0=d.now + 1)
    d2.cluster.restore(jobs, [], nodes, d2.now, reconnect_grace=15.0)
    (n1,) = [n for n in d2.cluster.nodes() if n.name == "n1"]
    assert n1.state == "draining" and n1.drain_reason == "spot reclaim"
    # A node that reconnects holding the round is told the stop again, on what is left of the
    # timeline: SIGTERM 49 s from now (60 s after the drain), SIGKILL 30 s after that.
    a = d.assignment("n0")
    running_group = RunningGroup("j", a.round, a.attempt, ((0, 4242),))
    d2.clear()
    d2.connect(
        "n0", addr="10.0.0.1", incarnation=d.nodes["n0"].incarnation, running=[running_group]
    )
    (stop,) = of_type(d2.history, StopRound)
    assert (stop.node, stop.notice, stop.drain_node) == ("n0", True, "n1")
    assert (stop.term_after, stop.grace) == (pytest.approx(49.0), pytest.approx(30.0))
    d2._take(d2.cluster.undrain("n1", d2.now))
    assert [n.drain_reason for n in d2.cluster.nodes()] == ["", ""]


def test_an_agents_drain_request_is_answered_after_its_stops_and_lifted_by_a_new_agent() -> None:
    d = running(nodes=2, stop_grace=10.0)
    d.clear()
    n1 = d.nodes["n1"]
    effects = d._take(d.cluster.step("n1", n1.incarnation, DrainRequest(None, "SIGTERM"), d.now))
    kinds = [type(e) for e in effects if isinstance(e, StopRound | DrainAccepted)]
    assert kinds == [StopRound, StopRound, DrainAccepted]
    assert effects.send[-1] == DrainAccepted("n1", n1.incarnation, None)
    # No deadline: each job's stop_grace, SIGTERM at once.
    assert {(s.term_after, s.grace) for s in of_type(effects, StopRound)} == {(0.0, 10.0)}
    d.settle()
    (info,) = [n for n in d.cluster.nodes() if n.name == "n1"]
    assert info.drain_by_agent and info.drain_reason == "SIGTERM"
    # The same agent reconnecting stays drained; a new agent process under the name does not.
    d.connect("n1", addr="10.0.0.2", incarnation=n1.incarnation)
    assert node_state(d, "n1") == "drained"
    d.disconnect("n1")
    d.connect("n1", addr="10.0.0.2")
    assert node_state(d, "n1") == "live"


def test_an_operators_drain_outlives_a_new_agent_and_overrides_the_agents_own() -> None:
    d = running(nodes=2)
    n1 = d.nodes["n1"]
    d._take(d.cluster.step("n1", n1.incarnation, DrainRequest(5.0, ""), d.now))
    d._take(d.cluster.drain("n1", None, d.now))
    d.settle()
    (info,) = [n for n in d.cluster.nodes() if n.name == "n1"]
    assert not info.drain_by_agent and info.drain_reason == "an operator asked"
    assert info.drain_deadline == d.now + 5.0  # the sooner deadline is kept
    d.disconnect("n1")
    d.connect("n1", addr="10.0.0.2")
    assert node_state(d, "n1") == "drained"
    assert d.state("j") == JobState.RUNNING and members(d) == ["n0"]


def test_a_drain_of_an_unknown_node_changes_nothing_and_a_bad_deadline_is_refused() -> None:
    d = running(nodes=2)
    assert d.cluster.drain("nope", 10.0, d.now) == []
    assert d.cluster.undrain("n0", d.now) == []  # not drained
    with pytest.raises(ValueError, match="deadline"):
        d.cluster.drain("n0", 0.0, d.now)
    with pytest.raises(ValueError, match="deadline"):
        d.cluster.drain("n0", 8 * 86400.0, d.now)
    assert not of_type(d.cluster.tick(d.now), AssignRound)
    assert nodes_of(d.history, StopRound) == []
