"""Clients and agents given a list of coordinator replicas find the leader.

Standbys here are small real gRPC servers answering every call as a standby replica does:
UNAVAILABLE, "not the leader; the leader is at HOST:PORT", and the leader's address in the
`gelastic-leader` trailing metadata. The leader is a real in-process coordinator. A fake
NodeSession server stands in for a coordinator whose messages carry chosen leader epochs, with a
real agent (and a real worker process) on the other end.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import grpc.aio
import psutil
import pytest

from client import Client, GelasticError, JobSpec, cli
from client.coordinators import LEADER_HEADER, UNREACHABLE_HEADER
from client.wire import spec_to_pb
from coordinator.server import Coordinator, CoordinatorConfig
from nodeagent.session import AgentConfig, NodeAgent
from protos.gelastic.v1 import gelastic_pb2 as pb
from protos.gelastic.v1 import gelastic_pb2_grpc as pb_grpc
from tests._helpers import free_port, gone, wait_for

WAIT_S = 30.0
SPEC = JobSpec(entrypoint=["python", "train.py"], nproc_per_node=1, min_nodes=1, max_nodes=1)
_STREAMING = {
    "/gelastic.v1.Coordinator/WatchJob": "unary_stream",
    "/gelastic.v1.Coordinator/ReadLogs": "unary_stream",
    "/gelastic.v1.Coordinator/GetResult": "unary_stream",
    "/gelastic.v1.NodeSession/Session": "stream_stream",
}


class Standby(grpc.GenericRpcHandler):
    """A replica that is not the leader: refuses every call, naming `leader` ("" = none)."""

    def __init__(self, leader: str = "") -> None:
        self.leader = leader
        self.calls: list[str] = []
        self.times: list[float] = []  # monotonic arrival of each call
        self.metadata: list[dict[str, str]] = []  # the invocation metadata of each call
        self.server = grpc.aio.server()
        self.server.add_generic_rpc_handlers((self,))
        self.port = self.server.add_insecure_port("127.0.0.1:0")

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    async def _refuse(self, _request: object, context: grpc.aio.ServicerContext) -> None:  # type: ignore[type-arg]
        if self.leader:
            context.set_trailing_metadata(((LEADER_HEADER, self.leader),))
            await context.abort(
                grpc.StatusCode.UNAVAILABLE, f"not the leader; the leader is at {self.leader}"
            )
        await context.abort(grpc.StatusCode.UNAVAILABLE, "no leader elected yet")

    def service(self, details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler | None:
        method = str(details.method)
        self.calls.append(method)
        self.times.append(time.monotonic())
        self.metadata.append(
            {k: v for k, v in details.invocation_metadata or () if isinstance(v, str)}
        )
        kind = _STREAMING.get(method, "unary_unary")

        async def refuse_stream(
            request: object, context: grpc.aio.ServicerContext
        ) -> AsyncIterator[bytes]:  # type: ignore[type-arg]
            await self._refuse(request, context)
            yield b""  # never reached: makes this an async generator, as a stream handler is

        if kind == "unary_unary":
            return grpc.unary_unary_rpc_method_handler(self._refuse)
        if kind == "unary_stream":
            return grpc.unary_stream_rpc_method_handler(refuse_stream)
        return grpc.stream_stream_rpc_method_handler(refuse_stream)

    async def __aenter__(self) -> Standby:
        await self.server.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.server.stop(None)


def _closed_port() -> str:
    """An address nothing listens on (a replica that is down)."""
    return f"127.0.0.1:{free_port()}"


@pytest.fixture
async def leader() -> AsyncIterator[Coordinator]:
    async with Coordinator(CoordinatorConfig(state_dir=":memory:", port=0, lease=600.0)) as c:
        yield c


# ---- clients ----------------------------------------------------------------------------------


async def test_a_client_reaches_the_leader_in_one_hop_by_the_standbys_hint_and_remembers_it(
    leader: Coordinator,
) -> None:
    async with Standby(leader.address) as first, Standby(leader.address) as second:
        # Without the hint the client would try the second standby next.
        client = Client(f"{first.address},{second.address},{leader.address}", timeout=10)
        try:
            job = await asyncio.to_thread(client.submit, SPEC)
            # One submit through a standby is one job.
            assert [j.job_id for j in await asyncio.to_thread(client.list_jobs)] == [job.job_id]
            assert first.calls == ["/gelastic.v1.Coordinator/Submit"]
            assert second.calls == []
            assert client.address == leader.address
            # Remembered: the next calls go straight to the leader.
            await asyncio.to_thread(job.status)
            assert first.calls == ["/gelastic.v1.Coordinator/Submit"]
        finally:
            client.close()


async def test_a_watch_started_at_a_standby_is_served_by_the_leader(leader: Coordinator) -> None:
    async with Standby(leader.address) as standby:
        client = Client(f"{standby.address},{leader.address}", timeout=10)
        try:
            job_id = await leader.service.submit(SPEC)

            def first_update() -> pb.JobUpdate:
                for update in client.watch(job_id, timeout=WAIT_S):
                    return update
                raise AssertionError("the watch ended without an update")

            update = await asyncio.to_thread(first_update)
            assert update.job.job_id == job_id
            assert standby.calls == ["/gelastic.v1.Coordinator/WatchJob"]
            assert client.address == leader.address
        finally:
            client.close()


async def test_a_hint_to_an_address_that_is_not_listed_is_not_followed(
    leader: Coordinator,
) -> None:
    async with Standby() as trap, Standby(trap.address) as liar:
        client = Client(f"{liar.address},{leader.address}", timeout=10)
        try:
            assert await asyncio.to_thread(client.list_jobs) == []
        finally:
            client.close()
        assert liar.calls == ["/gelastic.v1.Coordinator/ListJobs"]
        assert trap.calls == []  # never dialed
        assert client.address == leader.address


async def test_with_every_replica_down_or_standby_a_call_fails_unavailable_within_its_deadline() -> (
    None
):
    down = _closed_port()
    async with Standby() as standby:
        client = Client(f"{down},{standby.address}", timeout=3)
        started = time.monotonic()
        try:
            with pytest.raises(GelasticError) as err:
                await asyncio.to_thread(client.submit, SPEC)
        finally:
            client.close()
        took = time.monotonic() - started
    assert err.value.code == grpc.StatusCode.UNAVAILABLE
    message = str(err.value)
    assert message.startswith(f"UNAVAILABLE: no coordinator of {down}, {standby.address} took")
    assert f"{standby.address}: UNAVAILABLE: no leader elected yet" in message
    assert f"{down}: UNAVAILABLE: " in message
    assert took < 3 + 1.5, took
    assert len(standby.calls) > 1  # it kept trying, within the deadline and the cap


async def test_the_cli_takes_a_list_and_names_a_bad_entry_or_every_unreachable_one(
    leader: Coordinator, capsys: pytest.CaptureFixture[str]
) -> None:
    async with Standby(leader.address) as standby:
        argv = ["--coordinator", f"{standby.address},{leader.address}", "jobs", "--json"]
        assert await asyncio.to_thread(cli.main, argv) == 0
        assert standby.calls == ["/gelastic.v1.Coordinator/ListJobs"]
    capsys.readouterr()
    assert await asyncio.to_thread(cli.main, ["--coordinator", "127.0.0.1:1,b", "jobs"]) == 2
    assert "entry 2 of 2, 'b', is not HOST:PORT" in capsys.readouterr().err
    down = [_closed_port(), _closed_port()]
    argv = ["--coordinator", ",".join(down), "--connect-timeout", "2", "jobs"]
    assert await asyncio.to_thread(cli.main, argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("gelastic jobs: cannot reach any coordinator of the list: "), err
    assert all(f"{d}: Connection refused" in err for d in down), err


# ---- agents -----------------------------------------------------------------------------------


def _agent(coordinator: str, tmp_path: Path, name: str = "node-a") -> NodeAgent:
    return NodeAgent(
        AgentConfig(
            coordinator=coordinator,
            name=name,
            addr="127.0.0.1",
            slots=1,
            log_dir=str(tmp_path / "logs"),
            reconnect_max=0.5,
        )
    )


async def test_an_agent_given_standbys_first_registers_with_the_leader(
    leader: Coordinator, tmp_path: Path
) -> None:
    async with Standby(leader.address) as first, Standby(leader.address) as second:
        agent = _agent(f"{first.address},{second.address},{leader.address}", tmp_path)
        async with agent:
            await asyncio.wait_for(agent.connected.wait(), WAIT_S)
            assert agent.target == leader.address
            assert leader.service.cluster.node_is_live("node-a", agent.incarnation)
        assert first.calls == ["/gelastic.v1.NodeSession/Session"]
        assert second.calls == []  # the hint, not the rotation, took it there


async def test_an_agent_given_a_new_replica_list_while_it_runs_dials_the_new_one(
    leader: Coordinator, tmp_path: Path
) -> None:
    # What `gelastic run` does on etcd: the agent starts with its own replica (a standby that
    # knows no leader yet) and is handed the replicas its replica learns of as they appear.
    async with Standby() as own:
        agent = _agent(own.address, tmp_path)
        async with agent:
            await wait_for(lambda: len(own.calls) >= 2, WAIT_S, what="two dials of the standby")
            assert not agent.connected.is_set()
            agent.coordinators = (own.address, leader.address)
            await asyncio.wait_for(agent.connected.wait(), WAIT_S)
            assert agent.target == leader.address
            assert agent.coordinators == (own.address, leader.address)
            assert leader.service.cluster.node_is_live("node-a", agent.incarnation)


async def test_an_agent_does_not_follow_a_hint_to_an_address_that_is_not_listed(
    leader: Coordinator, tmp_path: Path
) -> None:
    async with Standby() as trap, Standby(trap.address) as liar:
        agent = _agent(f"{liar.address},{leader.address}", tmp_path)
        async with agent:
            await asyncio.wait_for(agent.connected.wait(), WAIT_S)
            assert agent.target == leader.address
        assert liar.calls and trap.calls == []


async def test_an_agent_names_the_replica_it_could_not_reach_to_the_others(
    leader: Coordinator, tmp_path: Path
) -> None:
    """A replica that does not answer (a leader that died) is named in the agent's next
    sessions (`gelastic-unreachable`), so that a standby still naming it as the leader holds
    the agent instead of sending it back; a standby's own refusal does not make it
    unreachable, and the leader's welcome ends it."""
    gone = _closed_port()
    async with Standby() as standby:
        agent = _agent(f"{gone},{standby.address}", tmp_path)
        async with agent:
            await wait_for(
                lambda: len(standby.metadata) >= 3, WAIT_S, what="three calls to the standby"
            )
        assert [md.get(UNREACHABLE_HEADER) for md in standby.metadata[:3]] == [gone] * 3
    async with Standby(leader.address) as first:
        agent = _agent(f"{gone},{first.address},{leader.address}", tmp_path)
        async with agent:
            await asyncio.wait_for(agent.connected.wait(), WAIT_S)
            assert first.metadata[0].get(UNREACHABLE_HEADER) == gone
            assert agent._unreachable == ""


