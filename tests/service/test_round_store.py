"""The round's c10d store host is off its workers' path: its port is listened on before they
start, the host itself starts once they are spawned (after the round's start returned), and a
round stopped before then starts none.

Real workers (a python that sleeps) and a real store host process; every group is closed and
every pid checked gone at the end.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import psutil
import pytest

from client.assignment import RoundAssignment, WorkerRanks
from client.model import JobSpec, JobState
from client.node_protocol import Release
from coordinator.server import Coordinator
from nodeagent._launch import STORE_HOST_PATH
from nodeagent._workers import WorkerExit, WorkerGroup
from tests._helpers import free_port, gone, wait_for
from tests.service._local import coordinator_config, local_agent

BOUND = 30.0
HOST_STARTED = "started the c10d store host"
HOST_READY = "c10d store serving at"
WAIT_FOR_GO = """
import os, pathlib, time
deadline = time.monotonic() + 30
while not pathlib.Path(os.environ["GO"]).exists() and time.monotonic() < deadline:
    time.sleep(0.02)
"""


class Round:
    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.groups: list[WorkerGroup] = []
        self.exits: list[WorkerExit] = []
        self.port = free_port()

    def group(self, nproc: int = 2) -> WorkerGroup:
        spec = JobSpec(
            entrypoint=[sys.executable, "-c", "import time; time.sleep(60)"],
            nproc_per_node=nproc,
        )
        a = RoundAssignment(
            job_id="job1",
            round=0,
            attempt=0,
            spec=spec,
            group_rank=0,
            group_world_size=1,
            master_addr="127.0.0.1",
            master_port=self.port,
            workers=tuple(WorkerRanks(i, i, i, nproc, nproc) for i in range(nproc)),
            run_id="run1",
        )
        g = WorkerGroup(
            a,
            node_name="node0",
            log_root=self.tmp / "logs",
            on_exit=self.exits.append,
            run_dir=self.tmp,
            console=None,
        )
        self.groups.append(g)
        return g


@pytest.fixture
async def r(tmp_path: Path) -> AsyncIterator[Round]:
    rnd = Round(tmp_path)
    yield rnd
    pids = [p for g in rnd.groups for p in g.pids.values()]
    for g in rnd.groups:
        await asyncio.wait_for(g.close(), BOUND)
    await wait_for(lambda: all(gone(p) for p in pids), BOUND, what="the workers to be gone")


def _host_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [rec.getMessage() for rec in caplog.records if HOST_STARTED in rec.getMessage()]


async def test_the_store_host_starts_once_the_workers_are_spawned(
    r: Round, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="nodeagent")
    g = r.group()
    pids = await g.start()
    assert len(pids) == 2
    # The round's start is done and the workers run; the host is not started yet, but its
    # port already listens: a rank that connects now waits in the backlog.
    assert _host_lines(caplog) == []
    with socket.create_connection(("127.0.0.1", r.port), timeout=BOUND):
        pass
    await wait_for(lambda: bool(_host_lines(caplog)), BOUND, what="the store host to start")
    messages = [rec.getMessage() for rec in caplog.records]
    host_at = next(i for i, m in enumerate(messages) if HOST_STARTED in m)
    worker_at = [i for i, m in enumerate(messages) if " started pid " in m]
    assert len(worker_at) == 2 and max(worker_at) < host_at


async def test_a_round_stopped_before_its_host_starts_starts_none(
    r: Round, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="nodeagent")
    g = r.group()
    await g.start()
    g.go_unknown("stopped at once")  # before the loop's next turn
    await asyncio.wait_for(g.close(), BOUND)
    assert _host_lines(caplog) == []
    # The port was let go with the host that never started.
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", r.port))


async def test_a_store_port_in_use_fails_every_worker_before_it_starts(
    r: Round, caplog: pytest.LogCaptureFixture
) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", r.port))
        taken.listen(1)
        g = r.group()
        assert await g.start() == {}
        await wait_for(lambda: len(r.exits) == 2, BOUND, what="both workers to fail")
    assert all(
        e.failure is not None and "cannot listen on MASTER_ADDR:MASTER_PORT" in e.failure.message
        for e in r.exits
    )
    assert _host_lines(caplog) == []


async def test_a_store_host_without_torch_says_so_and_leaves(tmp_path: Path) -> None:
    # `python -S` has no site-packages, so no torch: the host says "no-torch" and exits 0.
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(8)
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-S",
            STORE_HOST_PATH,
            str(os.getpid()),
            str(sock.fileno()),
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            pass_fds=(sock.fileno(),),
            start_new_session=True,
        )
        assert proc.stdout is not None and proc.stdin is not None
        # Its stdin stays open meanwhile: EOF there would end it before it says anything.
        line = await asyncio.wait_for(proc.stdout.readline(), BOUND)
        proc.stdin.close()
        rc = await asyncio.wait_for(proc.wait(), BOUND)
    assert rc == 0
    assert line.decode().startswith("no-torch ModuleNotFoundError: No module named 'torch'")


async def test_an_agent_stopped_as_its_job_is_released_reaps_the_store_host(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # The worst moment: the agent stops in the same turn as the exit barrier's release, which
    # begins the finished round's close (the store host's stop) in the background. Its stop
    # must wait for that close: no host left running, none left for the parent to reap.
    caplog.set_level(logging.INFO, logger="nodeagent")
    async with Coordinator(coordinator_config(tmp_path)) as c:
        a = local_agent(c.address, tmp_path, slots=1)
        stops: list[asyncio.Task[None]] = []
        groups: list[WorkerGroup | None] = []
        release = a._rounds.release

        def release_then_stop(m: Release) -> None:
            groups.append(a._rounds.held[(m.job_id, m.round)].group)
            release(m)
            stops.append(asyncio.ensure_future(a.stop()))

        a._rounds.release = release_then_stop  # type: ignore[method-assign]
        async with a:
            await asyncio.wait_for(a.connected.wait(), BOUND)
            go = tmp_path / "go"
            job_id = await c.service.submit(
                JobSpec(entrypoint=[sys.executable, "-c", WAIT_FOR_GO], env={"GO": str(go)})
            )
            # The host has imported torch, as it has in a real job: its teardown takes a while.
            await wait_for(
                lambda: any(HOST_READY in rec.getMessage() for rec in caplog.records),
                BOUND,
                what="the store host to serve",
            )
            go.touch()
            await wait_for(lambda: bool(stops), BOUND, what="the job's release")
            await asyncio.wait_for(stops[0], BOUND)
            assert c.service.cluster.job_state(job_id) == JobState.SUCCEEDED
            hosts = [int(m.split(" pid ")[1].split()[0]) for m in _host_lines(caplog)]
            assert len(hosts) == 1
            # Reaped: not a zombie either (a zombie's pid still exists until waited for).
            assert not psutil.pid_exists(hosts[0])
            # And the round's close ran to its end: its log pumps finished, its tasks ended.
            assert groups[0] is not None and groups[0].closed
