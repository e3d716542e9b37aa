"""Big results never break GetJob, ListJobs, WatchJob or GetEvents for anybody.

Before the fix every Job message carried every rank's return value: five ranks of 3.5 MiB made
GetJob and ListJobs fail with RESOURCE_EXHAUSTED for every client, for as long as the job was
kept. Now jobs, lists and watches carry sizes only, the bytes come from GetResult in chunks of at
most 1 MiB, a job's ranks together may return at most MAX_RESULT_BYTES_PER_JOB, and events come
a bounded page at a time.
"""

from __future__ import annotations

import asyncio
import json
import pickle
from collections.abc import AsyncIterator

import pytest

from client import Client, JobSpec, JobState, WorkerState
from client.model import MAX_RESULT_BYTES_PER_JOB, MAX_RETURN_VALUE_BYTES
from client.results import KIND_JSON, KIND_PICKLE, tagged
from coordinator._job_list import LIST_TEXT_MAX
from coordinator.server import Coordinator, CoordinatorConfig
from protos.gelastic.v1 import gelastic_pb2 as pb
from protos.gelastic.v1 import gelastic_pb2_grpc as pb_grpc
from tests.service._fakes import FakeNode, worker_exit

MiB = 1024 * 1024
SMALL = 64 * 1024
"""What a job summary, a list entry or a watch update of these jobs stays under."""


@pytest.fixture
async def coordinator() -> AsyncIterator[Coordinator]:
    async with Coordinator(
        CoordinatorConfig(state_dir=":memory:", port=0, lease=30.0, heartbeat_interval=1.0)
    ) as c:
        yield c


async def _one_node_round(coordinator: Coordinator, nproc: int) -> tuple[FakeNode, pb.Assign]:
    node = FakeNode(coordinator.address, "node-a", "127.0.0.1", slots=nproc)
    await node.connect()
    rp = (await node.expect("reserve_port")).reserve_port
    await node.send(port_reserved=pb.PortReserved(job_id=rp.job_id, round=rp.round, port=40000))
    asg = (await node.expect("assign")).assign
    await node.send(
        workers_started=pb.WorkersStarted(
            job_id=asg.job_id,
            round=asg.round,
            workers=[
                pb.WorkerPid(local_rank=w.local_rank, pid=1000 + w.global_rank) for w in asg.workers
            ],
        )
    )
    return node, asg


def _value(rank: int, size: int) -> str:
    # A JSON value of about `size` bytes whose content differs per rank.
    return chr(ord("a") + rank % 26) * size


async def test_five_ranks_of_3_5_mib_leave_jobs_lists_and_watches_small(
    coordinator: Coordinator,
) -> None:
    ranks, size = 5, 3 * MiB + MiB // 2
    assert ranks * size > 16 * MiB  # more than one message may carry
    client = Client(coordinator.address, timeout=30)
    try:
        job = await asyncio.to_thread(
            client.submit, JobSpec(entrypoint="pkg.mod:fn", nproc_per_node=ranks)
        )
        node, asg = await _one_node_round(coordinator, ranks)
        key = asg.spec.result_key
        raws = {}
        for lr, w in enumerate(asg.workers):
            raws[w.global_rank] = tagged(
                key,
                job.job_id,
                w.global_rank,
                json.dumps(_value(w.global_rank, size)).encode(),
                kind=KIND_JSON,
            )
            assert len(raws[w.global_rank]) <= MAX_RETURN_VALUE_BYTES
            await node.outbox.put(
                worker_exit(asg, lr, 0, return_value=raws[w.global_rank], has_return_value=True)
            )
        await node.expect("release")
        await node.close()

        stub = pb_grpc.CoordinatorStub(client._channel)

        def read() -> tuple[pb.Job, pb.ListJobsResponse, list[pb.JobUpdate], list[pb.ResultChunk]]:
            got = stub.GetJob(pb.GetJobRequest(job_id=job.job_id), timeout=30)
            listed = stub.ListJobs(pb.ListJobsRequest(include_finished=True), timeout=30)
            watched = list(stub.WatchJob(pb.WatchJobRequest(job_id=job.job_id), timeout=30))
            chunks = list(stub.GetResult(pb.GetResultRequest(job_id=job.job_id), timeout=30))
            return got, listed, watched, chunks

        got, listed, watched, chunks = await asyncio.to_thread(read)
        assert got.state == pb.JOB_STATE_SUCCEEDED
        assert got.ByteSize() < SMALL and listed.ByteSize() < SMALL
        assert watched and all(u.ByteSize() < SMALL for u in watched)
        assert dict(got.result.return_value_sizes) == {r: len(v) for r, v in raws.items()}
        assert not got.result.return_values

        assert chunks and all(len(c.data) <= MiB for c in chunks)
        streamed: dict[int, bytes] = {}
        for c in chunks:
            assert c.offset == len(streamed.get(c.rank, b"")) and c.total == len(raws[c.rank])
            streamed[c.rank] = streamed.get(c.rank, b"") + c.data
        assert streamed == raws

        # The submitter gets its values back, intact and verified.
        result = await asyncio.to_thread(job.wait, 60)
        assert result.state == WorkerState.SUCCEEDED
        assert result.return_values == {r: _value(r, size) for r in range(ranks)}
        jobs = await asyncio.to_thread(client.list_jobs)
        assert [j.job_id for j in jobs] == [job.job_id]
    finally:
        client.close()