async def test_an_agent_hunting_for_a_leader_over_a_list_retries_at_a_short_pause(
    tmp_path: Path,
) -> None:
    """No replica knows a leader (an election under way): the agent keeps trying the list every
    0.2-0.5 s, not at a pause doubling up to its 5 s cap, so it finds the leader soon after one
    is elected. Only its first tries count here, within its bounded number of passes."""
    async with Standby() as first, Standby() as second:
        agent = NodeAgent(
            AgentConfig(
                coordinator=f"{first.address},{second.address},{_closed_port()}",
                name="node-a",
                addr="127.0.0.1",
                slots=1,
                log_dir=str(tmp_path / "logs"),
                reconnect_max=5.0,
            )
        )
        async with agent:
            await wait_for(
                lambda: len(first.times) + len(second.times) >= 12,
                WAIT_S,
                what="twelve calls to the standbys",
            )
        times = sorted(first.times + second.times)
    gaps = [b - a for a, b in itertools.pairwise(times)]
    # Between two standbys' tries the third (down) replica's is a fast failure, so a gap may
    # hold two pauses; with the doubling schedule the later gaps would be up to 5 s.
    assert max(gaps[-6:]) < 2 * 0.5 + 0.5, gaps
    assert min(gaps) >= 0.15, gaps


