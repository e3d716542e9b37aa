"""ListJobs comes a bounded page at a time, and the client and `gelastic jobs` read every page.

Before the fix ListJobs answered with one message holding every job with all of its workers and
members: finished jobs of 4,096 ranks made `list_jobs` and `gelastic jobs` fail with
RESOURCE_EXHAUSTED, for every client, for as long as the coordinator kept the jobs. Now a list
entry is a summary the same size whatever the job's width, a page stops at a size and a count,
and the token names the last job a page held, so jobs that come and go between two pages make
no other job come twice or not at all.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import shutil
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest

from client import Client, JobSpec, JobState
from coordinator import _job_list as job_list
from coordinator._job_list import LIST_PAGE_DEFAULT
from coordinator._store import Store
from coordinator.server import Coordinator, CoordinatorConfig
from protos.gelastic.v1 import gelastic_pb2 as pb
from protos.gelastic.v1 import gelastic_pb2_grpc as pb_grpc
from tests._helpers import wait_for
from tests.service._fakes import FakeNode

REPO = Path(__file__).resolve().parents[2]
WIDE = 4096
"""Ranks of each job (one node of 4,096 slots runs them)."""
JOBS = 90
"""Finished wide jobs: listed whole, with every worker, they are far over 16 MiB."""
ENTRY_BYTES = 4096
"""What one list entry of these jobs stays under."""
STEP = 60.0


def _config(state_dir: Path) -> CoordinatorConfig:
    return CoordinatorConfig(
        state_dir=str(state_dir), port=0, lease=60.0, heartbeat_interval=5.0, retain_jobs=JOBS
    )


async def _run_and_cancel(c: Coordinator, node: FakeNode, stub: pb_grpc.CoordinatorStub) -> str:
    """One job of WIDE ranks, started on `node` and cancelled: finished, with every worker."""
    spec = JobSpec(entrypoint=["/bin/true"], nproc_per_node=WIDE, name="wide")
    job_id = await c.service.submit(spec)
    rp = (await node.expect("reserve_port")).reserve_port
    await node.send(port_reserved=pb.PortReserved(job_id=job_id, round=rp.round, port=40000))
    asg = (await node.expect("assign")).assign
    await node.send(
        workers_started=pb.WorkersStarted(
            job_id=job_id,
            round=asg.round,
            workers=[
                pb.WorkerPid(local_rank=w.local_rank, pid=1000 + w.local_rank) for w in asg.workers
            ],
        )
    )
    await wait_for(
        lambda: c.service.cluster.job_state(job_id) == JobState.RUNNING, STEP, what="running"
    )
    await stub.CancelJob(pb.CancelJobRequest(job_id=job_id), timeout=STEP)
    stop = (await node.expect("stop")).stop
    await node.send(group_stopped=pb.GroupStopped(job_id=job_id, round=stop.round))
    await wait_for(
        lambda: c.service.cluster.job_state(job_id) == JobState.CANCELED, STEP, what="cancelled"
    )
    return job_id


async def _one_wide_job(state_dir: Path) -> None:
    async with Coordinator(_config(state_dir)) as c:
        node = FakeNode(c.address, "node-a", "127.0.0.1", slots=WIDE)
        await node.connect()
        try:
            async with grpc.aio.insecure_channel(c.address) as channel:
                await _run_and_cancel(c, node, pb_grpc.CoordinatorStub(channel))
        finally:
            await node.close()


@pytest.fixture(scope="module")
def wide_state(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[str]]:
    """A state dir holding JOBS finished jobs of WIDE ranks, and their ids in submit order.

    The first runs through a real coordinator; the others are its record as that coordinator
    stored it, under other ids and earlier submit times (running each takes the coordinator half
    a second of CPU; reading them back takes far less)."""
    state_dir = tmp_path_factory.mktemp("wide") / "state"
    asyncio.run(_one_wide_job(state_dir))
    store = Store(str(state_dir))
    try:
        (doc,) = store.load().jobs
        ids = []
        rows = []
        for i in range(1, JOBS):
            job_id = f"wide-copy{i:03d}"
            at = doc["submitted_at"] - JOBS + i  # before it: none is submitted in the future
            clone = {**doc, "job_id": job_id, "submitted_at": at, "request_id": ""}
            clone["result"] = {**doc["result"], "job_id": job_id}
            rows.append((job_id, at, doc["state"], clone))
            ids.append(job_id)
        store.save(rows, [])
    finally:
        store.close()
    return state_dir, [*ids, doc["job_id"]]


@pytest.fixture
async def coordinator(
    wide_state: tuple[Path, list[str]], tmp_path: Path
) -> AsyncIterator[Coordinator]:
    state_dir = tmp_path / "state"
    shutil.copytree(wide_state[0], state_dir)
    (state_dir / "coordinator.lock").unlink(missing_ok=True)
    async with Coordinator(_config(state_dir)) as c:
        yield c


@pytest.fixture
def wide_jobs(wide_state: tuple[Path, list[str]]) -> list[str]:
    return wide_state[1]


async def _cli(coordinator: Coordinator, *args: str) -> str:
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "gelastic",
        "--coordinator",
        coordinator.address,
        *args,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(proc.communicate(), STEP * 2)
    assert proc.returncode == 0, err.decode()[-2000:]
    return out.decode()


async def test_many_wide_finished_jobs_list_whole_through_the_client_and_the_cli(
    coordinator: Coordinator, wide_jobs: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    status = coordinator.service.cluster.job_status(wide_jobs[-1])
    assert len(status.workers) == WIDE  # what a list leaves out is kept
    monkeypatch.setattr(job_list, "LIST_PAGE_MAX", 16)  # several pages to follow
    client = Client(coordinator.address, timeout=STEP)
    try:
        jobs = await asyncio.to_thread(client.list_jobs)
    finally:
        client.close()
    assert [j.job_id for j in jobs] == wide_jobs  # submit order, each once
    for j in jobs:
        assert j.state == JobState.CANCELED and j.world_size == WIDE and j.nodes_joined == 1
        assert j.workers == () and j.members == ()

    listed = json.loads(await _cli(coordinator, "jobs", "--json"))
    assert [j["job_id"] for j in listed] == wide_jobs
    header, *rows = (await _cli(coordinator, "jobs")).splitlines()
    assert header.split()[:5] == ["JOB", "NAME", "STATE", "ATTEMPT", "NODES"]
    assert [r.split()[0] for r in rows] == wide_jobs
    assert all(r.split()[2:5] == ["CANCELED", "0", "1"] for r in rows), rows[:3]


async def _pages(stub: pb_grpc.CoordinatorStub, **ask: int) -> list[pb.ListJobsResponse]:
    pages: list[pb.ListJobsResponse] = []
    token = ""
    for _ in range(JOBS + 1):
        req = pb.ListJobsRequest(include_finished=True, page_token=token, **ask)
        pages.append(await stub.ListJobs(req, timeout=STEP))
        token = pages[-1].next_page_token
        if not token:
            return pages
    raise AssertionError("more pages than jobs")


async def test_a_page_is_bounded_in_count_and_bytes_and_an_entry_is_small(
    coordinator: Coordinator, wide_jobs: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    async with grpc.aio.insecure_channel(coordinator.address) as channel:
        stub = pb_grpc.CoordinatorStub(channel)
        (whole,) = await _pages(stub)  # the default page size holds them all
        assert len(whole.jobs) == JOBS <= LIST_PAGE_DEFAULT
        for entry in whole.jobs:
            assert entry.ByteSize() < ENTRY_BYTES
            assert not entry.workers and not entry.members and not entry.HasField("spec")
            assert entry.has_result and not entry.result.failures
            assert not entry.result.return_value_sizes and not entry.result.attempts

        monkeypatch.setattr(job_list, "LIST_PAGE_MAX", 10)
        capped = await _pages(stub, page_size=10**6)  # capped, not refused
        assert [len(p.jobs) for p in capped] == [10] * (JOBS // 10) + [JOBS % 10] * bool(JOBS % 10)

        most = 3 * max(entry.ByteSize() for entry in whole.jobs)
        monkeypatch.setattr(job_list, "LIST_PAGE_BYTES", most)
        by_size = await _pages(stub)
        assert len(by_size) >= JOBS // 3
        assert all(sum(j.ByteSize() for j in p.jobs) <= most for p in by_size)
    for pages in (capped, by_size):
        assert [j.job_id for p in pages for j in p.jobs] == wide_jobs


async def test_pages_hold_every_job_once_while_jobs_come_and_go(
    coordinator: Coordinator, wide_jobs: list[str]
) -> None:
    async with grpc.aio.insecure_channel(coordinator.address) as channel:
        stub = pb_grpc.CoordinatorStub(channel)

        async def page(token: str) -> pb.ListJobsResponse:
            req = pb.ListJobsRequest(include_finished=True, page_size=7, page_token=token)
            return await stub.ListJobs(req, timeout=STEP)

        first = await page("")
        seen = [j.job_id for j in first.jobs]
        assert seen == wide_jobs[:7]
        # A job comes and finishes: the oldest finished job (on the page read) is deleted to
        # keep `retain_jobs`. An offset would now skip a job; the token does not.
        late = await coordinator.service.submit(JobSpec(entrypoint=["/bin/true"], name="late"))
        await stub.CancelJob(pb.CancelJobRequest(job_id=late), timeout=STEP)
        assert not coordinator.service.cluster.has_job(wide_jobs[0])
        token = first.next_page_token
        for _ in range(JOBS):
            if not token:
                break
            resp = await page(token)
            seen += [j.job_id for j in resp.jobs]
            token = resp.next_page_token
        assert not token
    assert seen == [*wide_jobs, late]


@pytest.mark.parametrize(
    "token",
    [
        "garbage!",
        "x" * 401,
        base64.urlsafe_b64encode(b"j1|nan|job").decode().rstrip("="),
        base64.urlsafe_b64encode(b"j2|0x1p+0|job").decode().rstrip("="),
        base64.urlsafe_b64encode(b"j1|0x1p+0|").decode().rstrip("="),
        base64.urlsafe_b64encode(b"\xff\xfe|x").decode().rstrip("="),
    ],
)
async def test_a_token_the_coordinator_did_not_make_is_refused(token: str) -> None:
    config = CoordinatorConfig(state_dir=":memory:", port=0)
    async with Coordinator(config) as c, grpc.aio.insecure_channel(c.address) as channel:
        stub = pb_grpc.CoordinatorStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.ListJobs(pb.ListJobsRequest(page_token=token), timeout=STEP)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "page_token" in (err.value.details() or "")
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.ListJobs(pb.ListJobsRequest(page_size=-1), timeout=STEP)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
