"""A node placed on a function job cannot run code in the process that reads the job's result.

Before the fix a function job's worker stored every return value as a pickle tagged with the
job's key, and the submitting client's `Job.wait()` unpickled it once the tag checked out. But
every node the coordinator places on the job is sent that key (its agent writes it into the
workers' args files), and anyone who holds the agent token can register a node: such a node
tagged a pickle of its own, and its `__reduce__` ran in the submitter's process. Now a value that
JSON gives back exactly is stored and read as JSON; any other value stays a `PickledReturnValue`
that nothing unpickles unless the caller asks (`trust_pickles=True`, `trusted_return_values()`,
`gelastic result --trusted-load`).
"""

from __future__ import annotations

import asyncio
import enum
import hashlib
import hmac
import io
import math
import os
import pickle
import secrets
from collections.abc import AsyncIterator
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path
from typing import Any

import pytest

from client import Client, JobSpec, WorkerState
from client import results as rv
from client._report import format_result
from client.cli import main as cli_main
from client.model import MAX_RETURN_VALUE_BYTES
from coordinator.server import Coordinator, CoordinatorConfig
from gelastic.local import LocalCluster
from nodeagent import _return_value
from protos.gelastic.v1 import gelastic_pb2 as pb
from tests.e2e.conftest import assert_no_leftovers
from tests.service._fakes import FakeNode, worker_exit
from tests.workloads.return_values import VALUES

TIMEOUT = 120
REPO = str(Path(__file__).resolve().parents[2])


