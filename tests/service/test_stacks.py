"""Stack captures through the real service: what the agents are asked, what comes back, and
what a node that stays silent (or answers for others) leaves in the capture."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator

import grpc
import pytest

from client import Client, GelasticError, JobSpec
from coordinator.server import Coordinator, CoordinatorConfig
from protos.gelastic.v1 import gelastic_pb2 as pb
from tests._helpers import wait_for
from tests.service._fakes import FakeNode, run_round


@pytest.fixture
async def coordinator() -> AsyncIterator[Coordinator]:
    async with Coordinator(
        CoordinatorConfig(state_dir=":memory:", port=0, lease=30.0, heartbeat_interval=1.0)
    ) as c:
        yield c


@pytest.fixture
def client(coordinator: Coordinator) -> Iterator[Client]:
    c = Client(f"127.0.0.1:{coordinator.port}", timeout=10)
    yield c
    c.close()


async def running_2x2(
    coordinator: Coordinator, client: Client
) -> tuple[FakeNode, FakeNode, str, pb.Assign]:
    addr = f"127.0.0.1:{coordinator.port}"
    a, b = FakeNode(addr, "a", "10.0.0.1"), FakeNode(addr, "b", "10.0.0.2")
    await a.connect()
    await b.connect()
    spec = JobSpec(entrypoint=["python", "t.py"], nproc_per_node=2, min_nodes=2, max_nodes=2)
    job = await asyncio.to_thread(client.submit, spec)
    aa, _ = await run_round(a, b)
    cluster = coordinator.service.cluster

    def started() -> bool:
        workers = cluster.job_status(job.job_id).workers
        return len(workers) == 4 and all(w.pid for w in workers)

    await wait_for(started, 10, what="the 4 workers started")
    return a, b, job.job_id, aa


async def test_code_of_the_coordinator_takes_a_capture_with_its_own_reason(
    coordinator: Coordinator, client: Client
) -> None:
    a, b, job_id, _ = await running_2x2(coordinator, client)
    c = await coordinator.service.capture_stacks(job_id, "rank 2 made no step for 60 s", wait=1.0)
    assert c.reason == "rank 2 made no step for 60 s"
    # Neither node answers: each node's ranks are one group (the note names the node).
    assert [(g.status, g.ranks) for g in c.groups] == [("no_answer", (0, 1)), ("no_answer", (2, 3))]
    events = await asyncio.to_thread(client.events, job_id)
    stacks = [e for e in events if e.kind == "stacks"]
    assert len(stacks) == 1 and c.capture_id in stacks[0].reason
    assert "rank 2 made no step for 60 s" in stacks[0].reason
    await a.close()
    await b.close()


async def test_a_silent_node_leaves_its_ranks_as_no_answer_and_forged_ranks_are_dropped(
    coordinator: Coordinator, client: Client
) -> None:
    a, b, job_id, aa = await running_2x2(coordinator, client)
    capture = asyncio.ensure_future(asyncio.to_thread(client.capture_stacks, job_id, wait=2.0))
    qa = (await a.expect("stack_request")).stack_request
    qb = (await b.expect("stack_request")).stack_request
    assert (qa.job_id, qa.round, list(qa.local_ranks)) == (job_id, aa.round, [0, 1])
    assert qa.request_id != qb.request_id and 0 < qa.timeout_ms <= 2000
    first = 'Thread 1 (idle): "MainThread"\n    f (t.py:3)'
    await a.send(
        stack_reply=pb.StackReply(
            request_id=qa.request_id,
            stacks=[
                pb.WorkerStack(local_rank=0, pid=1, status="ok", text=first),
                pb.WorkerStack(local_rank=1, pid=2, status="ok", text=first.replace("1 (", "2 (")),
                pb.WorkerStack(local_rank=7, pid=3, status="ok", text="forged"),
            ],
        )
    )
    # b answers a's request: not its own, dropped.
    await b.send(stack_reply=pb.StackReply(request_id=qa.request_id, stacks=[]))
    c = await capture
    assert [(g.status, g.ranks, g.nodes) for g in c.groups] == [
        ("ok", (0, 1), ("a",)),
        ("no_answer", (2, 3), ("b",)),
    ]
    assert c.groups[1].note == "node b did not answer in time"
    assert "forged" not in str(c)
    assert coordinator.service.stacks.stray_replies == 1
    kept = await asyncio.to_thread(client.stacks, job_id)
    assert kept == [c]
    assert await asyncio.to_thread(client.stacks, job_id, c.capture_id) == [c]
    events = await asyncio.to_thread(client.events, job_id)
    assert [e.reason for e in events if e.kind == "stacks"] == [
        f"stacks captured: {c.capture_id}, 4 ranks in 2 groups (requested by a client)"
    ]
    with pytest.raises(GelasticError) as err:
        await asyncio.to_thread(client.stacks, job_id, "not an id")
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(GelasticError) as err:
        await asyncio.to_thread(client.capture_stacks, job_id, rank=9)
    assert err.value.code == grpc.StatusCode.FAILED_PRECONDITION
    await a.close()
    await b.close()
