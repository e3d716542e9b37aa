"""GPUs through the coordinator's real gRPC service: each round's GPUs go out in its Assign and
are never shared, a sick GPU quarantines its node (its round re-forms elsewhere), an operator
clears it over the wire, and the quarantine outlives a coordinator restart."""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import pytest

from client import Client, GelasticError, JobSpec, JobState
from coordinator.server import Coordinator, CoordinatorConfig
from protos.gelastic.v1 import gelastic_pb2 as pb
from tests._helpers import wait_for

from ._fakes import FakeNode

STEP = 10.0


def _config(state_dir: Path) -> CoordinatorConfig:
    return CoordinatorConfig(state_dir=str(state_dir), port=0, heartbeat_interval=0.2, lease=30.0)


def _gpus(node: str, n: int) -> list[pb.GpuDevice]:
    return [
        pb.GpuDevice(index=i, uuid=f"GPU-{node}-{i}", name="A100", memory_total=2**35)
        for i in range(n)
    ]


def _spec(nodes: int, nproc: int) -> JobSpec:
    return JobSpec(
        entrypoint=["true"],
        nproc_per_node=nproc,
        min_nodes=nodes,
        max_nodes=nodes,
        last_call_timeout=0,
    )


async def _assigned(master: FakeNode, *others: FakeNode) -> list[pb.Assign]:
    rp = (await master.expect("reserve_port")).reserve_port
    await master.send(
        port_reserved=pb.PortReserved(job_id=rp.job_id, round=rp.round, port=40000 + rp.round)
    )
    out = []
    for node in (master, *others):
        asg = (await node.expect("assign")).assign
        await node.send(
            workers_started=pb.WorkersStarted(
                job_id=asg.job_id,
                round=asg.round,
                workers=[
                    pb.WorkerPid(local_rank=w.local_rank, pid=2000 + w.global_rank)
                    for w in asg.workers
                ],
            )
        )
        out.append(asg)
    return out


async def test_two_jobs_on_one_node_get_their_own_gpus_in_their_assignments(
    tmp_path: Path,
) -> None:
    async with Coordinator(_config(tmp_path / "state")) as c:
        node = FakeNode(c.address, "g", "10.0.0.1", slots=4, gpus=_gpus("g", 4))
        await node.connect()
        client = Client(c.address, timeout=10)
        try:
            first = await asyncio.to_thread(client.submit, _spec(1, 2))
            (a,) = await _assigned(node)
            second = await asyncio.to_thread(client.submit, _spec(1, 2))
            (b,) = await _assigned(node)
            assert (a.job_id, b.job_id) == (first.job_id, second.job_id)
            assert list(a.gpus) == [0, 1] and list(a.gpu_uuids) == ["GPU-g-0", "GPU-g-1"]
            assert list(b.gpus) == [2, 3] and list(b.gpu_uuids) == ["GPU-g-2", "GPU-g-3"]
            (shown,) = await asyncio.to_thread(client.list_nodes)
            assert [g.uuid for g in shown.gpus] == [f"GPU-g-{i}" for i in range(4)]
            assert shown.gpus_used == (0, 1, 2, 3)
            await node.send(
                heartbeat=pb.Heartbeat(
                    seq=1,
                    gpus=[
                        pb.GpuHealth(index=i, utilization_percent=10.0 * i, temperature_c=50 + i)
                        for i in range(4)
                    ],
                )
            )
            await wait_for(
                lambda: c.service.cluster.nodes()[0].gpu_health,
                STEP,
                what="the GPU sample to arrive",
            )
            status = await asyncio.to_thread(client.job(second.job_id).status)
            rank0 = status.workers[0]
            assert rank0.gpu is not None
            assert (rank0.gpu.index, rank0.gpu.uuid, rank0.gpu.utilization_percent) == (
                2,
                "GPU-g-2",
                20.0,
            )
            assert (rank0.gpu.temperature_c, rank0.gpu.memory_total) == (52, 2**35)
        finally:
            client.close()
        await node.close()


@pytest.mark.parametrize(
    ("gpus", "named"),
    [
        ([pb.GpuDevice(index=0, uuid="GPU-a"), pb.GpuDevice(index=0, uuid="GPU-b")], "twice"),
        ([pb.GpuDevice(index=0, uuid="")], "uuid"),
        ([pb.GpuDevice(index=0, uuid="GPU-a,GPU-b")], "uuid"),
        ([pb.GpuDevice(index=i, uuid=f"GPU-{i}") for i in range(65)], "at most 64"),
    ],
)
async def test_a_hello_with_bad_gpus_is_refused_naming_the_field(
    tmp_path: Path, gpus: list[pb.GpuDevice], named: str
) -> None:
    async with Coordinator(_config(tmp_path / "state")) as c:
        node = FakeNode(c.address, "g", "10.0.0.1", slots=2, gpus=gpus)
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await node.connect()
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "hello.gpus" in (refused.value.details() or "")
        assert named in (refused.value.details() or "")
        assert c.service.cluster.nodes() == []
        await node.close()


