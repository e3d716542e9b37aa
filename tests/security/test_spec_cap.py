"""A spec is at most MAX_SPEC_BYTES in its wire form, at Submit and in the client.

Before the cap, env (1024 x 64 KiB) or argv (4096 x 64 KiB) passed every per-field check, and a
spec near the 16 MiB message limit was queued; the assignment carrying it could then never be
sent. Now the coordinator refuses it with INVALID_ARGUMENT naming the field that takes most of
the bytes, and the client refuses it before sending.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc
import grpc.aio
import pytest

from client import Client, JobSpec
from client.model import MAX_SPEC_BYTES, MAX_STRING, SpecError
from client.wire import check_spec_size, spec_to_pb
from coordinator.server import Coordinator, CoordinatorConfig
from protos.gelastic.v1 import gelastic_pb2 as pb
from protos.gelastic.v1 import gelastic_pb2_grpc as pb_grpc

VALUE = "v" * (MAX_STRING - 100)
"""Under the per-value limit; a few dozen of them are over the spec limit."""
OVER = MAX_SPEC_BYTES // len(VALUE) + 2


def _big_env() -> JobSpec:
    return JobSpec(entrypoint=["true"], env={f"V{i}": VALUE for i in range(OVER)})


def _big_args() -> JobSpec:
    return JobSpec(entrypoint=["true"], args=[VALUE] * OVER)


def _big_function_args() -> JobSpec:
    return JobSpec(entrypoint="os:getcwd", function_args=b"x" * (MAX_SPEC_BYTES - 8))


@pytest.fixture
async def coordinator() -> AsyncIterator[Coordinator]:
    async with Coordinator(CoordinatorConfig(state_dir=":memory:", port=0)) as c:
        yield c


@pytest.mark.parametrize(
    ("make", "field"),
    [(_big_env, "env"), (_big_args, "args"), (_big_function_args, "function_args")],
)
def test_the_size_check_names_the_biggest_field(make: object, field: str) -> None:
    spec = make()  # type: ignore[operator]
    spec.validate()  # every field is within its own limit
    with pytest.raises(SpecError) as err:
        check_spec_size(spec)
    assert err.value.field == field
    assert f"{MAX_SPEC_BYTES:,}" in str(err.value)


def test_a_spec_just_under_the_cap_passes() -> None:
    base = JobSpec(entrypoint=["true"])
    room = MAX_SPEC_BYTES - spec_to_pb(base).ByteSize()
    # One env entry costs its key, its value, and a few bytes of tags and lengths.
    values, left = [], room
    while left > 16:
        n = min(MAX_STRING, left - 16)
        values.append("v" * n)
        left -= pb.JobSpec(env={f"V{len(values) - 1}": values[-1]}).ByteSize()
    spec = JobSpec(entrypoint=["true"], env={f"V{i}": v for i, v in enumerate(values)})
    spec.validate()
    assert MAX_SPEC_BYTES - 64 < check_spec_size(spec) <= MAX_SPEC_BYTES


@pytest.mark.parametrize(
    ("make", "field"),
    [(_big_env, "env"), (_big_args, "args"), (_big_function_args, "function_args")],
)
async def test_submit_refuses_an_oversized_spec_naming_the_field(
    coordinator: Coordinator, make: object, field: str
) -> None:
    spec = make()  # type: ignore[operator]
    # Straight to the coordinator, as a client without the check would send it.
    async with grpc.aio.insecure_channel(
        coordinator.address, options=[("grpc.max_send_message_length", 16 << 20)]
    ) as ch:
        stub = pb_grpc.CoordinatorStub(ch)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.Submit(pb.SubmitRequest(spec=spec_to_pb(spec)), timeout=30)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert (err.value.details() or "").startswith(f"invalid spec: {field}: ")
        listed = await stub.ListJobs(pb.ListJobsRequest(include_finished=True), timeout=30)
        assert list(listed.jobs) == []


async def test_the_client_refuses_an_oversized_spec_before_sending(
    coordinator: Coordinator,
) -> None:
    client = Client(coordinator.address, timeout=10)
    try:
        with pytest.raises(SpecError) as err:
            await asyncio.to_thread(client.submit, _big_env())
        assert err.value.field == "env"
        assert await asyncio.to_thread(client.list_jobs, True) == []
    finally:
        client.close()
