"""Nothing a client saw and nothing an agent was told is lost when the coordinator dies.

The coordinator is SIGKILLed at the worst moments: right after it sends a node the Release of a
finished job, the Assign of a restarted round, or the Stop after a failure (the fault-injection
hook `GELASTIC_FAULTS`, off by default), and right after a client has seen a job end. It is then
started again on the same state; the job must end as it would have, with every worker started
exactly once per attempt and the events the client saw still there, in order. Each test runs with
either store: SQLite in the state directory, and a real etcd (tests/_etcd.py).
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from client import JobEvent, JobSpec, WorkerState
from gelastic.local import LocalCluster, poll_until
from tests.e2e.conftest import PY, script

TIMEOUT = 90
FAULTS = "GELASTIC_FAULTS"


@pytest.fixture(params=["sqlite", "etcd"])
def store_args(request: pytest.FixtureRequest) -> list[str]:
    """The coordinator's store flags: none (SQLite in its state dir) or an etcd of the session."""
    if request.param == "etcd":
        return ["--store", request.getfixturevalue("etcd_url")]
    return []


@pytest.fixture
def make_cluster(
    make_cluster: Callable[..., LocalCluster], store_args: list[str]
) -> Callable[..., LocalCluster]:
    """The suite's make_cluster, with this test's store."""

    def make(**kw: Any) -> LocalCluster:
        kw.setdefault("coordinator_args", store_args)
        return make_cluster(**kw)

    return make


@pytest.fixture
def cluster(make_cluster: Callable[..., LocalCluster]) -> LocalCluster:
    return make_cluster()


def _spec(out: Path, **env: str) -> JobSpec:
    return JobSpec(
        entrypoint=[PY, script("count_starts.py")],
        nproc_per_node=2,
        min_nodes=2,
        max_nodes=2,
        max_restarts=1,
        env={"OUT_DIR": str(out), **env},
    )


def _starts(out: Path) -> collections.Counter[tuple[int, int]]:
    """How many times each (attempt, rank) started."""
    path = out / "starts.log"
    lines = path.read_text().split() if path.exists() else []
    return collections.Counter(
        (int(a), int(r)) for a, r in zip(lines[0::3], lines[1::3], strict=True)
    )


def _died(cluster: LocalCluster) -> None:
    assert cluster.coordinator is not None
    proc = cluster.coordinator.popen
    poll_until(lambda: proc.poll() is not None, 60, what="the coordinator to kill itself")
    assert proc.returncode == -9, f"the coordinator exited with {proc.returncode}, not SIGKILL"


def _restart(cluster: LocalCluster) -> None:
    if cluster.coordinator is not None:
        cluster.coordinator.log.close()  # it died by itself: nobody closed its log
    cluster.env.pop(FAULTS, None)
    cluster.start_coordinator(port=cluster.port)


def _seq_ok(events: list[JobEvent]) -> None:
    seqs = [e.seq for e in events]
    assert seqs == sorted(set(seqs)), f"event numbers reused or out of order: {seqs}"


def _fault_cluster(make_cluster: object, fault: str) -> LocalCluster:
    assert callable(make_cluster)
    cluster = make_cluster(env={FAULTS: fault})
    assert isinstance(cluster, LocalCluster)
    return cluster


@pytest.mark.parametrize("round_", range(2))
def test_a_finished_job_survives_a_kill_right_after_its_release(
    make_cluster: object, out: Path, round_: int
) -> None:
    cluster = _fault_cluster(make_cluster, "kill-after-send:release")
    job = cluster.client.submit(_spec(out))
    _died(cluster)  # the first Release went out: the job had finished
    _restart(cluster)
    result = job.wait(TIMEOUT)
    assert result.state == WorkerState.SUCCEEDED, result.format_failures()
    # Re-read once both agents are back and heard: their reports must not reopen the job.
    _both_agents_back(cluster, out)
    after = job.status()
    assert after.state.is_terminal() and after.attempt == 0
    assert _starts(out) == {(0, r): 1 for r in range(4)}, "a finished job ran again"
    kinds = [e.kind for e in job.events()]
    assert kinds.count("round_formed") == 1, kinds
    _seq_ok(job.events())


