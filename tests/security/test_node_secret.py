"""The node secret at the coordinator: it hands a proven agent its node's name at once, refuses
any other, and never shows the secret (nor its hash) anywhere.

Before the fix a name held by a session was refused to every new hello until that session ended,
and a name restored from disk was refused until the reconnect grace ended, whoever asked: a
restarted agent whose old stream was still half-open, or whose coordinator had restarted, waited
(and after a second coordinator restart inside the grace gave up with exit 2). Now a hello that
proves the node's secret ends the old session and takes the name; an unproven one is refused for
good while a live agent holds the name, and for now (a refusal the agent retries) while only a
restored record keeps it.
"""

from __future__ import annotations

import asyncio
import json
import logging
import sqlite3
import urllib.request
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import grpc
import grpc.aio
import pytest

from client import Client
from client.model import JobSpec
from coordinator._node_claims import secret_digest
from coordinator.server import Coordinator, CoordinatorConfig
from nodeagent._node_secret import secret_path
from nodeagent.session import AgentConfig, NodeAgent
from protos.gelastic.v1 import gelastic_pb2 as pb
from tests._helpers import free_port
from tests.service._fakes import FakeNode

WAIT_S = 30.0
SECRET = "0123456789abcdef" * 4
OTHER = "fedcba9876543210" * 4


def _metadata(err: grpc.aio.AioRpcError) -> dict[str, str]:
    return {k: v for k, v in (err.trailing_metadata() or ()) if isinstance(v, str)}


async def _refused(node: FakeNode) -> grpc.aio.AioRpcError:
    try:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await node.connect()
        return err.value
    finally:
        await node.close()


@pytest.fixture
async def coordinator() -> AsyncIterator[Coordinator]:
    async with Coordinator(CoordinatorConfig(state_dir=":memory:", port=0, lease=600.0)) as c:
        yield c


async def test_a_proven_agent_ends_a_half_open_session_and_takes_the_name(
    coordinator: Coordinator,
) -> None:
    svc = coordinator.service
    # The old process died with its stream half-open: the coordinator still has the session.
    dead = FakeNode(
        coordinator.address, "n1", "127.0.0.1", incarnation="inc-dead", node_secret=SECRET
    )
    await dead.connect()
    old = svc._sessions["n1"]
    new = FakeNode(
        coordinator.address, "n1", "127.0.0.1", incarnation="inc-new", node_secret=SECRET
    )
    await new.connect()  # welcomed at once
    assert svc.cluster.node_is_live("n1", "inc-new")
    assert old.closed and svc._sessions["n1"] is not old
    assert dead.call is not None
    # The old call ended (its status comes once the coordinator is done with the session), and
    # its end changed nothing for the new one.
    for _ in range(100):  # what was written to it before (a clock probe), then its end
        if await asyncio.wait_for(dead.call.read(), WAIT_S) is grpc.aio.EOF:
            break
    assert await dead.call.code() == grpc.StatusCode.OK
    await dead.close()
    await new.send(heartbeat=pb.Heartbeat(seq=1))
    assert svc.cluster.node_is_live("n1", "inc-new") and "n1" in svc._sessions
    await new.close()


async def test_an_unproven_agent_under_a_live_name_is_refused_for_good(
    coordinator: Coordinator,
) -> None:
    owner = FakeNode(
        coordinator.address, "n1", "127.0.0.1", incarnation="inc-a", node_secret=SECRET
    )
    await owner.connect()
    for secret in ("", OTHER):
        err = await _refused(
            FakeNode(
                coordinator.address, "n1", "127.0.0.9", incarnation="inc-b", node_secret=secret
            )
        )
        assert err.code() == grpc.StatusCode.ALREADY_EXISTS
        assert "already has a live session" in (err.details() or "")
        md = _metadata(err)
        assert "gelastic-name-grace-ms" not in md
        assert md["gelastic-name-held-ms"] == "600000"  # the lease: a dead stream's longest life
    assert coordinator.service.cluster.node_is_live("n1", "inc-a")
    await owner.close()


