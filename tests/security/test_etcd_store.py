"""The etcd store keeps to its prefix, keeps its password to itself, and reads hostile records
as records to quarantine, never as a reason to stop or to trust them."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from coordinator._store_etcd import EtcdSettings, EtcdStore, parse_etcd_url
from coordinator.server import CoordinatorConfig
from protos.etcd import rpc_pb2 as epb
from protos.etcd import rpc_pb2_grpc as epb_grpc
from tests._etcd import EtcdServer

PASSWORD = "s3cret-etcd-password-42"


def _all_keys(server: EtcdServer) -> list[bytes]:
    with server.channel() as ch:
        resp = epb_grpc.KVStub(ch).Range(
            epb.RangeRequest(key=b"\0", range_end=b"\0", keys_only=True), timeout=5
        )
    return [kv.key for kv in resp.kvs]


def test_names_cannot_reach_outside_their_own_key(etcd_server: EtcdServer, etcd_url: str) -> None:
    endpoints, prefix = parse_etcd_url(etcd_url)
    store = EtcdStore(EtcdSettings(endpoints, prefix))
    hostile = ["../../other/jobs/x", "a/b", "%2F..%2F", "job\nwith newline", "x" * 300]
    try:
        store.save(
            [(j, float(i), "QUEUED", {"i": i}) for i, j in enumerate(hostile)],
            [(i + 1, j, {"i": i}) for i, j in enumerate(hostile)],
            [(n, {"name": n}) for n in hostile],
        )
        state = store.load()
        # Each name is one key part: forgetting one job deletes that job's events and no other's.
        store.save([], [], forget_jobs=["a"], forget_nodes=["a"])
        assert store.load().job_keys == hostile
    finally:
        store.close()
    assert state.job_keys == hostile and state.node_keys == sorted(hostile)
    assert state.event_keys == list(range(1, len(hostile) + 1))
    mine = [k for k in _all_keys(etcd_server) if k.startswith(prefix.encode() + b"/")]
    assert len(mine) == 3 * len(hostile) + 1  # jobs, events, nodes, and the schema version
    for key in mine:
        section, _, rest = key[len(prefix) + 1 :].partition(b"/")
        assert section in (b"jobs", b"events", b"nodes", b"meta"), key
        # One percent-encoded part (events: the job's part, then the number).
        assert rest.count(b"/") == (1 if section == b"events" else 0), key


def test_the_etcd_password_is_never_in_argv_repr_errors_or_logs(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with pytest.raises(ValueError, match="no user or password in the URL"):
        parse_etcd_url(f"etcd://root:{PASSWORD}@127.0.0.1:2379/gelastic")
    etcd = EtcdServer(tmp_path / "etcd")
    etcd.start()
    try:
        etcd.enable_auth("the-right-password")
        pw = tmp_path / "pw"
        pw.write_text(PASSWORD + "\n")
        config = CoordinatorConfig(
            store=etcd.url("gelastic"), etcd_user="root", etcd_password_file=str(pw)
        )
        settings = config.etcd_settings()
        assert settings is not None
        caplog.set_level(logging.DEBUG)
        with pytest.raises(ConnectionError) as err:
            EtcdStore(settings, connect_wait=1.0)
        assert "could not authenticate" in str(err.value)
        seen = [repr(config), repr(settings), str(err.value), repr(err.value), caplog.text]
        assert not [s for s in seen if PASSWORD in s]
    finally:
        etcd.stop()


def test_a_record_whose_pieces_do_not_add_up_is_quarantined(
    etcd_server: EtcdServer, etcd_url: str
) -> None:
    endpoints, prefix = parse_etcd_url(etcd_url)
    root = prefix + "/"
    pointer = {"__parts__": {"id": "1", "n": 1, "bytes": 5, "sha256": "0" * 64}}
    with etcd_server.channel() as ch:
        kv = epb_grpc.KVStub(ch)
        kv.Put(
            epb.PutRequest(key=(root + "jobs/forged").encode(), value=json.dumps(pointer).encode())
        )
        kv.Put(epb.PutRequest(key=(root + "parts/jobs%2Fforged/1/000000").encode(), value=b"evil!"))
        kv.Put(epb.PutRequest(key=(root + "nodes/huge").encode(), value=b"[" * 100_000))
    store = EtcdStore(EtcdSettings(endpoints, prefix))
    try:
        state = store.load()
        assert state.jobs == [] and state.nodes == []
        again = store.load()
        assert again.jobs == [] and again.nodes == []
    finally:
        store.close()
    keys = _all_keys(etcd_server)
    assert sum(k.startswith((root + "quarantine/").encode()) for k in keys) == 2
    assert not [k for k in keys if k.startswith((root + "parts/").encode())]


def test_a_record_nested_deeper_than_the_parser_goes_is_quarantined_in_sqlite_too(
    tmp_path: Path,
) -> None:
    import sqlite3

    from coordinator._store import Store

    Store(str(tmp_path / "state")).close()
    db = sqlite3.connect(tmp_path / "state" / "coordinator.sqlite3")
    with db:
        db.execute("INSERT INTO nodes VALUES ('deep', ?)", ("[" * 100_000,))
    db.close()
    store = Store(str(tmp_path / "state"))
    try:
        assert store.load().nodes == []
    finally:
        store.close()
    db = sqlite3.connect(tmp_path / "state" / "coordinator.sqlite3")
    try:
        assert [r[0] for r in db.execute("SELECT key FROM quarantine")] == ["deep"]
    finally:
        db.close()
