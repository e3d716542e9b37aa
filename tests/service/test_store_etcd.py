"""The etcd store against a real etcd: bounds, pieces, fences, quarantine, retention, TLS and
auth, and an etcd that restarts under a running coordinator."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import grpc
import pytest

from client import JobSpec
from client.wire import spec_to_pb
from coordinator._store import Fence, StoreFenced, StoreUnavailable
from coordinator._store_etcd import (
    MAX_TXN_OPS,
    PART_BYTES,
    EtcdSettings,
    EtcdStore,
    parse_etcd_url,
)
from coordinator.server import Coordinator, CoordinatorConfig
from protos.etcd import rpc_pb2 as epb
from protos.etcd import rpc_pb2_grpc as epb_grpc
from protos.gelastic.v1 import gelastic_pb2 as pb
from protos.gelastic.v1 import gelastic_pb2_grpc as pb_grpc
from tests._etcd import EtcdServer
from tests.service._fakes import FakeNode

SPEC = JobSpec(entrypoint=["python", "train.py"], nproc_per_node=1, min_nodes=1, max_nodes=1)


def _store(url: str, **kw: str) -> EtcdStore:
    endpoints, prefix = parse_etcd_url(url)
    return EtcdStore(EtcdSettings(endpoints, prefix, **kw))


def _keys(server: EtcdServer, prefix: str) -> dict[bytes, bytes]:
    """Every key (and value) under `prefix`, read straight from etcd."""
    start = prefix.encode()
    end = start[:-1] + bytes([start[-1] + 1])
    with server.channel() as ch:
        resp = epb_grpc.KVStub(ch).Range(epb.RangeRequest(key=start, range_end=end), timeout=5)
    return {kv.key: kv.value for kv in resp.kvs}


def _put(server: EtcdServer, key: str, value: bytes) -> int:
    """Put a key straight into etcd; returns the revision it was written at."""
    with server.channel() as ch:
        resp = epb_grpc.KVStub(ch).Put(epb.PutRequest(key=key.encode(), value=value), timeout=5)
    revision: int = resp.header.revision
    return revision


def _prefix(url: str) -> str:
    return parse_etcd_url(url)[1] + "/"


def _config(url: str, tmp_path: Path, leader_ttl: float = 3.0) -> CoordinatorConfig:
    return CoordinatorConfig(
        state_dir=str(tmp_path / "unused"),
        store=url,
        port=0,
        lease=30.0,
        heartbeat_interval=1.0,
        leader_ttl=leader_ttl,
    )


async def _submit(c: Coordinator, request_id: str) -> str:
    async with grpc.aio.insecure_channel(c.address) as ch:
        resp = await pb_grpc.CoordinatorStub(ch).Submit(
            pb.SubmitRequest(spec=spec_to_pb(SPEC), request_id=request_id), timeout=30
        )
        job_id: str = resp.job_id
        return job_id


async def _job_ids(c: Coordinator) -> list[str]:
    async with grpc.aio.insecure_channel(c.address) as ch:
        resp = await pb_grpc.CoordinatorStub(ch).ListJobs(
            pb.ListJobsRequest(include_finished=True), timeout=30
        )
        return [j.job_id for j in resp.jobs]


def test_a_batch_larger_than_one_txn_is_written_whole(
    etcd_server: EtcdServer, etcd_url: str
) -> None:
    store = _store(etcd_url)
    try:
        n = 5 * MAX_TXN_OPS
        store.save(
            [("job-1", 1.0, "RUNNING", {"n": 1})],
            [(seq, "job-1", {"seq": seq, "pad": "x" * 4000}) for seq in range(1, n + 1)],
            [("node-a", {"name": "node-a"})],
            {"event_seq_reserved": str(n + 10_000)},
        )
        state = store.load()
    finally:
        store.close()
    assert state.event_keys == list(range(1, n + 1))
    assert [e["seq"] for e in state.events] == state.event_keys
    assert state.job_keys == ["job-1"] and state.jobs == [{"n": 1}]
    assert state.meta["event_seq_reserved"] == str(n + 10_000)
    # More bytes than etcd takes in one request (1.5 MiB) went in, in several txns.
    assert n * 4000 > 2 * 1024 * 1024


def test_a_value_larger_than_a_request_is_stored_in_pieces_and_read_whole(
    etcd_server: EtcdServer, etcd_url: str
) -> None:
    big = {"env": {f"V{i}": "v" * 100_000 for i in range(40)}}  # ~4 MB of JSON
    store = _store(etcd_url)
    try:
        store.save([("job-big", 1.0, "QUEUED", big)], [])
        store.save([("job-big", 1.0, "RUNNING", big)], [])  # rewritten: old pieces go
        parts = [k for k in _keys(etcd_server, _prefix(etcd_url) + "parts/")]
        assert len(parts) == -(-len(json.dumps(_row(big))) // PART_BYTES), len(parts)
    finally:
        store.close()
    again = _store(etcd_url)
    try:
        assert again.load().jobs == [big]
        again.save([("job-big", 1.0, "SUCCEEDED", {"small": True})], [])
        assert not _keys(etcd_server, _prefix(etcd_url) + "parts/"), "pieces left behind"
        assert again.load().jobs == [{"small": True}]
    finally:
        again.close()


def _row(doc: dict[str, object]) -> dict[str, object]:
    return {"submitted_at": 1.0, "state": "RUNNING", "doc": doc}


def test_pieces_of_a_write_that_never_finished_are_ignored_and_deleted(
    etcd_server: EtcdServer, etcd_url: str
) -> None:
    store = _store(etcd_url)
    try:
        store.save([("job-1", 1.0, "QUEUED", {"v": 1})], [])
    finally:
        store.close()
    # A crash after the pieces of a large rewrite went in, before the key pointed at them.
    orphan = _prefix(etcd_url) + "parts/jobs%2Fjob-1/99999999999999999999/000000"
    _put(etcd_server, orphan, b"half of a value")
    again = _store(etcd_url)
    try:
        assert again.load().jobs == [{"v": 1}]
    finally:
        again.close()
    assert not _keys(etcd_server, _prefix(etcd_url) + "parts/")


def test_a_fenced_write_fails_once_the_fence_key_is_made_again(
    etcd_server: EtcdServer, etcd_url: str
) -> None:
    leader_key = _prefix(etcd_url) + "leader"
    revision = _put(etcd_server, leader_key, b"me")
    store = _store(etcd_url)
    try:
        store.set_fence(Fence(leader_key.encode(), revision))
        store.save([("job-1", 1.0, "QUEUED", {"v": 1})], [])
        # Another coordinator took over: the key was deleted and made again.
        with etcd_server.channel() as ch:
            epb_grpc.KVStub(ch).DeleteRange(
                epb.DeleteRangeRequest(key=leader_key.encode()), timeout=5
            )
        _put(etcd_server, leader_key, b"someone else")
        with pytest.raises(StoreFenced, match="another coordinator leads"):
            store.save([("job-1", 1.0, "RUNNING", {"v": 2})], [])
        with pytest.raises(StoreFenced):
            store.save([], [(7, "job-1", {"seq": 7})])
        store.set_fence(None)
        assert store.load().jobs == [{"v": 1}], "a fenced write went in"
        assert store.load().event_keys == []
    finally:
        store.close()


def test_cut_and_forgotten_events_are_deleted_in_the_same_batch_as_new_ones(
    etcd_server: EtcdServer, etcd_url: str
) -> None:
    store = _store(etcd_url)
    try:
        store.save([("a", 1.0, "RUNNING", {}), ("b", 2.0, "RUNNING", {})], [])
        # One batch: events of a, a cut that covers some of them, and b forgotten with its own.
        store.save(
            [("a", 1.0, "RUNNING", {"v": 2})],
            [(s, "a", {"s": s}) for s in range(1, 11)] + [(11, "b", {"s": 11})],
            forget_jobs=["b"],
            cut_events=[("a", 3, 8)],
        )
        state = store.load()
    finally:
        store.close()
    assert state.job_keys == ["a"]
    assert state.event_keys == [1, 2, 3, 8, 9, 10]


async def test_bad_records_are_moved_aside_and_the_rest_loads(
    etcd_server: EtcdServer, etcd_url: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    async with Coordinator(_config(etcd_url, tmp_path)) as c:
        good = await _submit(c, "req-good")
    p = _prefix(etcd_url)
    _put(etcd_server, p + "jobs/broken-json", b"{not json")
    _put(etcd_server, p + "jobs/wrong-shape", json.dumps(_row({"x": 1})).encode())
    _put(etcd_server, p + "jobs/a-list", b"[1, 2]")
    _put(etcd_server, p + "events/nobody/" + "9" * 20, b"garbage")
    _put(etcd_server, p + "nodes/n-bad", json.dumps({"name": 5}).encode())
    async with Coordinator(_config(etcd_url, tmp_path)) as c:
        assert await _job_ids(c) == [good]
    quarantined = [json.loads(v) for v in _keys(etcd_server, p + "quarantine/").values()]
    assert sorted((q["source"], q["key"]) for q in quarantined) == [
        ("events", "nobody/" + "9" * 20),
        ("jobs", "a-list"),
        ("jobs", "broken-json"),
        ("jobs", "wrong-shape"),
        ("nodes", "n-bad"),
    ]
    assert {q["data"] for q in quarantined} >= {"{not json", "[1, 2]", "garbage"}
    left = _keys(etcd_server, p + "jobs/")
    assert list(left) == [(p + "jobs/" + good).encode()]
    logged = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert sum("quarantine" in m for m in logged) == 5, logged
    # A second start reads none of them.
    caplog.clear()
    async with Coordinator(_config(etcd_url, tmp_path)) as c:
        assert await _job_ids(c) == [good]
    assert not [r for r in caplog.records if "quarantine" in r.getMessage()]


async def test_retention_deletes_the_keys_of_old_jobs(
    etcd_server: EtcdServer, etcd_url: str
) -> None:
    from coordinator._cluster import ClusterConfig
    from coordinator._service import CoordinatorService

    store = _store(etcd_url)
    svc = CoordinatorService(ClusterConfig(retain_jobs=2), store=store)
    svc.start()
    big = JobSpec(entrypoint=["x"], env={f"V{i}": "v" * 60_000 for i in range(12)})  # pieces
    try:
        ids = []
        for i in range(6):
            job_id = await svc.submit(big, f"req-{i}")
            svc.apply(svc.cluster.cancel(job_id, svc.now()))
            await svc.flush()
            ids.append(job_id)
        assert svc.cluster.job_ids() == ids[-2:]
    finally:
        await svc.stop()
        store.close()
    p = _prefix(etcd_url)
    jobs = {k.decode().removeprefix(p + "jobs/") for k in _keys(etcd_server, p + "jobs/")}
    events = {k.decode().split("/")[-2] for k in _keys(etcd_server, p + "events/")}
    parts = {k.decode().split("/")[-3] for k in _keys(etcd_server, p + "parts/")}
    assert jobs == events == set(ids[-2:])
    assert parts == {f"jobs%2F{j}" for j in ids[-2:]}, parts


async def test_submit_and_cancel_answer_unavailable_while_etcd_is_down_and_resume_after(
    tmp_path: Path,
) -> None:
    etcd = EtcdServer(tmp_path / "etcd")
    etcd.start()
    try:
        # A leader lease longer than the outage: the coordinator keeps leading throughout (a
        # shorter one steps down, see tests/service/test_leader.py).
        async with Coordinator(_config(etcd.url("gelastic"), tmp_path, leader_ttl=60)) as c:
            node = FakeNode(c.address, "node-a", "127.0.0.1", slots=1)
            await node.connect()
            first = await _submit(c, "req-1")
            rp = (await node.expect("reserve_port")).reserve_port
            await node.send(port_reserved=pb.PortReserved(job_id=first, round=rp.round, port=40000))
            asg = (await node.expect("assign")).assign
            await node.send(
                workers_started=pb.WorkersStarted(
                    job_id=first,
                    round=asg.round,
                    workers=[pb.WorkerPid(local_rank=0, pid=1000, global_rank=0)],
                )
            )
            # Every later message to the agent, with when it came.
            seen: list[tuple[float, str]] = []
            got_stop = asyncio.Event()

            async def read() -> None:
                assert node.call is not None
                while (msg := await node.call.read()) is not grpc.aio.EOF:
                    kind = msg.WhichOneof("kind")
                    seen.append((time.monotonic(), kind))
                    if kind == "stop":
                        got_stop.set()

            reader = asyncio.get_running_loop().create_task(read())
            await asyncio.to_thread(etcd.stop)

            async with grpc.aio.insecure_channel(c.address) as ch:
                stub = pb_grpc.CoordinatorStub(ch)
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await stub.Submit(
                        pb.SubmitRequest(spec=spec_to_pb(SPEC), request_id="req-2"), timeout=30
                    )
                assert err.value.code() == grpc.StatusCode.UNAVAILABLE
                assert "etcd is unavailable" in (err.value.details() or ""), err.value.details()
                assert "not queued" in (err.value.details() or "")
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await stub.CancelJob(pb.CancelJobRequest(job_id=first), timeout=30)
                assert err.value.code() == grpc.StatusCode.UNAVAILABLE
                assert "etcd is unavailable" in (err.value.details() or ""), err.value.details()
                await asyncio.sleep(0.5)  # give a wrongly sent Stop the time to arrive
                back = time.monotonic()
                await asyncio.to_thread(etcd.start)
                # The coordinator resumes by itself: the held cancel is written and goes out.
                await asyncio.wait_for(got_stop.wait(), 30)
                # Nothing of the cancel reached the agent while it was not written.
                assert all(t > back for t, kind in seen if kind == "stop"), seen
                job = await stub.GetJob(pb.GetJobRequest(job_id=first), timeout=30)
                assert job.state == pb.JOB_STATE_STOPPING and job.reason == "canceled by the user"
                second = await _submit(c, "req-2")
            reader.cancel()
            await asyncio.gather(reader, return_exceptions=True)
            await node.close()
        async with Coordinator(_config(etcd.url("gelastic"), tmp_path)) as c:
            # Both jobs the clients were told about, and nothing of the refused submit.
            assert sorted(await _job_ids(c)) == sorted([first, second])
    finally:
        etcd.stop()


def test_a_member_that_does_not_answer_is_left_for_the_next(
    etcd_server: EtcdServer, etcd_url: str, tmp_path: Path
) -> None:
    dead = EtcdServer(tmp_path / "dead")  # never started: nothing listens on its port
    prefix = parse_etcd_url(etcd_url)[1]
    store = _store(f"etcd://{dead.endpoint},{etcd_server.endpoint}/{prefix}")
    try:
        store.save([("job-1", 1.0, "QUEUED", {"v": 1})], [])
        assert store.load().jobs == [{"v": 1}]
    finally:
        store.close()


def test_the_coordinator_waits_a_bounded_time_for_etcd_at_start(tmp_path: Path) -> None:
    etcd = EtcdServer(tmp_path / "etcd")  # never started: nothing listens on its port
    started = time.monotonic()
    with pytest.raises(StoreUnavailable, match=r"etcd is unavailable .*waited 1 s"):
        EtcdStore(EtcdSettings((etcd.endpoint,), "gelastic"), connect_wait=1.0)
    assert time.monotonic() - started < 15


def test_tls_and_auth_to_etcd(tmp_path: Path) -> None:
    from tests.service.test_security import _ca

    ca, cert, key, ccert, ckey = _ca(tmp_path)
    etcd = EtcdServer(tmp_path / "etcd", tls=(ca, cert, key))
    etcd.start()
    try:
        etcd.enable_auth("root-secret-1234")
        pw = tmp_path / "etcd.password"
        pw.write_text("root-secret-1234\n")
        url = etcd.url("gelastic")
        store = _store(
            url, ca_file=ca, cert_file=ccert, key_file=ckey, user="root", password_file=str(pw)
        )
        try:
            store.save([("job-1", 1.0, "QUEUED", {"v": 1})], [])
            assert store.load().jobs == [{"v": 1}]
        finally:
            store.close()
        wrong = tmp_path / "wrong.password"
        wrong.write_text("not-the-password")
        with pytest.raises(StoreUnavailable, match="could not authenticate to etcd as 'root'") as e:
            _store(
                url,
                ca_file=ca,
                cert_file=ccert,
                key_file=ckey,
                user="root",
                password_file=str(wrong),
            )
        assert "not-the-password" not in str(e.value)
        with pytest.raises(StoreUnavailable):  # no client certificate: refused
            EtcdStore(EtcdSettings(*parse_etcd_url(url), ca_file=ca), connect_wait=0)
    finally:
        etcd.stop()


def test_an_auth_token_etcd_no_longer_knows_is_renewed(tmp_path: Path) -> None:
    etcd = EtcdServer(tmp_path / "etcd")
    etcd.start()
    try:
        etcd.enable_auth("root-secret-1234")
        pw = tmp_path / "etcd.password"
        pw.write_text("root-secret-1234")
        store = _store(etcd.url("gelastic"), user="root", password_file=str(pw))
        try:
            store.save([("job-1", 1.0, "QUEUED", {"v": 1})], [])
            token = store._token
            assert token
            etcd.restart()  # etcd keeps its tokens in memory: this one is gone
            with etcd.channel() as ch, pytest.raises(grpc.RpcError, match="auth token"):
                epb_grpc.KVStub(ch).Range(
                    epb.RangeRequest(key=b"x"), timeout=5, metadata=[("token", token)]
                )
            store.save([("job-1", 1.0, "RUNNING", {"v": 2})], [])
            assert store._token != token
            assert store.load().jobs == [{"v": 2}]
        finally:
            store.close()
    finally:
        etcd.stop()


@pytest.mark.parametrize(
    "url",
    [
        "sqlite://x",
        "etcd://127.0.0.1:2379",
        "etcd://127.0.0.1:2379/",
        "etcd://127.0.0.1/p",
        "etcd://127.0.0.1:0/p",
        "etcd://127.0.0.1:99999/p",
        "etcd://h:1/a/../b",
        "etcd://h:1/a//b",
        "etcd://h:1/a b",
        "etcd://user:pw@127.0.0.1:2379/p",
        "etcd://" + ",".join(["h:1"] * 17) + "/p",
    ],
)
def test_a_bad_store_url_is_refused_naming_the_problem(url: str) -> None:
    with pytest.raises(ValueError, match="store: "):
        CoordinatorConfig(store=url).validate()


def test_good_store_urls() -> None:
    assert parse_etcd_url("etcd://10.0.0.1:2379,etcd-2.example:2379,[::1]:2379/prod/gelastic") == (
        ("10.0.0.1:2379", "etcd-2.example:2379", "[::1]:2379"),
        "prod/gelastic",
    )
    CoordinatorConfig(store="sqlite").validate()
    with pytest.raises(ValueError, match="--store etcd"):
        CoordinatorConfig(etcd_user="root").validate()
