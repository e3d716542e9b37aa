"""Nodes as the coordinator keeps them: a stop is not a loss, a lost node keeps the time it was
last seen across a restart, and ForgetNode drops a lost node (never a live one)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import pytest

from client import Client, GelasticError, JobSpec
from coordinator.server import Coordinator, CoordinatorConfig
from protos.gelastic.v1 import gelastic_pb2 as pb
from protos.gelastic.v1 import gelastic_pb2_grpc as pb_grpc
from tests._helpers import wait_for

from ._fakes import FakeNode, run_round

STEP = 10.0


def _config(state_dir: Path) -> CoordinatorConfig:
    return CoordinatorConfig(state_dir=str(state_dir), port=0, heartbeat_interval=0.2, lease=1.0)


async def test_a_stopping_coordinator_does_not_report_its_nodes_lost(tmp_path: Path) -> None:
    async with Coordinator(_config(tmp_path / "state")) as c:
        a = FakeNode(c.address, "a", "10.0.0.1")
        b = FakeNode(c.address, "b", "10.0.0.2")
        await a.connect()
        await b.connect()
        client = Client(c.address, timeout=10)
        try:
            job = await asyncio.to_thread(
                client.submit,
                JobSpec(entrypoint=["true"], min_nodes=2, max_nodes=2, last_call_timeout=0),
            )
            await run_round(a, b)
        finally:
            client.close()
        svc = c.service
    # The stop closed both sessions; neither node was lost, the job did not go back to the queue.
    kinds = [e.kind for e in svc.cluster.job_events(job.job_id)]
    assert "node_lost" not in kinds, kinds
    assert {n.state for n in svc.cluster.nodes()} == {"live"}
    await a.close()
    await b.close()


async def test_forget_node_over_the_wire(tmp_path: Path) -> None:
    async with Coordinator(_config(tmp_path / "state")) as c:
        live = FakeNode(c.address, "live", "10.0.0.1")
        gone = FakeNode(c.address, "gone", "10.0.0.2")
        await live.connect()
        await gone.connect()
        await gone.close()
        await wait_for(
            lambda: any(n.name == "gone" and n.state == "lost" for n in c.service.cluster.nodes()),
            STEP,
            what="the closed node to be lost",
        )
        lost_at = next(n.last_seen for n in c.service.cluster.nodes() if n.name == "gone")
        client = Client(c.address, timeout=10)
        try:
            with pytest.raises(GelasticError) as refused:
                await asyncio.to_thread(client.forget_node, "live")
            assert refused.value.code == grpc.StatusCode.FAILED_PRECONDITION
            assert await asyncio.to_thread(client.forget_node, "nobody") is False
            async with grpc.aio.insecure_channel(c.address) as ch:
                with pytest.raises(grpc.aio.AioRpcError) as bad:
                    await pb_grpc.CoordinatorStub(ch).ForgetNode(
                        pb.ForgetNodeRequest(name="x\n" * 100), timeout=10
                    )
            assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        finally:
            client.close()
        await live.close()
    # A restart: the lost node is still lost, and seen when it really was.
    async with Coordinator(_config(tmp_path / "state")) as c:
        nodes = {n.name: n for n in c.service.cluster.nodes()}
        assert nodes["gone"].state == "lost" and nodes["gone"].last_seen == lost_at
        client = Client(c.address, timeout=10)
        try:
            assert await asyncio.to_thread(client.forget_node, "gone") is True
            assert await asyncio.to_thread(client.forget_node, "gone") is False
        finally:
            client.close()
    # Forgotten on disk too.
    async with Coordinator(_config(tmp_path / "state")) as c:
        assert "gone" not in {n.name for n in c.service.cluster.nodes()}