async def test_a_restored_name_goes_to_its_node_at_once_and_to_no_other(tmp_path: Path) -> None:
    config = CoordinatorConfig(
        state_dir=str(tmp_path / "state"), port=0, lease=2.0, reconnect_grace=600.0
    )
    async with Coordinator(config) as c:
        node = FakeNode(c.address, "n1", "127.0.0.1", incarnation="inc-a", node_secret=SECRET)
        await node.connect()
        await c.service.flush()
        port = c.port
    await node.close()
    async with Coordinator(CoordinatorConfig(**{**config.__dict__, "port": port})) as c2:
        assert [n.state for n in c2.service.cluster.nodes()] == ["reconnecting"]
        for secret in ("", OTHER):
            err = await _refused(
                FakeNode(c2.address, "n1", "127.0.0.1", incarnation="inc-b", node_secret=secret)
            )
            assert err.code() == grpc.StatusCode.ALREADY_EXISTS
            details = err.details() or ""
            assert "kept for its previous agent until" in details and "live" not in details
            assert 590_000 < int(_metadata(err)["gelastic-name-grace-ms"]) <= 600_000
        back = FakeNode(c2.address, "n1", "127.0.0.1", incarnation="inc-c", node_secret=SECRET)
        await back.connect()
        assert c2.service.cluster.node_is_live("n1", "inc-c")
        await back.close()


async def test_an_agent_refused_for_now_waits_out_grace_after_grace(tmp_path: Path) -> None:
    """Its name is kept for a previous agent it cannot prove it is (another state dir), and the
    coordinator restarts twice inside the grace: the agent keeps trying, and gets in once the
    last grace ends."""
    grace = 3.0
    config = CoordinatorConfig(
        state_dir=str(tmp_path / "state"),
        port=0,
        lease=1.0,
        heartbeat_interval=0.2,
        reconnect_grace=grace,
    )
    async with Coordinator(config) as c:
        holder = FakeNode(c.address, "n1", "127.0.0.1", incarnation="inc-a", node_secret=SECRET)
        await holder.connect()
        await c.service.flush()
        port = c.port
    await holder.close()
    config = CoordinatorConfig(**{**config.__dict__, "port": port})
    agent = NodeAgent(
        AgentConfig(
            coordinator=f"127.0.0.1:{port}",
            name="n1",
            addr="127.0.0.1",
            slots=1,
            gpus="none",
            log_dir=str(tmp_path / "agent"),
            reconnect_max=0.2,
        )
    )
    async with agent:
        for _ in range(3):  # a restart (the grace begins again), twice, then the last one
            c2 = Coordinator(config)
            await c2.start()
            try:
                await asyncio.sleep(grace - 0.5)  # inside the grace: refused for now
                assert not agent.connected.is_set() and not agent.refused.is_set()
            finally:
                await c2.stop()
        async with Coordinator(config) as c3:
            await asyncio.wait_for(agent.connected.wait(), WAIT_S)
            assert not agent.refused.is_set()
            assert c3.service.cluster.node_is_live("n1", agent.incarnation)


TOKEN = "node-secret-token-for-tests-0123456789"


def _authed_channel(address: str) -> grpc.aio.Channel:
    class _Token(grpc.aio.StreamStreamClientInterceptor):  # type: ignore[misc]
        async def intercept_stream_stream(self, continuation, details, request):  # type: ignore[no-untyped-def]
            md = [*(details.metadata or []), ("authorization", f"Bearer {TOKEN}")]
            return await continuation(details._replace(metadata=md), request)

    return grpc.aio.insecure_channel(address, interceptors=[_Token()])