async def test_return_values_over_the_per_job_budget_fail_the_job_clearly(
    coordinator: Coordinator,
) -> None:
    size = 3 * MiB + MiB // 2
    ranks = MAX_RESULT_BYTES_PER_JOB // size + 1
    client = Client(coordinator.address, timeout=30)
    try:
        job = await asyncio.to_thread(
            client.submit, JobSpec(entrypoint="pkg.mod:fn", nproc_per_node=ranks)
        )
        node, asg = await _one_node_round(coordinator, ranks)
        key = asg.spec.result_key
        for lr, w in enumerate(asg.workers):
            raw = tagged(
                key, job.job_id, w.global_rank, pickle.dumps(b"x" * size), kind=KIND_PICKLE
            )
            await node.outbox.put(worker_exit(asg, lr, 0, return_value=raw, has_return_value=True))
        stop = (await node.expect("stop")).stop
        await node.send(group_stopped=pb.GroupStopped(job_id=stop.job_id, round=stop.round))
        result = await asyncio.to_thread(job.wait, 60)
        await node.close()
        assert result.state == WorkerState.FAILED and result.return_values == {}
        status = await asyncio.to_thread(job.status)
        assert status.state == JobState.FAILED
        (failure,) = result.failures.values()
        assert f"per-job limit of {MAX_RESULT_BYTES_PER_JOB} bytes" in failure.message
        assert failure.global_rank == ranks - 1
        assert coordinator.service.cluster.job_result(job.job_id).return_values == {}  # type: ignore[union-attr]
    finally:
        client.close()


async def test_events_come_a_bounded_page_at_a_time(coordinator: Coordinator) -> None:
    ranks = 1500  # a "worker_exited" event each, more than one page holds
    client = Client(coordinator.address, timeout=30)
    try:
        job = await asyncio.to_thread(
            client.submit, JobSpec(entrypoint=["python", "train.py"], nproc_per_node=ranks)
        )
        node, asg = await _one_node_round(coordinator, ranks)
        for lr in range(ranks):
            await node.outbox.put(worker_exit(asg, lr, 0))
        await node.expect("release")
        await node.close()
        await asyncio.to_thread(job.wait, 60)
        stub = pb_grpc.CoordinatorStub(client._channel)

        def first_pages() -> tuple[pb.GetEventsResponse, list[pb.JobUpdate]]:
            page = stub.GetEvents(pb.GetEventsRequest(job_id=job.job_id), timeout=30)
            watch = list(stub.WatchJob(pb.WatchJobRequest(job_id=job.job_id), timeout=30))
            return page, watch

        page, watch = await asyncio.to_thread(first_pages)
        assert page.more and 0 < len(page.events) <= 1000
        assert len(watch) >= 2 and all(len(u.events) <= 1000 for u in watch)

        events = await asyncio.to_thread(job.events)
        seqs = [e.seq for e in events]
        assert seqs == sorted(set(seqs))
        assert sum(e.kind == "worker_exited" for e in events) == ranks
        assert events[-1].kind == "finished"
        assert [e.seq for u in watch for e in u.events] == seqs
    finally:
        client.close()


