"""Submit is idempotent and durable: a retry never makes a second job, a failed write runs none.

Every test runs against both stores: SQLite in a state dir and a real etcd (tests/_etcd.py).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from client import Client, JobSpec
from client.wire import spec_to_pb
from coordinator._store import StateStore, Store
from coordinator._store_etcd import EtcdStore
from coordinator.server import Coordinator, CoordinatorConfig
from protos.gelastic.v1 import gelastic_pb2 as pb
from protos.gelastic.v1 import gelastic_pb2_grpc as pb_grpc
from tests.service._fakes import FakeNode

SPEC = JobSpec(entrypoint=["python", "train.py"], nproc_per_node=1, min_nodes=1, max_nodes=1)


@pytest.fixture(params=["sqlite", "etcd"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """The --store of the test's coordinator: "sqlite" (in tmp_path/state) or an etcd URL."""
    if request.param == "etcd":
        url: str = request.getfixturevalue("etcd_url")
        return url
    return "sqlite"


def _config(state_dir: Path, store: str = "sqlite") -> CoordinatorConfig:
    return CoordinatorConfig(
        state_dir=str(state_dir), store=store, port=0, lease=30.0, heartbeat_interval=1.0
    )


def _open_store(state_dir: Path, store: str) -> StateStore:
    settings = _config(state_dir, store).etcd_settings()
    return Store(str(state_dir)) if settings is None else EtcdStore(settings)


@pytest.fixture
async def coordinator(tmp_path: Path, store: str) -> AsyncIterator[Coordinator]:
    async with Coordinator(_config(tmp_path / "state", store)) as c:
        yield c


async def _submit(c: Coordinator, request_id: str, spec: JobSpec = SPEC) -> pb.SubmitResponse:
    async with grpc.aio.insecure_channel(c.address) as ch:
        stub = pb_grpc.CoordinatorStub(ch)
        return await stub.Submit(pb.SubmitRequest(spec=spec_to_pb(spec), request_id=request_id))


async def _job_ids(c: Coordinator) -> list[str]:
    async with grpc.aio.insecure_channel(c.address) as ch:
        resp = await pb_grpc.CoordinatorStub(ch).ListJobs(pb.ListJobsRequest(include_finished=True))
        return [j.job_id for j in resp.jobs]


def _fail_the_next_write(c: Coordinator, monkeypatch: pytest.MonkeyPatch) -> None:
    save = c.store.save
    failures = [OSError("disk full")]

    def failing_save(*args: Any, **kw: Any) -> None:
        if failures:
            raise failures.pop()
        save(*args, **kw)

    monkeypatch.setattr(c.store, "save", failing_save)


async def test_a_repeated_request_id_returns_the_first_job(coordinator: Coordinator) -> None:
    first = await _submit(coordinator, "req-1")
    again = await _submit(coordinator, "req-1")
    other = await _submit(coordinator, "req-2")
    assert again.job_id == first.job_id != other.job_id
    assert sorted(await _job_ids(coordinator)) == sorted({first.job_id, other.job_id})


async def test_a_request_id_cannot_submit_another_spec(coordinator: Coordinator) -> None:
    await _submit(coordinator, "req-1")
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await _submit(coordinator, "req-1", JobSpec(entrypoint=["other"]))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "request_id" in (err.value.details() or "")


@pytest.mark.parametrize("bad", ["x" * 129, "a b", "../x", "é"])
async def test_a_malformed_request_id_is_refused(coordinator: Coordinator, bad: str) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await _submit(coordinator, bad)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT


async def test_a_request_id_survives_a_restart(tmp_path: Path, store: str) -> None:
    async with Coordinator(_config(tmp_path / "state", store)) as c:
        first = await _submit(c, "req-1")
    async with Coordinator(_config(tmp_path / "state", store)) as c:
        assert (await _submit(c, "req-1")).job_id == first.job_id
        assert await _job_ids(c) == [first.job_id]


async def test_a_submit_whose_write_fails_runs_nothing_and_a_retry_runs_it_once(
    coordinator: Coordinator, monkeypatch: pytest.MonkeyPatch
) -> None:
    node = FakeNode(coordinator.address, "node-a", "127.0.0.1", slots=1)
    await node.connect()
    _fail_the_next_write(coordinator, monkeypatch)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await _submit(coordinator, "req-1")
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    assert await _job_ids(coordinator) == []
    # Nothing of the job reached the node: the next message it gets is for the retried job.
    retried = await _submit(coordinator, "req-1")
    reserve = await node.expect("reserve_port")
    assert reserve.reserve_port.job_id == retried.job_id
    assert await _job_ids(coordinator) == [retried.job_id]
    await node.close()