class EpochCoordinator(pb_grpc.NodeSessionServicer):  # type: ignore[misc]
    """A NodeSession server that sends, on each session, the messages a test scripts."""

    def __init__(self) -> None:
        self.sessions: asyncio.Queue[
            tuple[
                pb.Hello,
                asyncio.Queue[pb.CoordinatorMessage | None],
                list[pb.NodeMessage],
                asyncio.Event,
            ]
        ] = asyncio.Queue()
        self.server = grpc.aio.server()
        pb_grpc.add_NodeSessionServicer_to_server(self, self.server)
        self.port = self.server.add_insecure_port("127.0.0.1:0")

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    async def Session(
        self,
        request_iterator: AsyncIterator[pb.NodeMessage],
        context: grpc.aio.ServicerContext,  # type: ignore[type-arg]
    ) -> AsyncIterator[pb.CoordinatorMessage]:
        first = await anext(aiter(request_iterator))
        outbox: asyncio.Queue[pb.CoordinatorMessage | None] = asyncio.Queue()
        received: list[pb.NodeMessage] = []
        ended = asyncio.Event()

        async def read() -> None:
            try:
                async for m in request_iterator:
                    received.append(m)
            finally:
                ended.set()

        reader = asyncio.get_running_loop().create_task(read())
        await self.sessions.put((first.hello, outbox, received, ended))
        try:
            while (msg := await outbox.get()) is not None:
                yield msg
        finally:
            reader.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await reader

    async def next_session(
        self,
    ) -> tuple[
        pb.Hello, asyncio.Queue[pb.CoordinatorMessage | None], list[pb.NodeMessage], asyncio.Event
    ]:
        return await asyncio.wait_for(self.sessions.get(), WAIT_S)


