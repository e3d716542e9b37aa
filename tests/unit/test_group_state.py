"""Worker groups as a unit on the coordinator: the state each node's group is in, the UNKNOWN
report of an agent that can no longer supervise its group (an INFRA failure of that node that
ends the round as a failure), and each worker's role ranks in the status."""

from __future__ import annotations

import subprocess
import sys

import pytest

from client._tables import status_text, to_jsonable
from client.model import FailureCategory, JobState, WorkerState
from client.node_protocol import GroupHealth, GroupUnknown, Heartbeat
from client.wire import job_status_from_pb, job_to_pb
from nodeagent import _faults

from ._cluster_driver import Driver
from .test_cluster import running_job


def _unknown(d: Driver, name: str, reason: str = "health monitor raised") -> None:
    n = d.nodes[name]
    a = d.assignment(name)
    d._take(d.cluster.step(name, n.incarnation, GroupUnknown(a.job_id, a.round, reason), d.now))


def _groups(d: Driver) -> dict[str, WorkerState | None]:
    return {m.node: m.group_state for m in d.cluster.job_status("j").members}


def test_group_unknown_is_an_infra_failure_of_that_node_and_a_restart() -> None:
    d = running_job(nodes=2, nproc=2, max_restarts=1)
    assert _groups(d) == {"n0": WorkerState.HEALTHY, "n1": WorkerState.HEALTHY}
    _unknown(d, "n1", "health monitor raised: RuntimeError: boom\nsecond line")
    assert _groups(d)["n1"] == WorkerState.UNKNOWN
    d.settle()
    assert (d.state("j"), d.attempt("j")) == (JobState.RUNNING, 1)  # one restart spent
    (first,) = d.cluster.job_attempts("j")[:1]
    assert sorted(f.global_rank for f in first.failures) == [2, 3]
    for f in first.failures:
        assert (f.node, f.category) == ("n1", FailureCategory.INFRA)
        assert "worker group UNKNOWN" in f.message
        assert "RuntimeError: boom second line" in f.message  # one line
    (ev,) = [e for e in d.cluster.job_events("j") if e.kind == "group_unknown"]
    assert ev.node == "n1" and "RuntimeError: boom" in ev.reason
    # The new round starts from INIT/HEALTHY again on both nodes.
    assert set(_groups(d).values()) <= {WorkerState.INIT, WorkerState.HEALTHY}


def test_group_unknown_without_restarts_left_fails_the_job_with_infra() -> None:
    d = running_job(nodes=2, nproc=1, max_restarts=0)
    _unknown(d, "n0")
    d.settle()
    assert d.state("j") == JobState.FAILED
    result = d.cluster.job_result("j")
    assert result is not None
    assert {r: f.category for r, f in result.failures.items()} == {0: FailureCategory.INFRA}
    assert _groups(d)["n0"] == WorkerState.UNKNOWN


def test_a_second_unknown_or_one_for_a_stale_round_changes_nothing() -> None:
    d = running_job(nodes=1, nproc=1, max_restarts=3)
    a = d.assignment("n0")
    _unknown(d, "n0")
    _unknown(d, "n0")  # the replay after a reconnect, say
    d.settle()
    assert d.attempt("j") == 1
    assert d.event_kinds("j").count("group_unknown") == 1
    n = d.nodes["n0"]
    d.cluster.step("n0", n.incarnation, GroupUnknown("j", a.round, "late"), d.now)  # the old round
    d.settle()
    assert d.attempt("j") == 1 and d.state("j") == JobState.RUNNING


def test_an_unknown_from_a_group_whose_workers_all_succeeded_fails_nothing() -> None:
    d = running_job(nodes=2, nproc=1)
    d.finish("n0")
    _unknown(d, "n0")
    d.settle()
    assert d.state("j") == JobState.RUNNING and d.attempt("j") == 0
    assert "group_unknown" in d.event_kinds("j")
    d.finish("n1")
    assert d.state("j") == JobState.SUCCEEDED


def test_heartbeats_carry_the_group_state_and_unknown_sticks() -> None:
    d = running_job(nodes=1, nproc=1)
    n = d.nodes["n0"]
    a = d.assignment("n0")

    def beat(state: WorkerState) -> None:
        d.cluster.step(
            "n0", n.incarnation, Heartbeat(groups=(GroupHealth("j", a.round, state=state),)), d.now
        )

    beat(WorkerState.UNHEALTHY)
    assert _groups(d) == {"n0": WorkerState.UNHEALTHY}
    beat(WorkerState.HEALTHY)
    assert _groups(d) == {"n0": WorkerState.HEALTHY}
    beat(WorkerState.FAILED)
    beat(WorkerState.STOPPED)  # stopped after it failed: it failed
    assert _groups(d) == {"n0": WorkerState.FAILED}
    beat(WorkerState.UNKNOWN)
    beat(WorkerState.HEALTHY)
    assert _groups(d) == {"n0": WorkerState.UNKNOWN}


