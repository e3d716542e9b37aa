"""The coordinator on a three-member etcd cluster while members die (SIGKILL) and come back.

One member lost (a follower of etcd's own election): the coordinator carries on in the same
term (the store and the leader lease leave the dead member for the next in the URL) and nothing
is lost. Two lost (no quorum): it
can neither write nor renew its lease, so what it cannot write it refuses with UNAVAILABLE and
a clear message, and it steps down on its own timer; nothing it answers is wrong. One member
back: it is elected again by itself, loads what was written, and serves; a new coordinator on
the same keys finds every job a client was told about, and no other.
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
from tests._helpers import wait_for
from tests.service._fakes import FakeNode, worker_exit

ONE_NODE = JobSpec(entrypoint=["python", "train.py"], nproc_per_node=1, min_nodes=1, max_nodes=1)
TWO_NODES = JobSpec(entrypoint=["python", "train.py"], nproc_per_node=1, min_nodes=2, max_nodes=2)
"""Stays QUEUED: the test has one node."""
TTL = 3.0
CALL_S = 60.0
WAIT_S = 30.0
CLEAR = ("etcd is unavailable", "not the leader", "no leader elected yet")
"""What an UNAVAILABLE says while etcd has no quorum: the store's error, or the standby's."""


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
        state_dir=str(tmp_path / "unused"),
        store=url,
        port=0,
        lease=30.0,
        heartbeat_interval=1.0,
        leader_ttl=TTL,
    )


def _epoch(c: Coordinator) -> int:
    assert c.leadership is not None
    return c.leadership.epoch


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


async def _ended(node: FakeNode) -> None:
    """Read what the node is still sent until the coordinator ends its session."""
    assert node.call is not None
    try:
        while await asyncio.wait_for(node.call.read(), WAIT_S) is not grpc.aio.EOF:
            pass
    except grpc.aio.AioRpcError as exc:
        assert exc.code() == grpc.StatusCode.UNAVAILABLE, exc


async def test_one_member_lost_carries_on_quorum_lost_refuses_one_back_resumes(
    etcd_cluster: EtcdCluster, tmp_path: Path
) -> None:
    # The store talks to the first member of its URL: a follower of etcd's own election. (The
    # loss of etcd's raft leader leaves etcd without one for its election timeout, which a
    # 3 s leader TTL may not ride out: docs/replicas.md.)
    follower = next(i for i in range(3) if i != etcd_cluster.raft_leader())
    url = etcd_cluster.url("gelastic", first=follower)
    async with Coordinator(_config(url, tmp_path)) as c:
        await wait_for(lambda: c.leading, WAIT_S, what="the coordinator leads")
        epoch = _epoch(c)
        node = FakeNode(c.address, "node-a", "127.0.0.1", slots=1)
        await node.connect()
        async with grpc.aio.insecure_channel(c.address) as ch:
            stub = pb_grpc.CoordinatorStub(ch)
            first = await _submit(stub, ONE_NODE, "req-1")
            # The worst moment: the member that just committed the job dies before the next
            # write (the job's round) goes to it.
            killed = _member_in_use(c, etcd_cluster)
            assert killed == follower
            await asyncio.to_thread(etcd_cluster.kill, killed)

            # The same term carries on: the node's session goes on, the job runs and ends.
            await _run_to_success(node, first)
            assert await _state(stub, first) == pb.JOB_STATE_SUCCEEDED
            second = await _submit(stub, TWO_NODES, "req-2")
            assert _member_in_use(c, etcd_cluster) != killed
            assert await _state(stub, second) == pb.JOB_STATE_QUEUED
            await asyncio.sleep(TTL)  # a whole lease: renewed without the dead member
            assert c.leading and _epoch(c) == epoch
            assert c.leadership is not None and c.leadership.terms == 1

            # A second member: etcd has no quorum and commits nothing.
            await asyncio.to_thread(etcd_cluster.kill, _member_in_use(c, etcd_cluster))
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await _submit(stub, ONE_NODE, "req-3")
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
            details = err.value.details() or ""
            assert any(m in details for m in CLEAR), details
            # It steps down on its own timer (it cannot renew its lease), and the node's
            # session ends with it.
            await wait_for(lambda: not c.leading, 2 * TTL, what="the coordinator steps down")
            await _ended(node)
            await node.close()
            # Never a wrong answer: UNAVAILABLE, saying why.
            for job_id in (first, second):
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await _state(stub, job_id)
                assert err.value.code() == grpc.StatusCode.UNAVAILABLE
                assert any(m in (err.value.details() or "") for m in CLEAR), err.value.details()

            # One member back: a quorum again; it is elected by itself and serves what was
            # written.
            await asyncio.to_thread(etcd_cluster.start_member, killed)
            await wait_for(lambda: c.leading, WAIT_S, what="the coordinator leads again")
            assert _epoch(c) > epoch
            assert await _state(stub, first) == pb.JOB_STATE_SUCCEEDED
            assert await _state(stub, second) == pb.JOB_STATE_QUEUED
            node = FakeNode(c.address, "node-a", "127.0.0.1", slots=1)
            await node.connect()
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
        await wait_for(lambda: c.leading, WAIT_S, what="the new coordinator leads")
        stub = pb_grpc.CoordinatorStub(ch)
        listed = await stub.ListJobs(pb.ListJobsRequest(include_finished=True), timeout=CALL_S)
        assert sorted(j.job_id for j in listed.jobs) == sorted([first, second, third])
        assert await _state(stub, first) == pb.JOB_STATE_SUCCEEDED
        assert await _state(stub, second) == pb.JOB_STATE_QUEUED
        assert await _state(stub, third) == pb.JOB_STATE_SUCCEEDED
