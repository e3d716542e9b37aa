"""A job the coordinator holds can always be read and cancelled by its own id.

Before the fix GetJob, WatchJob, GetEvents and CancelJob judged the id before looking the job
up, so a job whose id today's rules refuse (made by an earlier version from a name ending in a
newline, and kept on disk) answered INVALID_ARGUMENT to everything: it could not be cancelled.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc
import pytest

import coordinator._service as service_module
from client import Client, GelasticError, JobSpec, JobState
from client.model import is_job_id
from coordinator.server import Coordinator, CoordinatorConfig
from protos.gelastic.v1 import gelastic_pb2 as pb
from protos.gelastic.v1 import gelastic_pb2_grpc as pb_grpc

LEGACY_ID = "x\n-0123456789"


@pytest.fixture
async def coordinator() -> AsyncIterator[Coordinator]:
    async with Coordinator(CoordinatorConfig(state_dir=":memory:", port=0)) as c:
        yield c


async def test_a_job_with_an_id_todays_rules_refuse_is_still_cancellable(
    coordinator: Coordinator, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert not is_job_id(LEGACY_ID)
    # As an earlier coordinator made it (and a restart brought it back from disk).
    monkeypatch.setattr(service_module, "_new_job_id", lambda name: LEGACY_ID)
    client = Client(coordinator.address, timeout=10)
    try:
        job = await asyncio.to_thread(client.submit, JobSpec(entrypoint=["true"]))
        assert job.job_id == LEGACY_ID
        assert (await asyncio.to_thread(job.status)).state == JobState.QUEUED
        assert await asyncio.to_thread(job.events) != []
        status = await asyncio.to_thread(client.cancel, LEGACY_ID)
        assert status.state == JobState.CANCELED
        # What names no job is still judged: a bad id is INVALID_ARGUMENT, a good one NOT_FOUND.
        for bad, code in (
            ("y\n-0123456789", grpc.StatusCode.INVALID_ARGUMENT),
            ("y-0123456789", grpc.StatusCode.NOT_FOUND),
        ):
            with pytest.raises(GelasticError) as err:
                await asyncio.to_thread(client.cancel, bad)
            assert err.value.code == code
    finally:
        client.close()


async def test_a_name_with_a_trailing_newline_is_refused_at_submit(
    coordinator: Coordinator,
) -> None:
    # The raw stub: the server must refuse on its own, whatever the client checks.
    async with grpc.aio.insecure_channel(coordinator.address) as ch:
        stub = pb_grpc.CoordinatorStub(ch)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.Submit(
                pb.SubmitRequest(spec=pb.JobSpec(entrypoint=["true"], name="x\n")), timeout=10
            )
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "name" in (err.value.details() or "")
    assert coordinator.service.cluster.job_ids() == []