async def test_many_big_failures_leave_the_job_message_bounded(coordinator: Coordinator) -> None:
    ranks, text = 200, "x" * (64 * 1024 - 1)
    client = Client(coordinator.address, timeout=30)
    try:
        job = await asyncio.to_thread(
            client.submit, JobSpec(entrypoint=["python", "train.py"], nproc_per_node=ranks)
        )
        node, asg = await _one_node_round(coordinator, ranks)
        for lr, w in enumerate(asg.workers):
            failure = pb.ProcessFailure(
                global_rank=w.global_rank,
                local_rank=lr,
                exitcode=1,
                message=f"rank {w.global_rank}: " + text,
                traceback=text,
                stderr_tail=text,
                timestamp=1000.0 + lr,
            )
            await node.outbox.put(worker_exit(asg, lr, 1, failure=failure, has_failure=True))
        stop = (await node.expect("stop")).stop
        await node.send(group_stopped=pb.GroupStopped(job_id=stop.job_id, round=stop.round))
        result = await asyncio.to_thread(job.wait, 60)
        await node.close()
        held = coordinator.service.cluster.job_result(job.job_id)
        assert held is not None and len(held.failures) == ranks  # ~38 MiB of failure text

        stub = pb_grpc.CoordinatorStub(client._channel)

        def read() -> tuple[pb.Job, pb.ListJobsResponse, list[pb.JobUpdate]]:
            got = stub.GetJob(pb.GetJobRequest(job_id=job.job_id), timeout=30)
            listed = stub.ListJobs(pb.ListJobsRequest(include_finished=True), timeout=30)
            watched = list(stub.WatchJob(pb.WatchJobRequest(job_id=job.job_id), timeout=30))
            return got, listed, watched

        got, listed, watched = await asyncio.to_thread(read)
        assert got.ByteSize() <= 5 * MiB and listed.ByteSize() < SMALL
        # The list entry names the root cause too, cut to who and what.
        (entry,) = listed.jobs
        assert entry.result.root_cause_rank == 0
        assert list(entry.result.failures) == [0]
        shown = entry.result.failures[0]
        assert shown.root_cause and shown.message.startswith("rank 0: ")
        assert len(shown.message) <= LIST_TEXT_MAX + 6 and not shown.traceback
        assert not shown.stderr_tail
        assert all(u.ByteSize() <= 5 * MiB for u in watched)
        # The root cause keeps its whole report; the others keep who and what.
        assert result.is_failed() and len(result.failures) == ranks
        root = result.root_cause
        assert root is not None and root.global_rank == 0 and root.traceback == text
        assert all(f.message.startswith(f"rank {r}: ") for r, f in result.failures.items())
        # GetJob shortened the attempt's failures; GetAttempts gives them whole.
        assert all(not f.traceback for a in got.result.attempts for f in a.failures)
        (attempt,) = await asyncio.to_thread(job.attempts)
        assert attempt.failures and all(f.traceback == text for f in attempt.failures)
    finally:
        client.close()


def test_attempts_come_a_bounded_page_at_a_time() -> None:
    from client.model import AttemptSummary, ProcessFailure
    from coordinator._rpc import ATTEMPTS_PAGE_MAX, _attempt_page

    small = [AttemptSummary(i, i + 1, ("node-0",), "restart") for i in range(45)]
    page, more = _attempt_page(small)
    assert len(page) == ATTEMPTS_PAGE_MAX and more
    assert [a.attempt for a in page] == list(range(ATTEMPTS_PAGE_MAX))
    page, more = _attempt_page(small[40:])
    assert len(page) == 5 and not more
    text = "y" * (600 * 1024)
    big = [
        AttemptSummary(i, i + 1, ("node-0",), "failed", (ProcessFailure(0, 0, 1, 1, text, 0.0),))
        for i in range(3)
    ]
    page, more = _attempt_page(big)
    # Each about 0.6 MiB against a 1 MiB page: one per page, but never none.
    assert len(page) == 1 and more and page[0].failures[0].message == text
