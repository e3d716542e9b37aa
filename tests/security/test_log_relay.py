"""The log relay is paced end to end, never drops data silently and never hangs on a lost node.

Before the fix the agent read a log file as fast as the disk allowed into an unbounded outbox,
the coordinator put each chunk into a 1024-chunk queue and dropped what did not fit, and the
client's stream still ended OK (3,072,000 bytes sent, 2,231,296 received). A follow of a node that
went away waited for good, and one client could open any number of streams. Now the agent reads
a chunk per credit the coordinator grants as its client consumes, data lost anyway ends the call
with DATA_LOSS, a node that goes ends it with UNAVAILABLE naming the node, and log streams are
capped per client and in all.
"""

from __future__ import annotations

import asyncio
import sys
import threading
import time
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import grpc.aio
import pytest

import coordinator._log_relay as relay_module
import nodeagent.session as session_module
from client import Client
from client._client import GelasticError
from client.cli import main as cli_main
from client.model import JobSpec
from coordinator._errors import RequestError
from coordinator.server import Coordinator, CoordinatorConfig
from nodeagent.session import AgentConfig, NodeAgent
from protos.gelastic.v1 import gelastic_pb2 as pb
from protos.gelastic.v1 import gelastic_pb2_grpc as pb_grpc
from tests._helpers import wait_for
from tests.service._fakes import FakeNode

WAIT_S = 30.0
LOG_WINDOW = relay_module.LOG_WINDOW_CHUNKS
LOG_BYTES = 3_072_000
# Writes LOG_BYTES of a pattern that shows any lost or reordered kilobyte, then exits 0.
WRITER = (
    "import sys\n"
    "out = sys.stdout.buffer\n"
    f"for i in range({LOG_BYTES // 1024}):\n"
    "    out.write(b'%07d:' % i + b'x' * 1015 + b'\\n')\n"
    "out.flush()\n"
)


@pytest.fixture
async def coordinator() -> AsyncIterator[Coordinator]:
    async with Coordinator(CoordinatorConfig(state_dir=":memory:", port=0, lease=600.0)) as c:
        yield c


async def _job_on(c: Coordinator, node: FakeNode) -> str:
    """A one-rank job whose rank 0 runs on `node` (a scripted agent)."""
    job_id = await c.service.submit(
        JobSpec(entrypoint=["python", "t.py"], nproc_per_node=1, min_nodes=1, max_nodes=1)
    )
    rp = (await node.expect("reserve_port")).reserve_port
    await node.send(port_reserved=pb.PortReserved(job_id=job_id, round=rp.round, port=40000))
    asg = (await node.expect("assign")).assign
    await node.send(
        workers_started=pb.WorkersStarted(
            job_id=job_id,
            round=asg.round,
            workers=[pb.WorkerPid(local_rank=0, pid=4242, global_rank=0)],
        )
    )
    await wait_for(
        lambda: c.service.cluster.log_location(job_id, 0, None) is not None,
        WAIT_S,
        what="rank 0's log location",
    )
    return job_id