async def test_the_secret_and_its_hash_are_never_shown(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    token = tmp_path / "token"
    token.write_text(TOKEN)
    token.chmod(0o600)
    config = CoordinatorConfig(
        state_dir=str(tmp_path / "state"),
        port=0,
        token_file=str(token),
        dashboard_port=free_port(),
        metrics_port=free_port(),
    )
    digest = secret_digest(SECRET)
    shown: list[str] = []
    async with Coordinator(config) as c:
        node = FakeNode(c.address, "n1", "127.0.0.1", slots=1, node_secret=SECRET)
        await node.channel.close()
        node.channel = _authed_channel(c.address)
        await node.connect()
        job_id = await c.service.submit(
            JobSpec(entrypoint=["python", "t.py"], nproc_per_node=1, min_nodes=1, max_nodes=1)
        )
        rp = (await node.expect("reserve_port")).reserve_port
        await node.send(port_reserved=pb.PortReserved(job_id=job_id, round=rp.round, port=40000))
        asg = (await node.expect("assign")).assign
        await node.send(
            workers_started=pb.WorkersStarted(
                job_id=job_id,
                round=asg.round,
                workers=[pb.WorkerPid(local_rank=0, pid=4242, global_rank=0)],
            )
        )
        await c.service.flush()
        client = Client(c.address, token_file=str(token))
        try:
            raw = await asyncio.to_thread(
                lambda: (client.list_nodes(), client.get_job(job_id), client.events(job_id))
            )
        finally:
            client.close()
        nodes, job, events = raw
        shown += [repr(nodes), job.SerializeToString().hex(), repr(job), repr(events)]
        assert c.dashboard is not None
        base = c.dashboard.url.rstrip("/")
        async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {TOKEN}"}) as http:
            for path in ("/api/overview", f"/api/jobs/{job_id}"):
                async with http.get(base + path) as resp:
                    assert resp.status == 200
                    shown.append(await resp.text())
            async with http.get(base + "/api/stream/overview") as resp:
                assert resp.status == 200
                while True:
                    line = (await asyncio.wait_for(resp.content.readline(), WAIT_S)).decode()
                    if line.startswith("data: "):
                        overview = json.loads(line[6:])
                        assert [n["name"] for n in overview["nodes"]] == ["n1"]
                        shown.append(line)
                        break
        url = f"http://127.0.0.1:{config.metrics_port}/metrics"
        shown.append(
            await asyncio.to_thread(lambda: urllib.request.urlopen(url, timeout=5).read().decode())
        )
        await node.close()
    shown.append(caplog.text)
    for text in shown:
        assert SECRET not in text and digest not in text
        assert SECRET.encode().hex() not in text
    # The store keeps the hash, never the secret.
    db = next((tmp_path / "state").glob("*.sqlite3"))
    with sqlite3.connect(db) as conn:
        dump = "\n".join(conn.iterdump())
    assert digest in dump and SECRET not in dump


async def test_an_agents_secret_file_proves_it_after_a_restart(tmp_path: Path) -> None:
    """A NodeAgent restarted on its state dir is its node again at once, though the restarted
    coordinator keeps the name for the agent process it knew."""
    config = CoordinatorConfig(
        state_dir=str(tmp_path / "coordinator"), port=0, lease=2.0, reconnect_grace=600.0
    )
    agent_config = AgentConfig(
        coordinator="",
        name="n1",
        addr="127.0.0.1",
        slots=1,
        gpus="none",
        log_dir=str(tmp_path / "logs"),
        state_dir=str(tmp_path / "state"),
        reconnect_max=0.2,
    )
    c = Coordinator(config)
    await c.start()
    agent_config = AgentConfig(**{**agent_config.__dict__, "coordinator": c.address})
    config = CoordinatorConfig(**{**config.__dict__, "port": c.port})
    first = NodeAgent(agent_config)
    try:
        await first.start()
        await asyncio.wait_for(first.connected.wait(), WAIT_S)
        assert secret_path(tmp_path / "state", "n1").exists()
        await c.service.flush()  # the node is on disk before the coordinator goes
    finally:
        await c.stop()  # first: the node stays live on disk
        await first.stop()
    async with Coordinator(config) as c2:
        assert [n.state for n in c2.service.cluster.nodes()] == ["reconnecting"]
        second = NodeAgent(agent_config)
        async with second:
            await asyncio.wait_for(second.connected.wait(), WAIT_S)
            assert c2.service.cluster.node_is_live("n1", second.incarnation)
            assert second.incarnation != first.incarnation
