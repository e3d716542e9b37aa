"""An agent warms standbys for a job only while a later round can come to them.

A real in-process coordinator and agent, real worker and standby processes: the standbys the
agent starts are counted where its pool makes them (forked from the job's zygote). A round of one node at the job's last attempt
warms none (only a failure restart could use them, and the budget is spent); a round with
restarts left still gets one per worker. A job without `preload` gets interpreters of its own
as standbys, only while it has restarts left, and its restart runs on them. `can_serve` is
the rule, checked case by case.
"""

from __future__ import annotations

import asyncio
import dataclasses
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from client.assignment import RoundAssignment, WorkerRanks
from client.model import JobSpec, JobState
from coordinator.server import Coordinator
from nodeagent._process import ProcessHandle, RealProcess
from nodeagent._standby import can_serve
from nodeagent.session import NodeAgent
from tests._helpers import wait_for
from tests.service._local import coordinator_config, local_agent
from tests.service.test_workers import wait_gone

PY = sys.executable
DEADLINE = 60.0
# Attempt 0 fails once told to; attempt 1 runs until told to finish. Every wait is bounded.
WORKER = """
import os, pathlib, sys, time
out = pathlib.Path(os.environ["OUT_DIR"])
attempt = os.environ["TORCHELASTIC_RESTART_COUNT"]
(out / f"started-{attempt}-{os.environ['RANK']}").write_text(str(os.getpid()))
deadline = time.monotonic() + 60
while not (out / f"go-{attempt}").exists() and time.monotonic() < deadline:
    time.sleep(0.02)
sys.exit(1 if attempt == "0" else 0)
"""


@pytest.fixture
async def agent(
    tmp_path: Path,
) -> AsyncIterator[tuple[Coordinator, NodeAgent, list[ProcessHandle]]]:
    async with Coordinator(coordinator_config(tmp_path)) as c:
        a = local_agent(c.address, tmp_path, slots=2)
        started: list[ProcessHandle] = []
        real = a._standbys._forker

        async def recording(zygote: Any) -> Any:
            handle, wfd = await real(zygote)  # every fork: a round's workers and standbys
            started.append(handle)
            return handle, wfd

        a._standbys._forker = recording
        async with a:
            await asyncio.wait_for(a.connected.wait(), DEADLINE)
            yield c, a, started
        await wait_gone([p.pid for p in started])


def _worker_job(
    tmp_path: Path, max_restarts: int, preload: tuple[str, ...]
) -> tuple[JobSpec, Path]:
    """A spec of WORKER, 2 per node, and the directory its ranks report to."""
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    out = tmp_path / "out"
    out.mkdir()
    spec = JobSpec(
        entrypoint=[PY, str(script)],
        nproc_per_node=2,
        max_restarts=max_restarts,
        stop_grace=2.0,
        preload=preload,
        env={"OUT_DIR": str(out)},
    )
    return spec, out


def _started(c: Coordinator, job_id: str, attempt: int) -> bool:
    """Whether attempt `attempt` of the job reported its workers started."""
    return any(
        e.kind == "workers_started" and e.attempt == attempt
        for e in c.service.cluster.job_events(job_id)
    )


@pytest.mark.parametrize(("max_restarts", "warmed"), [(1, 2), (2, 4)])
async def test_standbys_are_warmed_only_while_a_restart_can_use_them(
    tmp_path: Path,
    agent: tuple[Coordinator, NodeAgent, list[ProcessHandle]],
    max_restarts: int,
    warmed: int,
) -> None:
    c, a, started = agent
    spec, out = _worker_job(tmp_path, max_restarts, ("json",))
    job_id = await c.service.submit(spec)
    cl = c.service.cluster

    # Attempt 0's workers are forks; it has a restart left: one standby per worker.
    # (WorkersStarted is sent after the agent warmed, or did not warm, the pool.)
    await wait_for(lambda: _started(c, job_id, 0), DEADLINE, what="round 0 to start")
    await wait_for(
        lambda: a._standbys.count(job_id) == 2, DEADLINE, what="two standbys for the job"
    )
    assert len(started) == 2 + 2
    (out / "go-0").touch()
    # Attempt 1 runs on them; it warms new ones only if a restart is still left.
    await wait_for(lambda: _started(c, job_id, 1), DEADLINE, what="round 1 to start")
    await wait_for(
        lambda: a._standbys.count(job_id) == warmed - 2, DEADLINE, what="the standbys warmed"
    )
    assert len(started) == 2 + warmed, [p.pid for p in started]
    (out / "go-1").touch()
    await wait_for(
        lambda: cl.job_state(job_id).is_terminal(),
        DEADLINE,
        what="the job to end",
    )
    assert cl.job_state(job_id) == JobState.SUCCEEDED
    assert len(started) == 2 + warmed
    # The agent lets the spare ones go with the job (its release follows the coordinator's end).
    await wait_for(
        lambda: a._standbys.count(job_id) == 0, DEADLINE, what="the job's standbys to go"
    )


