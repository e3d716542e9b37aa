"""A failover under a running job, as a client and an agent given the replica list see it.

Two coordinator replicas on one real etcd; a real agent with a real worker; the real client.
The leader is stopped (its lease revoked on the way out): the agent reconnects to the new
leader and is adopted (its worker is not restarted, its exit reported), and a `wait()` started
before the failover ends with the job's result from the new leader. While the only leader
cannot reach etcd, a submit fails UNAVAILABLE saying the store is unreachable, and once etcd is
back no job appears that the client was told was not queued. A submit repeated on the new
leader with the first try's request id returns the job the first try made.
"""

from __future__ import annotations

import asyncio
import io
import sys
import time
from pathlib import Path

import grpc
import psutil
import pytest

from client import Client, GelasticError, JobSpec, WorkerState
from client._progress import _Progress
from client.wire import spec_to_pb
from coordinator.server import Coordinator, CoordinatorConfig
from nodeagent.session import AgentConfig, NodeAgent
from protos.gelastic.v1 import gelastic_pb2 as pb
from tests._etcd import EtcdServer
from tests._helpers import free_port, wait_for

TTL = 3.0
WAIT_S = 60.0
SPEC = JobSpec(entrypoint=["python", "train.py"], nproc_per_node=1, min_nodes=1, max_nodes=1)
WORKER = """
import os, sys, time
deadline = time.monotonic() + 120
while not os.path.exists(sys.argv[1]) and time.monotonic() < deadline:
    time.sleep(0.02)
sys.exit(0 if os.path.exists(sys.argv[1]) else 5)
"""


def _config(url: str, tmp_path: Path) -> CoordinatorConfig:
    return CoordinatorConfig(
        state_dir=str(tmp_path / "unused"),
        store=url,
        port=0,
        lease=30.0,
        heartbeat_interval=0.5,
        leader_ttl=TTL,
        reconnect_grace=60.0,
    )


def _closed_port() -> str:
    return f"127.0.0.1:{free_port()}"


async def test_a_wait_started_before_a_failover_ends_with_the_result_from_the_new_leader(
    etcd_server: EtcdServer, etcd_url: str, tmp_path: Path
) -> None:
    coords = [Coordinator(_config(etcd_url, tmp_path)) for _ in range(2)]
    for c in coords:
        await c.start()
    try:
        await wait_for(
            lambda: sum(c.leading for c in coords) == 1, WAIT_S, what="one replica leads"
        )
        first = next(c for c in coords if c.leading)
        second = next(c for c in coords if c is not first)
        listed = ",".join(c.advertised() for c in (second, first))  # a standby first
        script = tmp_path / "worker.py"
        script.write_text(WORKER)
        go = tmp_path / "go"
        agent = NodeAgent(
            AgentConfig(
                coordinator=listed,
                name="node-a",
                addr="127.0.0.1",
                slots=1,
                log_dir=str(tmp_path / "logs"),
                reconnect_max=0.5,
            )
        )
        async with agent:
            await asyncio.wait_for(agent.connected.wait(), WAIT_S)
            assert agent.target == first.advertised()
            epoch = agent.epoch
            assert epoch > 0
            client = Client(listed, timeout=20)
            try:
                spec = JobSpec(
                    entrypoint=[sys.executable, str(script)],
                    args=[str(go)],
                    nproc_per_node=1,
                    min_nodes=1,
                    max_nodes=1,
                )
                job = await asyncio.to_thread(client.submit, spec)
                await wait_for(
                    lambda: any(h.pids for h in agent._held.values()),
                    WAIT_S,
                    what="the worker runs",
                )
                (held,) = agent._held.values()
                pid = held.pids[0]
                out = io.StringIO()
                progress = _Progress(out)
                waiting = asyncio.ensure_future(
                    asyncio.to_thread(job.wait, WAIT_S, progress=progress)
                )
                await wait_for(lambda: out.getvalue() != "", WAIT_S, what="the watch is open")

                await first.stop()  # its lease is revoked: the standby takes over at once
                go.write_text("")  # the worker exits during the failover
                await wait_for(lambda: second.leading, WAIT_S, what="the other replica leads")
                result = await asyncio.wait_for(waiting, WAIT_S)
            finally:
                client.close()
            assert result.state == WorkerState.SUCCEEDED, result
            assert [a.attempt for a in result.attempts] == [0]  # no worker was restarted
            assert agent.target == second.advertised()
            assert agent.epoch > epoch
            assert second.service.cluster.node_is_live("node-a", agent.incarnation)
            assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == (
                psutil.STATUS_ZOMBIE
            )
            assert client.address == second.advertised()
    finally:
        for c in coords:
            await c.stop()


async def test_while_the_leader_cannot_reach_etcd_a_submit_fails_unavailable_naming_the_store(
    tmp_path: Path,
) -> None:
    etcd = EtcdServer(tmp_path / "etcd")
    etcd.start()
    try:
        async with Coordinator(_config(etcd.url("gelastic"), tmp_path)) as c:
            await wait_for(lambda: c.leading, WAIT_S, what="it leads")
            listed = f"{c.advertised()},{_closed_port()}"
            client = Client(listed, timeout=10)
            try:
                assert await asyncio.to_thread(client.list_jobs) == []
                await asyncio.to_thread(etcd.stop)
                spec = JobSpec(entrypoint=["python", "t.py"], nproc_per_node=1)
                started = time.monotonic()
                with pytest.raises(GelasticError) as err:
                    await asyncio.to_thread(client.submit, spec)
                assert time.monotonic() - started < 10 + 6  # the deadline, and one etcd call
                assert err.value.code == grpc.StatusCode.UNAVAILABLE
                message = str(err.value)
                assert f"{c.advertised()}: UNAVAILABLE: the coordinator could not write" in message
                assert "store" in message and "etcd is unavailable" in message, message
                await asyncio.to_thread(etcd.start)
                await wait_for(lambda: c.leading, WAIT_S, what="it leads again")
                # Never a wrong answer: the job it was told was not queued does not appear.
                assert await asyncio.to_thread(client.list_jobs) == []
            finally:
                client.close()
    finally:
        etcd.stop()


async def test_a_submit_repeated_after_a_failover_returns_the_job_the_first_try_made(
    etcd_server: EtcdServer, etcd_url: str, tmp_path: Path
) -> None:
    coords = [Coordinator(_config(etcd_url, tmp_path)) for _ in range(2)]
    for c in coords:
        await c.start()
    try:
        await wait_for(
            lambda: sum(c.leading for c in coords) == 1, WAIT_S, what="one replica leads"
        )
        first = next(c for c in coords if c.leading)
        second = next(c for c in coords if c is not first)
        listed = ",".join(c.advertised() for c in coords)
        request = pb.SubmitRequest(spec=spec_to_pb(SPEC), request_id="retry-1")

        def submit() -> str:
            # As Client.submit does: one request id for every try, on whichever replica leads.
            client = Client(listed, timeout=20)
            try:
                resp = client._call(
                    lambda stub, t: stub.Submit(request, timeout=t), idempotent=True
                )
                return str(resp.job_id)
            finally:
                client.close()

        job_id = await asyncio.to_thread(submit)
        await first.stop()
        await wait_for(lambda: second.leading, WAIT_S, what="the other replica leads")
        assert await asyncio.to_thread(submit) == job_id
        assert second.service.cluster.job_ids() == [job_id]
    finally:
        for c in coords:
            await c.stop()
