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
