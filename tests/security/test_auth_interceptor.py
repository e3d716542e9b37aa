"""The token is checked before anything else, and no method name makes the check crash.

Before the fix the interceptor looked the method up and built its refusal from the real handler:
an unknown method (no handler) raised AttributeError, which the caller saw as UNKNOWN, and the
refusal kept the method's request deserializer, so an unauthenticated caller's body was parsed
(a malformed one came back as a parse error instead of UNAUTHENTICATED).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import grpc.aio
import pytest

from coordinator.server import Coordinator, CoordinatorConfig

TOKEN = "s3cret-token-for-tests-0123456789"
# Not a protobuf message: field 0 with wire type 7 does not exist.
GARBAGE = b"\x07\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff"


def _bearer(token: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {token}"),) if token else ()


@pytest.fixture
async def address(tmp_path: Path) -> AsyncIterator[str]:
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN)
    cfg = CoordinatorConfig(state_dir=":memory:", port=0, token_file=str(token_file))
    async with Coordinator(cfg) as c:
        yield c.address


async def _unary(address: str, method: str, body: bytes, token: str) -> grpc.StatusCode:
    async with grpc.aio.insecure_channel(address) as ch:
        call = ch.unary_unary(method, None, None)  # bytes in, bytes out: no serializers
        try:
            await call(body, metadata=_bearer(token), timeout=10)
        except grpc.aio.AioRpcError as err:
            return err.code()
        return grpc.StatusCode.OK


async def _stream(address: str, method: str, body: bytes, token: str) -> grpc.StatusCode:
    # The server ends these calls before it reads a message. When the client's write of the body
    # races that end, the client's own core reports INTERNAL ("Internal error from Core") and the
    # server's status is lost; that is the client, not an answer. Try again then, a few times:
    # a server that really answered INTERNAL would do it every time.
    code = grpc.StatusCode.INTERNAL
    for _ in range(5):
        async with grpc.aio.insecure_channel(address) as ch:
            call = ch.stream_stream(method, None, None)(
                iter([body]), metadata=_bearer(token), timeout=10
            )
            try:
                async for _ in call:
                    pass
            except grpc.aio.AioRpcError as err:
                code = err.code()
                if code == grpc.StatusCode.INTERNAL and err.details() == "Internal error from Core":
                    continue
                return code
            return grpc.StatusCode.OK
    return code


@pytest.mark.parametrize(
    "method",
    [
        "/gelastic.v1.Coordinator/ListJobs",
        "/gelastic.v1.Coordinator/Submit",
        "/gelastic.v1.Coordinator/WatchJob",
        "/gelastic.v1.NodeSession/Session",
    ],
)
@pytest.mark.parametrize("token", ["", "wrong-token-" + "w" * 20])
async def test_a_malformed_body_without_the_token_is_refused_unread(
    address: str, method: str, token: str
) -> None:
    assert await _unary(address, method, GARBAGE, token) == grpc.StatusCode.UNAUTHENTICATED
    assert await _stream(address, method, GARBAGE, token) == grpc.StatusCode.UNAUTHENTICATED


@pytest.mark.parametrize(
    "method",
    [
        "/gelastic.v1.Coordinator/NoSuchMethod",
        "/gelastic.v1.NodeSession/NoSuchMethod",
        "/gelastic.v1.Coordinator/",
        "/gelastic.v1.NodeSession/" + "x" * 4000,
    ],
)
async def test_an_unknown_method_is_unauthenticated_or_unimplemented_never_an_error(
    address: str, method: str
) -> None:
    assert await _unary(address, method, b"", "") == grpc.StatusCode.UNAUTHENTICATED
    assert await _stream(address, method, b"", "") == grpc.StatusCode.UNAUTHENTICATED
    assert await _unary(address, method, b"", TOKEN) == grpc.StatusCode.UNIMPLEMENTED
    assert await _stream(address, method, b"", TOKEN) == grpc.StatusCode.UNIMPLEMENTED


async def test_the_right_token_still_reaches_the_servicer(address: str) -> None:
    # An empty ListJobsRequest is b"": the real servicer answers it.
    assert await _unary(address, "/gelastic.v1.Coordinator/ListJobs", b"", TOKEN) == (
        grpc.StatusCode.OK
    )