def _assign(job_id: str, epoch: int) -> pb.CoordinatorMessage:
    spec = JobSpec(
        entrypoint=[sys.executable, "-c", "import time; time.sleep(120)"],
        nproc_per_node=1,
        min_nodes=1,
        max_nodes=1,
    )
    return pb.CoordinatorMessage(
        epoch=epoch,
        assign=pb.Assign(
            job_id=job_id,
            round=1,
            attempt=0,
            spec=spec_to_pb(spec),
            group_rank=0,
            group_world_size=1,
            master_addr="127.0.0.1",
            master_port=29999,
            workers=[
                pb.WorkerRanks(
                    local_rank=0, global_rank=0, role_rank=0, world_size=1, role_world_size=1
                )
            ],
            run_id=job_id,
        ),
    )


def _welcome(epoch: int) -> pb.CoordinatorMessage:
    return pb.CoordinatorMessage(
        epoch=epoch, welcome=pb.Welcome(heartbeat_interval_ms=200, lease_ms=5000)
    )


def _started(received: list[pb.NodeMessage], job_id: str) -> list[pb.WorkersStarted]:
    return [
        m.workers_started
        for m in received
        if m.WhichOneof("kind") == "workers_started" and m.workers_started.job_id == job_id
    ]


async def test_an_agent_refuses_a_message_of_an_older_epoch_and_reconnects(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    fake = EpochCoordinator()
    await fake.server.start()
    agent = _agent(fake.address, tmp_path)
    pid = 0
    try:
        async with agent:
            hello, outbox, received, ended = await fake.next_session()
            assert list(hello.running) == []
            await outbox.put(_welcome(5))
            await outbox.put(_assign("job-new-0000000001", 5))
            await wait_for(
                lambda: bool(_started(received, "job-new-0000000001")),
                WAIT_S,
                what="the new job's worker to start",
            )
            (started,) = _started(received, "job-new-0000000001")
            pid = started.workers[0].pid
            assert psutil.pid_exists(pid)

            # A deposed leader (epoch 3) still holding a stream: not acted on, session closed.
            await outbox.put(_assign("job-old-0000000002", 3))
            await asyncio.wait_for(ended.wait(), WAIT_S)
            await outbox.put(None)
            assert ("job-old-0000000002", 1) not in agent._held
            assert _started(received, "job-old-0000000002") == []
            assert not (agent.log_root / "job-old-0000000002").exists()
            assert agent.epoch == 5

            # It reconnects, and the worker of epoch 5's round runs on, offered for adoption.
            hello, outbox, received, ended = await fake.next_session()
            assert [(g.job_id, [w.pid for w in g.workers]) for g in hello.running] == [
                ("job-new-0000000001", [pid])
            ]
            assert psutil.pid_exists(pid)
            # Epoch 0 (an unelected coordinator) is refused once an epoch was seen.
            await outbox.put(_welcome(0))
            await asyncio.wait_for(ended.wait(), WAIT_S)
            await outbox.put(None)
            assert not agent.connected.is_set()

            # A newer leader is followed, and its epoch becomes the newest.
            hello, outbox, received, ended = await fake.next_session()
            await outbox.put(_welcome(9))
            await asyncio.wait_for(agent.connected.wait(), WAIT_S)
            assert agent.epoch == 9
            # Two refusals, one line (rate-limited), naming the epochs.
            refusals = [r.getMessage() for r in caplog.records if "carries leader epoch" in r.msg]
            assert len(refusals) == 1, refusals
            assert (
                "refused assign from" in refusals[0]
                and "epoch 3, older than epoch 5" in (refusals[0])
            )
            assert ("job-old-0000000002", 1) not in agent._held
            await outbox.put(None)
    finally:
        await fake.server.stop(None)
    if pid:
        await wait_for(lambda: gone(pid), WAIT_S, what="the worker to exit")
