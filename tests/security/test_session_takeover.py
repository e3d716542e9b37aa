"""A node's session cannot be taken over, and its log requests cannot be answered by another node.

Before the fix ListNodes published each node's incarnation, and a Hello with a live node's name
and incarnation closed that node's session and took its place; a restored node's name went to any
agent that asked during the reconnect grace. Log request ids counted up from 1, and a log chunk
was accepted for any request id from any node, so another agent could write into a client's log
stream. Now incarnations stay private, a Hello for a name with a live session is refused whatever
its incarnation (the agent retries and gets in once the old session is gone), a restored name is
kept for its own agent during the grace, and request ids are random and answered only by the node
that was asked.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import grpc.aio
import pytest

from client import Client
from client.model import JobSpec
from coordinator.server import Coordinator, CoordinatorConfig
from nodeagent.session import AgentConfig, NodeAgent
from protos.gelastic.v1 import gelastic_pb2 as pb
from protos.gelastic.v1 import gelastic_pb2_grpc as pb_grpc
from tests._helpers import wait_for
from tests.service._fakes import FakeNode

WAIT_S = 30.0


@pytest.fixture
async def coordinator() -> AsyncIterator[Coordinator]:
    async with Coordinator(CoordinatorConfig(state_dir=":memory:", port=0, lease=600.0)) as c:
        yield c


async def _refused(address: str, name: str, incarnation: str) -> grpc.aio.AioRpcError:
    node = FakeNode(address, name, "127.0.0.9", incarnation=incarnation)
    try:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await node.connect()
        return err.value
    finally:
        await node.close()


async def test_incarnations_are_not_published(coordinator: Coordinator) -> None:
    node = FakeNode(coordinator.address, "node-a", "127.0.0.1", incarnation="secret-inc-1")
    await node.connect()
    async with grpc.aio.insecure_channel(coordinator.address) as ch:
        resp = await pb_grpc.CoordinatorStub(ch).ListNodes(pb.ListNodesRequest())
    assert [n.name for n in resp.nodes] == ["node-a"]
    assert resp.nodes[0].incarnation == ""
    assert b"secret-inc-1" not in resp.SerializeToString()
    nodes = await asyncio.to_thread(lambda: Client(coordinator.address).list_nodes())
    assert [(n.name, n.incarnation) for n in nodes] == [("node-a", "")]
    await node.close()


async def test_a_second_hello_for_a_live_session_is_refused_whatever_its_incarnation(
    coordinator: Coordinator,
) -> None:
    owner = FakeNode(coordinator.address, "node-a", "127.0.0.1", incarnation="inc-owner")
    await owner.connect()
    svc = coordinator.service
    first = svc._sessions["node-a"]
    for incarnation in ("inc-owner", "inc-other"):
        err = await _refused(coordinator.address, "node-a", incarnation)
        assert err.code() == grpc.StatusCode.ALREADY_EXISTS, err
        assert "already has a live session" in (err.details() or "")
    # The owner's session is untouched: same session, still live, still told things.
    assert svc._sessions["node-a"] is first and not first.closed
    assert svc.cluster.node_is_live("node-a", "inc-owner")
    await owner.send(heartbeat=pb.Heartbeat(seq=1))
    # Once it is gone, the name is free again.
    await owner.close()
    await wait_for(lambda: "node-a" not in svc._sessions, WAIT_S, what="node-a's session to end")
    again = FakeNode(coordinator.address, "node-a", "127.0.0.1", incarnation="inc-other")
    await again.connect()
    await again.close()


async def test_an_agent_refused_for_its_name_gets_in_once_the_old_session_ends(
    coordinator: Coordinator, tmp_path: Path
) -> None:
    holder = FakeNode(coordinator.address, "node-a", "127.0.0.1", incarnation="inc-old")
    await holder.connect()
    agent = NodeAgent(
        AgentConfig(
            coordinator=coordinator.address, name="node-a", addr="127.0.0.1", slots=1,
            log_dir=str(tmp_path / "logs"),
        )
    )  # fmt: skip
    async with agent:
        # It is refused while the holder's session lives (and keeps trying).
        await asyncio.sleep(0.5)  # several tries of the agent's backoff
        assert not agent.connected.is_set()
        assert coordinator.service.cluster.node_is_live("node-a", "inc-old")
        ended = time.monotonic()
        await holder.close()
        await asyncio.wait_for(agent.connected.wait(), WAIT_S)
        # Bounded backoff: in well within a couple of its capped pauses.
        assert time.monotonic() - ended < 5.0
        assert coordinator.service.cluster.node_is_live("node-a", agent.incarnation)


async def test_a_restored_nodes_name_is_kept_for_its_own_agent_during_the_grace(
    tmp_path: Path,
) -> None:
    config = CoordinatorConfig(
        state_dir=str(tmp_path / "state"), port=0, lease=2.0, reconnect_grace=600.0
    )
    async with Coordinator(config) as c:
        node = FakeNode(c.address, "node-a", "127.0.0.1", incarnation="inc-a")
        await node.connect()
        await c.service.flush()
        port = c.port
    await node.close()  # after the coordinator went: on disk the node is still live
    async with Coordinator(CoordinatorConfig(**{**config.__dict__, "port": port})) as c2:
        assert [n.state for n in c2.service.cluster.nodes()] == ["reconnecting"]
        err = await _refused(c2.address, "node-a", "inc-impostor")
        assert err.code() == grpc.StatusCode.ALREADY_EXISTS
        assert "reconnect grace" in (err.details() or "")
        assert [n.state for n in c2.service.cluster.nodes()] == ["reconnecting"]
        # Its own agent gets straight back in.
        back = FakeNode(c2.address, "node-a", "127.0.0.1", incarnation="inc-a")
        await back.connect()
        assert c2.service.cluster.node_is_live("node-a", "inc-a")
        await back.close()


async def test_the_name_is_free_once_the_reconnect_grace_ends(tmp_path: Path) -> None:
    config = CoordinatorConfig(
        state_dir=str(tmp_path / "state"),
        port=0,
        lease=1.0,
        heartbeat_interval=0.2,
        reconnect_grace=1.0,
    )
    async with Coordinator(config) as c:
        node = FakeNode(c.address, "node-a", "127.0.0.1", incarnation="inc-a")
        await node.connect()
        await c.service.flush()
        port = c.port
    await node.close()
    async with Coordinator(CoordinatorConfig(**{**config.__dict__, "port": port})) as c2:
        assert [n.state for n in c2.service.cluster.nodes()] == ["reconnecting"]
        await wait_for(
            lambda: [n.state for n in c2.service.cluster.nodes()] == ["lost"],
            WAIT_S,
            what="node-a to be lost",
        )
        new = FakeNode(c2.address, "node-a", "127.0.0.1", incarnation="inc-new")
        await new.connect()
        assert c2.service.cluster.node_is_live("node-a", "inc-new")
        await new.close()


async def _one_rank_job(c: Coordinator, owner: FakeNode) -> str:
    """A one-rank job that runs on `owner` (the only node connected when it is submitted)."""
    job_id = await c.service.submit(
        JobSpec(entrypoint=["python", "t.py"], nproc_per_node=1, min_nodes=1, max_nodes=1)
    )
    rp = (await owner.expect("reserve_port")).reserve_port
    await owner.send(port_reserved=pb.PortReserved(job_id=job_id, round=rp.round, port=40000))
    asg = (await owner.expect("assign")).assign
    await owner.send(
        workers_started=pb.WorkersStarted(
            job_id=job_id,
            round=asg.round,
            workers=[pb.WorkerPid(local_rank=0, pid=4242, global_rank=0)],
        )
    )
    await wait_for(
        lambda: c.service.cluster.log_location(job_id, 0, None) is not None,
        WAIT_S,
        what="rank 0's log location",
    )
    return job_id


async def test_a_chunk_sent_by_another_node_for_a_request_is_not_delivered(
    coordinator: Coordinator,
) -> None:
    owner = FakeNode(coordinator.address, "node-a", "127.0.0.1", slots=1)
    other = FakeNode(coordinator.address, "node-b", "127.0.0.2", slots=1)
    await owner.connect()
    job_id = await _one_rank_job(coordinator, owner)
    await other.connect()
    async with grpc.aio.insecure_channel(coordinator.address) as ch:
        call = pb_grpc.CoordinatorStub(ch).ReadLogs(
            pb.ReadLogsRequest(job_id=job_id, rank=0, stream="stdout", attempt=-1),
            timeout=WAIT_S,
        )
        # The other node knows the request id (the worst case) and answers first.
        rid = (await owner.expect("start_logs")).start_logs.request_id
        dropped = coordinator.service.log_relay.stray_chunks
        await other.send(log_chunk=pb.LogChunk(request_id=rid, data=b"forged\n", eof=True))
        await wait_for(
            lambda: coordinator.service.log_relay.stray_chunks == dropped + 1,
            WAIT_S,
            what="the stray chunk to be dropped",
        )
        await owner.send(log_chunk=pb.LogChunk(request_id=rid, data=b"genuine\n", eof=True))
        got = []
        while (m := await call.read()) is not grpc.aio.EOF:
            got.append(m.data)
        assert got == [b"genuine\n"]
        assert await call.code() == grpc.StatusCode.OK
    # The node without the job goes first: nothing is left to assign when the owner goes.
    await other.close()
    await wait_for(
        lambda: "node-b" not in coordinator.service._sessions,
        WAIT_S,
        what="node-b's session to end",
    )
    await owner.close()


async def test_log_request_ids_are_random(coordinator: Coordinator) -> None:
    owner = FakeNode(coordinator.address, "node-a", "127.0.0.1", slots=1)
    await owner.connect()
    job_id = await _one_rank_job(coordinator, owner)
    ids = []
    async with grpc.aio.insecure_channel(coordinator.address) as ch:
        for _ in range(6):
            call = pb_grpc.CoordinatorStub(ch).ReadLogs(
                pb.ReadLogsRequest(job_id=job_id, rank=0, stream="stdout", attempt=-1),
                timeout=WAIT_S,
            )
            rid = (await owner.expect("start_logs")).start_logs.request_id
            ids.append(rid)
            await owner.send(log_chunk=pb.LogChunk(request_id=rid, eof=True))
            assert await call.read() is grpc.aio.EOF
    assert len(set(ids)) == len(ids)
    assert all(0 < i < 2**63 for i in ids)
    # Counting up would give small, consecutive ids; 63 random bits give neither.
    assert all(i > 2**32 for i in ids), ids
    assert all(abs(x - y) > 2**16 for x, y in itertools.pairwise(ids)), ids
    await owner.close()
