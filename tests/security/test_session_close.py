"""An agent that stops reading cannot keep a dead session open: a full outbox ends the call.

Before the fix `_Session.close()` put a None sentinel into the bounded outbox and suppressed
QueueFull, and the stream loop only ended on that sentinel. With the outbox full (the very case
that closes the session) the sentinel was lost: the loop yielded what was queued, then waited on
the empty outbox for good, or hung in a write the agent never read. The node stayed "live", the
call stayed open, and the agent, if it read again, never saw the end.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc
import grpc.aio
import pytest

import coordinator._node_sessions as sessions_module
from coordinator.server import Coordinator, CoordinatorConfig
from protos.gelastic.v1 import gelastic_pb2 as pb
from protos.gelastic.v1 import gelastic_pb2_grpc as pb_grpc
from tests._helpers import wait_for

BIG = (
    2 * 1024 * 1024
)  # a few of these are more than the transport holds for a peer that reads nothing
WAIT_S = 10.0


def _big(i: int) -> pb.CoordinatorMessage:
    return pb.CoordinatorMessage(
        start_logs=pb.StartLogs(request_id=i, job_id="j" * BIG, stream="stdout")
    )


@pytest.fixture
async def coordinator(monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[Coordinator]:
    monkeypatch.setattr(sessions_module, "OUTBOX_LIMIT", 8)
    async with Coordinator(CoordinatorConfig(state_dir=":memory:", port=0, lease=600.0)) as c:
        yield c


async def _agent_that_never_reads(
    address: str,
) -> tuple[
    grpc.aio.Channel,
    grpc.aio.StreamStreamCall[pb.NodeMessage, pb.CoordinatorMessage],
    asyncio.Event,
]:
    ch = grpc.aio.insecure_channel(address, options=[("grpc.max_receive_message_length", 64 << 20)])
    done = asyncio.Event()

    async def gen() -> AsyncIterator[pb.NodeMessage]:
        yield pb.NodeMessage(hello=pb.Hello(name="n1", addr="127.0.0.1", slots=1, incarnation="i1"))
        await done.wait()

    call = pb_grpc.NodeSessionStub(ch).Session(gen())
    return ch, call, done


async def _assert_the_call_ends(
    call: grpc.aio.StreamStreamCall[pb.NodeMessage, pb.CoordinatorMessage],
) -> None:
    async def drain() -> grpc.StatusCode:
        try:
            async for _ in call:
                pass
        except grpc.aio.AioRpcError as err:
            return err.code()
        return grpc.StatusCode.OK

    # Ends, as any close by the coordinator does; before the fix the drain never finished.
    assert await asyncio.wait_for(drain(), WAIT_S) == grpc.StatusCode.OK


def _node_state(c: Coordinator) -> str:
    return {n.name: n.state for n in c.service.cluster.nodes()}.get("n1", "")


async def test_a_burst_that_fills_the_outbox_ends_the_session(coordinator: Coordinator) -> None:
    svc = coordinator.service
    ch, call, done = await _agent_that_never_reads(coordinator.address)
    try:
        await wait_for(lambda: "n1" in svc._sessions, WAIT_S, what="n1's session")
        session = svc._sessions["n1"]
        for i in range(20):  # no await in between: the outbox overflows at once
            session.send(_big(i))
        assert session.closed
        await wait_for(lambda: "n1" not in svc._sessions, WAIT_S, what="n1's session to close")
        assert _node_state(coordinator) == "lost"
        await _assert_the_call_ends(call)
    finally:
        done.set()
        call.cancel()
        await ch.close(None)


async def test_a_write_the_agent_never_reads_does_not_hold_a_closed_session(
    coordinator: Coordinator,
) -> None:
    svc = coordinator.service
    ch, call, done = await _agent_that_never_reads(coordinator.address)
    try:
        await wait_for(lambda: "n1" in svc._sessions, WAIT_S, what="n1's session")
        session = svc._sessions["n1"]
        for i in range(7):
            session.send(_big(i))
        # The loop has begun writing what the agent will never read; the transport takes only a
        # few MB of it, so the loop is held in a write (or soon will be) when the close comes.
        await wait_for(
            lambda: session.outbox.qsize() < 7, WAIT_S, what="the outbox to drain below 7"
        )
        for i in range(7, 7 + sessions_module.OUTBOX_LIMIT + 1):
            session.send(_big(i))
        assert session.closed
        await wait_for(lambda: "n1" not in svc._sessions, WAIT_S, what="n1's session to close")
        assert _node_state(coordinator) == "lost"
        await _assert_the_call_ends(call)
    finally:
        done.set()
        call.cancel()
        await ch.close(None)
