"""The coordinator on a three-member etcd cluster while members die (SIGKILL) and come back.

One member lost: the coordinator carries on (the store leaves the dead member for the next in
the URL) and nothing is lost. Two lost (no quorum): what it cannot write it refuses with
UNAVAILABLE naming etcd, and what it answers is true. One member back: it resumes by itself,
and a new coordinator on the same keys finds every job a client was told about, and no other.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from client import JobSpec
from client.wire import spec_to_pb
from coordinator._store_etcd import EtcdStore
from coordinator.server import Coordinator, CoordinatorConfig
from protos.gelastic.v1 import gelastic_pb2 as pb
from protos.gelastic.v1 import gelastic_pb2_grpc as pb_grpc
from tests._etcd import EtcdCluster
from tests.service._fakes import FakeNode, worker_exit

ONE_NODE = JobSpec(entrypoint=["python", "train.py"], nproc_per_node=1, min_nodes=1, max_nodes=1)
TWO_NODES = JobSpec(entrypoint=["python", "train.py"], nproc_per_node=1, min_nodes=2, max_nodes=2)
"""Stays QUEUED: the test has one node."""
CALL_S = 60.0


@pytest.fixture
def etcd_cluster(tmp_path: Path) -> Iterator[EtcdCluster]:
    cluster = EtcdCluster(tmp_path / "etcd")
    cluster.start()
    try:
        yield cluster
    finally:
        cluster.stop()


def _config(url: str, tmp_path: Path) -> CoordinatorConfig:
    return CoordinatorConfig(
        state_dir=str(tmp_path / "unused"), store=url, port=0, lease=30.0, heartbeat_interval=1.0
    )


def _member_in_use(c: Coordinator, cluster: EtcdCluster) -> int:
    """The member the coordinator's store made its last call to."""
    store = c.store
    assert isinstance(store, EtcdStore)
    return cluster.index(store.settings.endpoints[store._current])


async def _submit(stub: pb_grpc.CoordinatorStub, spec: JobSpec, request_id: str) -> str:
    resp = await stub.Submit(
        pb.SubmitRequest(spec=spec_to_pb(spec), request_id=request_id), timeout=CALL_S
    )
    job_id: str = resp.job_id
    return job_id


async def _state(stub: pb_grpc.CoordinatorStub, job_id: str) -> int:
    job = await stub.GetJob(pb.GetJobRequest(job_id=job_id), timeout=CALL_S)
    state: int = job.state
    return state


async def _run_to_success(node: FakeNode, job_id: str) -> None:
    rp = (await node.expect("reserve_port")).reserve_port
    assert rp.job_id == job_id
    await node.send(port_reserved=pb.PortReserved(job_id=job_id, round=rp.round, port=40000))
    asg = (await node.expect("assign")).assign
    await node.send(
        workers_started=pb.WorkersStarted(
            job_id=job_id,
            round=asg.round,
            workers=[pb.WorkerPid(local_rank=0, pid=1000, global_rank=0)],
        )
    )
    await node.outbox.put(worker_exit(asg, 0, 0))
    await node.expect("release")


async def test_one_member_lost_carries_on_quorum_lost_refuses_one_back_resumes(
    etcd_cluster: EtcdCluster, tmp_path: Path
) -> None:
    url = etcd_cluster.url("gelastic")
    async with Coordinator(_config(url, tmp_path)) as c:
        node = FakeNode(c.address, "node-a", "127.0.0.1", slots=1)
        await node.connect()
        async with grpc.aio.insecure_channel(c.address) as ch:
            stub = pb_grpc.CoordinatorStub(ch)
            first = await _submit(stub, ONE_NODE, "req-1")
            # The worst moment: the member that just committed the job dies before the next
            # write (the job's round) goes to it.
            killed = _member_in_use(c, etcd_cluster)
            await asyncio.to_thread(etcd_cluster.kill, killed)

            await _run_to_success(node, first)
            assert await _state(stub, first) == pb.JOB_STATE_SUCCEEDED
            second = await _submit(stub, TWO_NODES, "req-2")
            assert _member_in_use(c, etcd_cluster) != killed
            assert await _state(stub, second) == pb.JOB_STATE_QUEUED

            # A second member: etcd has no quorum and commits nothing.
            also = _member_in_use(c, etcd_cluster)
            await asyncio.to_thread(etcd_cluster.kill, also)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await _submit(stub, ONE_NODE, "req-3")
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
            details = err.value.details() or ""
            assert "etcd is unavailable" in details and "not queued" in details, details
            # What it does answer meanwhile is what is written.
            assert await _state(stub, first) == pb.JOB_STATE_SUCCEEDED
            assert await _state(stub, second) == pb.JOB_STATE_QUEUED
            listed = await stub.ListJobs(pb.ListJobsRequest(include_finished=True), timeout=CALL_S)
            assert sorted(j.job_id for j in listed.jobs) == sorted([first, second])

            # One member back: a quorum again, and the coordinator resumes by itself.
            await asyncio.to_thread(etcd_cluster.start_member, killed)
            third = await _submit(stub, ONE_NODE, "req-3")
            assert third not in (first, second)
            await _run_to_success(node, third)
            assert await _state(stub, third) == pb.JOB_STATE_SUCCEEDED
        await node.close()

    # Nothing lost: the jobs clients were told about, in the states they were told, and not
    # the refused one.
    async with (
        Coordinator(_config(url, tmp_path)) as c,
        grpc.aio.insecure_channel(c.address) as ch,
    ):
        stub = pb_grpc.CoordinatorStub(ch)
        listed = await stub.ListJobs(pb.ListJobsRequest(include_finished=True), timeout=CALL_S)
        assert sorted(j.job_id for j in listed.jobs) == sorted([first, second, third])
        assert await _state(stub, first) == pb.JOB_STATE_SUCCEEDED
        assert await _state(stub, second) == pb.JOB_STATE_QUEUED
        assert await _state(stub, third) == pb.JOB_STATE_SUCCEEDED
