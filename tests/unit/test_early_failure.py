"""A failure reported when it is recorded (before the worker's exit): the cluster's side.

The notice starts the stop at once; the exit that follows completes the failure (exit code,
signal) and counts no second failure, no second event and no second restart.
"""

from __future__ import annotations

from dataclasses import replace

from client.model import JobState, ProcessFailure
from client.node_protocol import GroupStopped, WorkerExited, WorkerFailing
from coordinator._cluster import Cluster, RunningGroupReport, StopRound, WorkerExitReport
from coordinator._codec import encode

from ._cluster_driver import Driver, of_type
from .test_cluster import failure, running_job


def failing(d: Driver, name: str, local_rank: int, f: ProcessFailure, round_: int | None = None):
    n = d.nodes[name]
    a = d.assignment(name)
    round_ = a.round if round_ is None else round_
    pid = n.running.get((a.job_id, round_), {}).get(local_rank, 0)
    f = replace(f, pid=pid, local_rank=local_rank)
    return d._take(d.cluster.step(name, n.incarnation, WorkerFailing(a.job_id, round_, f), d.now))


def test_an_early_failure_stops_the_round_at_once_and_its_exit_only_adds_the_code() -> None:
    d = running_job(nodes=2, nproc=2, max_restarts=0)
    for n in d.nodes.values():
        n.auto_stop = False
    d.clear()
    failing(d, "n1", 1, failure(3, 1, ts=d.now - 0.5, msg="ValueError: bad batch"))
    # No restart left: FAILED at once, while every node is still stopping its workers.
    assert d.state("j") == JobState.FAILED
    assert sorted(s.node for s in of_type(d.history, StopRound)) == ["n0", "n1"]
    early = d.cluster.job_result("j")
    assert early is not None and early.root_cause is not None
    assert early.root_cause.message == "ValueError: bad batch"
    assert early.root_cause.signal != "SIGTERM"  # not known yet
    # The same notice again (an agent's replay) changes nothing.
    before = len(d.history)
    failing(d, "n1", 1, failure(3, 1, ts=d.now - 0.5, msg="ValueError: bad batch"))
    assert len(d.history) == before
    # Its exit: the stop cut its teardown short.
    d.advance(0.1)
    d.exit(
        "n1",
        1,
        -15,
        failure=replace(
            failure(3, 1, ts=d.now, msg="ValueError: bad batch"),
            exitcode=-15,
            signal="SIGTERM",
            stderr_tail="Traceback ...",
        ),
    )
    d.group_stopped("n0", "j", 1)
    d.group_stopped("n1", "j", 1)
    assert d.state("j") == JobState.FAILED
    result = d.cluster.job_result("j")
    assert result is not None and result.root_cause is not None
    assert sorted(result.failures) == [3]
    f = result.failures[3]
    assert f.root_cause and f.message == "ValueError: bad batch"
    assert (f.exitcode, f.signal, f.stderr_tail) == (-15, "SIGTERM", "Traceback ...")
    (kept,) = result.attempts[0].failures
    assert (kept.exitcode, kept.signal, kept.root_cause) == (-15, "SIGTERM", True)
    assert d.event_kinds("j").count("worker_failed") == 1
    assert d.event_kinds("j").count("finished") == 1


def test_an_early_failure_spends_one_restart_and_the_next_round_runs() -> None:
    d = running_job(nodes=2, nproc=1, max_restarts=3)
    failing(d, "n1", 0, failure(1, 0, ts=d.now))
    d.exit("n1", 0, 1, failure=failure(1, 0, ts=d.now))
    # A replay after the exit, and the exit again: both ignored.
    failing(d, "n1", 0, failure(1, 0, ts=d.now), round_=1)
    d.settle()
    assert d.state("j") == JobState.RUNNING
    assert d.attempt("j") == 1
    assert d.event_kinds("j").count("restart") == 1
    assert d.event_kinds("j").count("worker_failed") == 1


def test_an_exit_without_an_early_notice_is_as_before() -> None:
    d = running_job(nodes=1, nproc=2)
    d.exit("n0", 0, 3)
    d.settle()
    result = d.cluster.job_result("j")
    assert result is not None
    (f,) = result.failures.values()
    assert (f.exitcode, f.root_cause) == (3, True)
    assert "exit code 3" in f.message


def test_an_early_notice_for_a_stale_round_is_ignored() -> None:
    d = running_job(nodes=2, nproc=1, max_restarts=3)
    d.exit("n0", 0, 1)
    d.settle()
    assert d.round("j") == 2
    d.clear()
    failing(d, "n1", 0, failure(1, 0, ts=d.now), round_=1)
    assert d.state("j") == JobState.RUNNING
    assert d.attempt("j") == 1
    # The node is told to stop what it still runs of round 1, nothing else happens.
    assert [(s.node, s.round) for s in of_type(d.history, StopRound)] == [("n1", 1)]
    assert d.event_kinds("j").count("worker_failed") == 1


def test_an_early_notice_from_another_process_of_the_rank_is_ignored() -> None:
    d = running_job(nodes=1, nproc=1)
    n = d.nodes["n0"]
    f = replace(failure(0, 0, ts=d.now), pid=999_999)
    d._take(d.cluster.step("n0", n.incarnation, WorkerFailing("j", 1, f), d.now))
    assert d.state("j") == JobState.RUNNING


def test_an_early_failure_survives_a_coordinator_restart_and_the_exit_completes_it() -> None:
    d = running_job(nodes=1, nproc=2, max_restarts=0)
    n = d.nodes["n0"]
    n.auto_stop = False
    failing(d, "n0", 1, failure(1, 1, ts=d.now, msg="RuntimeError: x"))
    c2 = Cluster(d.cluster.config)
    c2.restore(
        [d.cluster.dump_job(j) for j in d.cluster.job_ids()],
        d.cluster.job_events("j") and [encode(e) for e in d.cluster.job_events("j")],
        d.cluster.dump_nodes(),
        d.now,
        reconnect_grace=15.0,
    )
    pids = n.running[("j", 1)]
    c2.node_connected(
        "n0",
        n.addr,
        n.slots,
        n.incarnation,
        d.now,
        running=[RunningGroupReport("j", 1, 0, tuple(sorted(pids.items())))],
    )
    # The agent replays its notice (ignored), then the exit comes.
    f = replace(failure(1, 1, ts=d.now, msg="RuntimeError: x"), pid=pids[1])
    c2.step("n0", n.incarnation, WorkerFailing("j", 1, f), d.now)
    exit_report = WorkerExitReport(1, 1, pids[1], 1, failure=replace(f, exitcode=1))
    c2.step("n0", n.incarnation, WorkerExited("j", 1, exit_report), d.now)
    c2.step(
        "n0", n.incarnation, WorkerExited("j", 1, WorkerExitReport(0, 0, pids[0], -15, True)), d.now
    )
    c2.step("n0", n.incarnation, GroupStopped("j", 1, ()), d.now)
    assert c2.job_state("j") == JobState.FAILED
    result = c2.job_result("j")
    assert result is not None and sorted(result.failures) == [1]
    assert result.failures[1].message == "RuntimeError: x"
    assert [e.kind for e in c2.job_events("j")].count("worker_failed") == 1
