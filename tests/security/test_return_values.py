"""Return values are never unpickled unless the caller asks, and checked when it holds the key.

Before the fix the client called `pickle.loads` on whatever bytes the coordinator held for a
rank: bytes any process of the same user on the node (which can rewrite `return.pkl`), any
agent-token holder, or anyone on a plaintext channel could choose, and the coordinator kept such
bytes even for command jobs. `gelastic result <job>` ran them on the caller's machine. Now the
worker tags its value with the job's key (made by the submitting client, handed to the worker
only in its 0600 args file), the submitting `Job` checks the tag before decoding, and no lookup
unpickles anything unless told to (tests/security/test_return_value_pickles.py: not even a value
whose tag checks out).
"""

from __future__ import annotations

import asyncio
import io
import json
import logging
import os
import pickle
import secrets
from collections.abc import AsyncIterator
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import pytest

from client import Client, JobSpec, JobState, WorkerState
from client.cli import main as cli_main
from client.results import (
    KIND_JSON,
    KIND_PICKLE,
    MAGIC,
    PickledReturnValue,
    ReturnValueError,
    result_tag,
    tagged,
    trusted_load,
)
from coordinator.server import Coordinator, CoordinatorConfig
from nodeagent import _return_value
from nodeagent._launch import build_launch_plan
from protos.gelastic.v1 import gelastic_pb2 as pb
from protos.gelastic.v1 import gelastic_pb2_grpc as pb_grpc
from tests.service._fakes import FakeNode, worker_exit


