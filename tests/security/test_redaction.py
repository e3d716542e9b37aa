"""Secrets in a job's env and argv reach its workers, and nothing else.

Before the fix the `submitted` event (and so the coordinator's INFO log, GetEvents, WatchJob)
carried the whole command line, and GetJob returned the spec with every env value. Now logs and
events name the program and counts, and GetJob shows env names and argv with the values of
secret-looking options withheld; the agent's assignment still carries the real spec.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from pathlib import Path

import grpc.aio
import pytest

from client import Client, JobSpec, JobState
from client.redaction import REDACTED, describe_command, redact_argv
from coordinator.server import Coordinator, CoordinatorConfig
from protos.gelastic.v1 import gelastic_pb2 as pb
from protos.gelastic.v1 import gelastic_pb2_grpc as pb_grpc
from tests.service._fakes import FakeNode, worker_exit
from tests.service.test_workers import Harness, wait_gone

SECRETS = ("s3cr3t-value", "hunter2-pw", "tok-abc123", "dbpass-789")
SPEC = JobSpec(
    entrypoint=["python", "train.py"],
    args=["--password=hunter2-pw", "--token", "tok-abc123", "DB_PASS=dbpass-789", "--epochs=3"],
    env={"API_KEY": "s3cr3t-value"},
)


def test_redact_argv_hides_the_values_of_secret_looking_options() -> None:
    argv = [
        "prog",
        "--token=x1",
        "--api-key",
        "x2",
        "-p",
        "--SECRET_thing=x3",
        "AWS_SECRET_ACCESS_KEY=x4",
        "--lr=0.1",
        "plain",
        "--password",
    ]
    assert redact_argv(argv) == [
        "prog",
        f"--token={REDACTED}",
        "--api-key",
        REDACTED,
        "-p",
        f"--SECRET_thing={REDACTED}",
        f"AWS_SECRET_ACCESS_KEY={REDACTED}",
        "--lr=0.1",
        "plain",
        "--password",
    ]
    assert describe_command(["sh -c 'x --token t'"], 2) == (
        "'sh' with 1 argument(s) and 2 env variable(s)"
    )


@pytest.fixture
async def coordinator() -> AsyncIterator[Coordinator]:
    cfg = CoordinatorConfig(state_dir=":memory:", port=0, lease=600.0, heartbeat_interval=1.0)
    async with Coordinator(cfg) as c:
        yield c


def _assert_clean(what: str, data: bytes | str) -> None:
    text = data.decode("utf-8", "replace") if isinstance(data, bytes) else data
    for s in SECRETS:
        assert s not in text, f"{s!r} is in {what}: {text[:400]!r}"


async def test_secrets_reach_the_worker_and_no_log_event_or_response(
    coordinator: Coordinator, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    node = FakeNode(coordinator.address, "n1", "127.0.0.1", slots=1)
    await node.connect()
    client = Client(coordinator.address, timeout=10)
    try:
        job = await asyncio.to_thread(client.submit, SPEC)
        rp = (await node.expect("reserve_port")).reserve_port
        await node.send(port_reserved=pb.PortReserved(job_id=rp.job_id, round=rp.round, port=4000))
        asg = (await node.expect("assign")).assign
        # The worker gets the real spec.
        assert asg.spec.env["API_KEY"] == "s3cr3t-value"
        assert list(asg.spec.args) == list(SPEC.args)
        await node.send(
            workers_started=pb.WorkersStarted(
                job_id=asg.job_id,
                round=asg.round,
                workers=[pb.WorkerPid(local_rank=0, pid=1000, global_rank=0)],
            )
        )
        await node.outbox.put(worker_exit(asg, 0, 0))
        result = await asyncio.to_thread(job.wait, 30)
        assert result.state.value == "SUCCEEDED"
        assert (await asyncio.to_thread(job.status)).state == JobState.SUCCEEDED

        shown = await asyncio.to_thread(client.get_job, job.job_id)
        _assert_clean("GetJob", shown.SerializeToString())
        assert dict(shown.spec.env) == {"API_KEY": REDACTED}
        assert list(shown.spec.args) == [
            f"--password={REDACTED}",
            "--token",
            REDACTED,
            f"DB_PASS={REDACTED}",
            "--epochs=3",
        ]
        assert list(shown.spec.entrypoint) == ["python", "train.py"]
        async with grpc.aio.insecure_channel(coordinator.address) as ch:
            stub = pb_grpc.CoordinatorStub(ch)
            listed = await stub.ListJobs(pb.ListJobsRequest(include_finished=True), timeout=10)
            _assert_clean("ListJobs", listed.SerializeToString())
            events = await stub.GetEvents(pb.GetEventsRequest(job_id=job.job_id), timeout=10)
            _assert_clean("GetEvents", events.SerializeToString())
            async for update in stub.WatchJob(pb.WatchJobRequest(job_id=job.job_id), timeout=10):
                _assert_clean("WatchJob", update.SerializeToString())
        submitted = next(e for e in events.events if e.kind == "submitted")
        assert "'python' with 6 argument(s) and 1 env variable(s)" in submitted.reason
    finally:
        client.close()
        await node.close()
    assert caplog.records
    for record in caplog.records:
        _assert_clean(f"log record {record.name}", record.getMessage())


async def test_the_agent_logs_a_workers_command_without_its_secrets(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    h = Harness(tmp_path)
    # The worker checks that it got the real values (read from files, so that its own command
    # line holds none of them); the agent's log must not show them.
    (tmp_path / "expected").write_text("s3cr3t-value")
    (tmp_path / "expected.tok").write_text("tok-abc123")
    check = 'test "$API_KEY" = "$(cat "$0")" && test "$1" = "--token=$(cat "$0.tok")"'
    spec = JobSpec(
        entrypoint=["sh", "-c", check],
        args=[str(tmp_path / "expected"), "--token=tok-abc123"],
        env={"API_KEY": "s3cr3t-value"},
    )
    g, exits = h.group(spec)
    try:
        await h.start(g)
        (done,) = await exits.wait(1)
        assert done.exitcode == 0, done
    finally:
        await asyncio.wait_for(g.close(), 30)
        await wait_gone(h.pids)
    started = [r.getMessage() for r in caplog.records if "started pid" in r.getMessage()]
    assert started and f"--token={REDACTED}" in started[0]
    for record in caplog.records:
        _assert_clean(f"log record {record.name}", record.getMessage())
