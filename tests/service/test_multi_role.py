"""Multi-role jobs through the real service: the round forms once every role has its nodes,
each Assign names its node's role with torch's ranks, status shows the roles, a failure in one
role stops and restarts every node, and a bad role is refused naming its field."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc
import pytest

from client import Client, JobSpec, JobState, Role
from client._tables import status_text
from client.wire import spec_from_pb, spec_to_pb
from coordinator._dashboard import DashboardModel
from coordinator.server import Coordinator, CoordinatorConfig
from protos.gelastic.v1 import gelastic_pb2 as pb
from protos.gelastic.v1 import gelastic_pb2_grpc as pb_grpc
from tests._torch_ranks import torch_ranks
from tests.service._fakes import FakeNode, run_round, worker_exit

SPEC = JobSpec(
    roles=(
        Role("ps", ["python", "ps.py"]),
        Role("trainer", ["python", "train.py"], nproc_per_node=2, min_nodes=1, max_nodes=2),
    ),
    max_restarts=1,
    last_call_timeout=0,
)


@pytest.fixture
async def coordinator() -> AsyncIterator[Coordinator]:
    # The scripted nodes send no heartbeats: the lease outlasts the test on a loaded machine.
    async with Coordinator(
        CoordinatorConfig(state_dir=":memory:", port=0, lease=300.0, heartbeat_interval=1.0)
    ) as c:
        yield c


@pytest.fixture
def client(coordinator: Coordinator) -> Client:
    c = Client(f"127.0.0.1:{coordinator.port}", timeout=10)
    yield c  # type: ignore[misc]
    c.close()


def _ranks(asg: pb.Assign) -> list[dict[str, int]]:
    return [
        {
            "LOCAL_RANK": w.local_rank,
            "RANK": w.global_rank,
            "ROLE_RANK": w.role_rank,
            "WORLD_SIZE": w.world_size,
            "ROLE_WORLD_SIZE": w.role_world_size,
        }
        for w in asg.workers
    ]


async def test_roles_form_one_round_and_restart_together(
    coordinator: Coordinator, client: Client
) -> None:
    job = await asyncio.to_thread(client.submit, SPEC)
    # A one-slot node fits only the ps: alone it forms no round (the trainer has no node).
    a = FakeNode(coordinator.address, "node-a", "127.0.0.1", slots=1)
    await a.connect()  # the welcome comes after the coordinator placed what it could
    status = await asyncio.to_thread(job.status)
    assert status.state == JobState.QUEUED and status.round == 0 and not status.members
    b = FakeNode(coordinator.address, "node-b", "127.0.0.2", slots=2)
    await b.connect()
    aa, ab = await run_round(a, b)
    assert ({w.role for w in aa.workers}, {w.role for w in ab.workers}) == ({"ps"}, {"trainer"})
    assert [_ranks(aa), _ranks(ab)] == torch_ranks([("ps", 1), ("trainer", 2)])
    # The agent gets the whole spec and runs its role's part of it.
    assert spec_to_pb(spec_from_pb(aa.spec)) == spec_to_pb(SPEC)
    mine = spec_from_pb(ab.spec).for_role(ab.workers[0].role)
    assert (mine.role, mine.argv, mine.nproc_per_node) == ("trainer", ("python", "train.py"), 2)

    status = await asyncio.to_thread(job.status)
    assert {m.node: (m.role, m.nproc) for m in status.members} == {
        "node-a": ("ps", 1),
        "node-b": ("trainer", 2),
    }
    text = status_text(status)
    assert "ROLE" in text and "trainer" in text, text
    shown = DashboardModel(coordinator.service).job(job.job_id)["spec"]
    assert (shown["role"], shown["entrypoint"]) == ("ps, trainer", "ps: python; trainer: python")

    # A trainer fails: both nodes are stopped, and both roles start again in attempt 1.
    await b.outbox.put(worker_exit(ab, 1, 3))
    for node, asg in ((a, aa), (b, ab)):
        stop = (await node.expect("stop")).stop
        assert stop.round == asg.round
        await node.send(
            group_stopped=pb.GroupStopped(job_id=asg.job_id, round=asg.round),
        )
    rp = await a.expect("reserve_port")
    await a.send(
        port_reserved=pb.PortReserved(
            job_id=rp.reserve_port.job_id, round=rp.reserve_port.round, port=40001
        )
    )
    again = [(await n.expect("assign")).assign for n in (a, b)]
    assert [x.attempt for x in again] == [1, 1]
    assert [_ranks(x) for x in again] == torch_ranks([("ps", 1), ("trainer", 2)])
    await a.close()
    await b.close()


async def test_a_bad_role_is_invalid_argument_naming_the_field(client: Client) -> None:
    msg = spec_to_pb(SPEC)
    msg.roles[1].nproc_per_node = 0
    stub = pb_grpc.CoordinatorStub(grpc.insecure_channel(client.address))
    with pytest.raises(grpc.RpcError) as err:
        await asyncio.to_thread(stub.Submit, pb.SubmitRequest(spec=msg))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT  # type: ignore[attr-defined]
    assert "roles[1].nproc_per_node" in err.value.details()  # type: ignore[attr-defined]