async def test_a_gpu_error_quarantines_the_node_until_cleared_even_across_a_restart(
    tmp_path: Path,
) -> None:
    state = tmp_path / "state"
    async with Coordinator(_config(state)) as c:
        a = FakeNode(c.address, "a", "10.0.0.1", slots=2, gpus=_gpus("a", 2))
        b = FakeNode(c.address, "b", "10.0.0.2", slots=2, gpus=_gpus("b", 2))
        spare = FakeNode(c.address, "c", "10.0.0.3", slots=2, gpus=_gpus("c", 2))
        for n in (a, b, spare):
            await n.connect()
        client = Client(c.address, timeout=10)
        try:
            job = await asyncio.to_thread(client.submit, _spec(2, 2))
            first = await _assigned(a, b)
            assert {x.round for x in first} == {1}
            # A new uncorrectable ECC error on b's GPU 1.
            await b.send(
                heartbeat=pb.Heartbeat(
                    seq=1, gpus=[pb.GpuHealth(index=0), pb.GpuHealth(index=1, uncorrectable_ecc=1)]
                )
            )
            for node in (a, b):
                stop = (await node.expect("stop")).stop
                assert "node b quarantined" in stop.reason
                await node.send(group_stopped=pb.GroupStopped(job_id=stop.job_id, round=stop.round))
            second = await _assigned(a, spare)
            assert {x.round for x in second} == {2} and second[0].job_id == job.job_id
            nodes = {n.name: n for n in await asyncio.to_thread(client.list_nodes)}
            assert nodes["b"].state == "quarantined"
            assert "GPU 1 (GPU-b-1) has 1 uncorrectable ECC errors" in nodes["b"].quarantine_reason
            assert nodes["b"].quarantined_until > 0
        finally:
            client.close()
        for n in (a, b, spare):
            await n.close()
    async with Coordinator(_config(state)) as c:
        client = Client(c.address, timeout=10)
        try:
            nodes = {n.name: n for n in await asyncio.to_thread(client.list_nodes)}
            assert nodes["b"].state == "quarantined", nodes["b"]
            assert await asyncio.to_thread(client.clear_quarantine, "b") is True
            assert await asyncio.to_thread(client.clear_quarantine, "b") is False
            assert await asyncio.to_thread(client.clear_quarantine, "nobody") is False
            nodes = {n.name: n for n in await asyncio.to_thread(client.list_nodes)}
            assert nodes["b"].state != "quarantined" and nodes["b"].quarantine_reason == ""
        finally:
            client.close()
    # The clear was written too.
    async with Coordinator(_config(state)) as c:
        assert {n.name: n.quarantine_reason for n in c.service.cluster.nodes()}["b"] == ""


async def test_clearing_a_quarantine_needs_the_client_token(tmp_path: Path) -> None:
    token_file = tmp_path / "token"
    token_file.write_text("s3cret-token-for-tests-0123456789")
    token_file.chmod(0o600)
    cfg = CoordinatorConfig(state_dir=":memory:", port=0, token_file=str(token_file))
    async with Coordinator(cfg) as c:
        anonymous = Client(c.address, timeout=10)
        trusted = Client(c.address, timeout=10, token_file=str(token_file))
        try:
            with pytest.raises(GelasticError) as refused:
                await asyncio.to_thread(anonymous.clear_quarantine, "n1")
            assert refused.value.code == grpc.StatusCode.UNAUTHENTICATED
            assert await asyncio.to_thread(trusted.clear_quarantine, "n1") is False
        finally:
            anonymous.close()
            trusted.close()


async def test_a_quarantine_ends_by_itself_when_its_ttl_passes(tmp_path: Path) -> None:
    cfg = CoordinatorConfig(
        state_dir=str(tmp_path / "state"),
        port=0,
        heartbeat_interval=0.2,
        lease=30.0,
        quarantine_ttl=1.0,
    )
    async with Coordinator(cfg) as c:
        node = FakeNode(c.address, "g", "10.0.0.1", slots=1, gpus=_gpus("g", 1))
        await node.connect()
        await node.send(
            heartbeat=pb.Heartbeat(seq=1, gpus=[pb.GpuHealth(index=0, uncorrectable_ecc=1)])
        )
        cluster = c.service.cluster
        await wait_for(
            lambda: cluster.nodes()[0].state == "quarantined", STEP, what="the quarantine"
        )
        job_id = await c.service.submit(_spec(1, 1))
        assert cluster.job_state(job_id) == JobState.QUEUED
        # Placed once the TTL passes, and the accepted count does not quarantine it again.
        (asg,) = await _assigned(node)
        assert asg.job_id == job_id and list(asg.gpus) == [0]
        sample = pb.GpuHealth(index=0, utilization_percent=33.0, uncorrectable_ecc=1)
        await node.send(heartbeat=pb.Heartbeat(seq=2, gpus=[sample]))
        await wait_for(
            lambda: [h.utilization_percent for h in cluster.nodes()[0].gpu_health] == [33.0],
            STEP,
            what="the second sample",
        )
        assert cluster.nodes()[0].state == "live"
        assert cluster.job_state(job_id) == JobState.RUNNING
        await node.close()
