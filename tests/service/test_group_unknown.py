"""A worker group the agent can no longer supervise is UNKNOWN: its workers are killed, the
coordinator hears why, and the round ends as an INFRA failure of that node (restart, or fail
when no restart is left).

A real in-process coordinator and agent, real worker processes; the faults come from the
agent's fault-injection hook (nodeagent._faults), armed per test.
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from client import Client, Job
from client.model import FailureCategory, JobSpec, JobState, JobStatus, WorkerState
from coordinator.server import Coordinator
from nodeagent import _faults, _standby
from nodeagent._launch import WorkerLaunch
from nodeagent._process import ProcessHandle
from nodeagent._workers import WorkerGroup
from nodeagent.session import AgentConfig, NodeAgent, _Held
from protos.gelastic.v1 import gelastic_pb2 as pb
from tests._helpers import wait_for
from tests.service._local import coordinator_config, local_agent
from tests.service.test_workers import Harness, gone, h, wait_gone

__all__ = ["h"]

PY = sys.executable
DEADLINE = 60.0
SLEEPER = "import time\ntime.sleep(120)\n"


@pytest.fixture
def spawned(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """The pid of every worker the agent spawns (the real spawn, recorded)."""
    pids: list[int] = []
    real = _standby.spawn

    def recording(launch: WorkerLaunch, **kw: Any) -> ProcessHandle:
        handle = real(launch, **kw)
        pids.append(handle.pid)
        return handle

    monkeypatch.setattr(_standby, "spawn", recording)
    yield pids
    _faults.configure("")


@pytest.fixture
async def cluster(tmp_path: Path) -> AsyncIterator[tuple[Coordinator, NodeAgent]]:
    async with Coordinator(coordinator_config(tmp_path)) as c:
        agent = local_agent(c.address, tmp_path, slots=2)
        async with agent:
            await asyncio.wait_for(agent.connected.wait(), DEADLINE)
            yield c, agent


async def _status_until(job: Job, pred: Callable[[JobStatus], bool]) -> JobStatus:
    """The job's status (through the real client) once `pred` holds; fails past DEADLINE."""
    deadline = time.monotonic() + DEADLINE
    while True:
        status = await asyncio.to_thread(job.status)
        if pred(status):
            return status
        assert time.monotonic() < deadline, status
        await asyncio.sleep(0.1)


def _spec(tmp_path: Path, max_restarts: int) -> JobSpec:
    script = tmp_path / "sleeper.py"
    script.write_text(SLEEPER)
    return JobSpec(
        entrypoint=[PY, str(script)],
        nproc_per_node=2,
        max_restarts=max_restarts,
        stop_grace=2.0,
        unhealthy_timeout=1.0,  # the health monitor's first pass comes at once
    )


@pytest.mark.parametrize(
    ("fault", "words", "started"),
    [
        ("monitor-raise", "health monitor raised", 2),
        ("observe-fail", "cannot be observed", 2),
        ("start-fail-after:1", "the start failed after 1 of 2 worker(s)", 1),
    ],
)
async def test_an_unsupervisable_group_is_killed_reported_unknown_and_restarted_then_failed_as_infra(
    tmp_path: Path,
    spawned: list[int],
    cluster: tuple[Coordinator, NodeAgent],
    fault: str,
    words: str,
    started: int,
) -> None:
    c, agent = cluster
    real = agent._standbys._spawner

    def standby(*args: Any, **kw: Any) -> Any:
        # The restart takes over standbys: started by the agent, so counted as its workers.
        handle = real(*args, **kw)
        spawned.append(handle.pid)
        return handle

    agent._standbys._spawner = standby
    _faults.configure(fault)
    # The fault is there on every attempt: the first restarts the job, the second fails it.
    job_id = await c.service.submit(_spec(tmp_path, max_restarts=1))
    cl = c.service.cluster
    await wait_for(
        lambda: cl.job_state(job_id).is_terminal(),
        DEADLINE,
        what="the job to end",
    )
    assert cl.job_state(job_id) == JobState.FAILED

    # Every worker the agent started is gone: none runs unsupervised.
    assert len(spawned) == 2 * started, spawned
    await wait_gone(spawned)

    events = cl.job_events(job_id)
    unknown = [e for e in events if e.kind == "group_unknown"]
    assert [e.attempt for e in unknown] == [0, 1], [(e.kind, e.reason) for e in events]
    assert all(words in e.reason and e.node == "node-a" for e in unknown), unknown
    assert [e.kind for e in events].count("restart") == 1

    attempts = cl.job_attempts(job_id)
    assert [a.attempt for a in attempts] == [0, 1]
    for a in attempts:
        assert a.failures, a
        assert {f.category for f in a.failures} == {FailureCategory.INFRA}, a.failures
        assert all(words in f.message for f in a.failures)
    result = cl.job_result(job_id)
    assert result is not None and result.is_failed()
    assert {f.category for f in result.failures.values()} == {FailureCategory.INFRA}
    assert set(result.failures) == {0, 1}
    status = cl.job_status(job_id)
    assert [m.group_state for m in status.members] == [WorkerState.UNKNOWN]