async def test_three_megabytes_through_a_slow_reader_arrive_byte_for_byte(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Small chunks: 3,000 of them, more than any queue on the way holds.
    monkeypatch.setattr(session_module, "LOG_CHUNK_BYTES", 1024)
    config = CoordinatorConfig(state_dir=":memory:", port=0, lease=600.0)
    async with Coordinator(config) as c:
        agent = NodeAgent(
            AgentConfig(
                coordinator=c.address, name="node-a", addr="127.0.0.1", slots=1,
                log_dir=str(tmp_path / "logs"),
            )
        )  # fmt: skip
        async with agent:
            await asyncio.wait_for(agent.connected.wait(), WAIT_S)
            job_id = await c.service.submit(
                JobSpec(
                    entrypoint=[sys.executable, "-c", WRITER],
                    nproc_per_node=1,
                    min_nodes=1,
                    max_nodes=1,
                )
            )
            await wait_for(
                lambda: c.service.cluster.job_state(job_id).is_terminal(),
                60.0,
                what="the job to end",
            )
            (path,) = (tmp_path / "logs").glob(f"{job_id}/attempt_0*/0/stdout.log")
            expected = path.read_bytes()
            assert len(expected) == LOG_BYTES

            def slow_read() -> bytes:
                # No BDP probing: the transport holds only its initial window for the client.
                with grpc.insecure_channel(c.address, [("grpc.http2.bdp_probe", 0)]) as ch:
                    stream = pb_grpc.CoordinatorStub(ch).ReadLogs(
                        pb.ReadLogsRequest(job_id=job_id, rank=0, stream="stdout", attempt=-1),
                        timeout=WAIT_S * 2,
                    )
                    got = [next(stream).data]
                    time.sleep(1.0)  # the slow reader: everything the node has is ready now
                    got.extend(m.data for m in stream)
                    return b"".join(got)

            got = await asyncio.to_thread(slow_read)
            assert len(got) == len(expected)
            assert got == expected
            # The agent served it through a bounded outbox and holds nothing of it now.
            await wait_for(
                lambda: not agent._log_tasks and not agent._log_requests,
                WAIT_S,
                what="the agent's log tasks to end",
            )


async def _stream(address: str, job_id: str, follow: bool) -> tuple[grpc.aio.Channel, object]:
    ch = grpc.aio.insecure_channel(address)
    call = pb_grpc.CoordinatorStub(ch).ReadLogs(
        pb.ReadLogsRequest(job_id=job_id, rank=0, stream="stdout", attempt=-1, follow=follow),
        timeout=WAIT_S,
    )
    return ch, call


async def _drain(call: object) -> tuple[bytes, grpc.StatusCode, str]:
    data = b""
    try:
        while (m := await call.read()) is not grpc.aio.EOF:  # type: ignore[attr-defined]
            data += m.data
    except grpc.aio.AioRpcError as err:
        return data, err.code(), err.details() or ""
    return data, grpc.StatusCode.OK, ""


async def test_a_chunk_over_the_limit_ends_the_stream_with_data_loss(
    coordinator: Coordinator,
) -> None:
    node = FakeNode(coordinator.address, "node-a", "127.0.0.1", slots=1)
    await node.connect()
    job_id = await _job_on(coordinator, node)
    ch, call = await _stream(coordinator.address, job_id, follow=False)
    start = (await node.expect("start_logs")).start_logs
    assert start.credit_chunks == relay_module.LOG_WINDOW_CHUNKS
    rid = start.request_id
    await node.send(log_chunk=pb.LogChunk(request_id=rid, data=b"first\n"))
    big = b"y" * (relay_module.LOG_CHUNK_MAX_BYTES + 1)
    await node.send(log_chunk=pb.LogChunk(request_id=rid, data=big))
    await node.send(log_chunk=pb.LogChunk(request_id=rid, data=b"after\n", eof=True))
    data, code, details = await asyncio.wait_for(_drain(call), WAIT_S)
    assert data == b"first\n"  # what came before the loss, then the loss is said
    assert code == grpc.StatusCode.DATA_LOSS, (code, details)
    assert "node-a" in details and "incomplete" in details
    await ch.close()
    await node.close()


async def test_more_chunks_than_granted_end_the_stream_with_data_loss(
    coordinator: Coordinator,
) -> None:
    node = FakeNode(coordinator.address, "node-a", "127.0.0.1", slots=1)
    await node.connect()
    job_id = await _job_on(coordinator, node)
    svc = coordinator.service
    req = pb.ReadLogsRequest(job_id=job_id, rank=0, stream="stdout", attempt=-1)
    # A reader that took one chunk and nothing since: the node has its first window, no more.
    reader = svc.log_relay.read_logs(req, client="ipv4:10.0.0.7")
    first = asyncio.create_task(anext(reader))  # type: ignore[arg-type]
    rid = (await node.expect("start_logs")).start_logs.request_id
    window = relay_module.LOG_WINDOW_CHUNKS
    for i in range(2 * window):
        await node.send(log_chunk=pb.LogChunk(request_id=rid, data=b"%d\n" % i))
    assert await asyncio.wait_for(first, WAIT_S) == b"0\n"
    stream = svc.log_relay.streams[rid]
    await wait_for(lambda: bool(stream.lost), WAIT_S, what="the stream to be lost")
    got = []
    with pytest.raises(RequestError) as err:
        while True:
            got.append(await asyncio.wait_for(anext(reader), WAIT_S))  # type: ignore[arg-type]
    # Everything before the loss arrives, in order; then the loss is said.
    assert got == [b"%d\n" % i for i in range(1, window)]
    assert err.value.code == grpc.StatusCode.DATA_LOSS
    assert "node-a" in err.value.message and "granted" in err.value.message
    await wait_for(lambda: not svc.log_relay.streams, WAIT_S, what="every log stream to close")
    await node.close()


@pytest.mark.parametrize("follow", [False, True])
async def test_a_node_gone_mid_read_is_data_loss_and_mid_follow_unavailable(
    coordinator: Coordinator, follow: bool
) -> None:
    node = FakeNode(coordinator.address, "node-a", "127.0.0.1", slots=1)
    await node.connect()
    job_id = await _job_on(coordinator, node)
    ch, call = await _stream(coordinator.address, job_id, follow=follow)
    rid = (await node.expect("start_logs")).start_logs.request_id
    await node.send(log_chunk=pb.LogChunk(request_id=rid, data=b"partial\n"))
    first = await asyncio.wait_for(call.read(), WAIT_S)  # type: ignore[attr-defined]
    assert first.data == b"partial\n"
    await node.close()  # the node's stream ends
    _, code, details = await asyncio.wait_for(_drain(call), WAIT_S)
    want = grpc.StatusCode.UNAVAILABLE if follow else grpc.StatusCode.DATA_LOSS
    assert code == want, (follow, code, details)
    assert "node node-a disconnected" in details
    await ch.close()
    await wait_for(
        lambda: not coordinator.service.log_relay.streams, WAIT_S, what="every log stream to close"
    )


async def test_follow_ends_when_the_node_is_lost_by_its_lease() -> None:
    config = CoordinatorConfig(state_dir=":memory:", port=0, lease=1.0, heartbeat_interval=0.2)
    async with Coordinator(config) as c:
        node = FakeNode(c.address, "node-a", "127.0.0.1", slots=1)
        await node.connect()
        job_id = await _job_on(c, node)
        ch, call = await _stream(c.address, job_id, follow=True)
        await node.expect("start_logs")
        # The node says nothing more: its lease runs out while its stream stays open.
        _, code, details = await asyncio.wait_for(_drain(call), WAIT_S)
        assert code == grpc.StatusCode.UNAVAILABLE and "node-a" in details, (code, details)
        await ch.close()
        await node.close()


def test_cli_follow_of_a_node_that_goes_says_so(capfd: pytest.CaptureFixture[str]) -> None:
    ready = threading.Event()
    finished = threading.Event()
    box: dict[str, object] = {}

    async def serve() -> None:
        async with Coordinator(CoordinatorConfig(state_dir=":memory:", port=0, lease=600)) as c:
            node = FakeNode(c.address, "node-a", "127.0.0.1", slots=1)
            await node.connect()
            box["address"], box["job"] = c.address, await _job_on(c, node)
            ready.set()
            rid = (await node.expect("start_logs")).start_logs.request_id
            await node.send(log_chunk=pb.LogChunk(request_id=rid, data=b"hello from rank 0\n"))
            stream = c.service.log_relay.streams[rid]
            # The coordinator has the chunk and passed it on; then the node goes.
            await wait_for(
                lambda: stream.window < LOG_WINDOW and stream.queue.empty(),
                WAIT_S,
                what="the window to reopen and the queue to drain",
            )
            await node.close()
            await asyncio.to_thread(finished.wait, WAIT_S)

    server = threading.Thread(target=asyncio.run, args=(serve(),))
    server.start()
    try:
        assert ready.wait(WAIT_S)
        code = cli_main(["--coordinator", str(box["address"]), "logs", str(box["job"]), "-f"])
    finally:
        finished.set()
        server.join(WAIT_S)
    out, err = capfd.readouterr()
    assert "hello from rank 0" in out, (out, err)
    assert code == 1, err
    assert "node node-a disconnected" in err and "cannot reach the coordinator" not in err


async def test_log_streams_are_capped_per_client_and_in_all(
    coordinator: Coordinator, monkeypatch: pytest.MonkeyPatch
) -> None:
    node = FakeNode(coordinator.address, "node-a", "127.0.0.1", slots=1)
    await node.connect()
    job_id = await _job_on(coordinator, node)
    svc = coordinator.service
    cap = relay_module.LOG_STREAMS_PER_CLIENT
    opened = [await _stream(coordinator.address, job_id, follow=True) for _ in range(cap)]
    await wait_for(lambda: len(svc.log_relay.streams) == cap, WAIT_S, what=f"{cap} log streams")
    ch, extra = await _stream(coordinator.address, job_id, follow=True)
    _, code, details = await asyncio.wait_for(_drain(extra), WAIT_S)
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and f"at most {cap}" in details
    await ch.close()
    # Another client is not held back by this one's streams, up to the cap of all clients.
    monkeypatch.setattr(relay_module, "LOG_STREAMS_MAX", cap + 1)
    req = pb.ReadLogsRequest(job_id=job_id, rank=0, stream="stdout", attempt=-1, follow=True)
    other = svc.log_relay.read_logs(req, client="ipv4:10.0.0.7")
    first = asyncio.create_task(anext(other))  # type: ignore[arg-type]
    await wait_for(
        lambda: len(svc.log_relay.streams) == cap + 1, WAIT_S, what=f"{cap + 1} log streams"
    )
    third = svc.log_relay.read_logs(req, client="ipv4:10.0.0.8")
    with pytest.raises(RequestError) as err:
        await anext(third)  # type: ignore[arg-type]
    assert err.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "already relays" in err.value.message
    first.cancel()
    with pytest.raises(asyncio.CancelledError):
        await first
    # Ending a stream frees its place.
    ch0, call0 = opened.pop()
    call0.cancel()  # type: ignore[attr-defined]
    await ch0.close()
    await wait_for(
        lambda: len(svc.log_relay.streams) == cap - 1, WAIT_S, what=f"{cap - 1} log streams"
    )
    ch, again = await _stream(coordinator.address, job_id, follow=True)
    await wait_for(lambda: len(svc.log_relay.streams) == cap, WAIT_S, what=f"{cap} log streams")
    for c, call in [*opened, (ch, again)]:
        call.cancel()  # type: ignore[attr-defined]
        await c.close()
    await wait_for(lambda: not svc.log_relay.streams, WAIT_S, what="every log stream to close")
    await node.close()


async def test_the_client_api_reports_data_loss(coordinator: Coordinator) -> None:
    node = FakeNode(coordinator.address, "node-a", "127.0.0.1", slots=1)
    await node.connect()
    job_id = await _job_on(coordinator, node)

    def read() -> bytes:
        with Client(coordinator.address) as client:
            return b"".join(client.job(job_id).logs(0))

    reader = asyncio.create_task(asyncio.to_thread(read))
    rid = (await node.expect("start_logs")).start_logs.request_id
    await node.send(log_chunk=pb.LogChunk(request_id=rid, data=b"z" * (1 << 17)))
    with pytest.raises(GelasticError) as err:
        await asyncio.wait_for(reader, WAIT_S)
    assert err.value.code == grpc.StatusCode.DATA_LOSS
    await node.close()


async def test_a_reader_that_takes_nothing_stalls_the_agents_file_reading_not_its_heartbeats(
    tmp_path: Path,
) -> None:
    config = CoordinatorConfig(state_dir=":memory:", port=0, lease=600.0, heartbeat_interval=0.2)
    async with Coordinator(config) as c:
        svc = c.service
        agent = NodeAgent(
            AgentConfig(
                coordinator=c.address, name="node-a", addr="127.0.0.1", slots=1,
                log_dir=str(tmp_path / "logs"),
            )
        )  # fmt: skip
        async with agent:
            await asyncio.wait_for(agent.connected.wait(), WAIT_S)
            job_id = await svc.submit(
                JobSpec(
                    entrypoint=[sys.executable, "-c", WRITER],
                    nproc_per_node=1,
                    min_nodes=1,
                    max_nodes=1,
                )
            )
            await wait_for(
                lambda: svc.cluster.job_state(job_id).is_terminal(), 60.0, what="the job to end"
            )
            kinds: list[str] = []
            on_node_message = svc.on_node_message
            on_heartbeat = svc.on_heartbeat  # heartbeats come this way, to be taken in a batch

            def record(session: object, msg: pb.NodeMessage) -> None:
                kinds.append(msg.WhichOneof("kind") or "")
                on_node_message(session, msg)  # type: ignore[arg-type]

            def record_beat(session: object, msg: pb.NodeMessage) -> None:
                kinds.append("heartbeat")
                on_heartbeat(session, msg)  # type: ignore[arg-type]

            svc.on_node_message = record  # type: ignore[method-assign]
            svc.on_heartbeat = record_beat  # type: ignore[method-assign]
            req = pb.ReadLogsRequest(job_id=job_id, rank=0, stream="stdout", attempt=-1)
            reader = svc.log_relay.read_logs(req, client="ipv4:10.0.0.7")
            assert len(await asyncio.wait_for(anext(reader), WAIT_S)) > 0  # type: ignore[arg-type]
            # The reader takes nothing more: the agent uses up its credit and waits for more.
            await wait_for(
                lambda: len(agent._log_requests) == 1,
                WAIT_S,
                what="the agent to serve one log request",
            )
            (served,) = agent._log_requests.values()
            await wait_for(
                lambda: served.credit == 0 and served.logs.empty(),
                WAIT_S,
                what="the served request's credit to run out",
            )
            # And every chunk the agent sent has arrived: none is still on its way.
            (stream,) = svc.log_relay.streams.values()
            await wait_for(lambda: stream.window == 0, WAIT_S, what="every chunk sent to arrive")
            sent = kinds.count("log_chunk")
            assert sent <= relay_module.LOG_WINDOW_CHUNKS
            beats = kinds.count("heartbeat")
            await wait_for(
                lambda: kinds.count("heartbeat") >= beats + 3, WAIT_S, what="three more heartbeats"
            )
            assert kinds.count("log_chunk") == sent  # nothing read meanwhile
            await reader.aclose()
            await wait_for(
                lambda: not agent._log_requests and not svc.log_relay.streams,
                WAIT_S,
                what="every log request and stream to close",
            )