@pytest.mark.parametrize("max_restarts", [0, 1])
async def test_a_job_without_preload_restarts_on_standbys_only_if_it_can_restart(
    tmp_path: Path,
    agent: tuple[Coordinator, NodeAgent, list[ProcessHandle]],
    max_restarts: int,
) -> None:
    c, a, forked = agent
    spawned: list[RealProcess] = []
    real = a._standbys._spawner

    def recording(*args: Any, **kw: Any) -> RealProcess:
        handle = real(*args, **kw)
        spawned.append(handle)
        return handle

    a._standbys._spawner = recording
    spec, out = _worker_job(tmp_path, max_restarts, ())
    job_id = await c.service.submit(spec)
    cl = c.service.cluster

    try:
        await wait_for(lambda: _started(c, job_id, 0), DEADLINE, what="round 0 to start")
        # WorkersStarted is sent after the agent warmed (or did not warm) the pool.
        assert a._standbys.count(job_id) == 2 * max_restarts
        assert len(spawned) == 2 * max_restarts
        assert forked == []  # no zygote: the first round's workers start cold
        (out / "go-0").touch()
        if max_restarts == 0:
            await wait_for(lambda: cl.job_state(job_id).is_terminal(), DEADLINE, what="the end")
            assert cl.job_state(job_id) == JobState.FAILED
            return
        await wait_for(lambda: _started(c, job_id, 1), DEADLINE, what="round 1 to start")
        stamps = [out / f"started-1-{rank}" for rank in (0, 1)]
        await wait_for(
            lambda: all(f.exists() and f.read_text() for f in stamps),
            DEADLINE,
            what="attempt 1's ranks to write their pids",
        )
        # Attempt 1 runs in the standbys; with no restart left, none is warmed again.
        ran = {int(f.read_text()) for f in stamps}
        assert ran == {p.pid for p in spawned}
        assert a._standbys.count(job_id) == 0
        (out / "go-1").touch()
        await wait_for(lambda: cl.job_state(job_id).is_terminal(), DEADLINE, what="the end")
        assert cl.job_state(job_id) == JobState.SUCCEEDED
        assert len(spawned) == 2
    finally:
        await wait_gone([p.pid for p in spawned])


def _round(spec: JobSpec, *, attempt: int, nodes: int) -> RoundAssignment:
    return RoundAssignment(
        job_id="job-1",
        round=1,
        attempt=attempt,
        spec=spec,
        group_rank=0,
        group_world_size=nodes,
        master_addr="127.0.0.1",
        master_port=29500,
        workers=(WorkerRanks(0, 0, 0, nodes, nodes),),
        run_id="run-1",
    )


def test_the_rule_for_standbys_that_can_serve() -> None:
    spec = JobSpec(entrypoint=[PY, "x.py"], preload=("torch",), max_restarts=1, max_nodes=2)
    assert can_serve(_round(spec, attempt=0, nodes=1))  # a failure restarts the job
    assert not can_serve(_round(spec, attempt=1, nodes=1))  # budget spent, no peer to lose
    assert can_serve(_round(spec, attempt=1, nodes=2))  # a lost peer re-forms it here
    fixed = dataclasses.replace(spec, min_nodes=2)
    assert can_serve(_round(fixed, attempt=1, nodes=2))  # a fixed-size job re-forms too
    assert not can_serve(_round(dataclasses.replace(spec, max_restarts=0), attempt=0, nodes=1))
    sweep = dataclasses.replace(spec, standby_linger=30.0)
    assert can_serve(_round(sweep, attempt=1, nodes=1))  # the next job of its spec
    # Without preload: only while a failure restart can come.
    bare = dataclasses.replace(spec, preload=())
    assert can_serve(_round(bare, attempt=0, nodes=1))
    assert can_serve(_round(bare, attempt=0, nodes=2))
    assert not can_serve(_round(bare, attempt=1, nodes=2))  # only a lost peer would re-form it
    assert not can_serve(_round(dataclasses.replace(bare, max_restarts=0), attempt=0, nodes=2))


async def test_a_drained_node_lets_the_jobs_standbys_go(
    tmp_path: Path, agent: tuple[Coordinator, NodeAgent, list[ProcessHandle]]
) -> None:
    c, a, _ = agent
    spec, _ = _worker_job(tmp_path, 1, ("json",))
    job_id = await c.service.submit(spec)
    await wait_for(
        lambda: a._standbys.count(job_id) == 2, DEADLINE, what="two standbys for the job"
    )
    svc = c.service
    svc.apply(svc.cluster.drain("node-a", None, svc.now()))
    # The job's next round cannot come to a drained node: its standbys go with the stop, not
    # after they idled out.
    await wait_for(lambda: a._standbys.count(job_id) == 0, 10.0, what="the standbys to go")
    await wait_for(
        lambda: svc.cluster.job_state(job_id) == JobState.QUEUED, DEADLINE, what="re-queued"
    )
    svc.apply(svc.cluster.cancel(job_id, svc.now()))
