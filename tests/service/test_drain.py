"""Drains through the real service: DrainNode/UndrainNode (token, checks, answers), the stop with
a notice that reaches every node of the round, an agent's own DrainRequest answered after its
stops, the dashboard's view of a drained node, the drain kept across a restart, and an agent
that leaves first when its drain is not accepted in time."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import grpc
import pytest

from client import Client, GelasticError, JobSpec
from coordinator.server import Coordinator, CoordinatorConfig
from nodeagent.session import DRAIN_ANSWER_S
from protos.gelastic.v1 import gelastic_pb2 as pb
from protos.gelastic.v1 import gelastic_pb2_grpc as pb_grpc
from tests._helpers import free_port, wait_for
from tests.service._fakes import FakeNode, run_round
from tests.service._local import local_agent
from tests.service.test_dashboard import TOKEN, _node, base

STEP = 10.0


@pytest.fixture
async def coord(tmp_path: Path) -> AsyncIterator[Coordinator]:
    token = tmp_path / "token"
    token.write_text(TOKEN)
    token.chmod(0o600)
    c = Coordinator(
        CoordinatorConfig(
            port=0, state_dir=":memory:", token_file=str(token), dashboard_port=free_port()
        )
    )
    await c.start()
    try:
        yield c
    finally:
        await c.stop()


@pytest.fixture
def client(coord: Coordinator, tmp_path: Path) -> AsyncIterator[Client]:
    c = Client(coord.address, token_file=str(tmp_path / "token"), timeout=10)
    yield c  # type: ignore[misc]
    c.close()


async def nodes(client: Client) -> dict[str, object]:
    return {n.name: n for n in await asyncio.to_thread(client.list_nodes)}


async def test_drain_node_stops_every_member_with_the_notice_and_undrain_lifts_it(
    coord: Coordinator, client: Client
) -> None:
    a, b = _node(coord, "node-a", slots=1), _node(coord, "node-b", slots=1)
    await a.connect()
    await b.connect()
    spec = JobSpec(
        entrypoint=["true"], min_nodes=1, max_nodes=2, stop_grace=30, last_call_timeout=0
    )
    await asyncio.to_thread(client.submit, spec)
    await run_round(a, b)

    state = await asyncio.to_thread(client.drain_node, "node-b", 90.0, "spot reclaim")
    assert state == "draining"
    for node in (a, b):
        stop = (await node.expect("stop")).stop
        assert (stop.notice, stop.term_after_ms, stop.grace_ms) == (True, 60_000, 30_000)
        assert stop.drain_node == "node-b" and "spot reclaim" in stop.reason
    info = (await nodes(client))["node-b"]
    assert info.state == "draining" and info.drain_reason == "spot reclaim"  # type: ignore[attr-defined]

    # The dashboard's cluster page shows it too.
    auth = {"Authorization": f"Bearer {TOKEN}"}
    async with (
        aiohttp.ClientSession(headers=auth) as http,
        http.get(base(coord) + "/api/overview") as resp,
    ):
        shown = {n["name"]: n for n in (await resp.json())["nodes"]}
    assert shown["node-b"]["state"] == "draining"
    assert shown["node-b"]["drain_reason"] == "spot reclaim"
    assert shown["node-b"]["drain_deadline"] > 0

    assert await asyncio.to_thread(client.drain_node, "nobody") == ""
    assert await asyncio.to_thread(client.undrain_node, "node-b")
    assert not await asyncio.to_thread(client.undrain_node, "node-b")
    assert (await nodes(client))["node-b"].drain_reason == ""  # type: ignore[attr-defined]
    await a.close()
    await b.close()


async def test_drain_node_checks_its_request_and_needs_the_token(
    coord: Coordinator, client: Client
) -> None:
    with pytest.raises(GelasticError, match="name"):
        await asyncio.to_thread(client.drain_node, "no such/name")
    with pytest.raises(GelasticError, match="deadline"):
        await asyncio.to_thread(client.drain_node, "n", 8 * 86400.0)
    with pytest.raises(GelasticError, match="reason"):
        await asyncio.to_thread(client.drain_node, "n", None, "x\x1b[31m")
    async with grpc.aio.insecure_channel(coord.address) as ch:
        stub = pb_grpc.CoordinatorStub(ch)
        for call in (
            stub.DrainNode(pb.DrainNodeRequest(name="n"), timeout=STEP),
            stub.UndrainNode(pb.UndrainNodeRequest(name="n"), timeout=STEP),
        ):
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await call
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED


async def test_an_agents_drain_request_is_answered_after_the_stops_of_its_rounds(
    coord: Coordinator, client: Client
) -> None:
    a, b = _node(coord, "node-a", slots=1), _node(coord, "node-b", slots=1)
    await a.connect()
    await b.connect()
    spec = JobSpec(entrypoint=["true"], min_nodes=1, max_nodes=2, stop_grace=7, last_call_timeout=0)
    await asyncio.to_thread(client.submit, spec)
    await run_round(a, b)
    await b.send(drain_request=pb.DrainRequest(deadline_ms=0, reason=""))
    assert b.call is not None
    kinds = []
    while "drain_accepted" not in kinds:
        msg = await asyncio.wait_for(b.call.read(), STEP)
        kinds.append(msg.WhichOneof("kind"))
    assert kinds.index("stop") < kinds.index("drain_accepted")
    stop = (await a.expect("stop")).stop
    assert (stop.notice, stop.term_after_ms, stop.grace_ms) == (True, 0, 7_000)
    info = (await nodes(client))["node-b"]
    assert info.drain_by_agent and "its agent is shutting down" in info.drain_reason  # type: ignore[attr-defined]
    await a.close()
    await b.close()


async def test_a_node_of_no_round_is_drained_at_once(coord: Coordinator, client: Client) -> None:
    n = _node(coord, "idle", slots=1)
    await n.connect()
    assert await asyncio.to_thread(client.drain_node, "idle") == "drained"
    await n.close()


async def test_a_drain_and_its_lifting_are_written_and_outlive_a_restart(tmp_path: Path) -> None:
    def config() -> CoordinatorConfig:
        return CoordinatorConfig(state_dir=str(tmp_path / "state"), port=0, lease=30.0)

    async with Coordinator(config()) as c:
        n = FakeNode(c.address, "n1", "10.0.0.1", slots=1)
        await n.connect()
        with Client(c.address, timeout=10) as client:
            state = await asyncio.to_thread(client.drain_node, "n1", 90.0, "maintenance")
            assert state == "drained"
        await n.close()
    async with Coordinator(config()) as c:
        (info,) = c.service.cluster.nodes()
        assert (info.drain_reason, info.state) == ("maintenance", "drained")
        assert info.drain_deadline > 0 and not info.drain_by_agent
        with Client(c.address, timeout=10) as client:
            assert await asyncio.to_thread(client.undrain_node, "n1")
    async with Coordinator(config()) as c:
        (info,) = c.service.cluster.nodes()
        assert info.drain_reason == "" and info.state != "drained"


async def test_an_agent_whose_drain_is_not_accepted_in_time_leaves_first(tmp_path: Path) -> None:
    config = CoordinatorConfig(state_dir=":memory:", port=0, lease=30.0, heartbeat_interval=0.2)
    async with Coordinator(config) as c:
        cluster = c.service.cluster
        # A coordinator that never answers a drain request (one from before drains, say).
        cluster._on_drain_request = lambda node, msg, now: None  # type: ignore[method-assign]
        agent = local_agent(c.address, tmp_path, slots=1)
        await agent.start()
        try:
            await asyncio.wait_for(agent.connected.wait(), STEP)
            job_id = await c.service.submit(
                JobSpec(entrypoint=["sleep", "60"], max_restarts=0, stop_grace=5.0)
            )
            await wait_for(
                lambda: any(e.kind == "workers_started" for e in cluster.job_events(job_id)),
                STEP,
                what="the worker to start",
            )
            t0 = asyncio.get_running_loop().time()
        finally:
            await agent.stop(None, leave_first=True)
        waited = asyncio.get_running_loop().time() - t0
        assert DRAIN_ANSWER_S <= waited < DRAIN_ANSWER_S + 5.0
        kinds = [e.kind for e in cluster.job_events(job_id)]
        # It left first: the node was lost, not drained, and no restart was spent.
        assert "node_lost" in kinds and "node_draining" not in kinds
        assert cluster.job_status(job_id).attempt == 0