class _Mkdir:
    """A pickle whose loading creates a directory: the proof that it was unpickled."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (os.mkdir, (self.path,))


class _Color(enum.IntEnum):
    RED = 1


class _Float(float):
    pass


class _Str(str):
    pass


def _token_file(path: Path) -> Path:
    path.write_text(secrets.token_urlsafe(32) + "\n")
    path.chmod(0o600)
    return path


@pytest.fixture
async def coordinator(tmp_path: Path) -> AsyncIterator[Coordinator]:
    # Agents and clients hold different tokens: the attacker below holds only the agent's.
    async with Coordinator(
        CoordinatorConfig(
            state_dir=":memory:",
            port=0,
            lease=30.0,
            heartbeat_interval=1.0,
            agent_token_file=str(_token_file(tmp_path / "agent-token")),
            client_token_file=str(_token_file(tmp_path / "client-token")),
        )
    ) as c:
        yield c


def _agent_metadata(tmp_path: Path) -> tuple[tuple[str, str], ...]:
    token = (tmp_path / "agent-token").read_text().strip()
    return (("authorization", f"Bearer {token}"),)


async def _fake_node_round(
    coordinator: Coordinator, tmp_path: Path, nproc: int
) -> tuple[FakeNode, pb.Assign]:
    """A node registered with nothing but the agent token, placed on the queued job."""
    node = FakeNode(coordinator.address, "fake-node", "127.0.0.1", slots=nproc)
    await node.connect(metadata=_agent_metadata(tmp_path))
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


async def _finish(node: FakeNode, asg: pb.Assign, values: dict[int, bytes]) -> None:
    for lr, w in enumerate(asg.workers):
        value = values[w.global_rank]
        await node.outbox.put(worker_exit(asg, lr, 0, return_value=value, has_return_value=True))
    await node.expect("release")


def _legacy_tagged(key: bytes, job_id: str, rank: int, pickled: bytes) -> bytes:
    """A pickle in the format workers stored before, tagged as they tagged it: what a fake node
    holding the key it got in Assign could always make."""
    msg = b"gelastic.v1 return value\x00" + job_id.encode() + b"\x00" + str(rank).encode() + b"\x00"
    return b"GELASTIC-RV/1\x00" + hmac.new(key, msg + pickled, hashlib.sha256).digest() + pickled


def _cli(coordinator: Coordinator, tmp_path: Path, *argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        code = cli_main(
            [
                "--coordinator",
                coordinator.address,
                "--token-file",
                str(tmp_path / "client-token"),
                *argv,
            ]
        )
    return code, out.getvalue(), err.getvalue()


def _typed_equal(a: Any, b: Any) -> bool:
    """Equal, with the very same types all the way down."""
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_typed_equal(v, b[k]) for k, v in a.items())
    if isinstance(a, list):
        return len(a) == len(b) and all(_typed_equal(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


async def test_a_pickle_a_fake_node_tags_with_the_jobs_key_never_runs_in_the_submitter(
    coordinator: Coordinator, tmp_path: Path
) -> None:
    marker = tmp_path / "loaded"
    evil = pickle.dumps(_Mkdir(str(marker)))
    client = Client(coordinator.address, timeout=10, token_file=str(tmp_path / "client-token"))
    try:
        job = await asyncio.to_thread(client.submit, JobSpec(entrypoint="pkg.mod:fn"))
        node, asg = await _fake_node_round(coordinator, tmp_path, 1)
        key = asg.spec.result_key
        assert key == job._result_key  # what the fake node got is the submitter's very key
        forged = _legacy_tagged(key, job.job_id, 0, evil)
        await _finish(node, asg, {0: forged})
        await node.close()

        result = await asyncio.to_thread(job.wait, 30)
        assert not marker.exists(), "the fake node's pickle ran in the submitting client"
        polled = await asyncio.to_thread(job.poll)
        looked_up = await asyncio.to_thread(client.job(job.job_id).wait, 30)
        assert polled is not None
        for r in (result, polled, looked_up):
            assert r.state == WorkerState.SUCCEEDED
            value = r.return_values[0]
            assert isinstance(value, rv.PickledReturnValue)
            assert value.rank == 0 and value.data == evil
            assert r.raw_return_values == {0: forged}
            # Showing it runs nothing either.
            for shown in (repr(value), str(r), format_result(r)):
                assert "PickledReturnValue of rank 0" in shown
        assert result.return_values_verified and result.return_values[0].verified
        assert not looked_up.return_values_verified and not looked_up.return_values[0].verified
        code, out, _ = await asyncio.to_thread(_cli, coordinator, tmp_path, "result", job.job_id)
        assert code == 0 and f"{len(evil)} bytes" in out and "--trusted-load" in out, out
        code, out, _ = await asyncio.to_thread(
            _cli, coordinator, tmp_path, "result", "--json", job.job_id
        )
        assert code == 0 and f"{len(evil)} bytes" in out, out
        assert not marker.exists()

        # The test can fail: loading these bytes does create the directory, and each explicit
        # way to trust them does so.
        result.trusted_return_values()
        assert marker.exists()
        marker.rmdir()
        await asyncio.to_thread(job.wait, 30, trust_pickles=True)
        assert marker.exists()
        marker.rmdir()
        code, _, err = await asyncio.to_thread(
            _cli, coordinator, tmp_path, "result", "--trusted-load", job.job_id
        )
        assert code == 0 and marker.exists() and "warning" in err
    finally:
        client.close()


async def test_json_values_come_back_decoded_and_pickles_only_when_trusted(
    coordinator: Coordinator, tmp_path: Path
) -> None:
    marker = tmp_path / "loaded"
    client = Client(coordinator.address, timeout=10, token_file=str(tmp_path / "client-token"))
    try:
        job = await asyncio.to_thread(
            client.submit, JobSpec(entrypoint="pkg.mod:fn", nproc_per_node=3)
        )
        node, asg = await _fake_node_round(coordinator, tmp_path, 3)
        key, jid = asg.spec.result_key, job.job_id
        data = {"loss": 0.5, "ranks": [0, 1, 2], "ok": True, "tag": None}
        raws = {
            0: _return_value.return_value_bytes(data, key, jid, 0),
            1: _return_value.return_value_bytes((1, "a"), key, jid, 1),
            # What a fake node would store now: its own pickle, tagged as a pickle.
            2: rv.tagged(key, jid, 2, pickle.dumps(_Mkdir(str(marker))), kind=rv.KIND_PICKLE),
        }
        await _finish(node, asg, raws)
        await node.close()

        result = await asyncio.to_thread(job.wait, 30)
        assert not marker.exists()
        assert _typed_equal(result.return_values[0], data)
        assert result.return_values[1] == rv.PickledReturnValue(
            1, pickle.dumps((1, "a"), protocol=_return_value._pickle_protocol()), verified=True
        )
        assert isinstance(result.return_values[2], rv.PickledReturnValue)
        # Without the key: the same data, nothing verified, nothing loaded.
        looked_up = await asyncio.to_thread(client.job(jid).wait, 30)
        assert _typed_equal(looked_up.return_values[0], data)
        assert not looked_up.return_values_verified
        assert isinstance(looked_up.return_values[1], rv.PickledReturnValue)
        code, out, err = await asyncio.to_thread(_cli, coordinator, tmp_path, "result", jid)
        assert code == 0 and "rank 0: {'loss': 0.5" in out and "--trusted-load" in out, out
        assert "(1, 'a')" not in out and "warning" not in err
        assert not marker.exists()

        # A tuple comes back only through an explicit trusted load.
        trusted = result.trusted_return_values()
        assert marker.exists()
        assert trusted[1] == (1, "a") and type(trusted[1]) is tuple
        assert _typed_equal(trusted[0], data)
        marker.rmdir()
        assert rv.trusted_load(raws[1], key=key, job_id=jid, rank=1) == (1, "a")
        with pytest.raises(rv.ReturnValueError, match="rank 0"):
            rv.trusted_load(raws[1], key=key, job_id=jid, rank=0)
        code, out, err = await asyncio.to_thread(
            _cli, coordinator, tmp_path, "result", "--trusted-load", jid
        )
        assert code == 0 and "rank 1: (1, 'a')" in out and "warning" in err
    finally:
        client.close()


def test_a_real_function_job_returns_json_typed_and_the_rest_only_as_pickles(
    tmp_path: Path,
) -> None:
    spec = JobSpec(
        entrypoint="tests.workloads.return_values:value_of_rank",
        nproc_per_node=len(VALUES),
        cwd=REPO,
        env={"PYTHONPATH": REPO},
    )
    cluster = LocalCluster(
        nodes=1, slots=len(VALUES), workdir=tmp_path / "cluster", lease=3.0, heartbeat_interval=0.5
    )
    with cluster:
        job = cluster.client.submit(spec)
        result = job.wait(TIMEOUT)
        assert result.state == WorkerState.SUCCEEDED, result.format_failures()
        assert result.return_values_verified
        # Rank 0's dict is stored as JSON and comes back equal, with the same types.
        raw0 = result.raw_return_values[0]
        assert raw0.startswith(rv.MAGIC + rv.KIND_JSON)
        assert _typed_equal(result.return_values[0], VALUES[0])
        # A tuple, an int-keyed dict and NaN are no JSON: pickles, left unloaded.
        for rank in range(1, len(VALUES)):
            value = result.return_values[rank]
            assert isinstance(value, rv.PickledReturnValue) and value.verified, value
            assert value.rank == rank
            assert result.raw_return_values[rank].startswith(rv.MAGIC + rv.KIND_PICKLE)
        trusted = result.trusted_return_values()
        assert trusted[1] == (1, "a") and type(trusted[1]) is tuple
        assert trusted[2] == {1: "one", 2: "two"}
        assert isinstance(trusted[3], float) and math.isnan(trusted[3])
        again = job.wait(TIMEOUT, trust_pickles=True).return_values
        assert again[1] == (1, "a") and again[2] == {1: "one", 2: "two"} and math.isnan(again[3])
        assert _typed_equal(again[0], VALUES[0])
        with cluster.connect() as other:
            looked_up = other.job(job.job_id).wait(TIMEOUT)
        assert _typed_equal(looked_up.return_values[0], VALUES[0])
        assert isinstance(looked_up.return_values[1], rv.PickledReturnValue)
        assert not looked_up.return_values[1].verified
    assert_no_leftovers(cluster)


def _nested(depth: int) -> list[Any]:
    value: list[Any] = []
    for _ in range(depth - 1):
        value = [value]
    return value


class _Point:
    def __init__(self, x: int) -> None:
        self.x = x

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Point) and other.x == self.x

    def __hash__(self) -> int:
        return self.x


_cycle: list[Any] = [1]
_cycle.append(_cycle)

JSON_VALUES: list[Any] = [
    None,
    True,
    0,
    -1,
    2**100,
    1.5,
    -0.0,
    1e308,
    "",
    "r\u00e9sum\u00e9 \u2603 \x1b[0m",
    "\ud800",
    [],
    {},
    [1, [2, [3]]],
    {"a": {"b": [None, False, 0.1]}},
    _nested(rv.MAX_JSON_DEPTH),
]
PICKLED_VALUES: list[Any] = [
    (1, 2),
    [1, (2,)],
    {"a": (1,)},
    {1: "a"},
    {True: 1},
    {None: 1},
    float("nan"),
    [float("inf")],
    b"bytes",
    bytearray(b"x"),
    {1, 2},
    _Color.RED,
    _Float(1.5),
    _Str("s"),
    {_Str("k"): 1},
    _nested(rv.MAX_JSON_DEPTH + 1),
    10**5000,
    _Point(3),
]


@pytest.mark.parametrize("value", JSON_VALUES, ids=[str(i) for i in range(len(JSON_VALUES))])
def test_the_worker_stores_as_json_what_json_gives_back_exactly(value: Any) -> None:
    key = secrets.token_bytes(32)
    raw = _return_value.return_value_bytes(value, key, "job-1", 3)
    assert raw.startswith(rv.MAGIC + rv.KIND_JSON)
    assert _typed_equal(rv.decode(raw, key=key, job_id="job-1", rank=3), value)
    assert _typed_equal(rv.decode(raw, rank=3), value)  # without the key: unverified, same data
    assert _typed_equal(rv.trusted_load(raw, key=key, job_id="job-1", rank=3), value)


@pytest.mark.parametrize("value", PICKLED_VALUES, ids=[str(i) for i in range(len(PICKLED_VALUES))])
def test_the_worker_stores_anything_else_only_as_a_pickle(value: Any) -> None:
    key = secrets.token_bytes(32)
    raw = _return_value.return_value_bytes(value, key, "job-1", 3)
    assert raw.startswith(rv.MAGIC + rv.KIND_PICKLE)
    got = rv.decode(raw, key=key, job_id="job-1", rank=3)
    assert isinstance(got, rv.PickledReturnValue) and got.rank == 3 and got.verified
    loaded = got.trusted_load()
    assert type(loaded) is type(value)
    if isinstance(value, float) and math.isnan(value):
        assert math.isnan(loaded)
    else:
        assert loaded == value


def test_a_cyclic_value_goes_as_a_pickle() -> None:
    raw = _return_value.return_value_bytes(_cycle, b"", "job-1", 0)
    loaded = rv.trusted_load(raw, rank=0)
    assert loaded[0] == 1 and loaded[1] is loaded


def test_json_over_the_size_limit_goes_as_a_pickle_that_fits() -> None:
    # Each float takes about 18 bytes as JSON, 9 as a pickle: only the pickle fits the limit.
    value = [i + 0.123456789012345 for i in range(MAX_RETURN_VALUE_BYTES // 14)]
    raw = _return_value.return_value_bytes(value, b"k" * 32, "job-1", 0)
    assert raw.startswith(rv.MAGIC + rv.KIND_PICKLE) and len(raw) <= MAX_RETURN_VALUE_BYTES
    assert rv.trusted_load(raw, key=b"k" * 32, job_id="job-1", rank=0) == value


HOSTILE_JSON = [
    b"[" * (MAX_RETURN_VALUE_BYTES - 64),
    b"[" * (rv.MAX_JSON_DEPTH + 1) + b"]" * (rv.MAX_JSON_DEPTH + 1),
    b'{"a":' * 5000 + b"1" + b"}" * 5000,
    b'["\\"[[[[' + b"[" * 100 + b'", ' + b"[" * 100,
    b"\xff\xfe[1]",
    b'"\xed\xa0\x80"',
    b"NaN",
    b"[-Infinity]",
    b'{"a": 1',
    b"",
    b"1" * 5000,
    b"[1] [2]",
    b'"\x1b]52;c;aGk=\x07"',
]


@pytest.mark.parametrize("payload", HOSTILE_JSON, ids=[str(i) for i in range(len(HOSTILE_JSON))])
def test_hostile_json_is_reported_for_its_rank_never_raised(payload: bytes) -> None:
    key = secrets.token_bytes(32)
    raw = rv.tagged(key, "job-1", 5, payload, kind=rv.KIND_JSON)
    for got in (rv.decode(raw, key=key, job_id="job-1", rank=5), rv.decode(raw, rank=5)):
        assert isinstance(got, rv.UnreadableReturnValue), got
        assert got.rank == 5 and got.reason
        # The reason is ours: none of the value's own bytes reach a terminal or a log.
        assert "\x1b" not in got.reason and "aGk=" not in got.reason and len(got.reason) < 300
    with pytest.raises(rv.ReturnValueError, match="rank 5"):
        rv.trusted_load(raw, key=key, job_id="job-1", rank=5)


def test_the_deepest_json_allowed_is_checked_without_recursion() -> None:
    # Twice the interpreter's recursion limit is refused by counting, not by the parser.
    deep = b"[" * 2000 + b"]" * 2000
    huge = b"[" * (MAX_RETURN_VALUE_BYTES - 64)
    got = rv.decode(rv.tagged(b"", "j", 0, huge, kind=rv.KIND_JSON), rank=0)
    assert isinstance(got, rv.UnreadableReturnValue) and "nested" in got.reason
    got = rv.decode(rv.tagged(b"", "j", 0, deep, kind=rv.KIND_JSON), rank=0)
    assert isinstance(got, rv.UnreadableReturnValue) and "2000 deep" in got.reason
    ok = b"[" * rv.MAX_JSON_DEPTH + b"]" * rv.MAX_JSON_DEPTH
    assert rv.decode(rv.tagged(b"", "j", 0, ok, kind=rv.KIND_JSON), rank=0) == _nested(
        rv.MAX_JSON_DEPTH
    )
    # Brackets inside strings do not count.
    text = b'["' + b"[" * 500 + b'\\"' + b"{" * 500 + b'"]'
    assert rv.decode(rv.tagged(b"", "j", 0, text, kind=rv.KIND_JSON), rank=0) == [
        "[" * 500 + '"' + "{" * 500
    ]


def test_bytes_in_no_known_format_are_unreadable_without_the_key_and_refused_with_it() -> None:
    key = secrets.token_bytes(32)
    good = rv.tagged(key, "job-1", 0, b"[1]", kind=rv.KIND_JSON)
    assert rv.decode(good, key=key, job_id="job-1", rank=0) == [1]
    flipped = rv.MAGIC + rv.KIND_PICKLE + good[len(rv.MAGIC) + 1 :]
    unknown_kind = rv.MAGIC + b"x" + good[len(rv.MAGIC) + 1 :]
    for raw in (
        b"",
        b"not a return value",
        rv.MAGIC,
        rv.MAGIC + rv.KIND_JSON + b"short",
        pickle.dumps([1]),
        b"x" * (MAX_RETURN_VALUE_BYTES + 1),
    ):
        assert isinstance(rv.decode(raw, rank=0), rv.UnreadableReturnValue), raw[:20]
        if len(raw) <= MAX_RETURN_VALUE_BYTES:
            with pytest.raises(rv.ReturnValueError, match="rank 0"):
                rv.decode(raw, key=key, job_id="job-1", rank=0)
    assert isinstance(rv.decode(unknown_kind, rank=0), rv.UnreadableReturnValue)
    # The tag covers the kind: JSON bytes relabelled as a pickle (or anything) are refused.
    for raw in (flipped, unknown_kind):
        with pytest.raises(rv.ReturnValueError, match="rank 0 of job job-1"):
            rv.decode(raw, key=key, job_id="job-1", rank=0)
    # A value in the earlier format, tagged with the key, reads as an unloaded pickle.
    legacy = _legacy_tagged(key, "job-1", 0, pickle.dumps((1, 2)))
    got = rv.decode(legacy, key=key, job_id="job-1", rank=0)
    assert isinstance(got, rv.PickledReturnValue) and got.trusted_load() == (1, 2)
    with pytest.raises(rv.ReturnValueError, match="rank 1"):
        rv.decode(legacy, key=key, job_id="job-1", rank=1)


def test_the_worker_and_the_client_agree_on_the_format_and_its_bounds() -> None:
    assert _return_value._RESULT_MAGIC == rv.MAGIC
    assert (_return_value._KIND_JSON, _return_value._KIND_PICKLE) == (rv.KIND_JSON, rv.KIND_PICKLE)
    assert _return_value._MAX_JSON_DEPTH == rv.MAX_JSON_DEPTH
    header = len(rv.MAGIC) + 1 + rv.TAG_BYTES
    assert MAX_RETURN_VALUE_BYTES - header == _return_value._MAX_JSON_BYTES