def test_a_finished_group_succeeded_and_a_stopped_one_is_stopped() -> None:
    d = running_job(nodes=2, nproc=1)
    d.finish("n0")
    assert _groups(d) == {"n0": WorkerState.SUCCEEDED, "n1": WorkerState.HEALTHY}
    d.cancel("j")
    d.settle()
    assert d.state("j") == JobState.CANCELED
    assert _groups(d) == {"n0": WorkerState.SUCCEEDED, "n1": WorkerState.STOPPED}


def test_status_shows_group_state_and_each_workers_role_ranks_through_the_wire() -> None:
    d = running_job(nodes=2, nproc=2)
    status = job_status_from_pb(job_to_pb(d.cluster.job_status("j"), None))
    assert [(m.node, m.group_state) for m in status.members] == [
        ("n0", WorkerState.HEALTHY),
        ("n1", WorkerState.HEALTHY),
    ]
    # One role today: its ranks are the global ones, as the rank assignment made them.
    assert [(w.role, w.role_rank, w.world_size, w.role_world_size) for w in status.workers] == [
        ("default", r, 4, 4) for r in range(4)
    ]
    text = status_text(status)
    assert "GROUP_STATE" in text and "ROLE_RANK" in text and "ROLE_WORLD" in text
    member_line = next(line for line in text.splitlines() if " n1 " in line and "10.0.0" in line)
    assert "HEALTHY" in member_line
    as_json = to_jsonable(status)
    assert as_json["members"][0]["group_state"] == "HEALTHY"
    assert as_json["workers"][3]["role_rank"] == 3
    assert as_json["workers"][3]["role_world_size"] == 4


# -- the agent's fault-injection hook -----------------------------------------------------------


@pytest.fixture
def disarmed() -> object:
    yield None
    _faults.configure("")


@pytest.mark.parametrize(
    ("text", "armed"),
    [
        ("monitor-raise", ("monitor-raise", 0)),
        (" observe-fail ", ("observe-fail", 0)),
        ("start-fail-after:2", ("start-fail-after", 2)),
        ("", None),
    ],
)
def test_agent_faults_parse(text: str, armed: tuple[str, int] | None, disarmed: object) -> None:
    _faults.configure(text)
    assert _faults._armed == armed


@pytest.mark.parametrize(
    "text",
    ["monitor", "start-fail-after:0", "start-fail-after:x", "observe-fail;rm -rf", "x" * 5000],
)
def test_a_bad_agent_fault_is_ignored_with_a_warning(
    text: str, disarmed: object, caplog: pytest.LogCaptureFixture
) -> None:
    _faults.configure(text)
    assert _faults._armed is None
    assert any("GELASTIC_AGENT_FAULTS" in r.getMessage() for r in caplog.records)
    _faults.monitor()
    _faults.observe()
    _faults.started(10)  # nothing is raised


def test_faults_are_off_by_default_and_each_raises_only_where_asked(disarmed: object) -> None:
    code = "import nodeagent._faults as f; print(f._armed)"
    env_free = {k: v for k, v in __import__("os").environ.items() if k != _faults.ENV}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env_free, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "None"
    bad = subprocess.run(
        [sys.executable, "-c", code],
        env={**env_free, _faults.ENV: "bogus"},
        capture_output=True,
        text=True,
        check=True,
    )
    assert bad.stdout.strip() == "None" and "not understood" in bad.stderr
    _faults.configure("start-fail-after:2")
    _faults.started(1)
    _faults.monitor()
    _faults.observe()
    with pytest.raises(_faults.InjectedFault):
        _faults.started(2)


def test_a_batch_of_heartbeats_is_taken_as_steps_would_and_skips_stale_sessions() -> None:
    d = Driver()
    d.connect("a", slots=1)
    d.connect("b", slots=1)
    d.submit("j", nproc_per_node=1, min_nodes=2, max_nodes=2, last_call_timeout=0.0)
    d.settle()
    r = d.round("j")
    unhealthy = Heartbeat(groups=(GroupHealth("j", r, state=WorkerState.UNHEALTHY),))
    a, b = d.nodes["a"], d.nodes["b"]
    d.now += 4.0  # most of the lease (5 s) gone without a word
    d.cluster.heartbeats(
        [("a", a.incarnation, unhealthy), ("b", "an-old-process", unhealthy)], d.now
    )
    states = {m.node: m.group_state for m in d.cluster.job_status("j").members}
    assert states == {"a": WorkerState.UNHEALTHY, "b": WorkerState.HEALTHY}
    # The batch renewed a's lease, not b's: only b is lost when the lease runs out.
    d.now += 2.0
    d.cluster.tick(d.now)
    live = {n.name for n in d.cluster.nodes() if n.state == "live"}
    assert live == {"a"}
    assert b.incarnation != "an-old-process"