class _Touch:
    """A pickle whose loading creates a path: the proof that something was unpickled."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (os.mkdir, (self.path,))


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


def _json(value: object) -> bytes:
    return json.dumps(value).encode()


async def _finish(node: FakeNode, asg: pb.Assign, values: dict[int, bytes]) -> None:
    for lr, w in enumerate(asg.workers):
        value = values.get(w.global_rank)
        kw = {"return_value": value, "has_return_value": True} if value is not None else {}
        await node.outbox.put(worker_exit(asg, lr, 0, **kw))
    await node.expect("release")


async def test_a_forged_return_value_is_refused_and_not_loaded(
    coordinator: Coordinator, tmp_path: Path
) -> None:
    # What the agent relays after another process of the user rewrote a worker's return.pkl:
    # an untagged pickle (rank 0), one tagged with a key that is not the job's (rank 1).
    marker = tmp_path / "loaded"
    evil = pickle.dumps(_Touch(str(marker)))
    client = Client(coordinator.address, timeout=10)
    try:
        job = await asyncio.to_thread(client.submit, JobSpec(entrypoint="pkg.mod:fn"))
        node, asg = await _one_node_round(coordinator, 1)
        await _finish(node, asg, {0: evil})
        with pytest.raises(ReturnValueError, match="rank 0"):
            await asyncio.to_thread(job.wait, 30)
        with pytest.raises(ReturnValueError, match="rank 0"):
            await asyncio.to_thread(job.poll)
        assert not marker.exists()
        await node.close()

        job = await asyncio.to_thread(client.submit, JobSpec(entrypoint="pkg.mod:fn"))
        node, asg = await _one_node_round(coordinator, 1)
        forged = tagged(secrets.token_bytes(32), job.job_id, 0, evil, kind=KIND_PICKLE)
        await _finish(node, asg, {0: forged})
        with pytest.raises(ReturnValueError, match="rank 0 of job"):
            await asyncio.to_thread(job.wait, 30)
        assert not marker.exists()
        await node.close()
    finally:
        client.close()


async def test_a_value_tagged_for_another_rank_or_job_is_refused(
    coordinator: Coordinator, tmp_path: Path
) -> None:
    client = Client(coordinator.address, timeout=10)
    try:
        spec = JobSpec(entrypoint="pkg.mod:fn", nproc_per_node=2)
        job = await asyncio.to_thread(client.submit, spec)
        node, asg = await _one_node_round(coordinator, 2)
        key = asg.spec.result_key
        assert len(key) == 32
        good = tagged(key, job.job_id, 0, _json("rank0"), kind=KIND_JSON)
        # Rank 0's genuine value copied onto rank 1: the tag binds the rank.
        await _finish(node, asg, {0: good, 1: good})
        with pytest.raises(ReturnValueError, match="rank 1"):
            await asyncio.to_thread(job.wait, 30)
        await node.close()

        other = tagged(key, "another-job", 0, _json("x"), kind=KIND_JSON)
        job2 = await asyncio.to_thread(
            client.submit, JobSpec(entrypoint="pkg.mod:fn", result_key=key)
        )
        node, asg = await _one_node_round(coordinator, 1)
        await _finish(node, asg, {0: other})
        with pytest.raises(ReturnValueError, match="rank 0"):
            await asyncio.to_thread(job2.wait, 30)
        await node.close()
    finally:
        client.close()


async def test_the_submitting_job_decodes_values_its_workers_tagged(
    coordinator: Coordinator,
) -> None:
    client = Client(coordinator.address, timeout=10)
    try:
        job = await asyncio.to_thread(
            client.submit, JobSpec(entrypoint="pkg.mod:fn", nproc_per_node=2)
        )
        node, asg = await _one_node_round(coordinator, 2)
        key = asg.spec.result_key
        await _finish(
            node,
            asg,
            {r: tagged(key, job.job_id, r, _json({"rank": r}), kind=KIND_JSON) for r in (0, 1)},
        )
        result = await asyncio.to_thread(job.wait, 30)
        assert result.state == WorkerState.SUCCEEDED
        assert result.return_values == {0: {"rank": 0}, 1: {"rank": 1}}
        assert result.return_values_verified
        await node.close()
        # Another process given the key may attach it; a wrong key loads nothing.
        with Client(coordinator.address, timeout=10) as other:
            attached = await asyncio.to_thread(other.job(job.job_id, result_key=key).poll)
            assert attached is not None and attached.return_values == result.return_values
            assert attached.return_values_verified
            wrong = other.job(job.job_id, result_key=secrets.token_bytes(32))
            with pytest.raises(ReturnValueError, match="rank 0"):
                await asyncio.to_thread(wrong.poll)
    finally:
        client.close()


async def test_a_return_value_reported_for_a_command_job_is_not_kept(
    coordinator: Coordinator, tmp_path: Path
) -> None:
    marker = tmp_path / "loaded"
    client = Client(coordinator.address, timeout=10)
    try:
        job = await asyncio.to_thread(client.submit, JobSpec(entrypoint=["python", "train.py"]))
        node, asg = await _one_node_round(coordinator, 1)
        await _finish(
            node,
            asg,
            {
                0: tagged(
                    b"k" * 32, job.job_id, 0, pickle.dumps(_Touch(str(marker))), kind=KIND_PICKLE
                )
            },
        )
        result = await asyncio.to_thread(job.wait, 30)
        assert result.state == WorkerState.SUCCEEDED
        assert result.return_values == {} and result.raw_return_values == {}
        assert result.return_value_sizes == {}
        assert coordinator.service.cluster.job_result(job.job_id).return_values == {}  # type: ignore[union-attr]
        stub = pb_grpc.CoordinatorStub(client._channel)
        chunks = await asyncio.to_thread(
            lambda: list(stub.GetResult(pb.GetResultRequest(job_id=job.job_id), timeout=10))
        )
        assert chunks == []
        assert not marker.exists()
        await node.close()
    finally:
        client.close()


async def test_looking_a_job_up_by_id_never_unpickles(
    coordinator: Coordinator, tmp_path: Path
) -> None:
    marker = tmp_path / "loaded"
    value = pickle.dumps(_Touch(str(marker)))
    submitter = Client(coordinator.address, timeout=10)
    other = Client(coordinator.address, timeout=10)
    try:
        job = await asyncio.to_thread(submitter.submit, JobSpec(entrypoint="pkg.mod:fn"))
        node, asg = await _one_node_round(coordinator, 1)
        raw = tagged(asg.spec.result_key, job.job_id, 0, value, kind=KIND_PICKLE)
        await _finish(node, asg, {0: raw})
        await node.close()

        # Another process knows only the id: Client lookups, wait, poll, the CLI.
        looked_up = other.job(job.job_id)
        for result in (
            await asyncio.to_thread(looked_up.wait, 30),
            await asyncio.to_thread(looked_up.poll),
        ):
            assert result is not None and result.state == WorkerState.SUCCEEDED
            assert result.return_values == {0: PickledReturnValue(0, value, verified=False)}
            assert not result.return_values_verified
            assert result.raw_return_values == {0: raw}
            assert result.return_value_sizes == {0: len(raw)}
        for argv in (
            ["result", job.job_id],
            ["result", "--json", job.job_id],
            ["cancel", "--wait", job.job_id],
        ):
            out = io.StringIO()
            with redirect_stdout(out):
                code = await asyncio.to_thread(
                    cli_main, ["--coordinator", coordinator.address, *argv]
                )
            assert code == 0, out.getvalue()
            if argv == ["result", job.job_id]:
                assert f"rank 0: <PickledReturnValue of rank 0: {len(value)} bytes" in (
                    out.getvalue()
                )
                assert "--trusted-load" in out.getvalue()
        assert not marker.exists()

        # The test can fail: these very bytes do create the file once someone loads them.
        trusted_load(raw, rank=0)
        assert marker.exists()
        marker.rmdir()
        # ... and `gelastic result --trusted-load` is the explicit way to do so.
        err = io.StringIO()
        with redirect_stdout(io.StringIO()), redirect_stderr(err):
            code = await asyncio.to_thread(
                cli_main,
                ["--coordinator", coordinator.address, "result", "--trusted-load", job.job_id],
            )
        assert code == 0 and marker.exists()
        assert "warning" in err.getvalue()
    finally:
        submitter.close()
        other.close()


async def test_the_result_key_never_appears_in_job_output(
    coordinator: Coordinator, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    key = secrets.token_bytes(32)
    spec = JobSpec(entrypoint="pkg.mod:fn", result_key=key, name="secretive")
    assert key.hex() not in repr(spec) and repr(key) not in repr(spec)
    client = Client(coordinator.address, timeout=10)
    try:
        job = await asyncio.to_thread(client.submit, spec)
        assert key.hex() not in repr(job)
        node, asg = await _one_node_round(coordinator, 1)
        assert asg.spec.result_key == key  # the agent needs it for the worker's args file
        await _finish(node, asg, {0: tagged(key, job.job_id, 0, b"1", kind=KIND_JSON)})
        result = await asyncio.to_thread(job.wait, 30)
        assert result.return_values == {0: 1}
        await node.close()

        stub = pb_grpc.CoordinatorStub(client._channel)

        def read_everything() -> list[bytes]:
            req = pb.GetJobRequest(job_id=job.job_id)
            out = [
                stub.GetJob(req, timeout=10).SerializeToString(),
                stub.ListJobs(
                    pb.ListJobsRequest(include_finished=True), timeout=10
                ).SerializeToString(),
                stub.GetEvents(
                    pb.GetEventsRequest(job_id=job.job_id), timeout=10
                ).SerializeToString(),
                stub.CancelJob(
                    pb.CancelJobRequest(job_id=job.job_id), timeout=10
                ).SerializeToString(),
            ]
            watch = stub.WatchJob(pb.WatchJobRequest(job_id=job.job_id), timeout=10)
            out.extend(u.SerializeToString() for u in watch)
            return out

        blobs = await asyncio.to_thread(read_everything)
        for blob in blobs:
            assert key not in blob and key.hex().encode() not in blob
        status = await asyncio.to_thread(job.status)
        assert status.state == JobState.SUCCEEDED
        assert key.hex() not in caplog.text and repr(key) not in caplog.text

        # The agent's launch plan holds it only in the args file's content, never in its repr,
        # argv or env.
        from client.assignment import RoundAssignment, WorkerRanks
        from client.wire import spec_from_pb

        a = RoundAssignment(
            job_id=job.job_id,
            round=1,
            attempt=0,
            spec=spec_from_pb(asg.spec),
            group_rank=0,
            group_world_size=1,
            master_addr="127.0.0.1",
            master_port=40000,
            workers=(WorkerRanks(0, 0, 0, 1, 1),),
            run_id=job.job_id,
        )
        (launch,) = build_launch_plan(a, log_root=Path("/logs"), node_name="n", agent_env={})
        assert launch.args_bytes is not None and key.hex().encode() in launch.args_bytes
        shown = repr(launch) + repr(launch.argv) + repr(launch.env)
        assert key.hex() not in shown
    finally:
        client.close()


def test_the_worker_tags_its_value_the_way_the_client_checks_it() -> None:
    key = secrets.token_bytes(32)
    for kind, data in ((KIND_PICKLE, pickle.dumps((1, 2, 3))), (KIND_JSON, b"[1,2,3]")):
        raw = _return_value._tagged(kind, data, key, "job-0123456789", 3)
        assert raw == tagged(key, "job-0123456789", 3, data, kind=kind)
        assert raw == MAGIC + kind + result_tag(key, "job-0123456789", 3, data, kind=kind) + data
    json_raw = _return_value.return_value_bytes([1, 2, 3], key, "job-0123456789", 3)
    assert json_raw == tagged(key, "job-0123456789", 3, b"[1,2,3]", kind=KIND_JSON)
    pickle_raw = _return_value.return_value_bytes((1, 2, 3), key, "job-0123456789", 3)
    assert pickle_raw.startswith(MAGIC + KIND_PICKLE)
    assert trusted_load(pickle_raw, key=key, job_id="job-0123456789", rank=3) == (1, 2, 3)