async def test_an_error_of_the_session_after_the_start_makes_the_group_unknown(
    tmp_path: Path,
    spawned: list[int],
    cluster: tuple[Coordinator, NodeAgent],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    c, agent = cluster

    def broken(_held: _Held) -> None:
        raise RuntimeError("standby pool broken")

    monkeypatch.setattr(agent, "_fill_standbys", broken)
    job_id = await c.service.submit(_spec(tmp_path, max_restarts=0))
    cl = c.service.cluster
    await wait_for(
        lambda: cl.job_state(job_id).is_terminal(),
        DEADLINE,
        what="the job to end",
    )
    assert len(spawned) == 2
    await wait_gone(spawned)
    (ev,) = [e for e in cl.job_events(job_id) if e.kind == "group_unknown"]
    assert "the start failed: RuntimeError: standby pool broken" in ev.reason, ev.reason
    result = cl.job_result(job_id)
    assert result is not None
    assert {f.category for f in result.failures.values()} == {FailureCategory.INFRA}


async def test_a_group_that_starts_healthy_shows_its_state_and_each_workers_ranks(
    tmp_path: Path, spawned: list[int], cluster: tuple[Coordinator, NodeAgent]
) -> None:
    c, _agent = cluster
    beats: list[int] = []
    seen = c.service.on_heartbeat  # heartbeats come this way, to be taken in a batch

    def record(session: Any, msg: pb.NodeMessage) -> None:
        beats.extend(g.state for g in msg.heartbeat.groups)
        seen(session, msg)

    c.service.on_heartbeat = record  # type: ignore[method-assign]
    job_id = await c.service.submit(_spec(tmp_path, max_restarts=0))
    client = Client(c.address, timeout=10)
    try:
        job = client.job(job_id)

        def healthy(s: JobStatus) -> bool:
            running = all(w.pid for w in s.workers)
            return [m.group_state for m in s.members] == [WorkerState.HEALTHY] and running

        status = await _status_until(job, healthy)
        assert [
            (w.global_rank, w.role, w.role_rank, w.world_size, w.role_world_size)
            for w in status.workers
        ] == [(0, "default", 0, 2, 2), (1, "default", 1, 2, 2)]
        # The agent's own word for it, in its heartbeats.
        await wait_for(
            lambda: pb.GROUP_STATE_HEALTHY in beats,
            DEADLINE,
            what="a heartbeat with a HEALTHY group",
        )
        await asyncio.to_thread(job.cancel)
        status = await _status_until(job, lambda s: s.state.is_terminal())
        assert [m.group_state for m in status.members] == [WorkerState.STOPPED]
    finally:
        client.close()
    await wait_gone(spawned)


async def test_without_a_fault_nothing_is_unknown(
    tmp_path: Path, spawned: list[int], cluster: tuple[Coordinator, NodeAgent]
) -> None:
    c, _agent = cluster
    script = tmp_path / "ok.py"
    script.write_text("print('ok')\n")
    job_id = await c.service.submit(JobSpec(entrypoint=[PY, str(script)], nproc_per_node=2))
    cl = c.service.cluster
    await wait_for(
        lambda: cl.job_state(job_id).is_terminal(),
        DEADLINE,
        what="the job to end",
    )
    assert cl.job_state(job_id) == JobState.SUCCEEDED
    assert "group_unknown" not in [e.kind for e in cl.job_events(job_id)]
    assert [m.group_state for m in cl.job_status(job_id).members] == [WorkerState.SUCCEEDED]
    assert all(gone(p) for p in spawned)


# -- the group on its own: no session to report to ---------------------------------------------


async def test_workers_are_killed_even_when_the_unknown_cannot_be_reported(h: Harness) -> None:
    def cannot_report(reason: str) -> None:
        raise ConnectionError("no session")

    _faults.configure("monitor-raise")
    try:
        g, exits = h.group(
            JobSpec(entrypoint=[PY, "-c", SLEEPER], nproc_per_node=2, unhealthy_timeout=1.0),
            on_unknown=cannot_report,
        )
        pids = await h.start(g)
        assert len(pids) == 2
        await wait_for(
            lambda: g.state is WorkerState.UNKNOWN, DEADLINE, what="the group to go UNKNOWN"
        )
        await wait_gone(list(pids.values()))
    finally:
        _faults.configure("")
    assert g.unknown_reason is not None and "health monitor raised" in g.unknown_reason
    assert g.state_reason == g.unknown_reason
    # Their exits are the agent's stop, never failures of the workers.
    done = await exits.wait(2)
    assert all(e.stopped_by_agent and e.failure is None for e in done), done


async def test_an_exit_that_cannot_be_reported_makes_the_group_unknown(h: Harness) -> None:
    reasons: list[str] = []
    code = "import os, sys, time\nif os.environ['RANK'] == '0': sys.exit(0)\ntime.sleep(120)\n"

    def broken_on_exit(_ex: object) -> None:
        raise RuntimeError("outbox broken")

    g = WorkerGroup(
        h.group(JobSpec(entrypoint=[PY, "-c", code], nproc_per_node=2))[0].assignment,
        node_name="node0",
        log_root=h.log_root,
        on_exit=broken_on_exit,
        on_unknown=reasons.append,
        console=None,
        run_dir=h.tmp,
    )
    h.groups.append(g)
    pids = await h.start(g)
    await wait_for(lambda: bool(reasons), DEADLINE, what="a reason")
    assert reasons == ["the exit of rank 0 could not be reported: RuntimeError: outbox broken"], (
        reasons
    )
    await wait_gone(list(pids.values()))  # rank 1 was still running: killed
    assert g.state is WorkerState.UNKNOWN


async def test_an_unknown_group_is_reported_again_on_the_next_session(tmp_path: Path) -> None:
    agent = NodeAgent(
        AgentConfig(coordinator="127.0.0.1:1", name="node-a", log_dir=str(tmp_path / "logs"))
    )
    harness = Harness(tmp_path)
    g, _ = harness.group(JobSpec(entrypoint=[PY, "-c", "pass"]))
    agent._held[("job1", 0)] = _Held(g.assignment, unknown="the start failed after 1 of 2")
    (msg,) = [m for m in agent._replay() if m.WhichOneof("kind") == "group_unknown"]
    assert (msg.group_unknown.job_id, msg.group_unknown.round) == ("job1", 0)
    assert msg.group_unknown.reason == "the start failed after 1 of 2"


async def test_a_failed_heartbeat_task_ends_the_session_and_the_next_one_beats_again(
    cluster: tuple[Coordinator, NodeAgent],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    _c, agent = cluster
    calls: list[int] = []
    observe = agent.metrics.observe

    def once_broken(groups: Any) -> None:
        calls.append(len(groups))
        if len(calls) == 1:
            raise RuntimeError("metrics broken")
        observe(groups)

    monkeypatch.setattr(agent.metrics, "observe", once_broken)
    # Not lost: the session ends with the reason, a new one starts, and it heartbeats again.
    await wait_for(lambda: len(calls) >= 3, DEADLINE, what="three calls")
    text = caplog.text
    assert "agent task agent-heartbeats failed" in text and "metrics broken" in text
    assert "the heartbeats to the coordinator failed" in text
    assert agent.connected.is_set() and not agent.refused.is_set()