def test_a_restarted_round_survives_a_kill_right_after_its_assign(
    make_cluster: object, out: Path
) -> None:
    # Assigns 1-2 form round 1; rank 0 crashes; assign 3 is the first of the restarted round.
    cluster = _fault_cluster(make_cluster, "kill-after-send:assign:3")
    job = cluster.client.submit(_spec(out, CRASH_RANK="0", SLEEP="1"))
    _died(cluster)
    _restart(cluster)
    result = job.wait(TIMEOUT)
    assert result.state == WorkerState.SUCCEEDED, result.format_failures()
    starts = _starts(out)
    assert all(n == 1 for n in starts.values()), f"a worker started twice: {starts}"
    # Attempt 0's peers may be stopped before they wrote their line; attempt 1 ran whole, once.
    assert {r for a, r in starts if a == 1} == set(range(4)) and (0, 0) in starts, starts
    assert {a for a, _ in starts} == {0, 1}
    assert job.status().attempt == 1
    _seq_ok(job.events())


def test_a_failure_survives_a_kill_right_after_the_stop_it_caused(
    make_cluster: object, out: Path
) -> None:
    cluster = _fault_cluster(make_cluster, "kill-after-send:stop")
    job = cluster.client.submit(_spec(out, CRASH_RANK="1", SLEEP="30"))
    _died(cluster)
    _restart(cluster)
    # Attempt 0's peers may be stopped before they wrote their line: wait for attempt 1's four.
    poll_until(
        lambda: {r for a, r in _starts(out) if a == 1} == set(range(4)),
        TIMEOUT,
        what="the restarted attempt to start",
    )
    # The failure that caused the stop was on disk before the stop went out.
    events = job.events()
    failed = [e for e in events if e.kind == "worker_failed"]
    assert [e.rank for e in failed] == [1], [(e.kind, e.reason) for e in events]
    assert [e.kind for e in events].index("worker_failed") < [e.kind for e in events].index(
        "recovered"
    )
    # Back on the new coordinator, the agents' word settles the stop: no stop deadline waited out.
    assert "stop_timeout" not in [e.kind for e in job.events()], job.events()
    job.cancel()
    result = job.wait(TIMEOUT)
    assert len(result.attempts) == 2 and result.attempts[0].failures, result.attempts
    starts = _starts(out)
    # A worker of attempt 0 may be stopped before it wrote its line; none starts twice.
    assert all(n == 1 for n in starts.values()) and {r for a, r in starts if a == 1} == set(
        range(4)
    ), starts
    _seq_ok(job.events())


@pytest.mark.parametrize("repeat", range(3))
def test_an_outcome_the_client_saw_survives_a_kill_at_once(
    cluster: LocalCluster, out: Path, repeat: int
) -> None:
    job = cluster.client.submit(_spec(out))
    poll_until(lambda: job.poll() is not None, TIMEOUT, interval=0.005, what="the job to end")
    cluster.kill_coordinator()  # the instant the client saw it end
    _restart(cluster)
    result = job.poll()
    assert result is not None and result.state == WorkerState.SUCCEEDED
    _both_agents_back(cluster, out)
    status = job.status()
    assert status.state.is_terminal(), f"a finished job is {status.state.value} again"
    assert _starts(out) == {(0, r): 1 for r in range(4)}, "a finished job ran again"
    _seq_ok(job.events())


def _both_agents_back(cluster: LocalCluster, out: Path) -> None:
    """A 2-node job runs to the end: both agents reconnected and the coordinator heard them."""
    probe = out / "probe"
    probe.mkdir()
    result = cluster.client.submit(_spec(probe)).wait(TIMEOUT)
    assert result.state == WorkerState.SUCCEEDED, result.format_failures()
