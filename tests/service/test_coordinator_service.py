"""Service tests: an in-process coordinator on 127.0.0.1:0, the real client, scripted node sessions."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import grpc
import pytest

from client import Client, GelasticError, JobSpec, JobState, WorkerState
from client.results import KIND_JSON, tagged
from coordinator.server import Coordinator, CoordinatorConfig
from protos.gelastic.v1 import gelastic_pb2 as pb
from protos.gelastic.v1 import gelastic_pb2_grpc as pb_grpc
from tests.service._fakes import FakeNode, run_round, worker_exit

STEP = 10.0


@pytest.fixture
async def coordinator() -> AsyncIterator[Coordinator]:
    async with Coordinator(
        CoordinatorConfig(state_dir=":memory:", port=0, lease=30.0, heartbeat_interval=1.0)
    ) as c:
        yield c


@pytest.fixture
def client(coordinator: Coordinator) -> Client:
    c = Client(f"127.0.0.1:{coordinator.port}", timeout=10)
    yield c  # type: ignore[misc]
    c.close()


async def test_two_by_two_job_succeeds_with_return_values(
    coordinator: Coordinator, client: Client
) -> None:
    spec = JobSpec(entrypoint="pkg.mod:fn", nproc_per_node=2, min_nodes=2, max_nodes=2)
    job = await asyncio.to_thread(client.submit, spec)
    status = await asyncio.to_thread(job.status)
    assert status.state == JobState.QUEUED
    a = FakeNode(coordinator.address, "node-a", "127.0.0.1")
    b = FakeNode(coordinator.address, "node-b", "127.0.0.2")
    await a.connect()
    await b.connect()
    aa, ab = await run_round(a, b)
    assert (aa.group_rank, ab.group_rank) == (0, 1)
    assert [w.global_rank for w in aa.workers] == [0, 1]
    assert [w.global_rank for w in ab.workers] == [2, 3]
    assert {aa.master_addr, ab.master_addr} == {"127.0.0.1"}
    assert {aa.master_port, ab.master_port} == {40000}
    assert all(w.world_size == 4 for w in [*aa.workers, *ab.workers])
    assert aa.run_id == job.job_id and aa.attempt == 0
    assert await asyncio.to_thread(job.poll) is None
    for node, asg in ((a, aa), (b, ab)):
        for lr in range(2):
            msg = worker_exit(
                asg,
                lr,
                0,
                return_value=tagged(
                    asg.spec.result_key,
                    job.job_id,
                    asg.workers[lr].global_rank,
                    json.dumps({"rank": asg.workers[lr].global_rank}).encode(),
                    kind=KIND_JSON,
                ),
                has_return_value=True,
            )
            await node.outbox.put(msg)
    await a.expect("release")
    await b.expect("release")
    result = await asyncio.to_thread(job.wait, 10)
    assert result.state == WorkerState.SUCCEEDED
    assert result.return_values == {r: {"rank": r} for r in range(4)}
    assert result.failures == {}
    await a.close()
    await b.close()


async def test_failure_stops_every_node_and_fails_the_job(
    coordinator: Coordinator, client: Client
) -> None:
    spec = JobSpec(entrypoint=["python", "train.py"], nproc_per_node=2, min_nodes=2, max_nodes=2)
    job = await asyncio.to_thread(client.submit, spec)
    a = FakeNode(coordinator.address, "node-a", "127.0.0.1")
    b = FakeNode(coordinator.address, "node-b", "127.0.0.2")
    await a.connect()
    await b.connect()
    aa, ab = await run_round(a, b)
    failure = pb.ProcessFailure(message="boom", exitcode=3, pid=1003, timestamp=123.0, local_rank=1)
    await b.outbox.put(worker_exit(ab, 1, 3, failure=failure, has_failure=True))
    stop_a = (await a.expect("stop")).stop
    stop_b = (await b.expect("stop")).stop
    assert stop_a.round == stop_b.round == aa.round
    assert "rank 3 failed on node-b" in stop_a.reason
    # The peers were stopped on purpose: they must appear in neither map.
    await a.outbox.put(worker_exit(aa, 0, -15, stopped_by_agent=True))
    await a.outbox.put(worker_exit(aa, 1, -15, stopped_by_agent=True))
    await b.outbox.put(worker_exit(ab, 0, -15, stopped_by_agent=True))
    for node, asg in ((a, aa), (b, ab)):
        await node.send(group_stopped=pb.GroupStopped(job_id=asg.job_id, round=asg.round))
    result = await asyncio.to_thread(job.wait, 10)
    assert result.is_failed()
    assert set(result.failures) == {3}
    f = result.failures[3]
    assert (f.node, f.local_rank, f.exitcode, f.pid, f.message) == ("node-b", 1, 3, 1003, "boom")
    assert result.return_values == {}
    await a.close()
    await b.close()


async def test_bad_spec_is_invalid_argument_naming_the_field(client: Client) -> None:
    bad = JobSpec(entrypoint=["x"], min_nodes=3, max_nodes=2)
    with pytest.raises(Exception, match="min_nodes"):
        await asyncio.to_thread(client.submit, bad)
    # Bypass client-side validation: the server must refuse on its own.
    stub = pb_grpc.CoordinatorStub(grpc.insecure_channel(client.address))
    with pytest.raises(grpc.RpcError) as err:
        await asyncio.to_thread(
            stub.Submit, pb.SubmitRequest(spec=pb.JobSpec(entrypoint=[], nproc_per_node=1))
        )
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT  # type: ignore[attr-defined]
    assert "entrypoint" in err.value.details()  # type: ignore[attr-defined]
    with pytest.raises(grpc.RpcError) as err:
        await asyncio.to_thread(
            stub.Submit, pb.SubmitRequest(spec=pb.JobSpec(entrypoint=["x"], env={"A=B": "1"}))
        )
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT  # type: ignore[attr-defined]
    assert "env" in err.value.details()  # type: ignore[attr-defined]


async def test_unknown_job_is_not_found(client: Client) -> None:
    with pytest.raises(GelasticError) as err:
        await asyncio.to_thread(client.get_job, "no-such-job")
    assert err.value.code == grpc.StatusCode.NOT_FOUND


async def test_session_must_start_with_hello_and_names_are_unique(coordinator: Coordinator) -> None:
    a = FakeNode(coordinator.address, "node-a", "127.0.0.1")
    await a.connect()
    impostor = FakeNode(coordinator.address, "node-a", "127.0.0.9", incarnation="other")
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await impostor.connect()
    assert err.value.code() == grpc.StatusCode.ALREADY_EXISTS
    await impostor.close()
    ch = grpc.aio.insecure_channel(coordinator.address)

    async def no_hello() -> AsyncIterator[pb.NodeMessage]:
        yield pb.NodeMessage(heartbeat=pb.Heartbeat(seq=1))

    call = pb_grpc.NodeSessionStub(ch).Session(no_hello())
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await call.read()
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    await ch.close()
    await a.close()


async def test_cancel_running_job(coordinator: Coordinator, client: Client) -> None:
    spec = JobSpec(entrypoint=["sleep", "100"], nproc_per_node=2, min_nodes=2, max_nodes=2)
    job = await asyncio.to_thread(client.submit, spec)
    a = FakeNode(coordinator.address, "node-a", "127.0.0.1")
    b = FakeNode(coordinator.address, "node-b", "127.0.0.2")
    await a.connect()
    await b.connect()
    aa, ab = await run_round(a, b)
    await asyncio.to_thread(job.cancel)
    for node, asg in ((a, aa), (b, ab)):
        await node.expect("stop")
        await node.send(group_stopped=pb.GroupStopped(job_id=asg.job_id, round=asg.round))
    result = await asyncio.to_thread(job.wait, 10)
    status = await asyncio.to_thread(job.status)
    assert status.state == JobState.CANCELED
    assert result.state == WorkerState.STOPPED and not result.is_failed()
    await a.close()
    await b.close()