async def test_the_client_retries_a_submit_with_one_request_id(
    coordinator: Coordinator, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The first try's write fails after the job was made; the client's retry must not make two.
    _fail_the_next_write(coordinator, monkeypatch)
    client = Client(coordinator.address, timeout=10)
    try:
        job = await asyncio.to_thread(client.submit, SPEC)
    finally:
        client.close()
    assert await _job_ids(coordinator) == [job.job_id]


async def test_event_numbers_are_never_given_twice_across_a_crash(
    tmp_path: Path, store: str
) -> None:
    from coordinator._service import CoordinatorService

    first = _open_store(tmp_path / "state", store)
    svc = CoordinatorService(store=first)
    svc.start()
    job_id = await svc.submit(SPEC, "req-1")
    written = max(e.seq for e in svc.cluster.job_events(job_id))
    # More events are numbered, then the process dies before they are written.
    svc.apply(svc.cluster.cancel(job_id, svc.now()))
    unwritten = max(e.seq for e in svc.cluster.job_events(job_id))
    assert unwritten > written
    assert svc._tick_task is not None and svc._flush_task is not None
    for task in (svc._tick_task, svc._flush_task):
        task.cancel()
    await asyncio.gather(svc._tick_task, svc._flush_task, return_exceptions=True)
    first.close()

    second = _open_store(tmp_path / "state", store)
    again = CoordinatorService(store=second)
    again.start()
    try:
        seqs = [e.seq for e in again.cluster.job_events(job_id)]
        # What was written is back; the "recovered" event restore adds is numbered past it all.
        assert seqs[-2] == written and seqs[-1] > unwritten
        other = await again.submit(SPEC, "req-2")
        assert min(e.seq for e in again.cluster.job_events(other)) > unwritten
    finally:
        await again.stop()
        second.close()


async def test_retention_deletes_rows_and_gives_the_space_back(tmp_path: Path) -> None:
    import sqlite3

    from coordinator._cluster import ClusterConfig
    from coordinator._service import CoordinatorService
    from coordinator._store import Store

    store = Store(str(tmp_path / "state"))
    svc = CoordinatorService(ClusterConfig(retain_jobs=2), store=store)
    svc.start()
    big = JobSpec(entrypoint=["x"], env={f"V{i}": "v" * 60_000 for i in range(8)})
    try:
        ids = []
        for i in range(12):
            job_id = await svc.submit(big, f"req-{i}")
            svc.apply(svc.cluster.cancel(job_id, svc.now()))
            await svc.flush()
            ids.append(job_id)
        assert svc.cluster.job_ids() == ids[-2:]
    finally:
        await svc.stop()
        store.close()
    db = sqlite3.connect(tmp_path / "state" / "coordinator.sqlite3")
    try:
        assert {r[0] for r in db.execute("SELECT job_id FROM jobs")} == set(ids[-2:])
        assert {r[0] for r in db.execute("SELECT DISTINCT job_id FROM events")} == set(ids[-2:])
        db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        pages = db.execute("PRAGMA page_count").fetchone()[0]
        free = db.execute("PRAGMA freelist_count").fetchone()[0]
        size = pages * db.execute("PRAGMA page_size").fetchone()[0]
    finally:
        db.close()
    # Two jobs of ~0.5 MB each are kept; ten were deleted and their pages given back.
    assert free < pages // 4, (free, pages)
    assert size < 4 * 1024 * 1024, size


async def test_bad_rows_are_moved_aside_and_the_rest_loads(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    import json
    import sqlite3

    async with Coordinator(_config(tmp_path / "state")) as c:
        good = (await _submit(c, "req-good")).job_id
    db = sqlite3.connect(tmp_path / "state" / "coordinator.sqlite3")
    with db:
        db.execute("INSERT INTO jobs VALUES ('broken-json', 1.0, 'QUEUED', '{not json')")
        db.execute("INSERT INTO jobs VALUES ('wrong-shape', 2.0, 'QUEUED', ?)", ('{"x": 1}',))
        db.execute("INSERT INTO jobs VALUES ('a-list', 3.0, 'QUEUED', '[1, 2]')")
        db.execute("INSERT INTO events VALUES (99999, 'nobody', 'garbage')")
        db.execute("INSERT INTO nodes VALUES ('n-bad', ?)", (json.dumps({"name": 5}),))
    db.close()
    async with Coordinator(_config(tmp_path / "state")) as c:
        assert await _job_ids(c) == [good]
        # The bad rows are gone from their tables for good: a second start reads none of them.
    db = sqlite3.connect(tmp_path / "state" / "coordinator.sqlite3")
    try:
        moved = sorted(db.execute("SELECT source, key FROM quarantine"))
        left = [r[0] for r in db.execute("SELECT job_id FROM jobs")]
        nodes = [r[0] for r in db.execute("SELECT name FROM nodes")]
    finally:
        db.close()
    assert moved == [
        ("events", "99999"),
        ("jobs", "a-list"),
        ("jobs", "broken-json"),
        ("jobs", "wrong-shape"),
        ("nodes", "n-bad"),
    ]
    assert left == [good] and "n-bad" not in nodes
    logged = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert sum("quarantine" in m for m in logged) == 5, logged
