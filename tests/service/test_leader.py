"""Coordinator replicas on one real etcd: the election, what a standby answers, take-over with
the state, the fence, the leader's own step-down timer, and the epoch on every message."""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from client import JobSpec
from client.coordinators import UNREACHABLE_HEADER
from client.wire import spec_to_pb
from coordinator._leader import LEADER_METADATA, MAX_HELD, LeaderGate
from coordinator._store_etcd import parse_etcd_url
from coordinator.server import Coordinator, CoordinatorConfig
from protos.etcd import rpc_pb2 as epb
from protos.etcd import rpc_pb2_grpc as epb_grpc
from protos.gelastic.v1 import gelastic_pb2 as pb
from protos.gelastic.v1 import gelastic_pb2_grpc as pb_grpc
from tests._etcd import EtcdServer
from tests._helpers import free_port, wait_for
from tests.service._fakes import FakeNode

SPEC = JobSpec(entrypoint=["python", "train.py"], nproc_per_node=1, min_nodes=1, max_nodes=1)
TTL = 3.0
WAIT_S = 20.0


def _config(url: str, tmp_path: Path, **kw: object) -> CoordinatorConfig:
    settings: dict[str, object] = {
        "state_dir": str(tmp_path / "unused"),
        "store": url,
        "port": 0,
        "lease": 30.0,
        "heartbeat_interval": 1.0,
        "leader_ttl": TTL,
    }
    settings.update(kw)
    return CoordinatorConfig(**settings)  # type: ignore[arg-type]


@contextlib.asynccontextmanager
async def _replicas(url: str, tmp_path: Path, n: int = 3) -> AsyncIterator[list[Coordinator]]:
    coords = [Coordinator(_config(url, tmp_path)) for _ in range(n)]
    try:
        for c in coords:
            await c.start()
        yield coords
    finally:
        for c in coords:
            await c.stop()


def _leader(coords: list[Coordinator]) -> Coordinator:
    leading = [c for c in coords if c.leading]
    assert len(leading) == 1, [c.advertised() for c in leading]
    return leading[0]


async def _leader_elected(coords: list[Coordinator]) -> Coordinator:
    await wait_for(lambda: sum(c.leading for c in coords) == 1, WAIT_S, what="one replica leads")
    return _leader(coords)


async def _call(address: str, fn: Callable[[pb_grpc.CoordinatorStub], Awaitable[object]]) -> object:
    async with grpc.aio.insecure_channel(address) as ch:
        return await fn(pb_grpc.CoordinatorStub(ch))


async def _submit(address: str, request_id: str) -> str:
    resp = await _call(
        address,
        lambda s: s.Submit(
            pb.SubmitRequest(spec=spec_to_pb(SPEC), request_id=request_id), timeout=30
        ),
    )
    assert isinstance(resp, pb.SubmitResponse)
    return resp.job_id


async def _refusal(address: str) -> tuple[grpc.StatusCode, str, dict[str, str]]:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await _call(address, lambda s: s.ListJobs(pb.ListJobsRequest(), timeout=10))
    md = {k: v for k, v in (err.value.trailing_metadata() or ()) if isinstance(v, str)}
    return err.value.code(), err.value.details() or "", md


async def _drain(node: FakeNode) -> list[str]:
    """Kinds of what the node is still sent, until the coordinator ends its session."""
    assert node.call is not None
    kinds: list[str] = []
    try:
        while (msg := await asyncio.wait_for(node.call.read(), WAIT_S)) is not grpc.aio.EOF:
            kinds.append(str(msg.WhichOneof("kind")))
    except grpc.aio.AioRpcError as exc:
        assert exc.code() == grpc.StatusCode.UNAVAILABLE, exc
    return kinds


def _revoke_leader_lease(server: EtcdServer, url: str) -> None:
    """Revoke the leader key's lease straight in etcd, as if it had expired."""
    key = (parse_etcd_url(url)[1] + "/leader").encode()
    with server.channel() as ch:
        kv = epb_grpc.KVStub(ch).Range(epb.RangeRequest(key=key), timeout=5).kvs[0]
        epb_grpc.LeaseStub(ch).LeaseRevoke(epb.LeaseRevokeRequest(ID=kv.lease), timeout=5)


async def test_one_of_three_replicas_leads_and_the_standbys_point_at_it(
    etcd_server: EtcdServer, etcd_url: str, tmp_path: Path
) -> None:
    async with _replicas(etcd_url, tmp_path) as coords:
        leader = await _leader_elected(coords)
        assert leader.leadership is not None and leader.leadership.epoch > 0
        job = await _submit(leader.address, "r1")
        for standby in (c for c in coords if c is not leader):
            code, details, md = await _refusal(standby.address)
            assert code == grpc.StatusCode.UNAVAILABLE
            assert details == f"not the leader; the leader is at {leader.advertised()}"
            assert md[LEADER_METADATA] == leader.advertised()
            # The node session too: an agent is sent to the leader, not served.
            node = FakeNode(standby.address, "node-s", "127.0.0.1", slots=1)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await node.connect()
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
            await node.close()
            # Health: the process serves, the gelastic services do not.
            async with grpc.aio.insecure_channel(standby.address) as ch:
                health = health_pb2_grpc.HealthStub(ch)
                whole = await health.Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
                api = await health.Check(
                    health_pb2.HealthCheckRequest(service="gelastic.v1.Coordinator"), timeout=5
                )
            assert whole.status == health_pb2.HealthCheckResponse.SERVING
            assert api.status == health_pb2.HealthCheckResponse.NOT_SERVING
            # A standby holds none of the state.
            assert not standby.service.cluster.has_job(job)


async def test_a_revoked_lease_elects_another_replica_which_loads_the_state(
    etcd_server: EtcdServer, etcd_url: str, tmp_path: Path
) -> None:
    async with _replicas(etcd_url, tmp_path) as coords:
        first = await _leader_elected(coords)
        assert first.leadership is not None
        epoch = first.leadership.epoch
        job = await _submit(first.address, "r1")
        # A client stream of the term: it ends when the term does.
        channel = grpc.aio.insecure_channel(first.address)
        watch = pb_grpc.CoordinatorStub(channel).WatchJob(pb.WatchJobRequest(job_id=job))
        assert (await watch.read()).job.job_id == job
        # Expiry, as etcd sees it: the lease goes; the leader learns it at its next keepalive.
        await asyncio.to_thread(_revoke_leader_lease, etcd_server, etcd_url)
        await wait_for(lambda: not first.leading, WAIT_S, what="the first leader steps down")
        with pytest.raises(grpc.aio.AioRpcError) as err:
            while (await asyncio.wait_for(watch.read(), WAIT_S)) is not grpc.aio.EOF:
                pass
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        await channel.close()
        second = await _leader_elected(coords)
        assert second.leadership is not None and second.leadership.epoch > epoch
        got = await _call(second.address, lambda s: s.GetJob(pb.GetJobRequest(job_id=job)))
        assert isinstance(got, pb.Job) and got.job_id == job
        # The old leader now points at the new one.
        if first is not second:
            await wait_for(
                lambda: (
                    first.leadership is not None
                    and first.leadership.leader_addr == second.advertised()
                ),
                WAIT_S,
                what="the old leader knows the new one",
            )
            code, _, md = await _refusal(first.address)
            assert code == grpc.StatusCode.UNAVAILABLE
            assert md[LEADER_METADATA] == second.advertised()


async def test_a_clean_stop_hands_over_at_once(
    etcd_server: EtcdServer, etcd_url: str, tmp_path: Path
) -> None:
    async with _replicas(etcd_url, tmp_path, n=2) as coords:
        first = await _leader_elected(coords)
        job = await _submit(first.address, "r1")
        other = next(c for c in coords if c is not first)
        stopped = time.monotonic()
        await first.stop()
        await wait_for(lambda: other.leading, WAIT_S, what="the standby leads")
        # Revoked on the way out: no wait for the TTL to run out.
        assert time.monotonic() - stopped < TTL
        got = await _call(other.address, lambda s: s.GetJob(pb.GetJobRequest(job_id=job)))
        assert isinstance(got, pb.Job) and got.job_id == job


async def test_a_deposed_leader_write_is_fenced_and_it_stops_sending(
    etcd_server: EtcdServer, etcd_url: str, tmp_path: Path
) -> None:
    async with _replicas(etcd_url, tmp_path, n=2) as coords:
        old = await _leader_elected(coords)
        assert old.leadership is not None
        term = old.service
        node = FakeNode(old.address, "node-a", "127.0.0.1", slots=1)
        welcome = await node.connect()
        assert welcome.epoch == old.leadership.epoch
        # Everything the old leader had to write is written (the node's record): its next
        # write is the submit's below.
        journal = old.service.journal
        await wait_for(lambda: not journal.wants_flush(), WAIT_S, what="the node's record")
        # Another replica takes the leader key while the old one's lease still lives: the old
        # one still believes it leads, until its next write.
        key = (parse_etcd_url(etcd_url)[1] + "/leader").encode()
        with etcd_server.channel() as ch:
            epb_grpc.KVStub(ch).DeleteRange(epb.DeleteRangeRequest(key=key), timeout=5)
        other = next(c for c in coords if c is not old)
        await wait_for(
            lambda: (
                other.leadership is not None
                and other.leadership.terms > 0
                and other.service.epoch > 0
            ),
            WAIT_S,
            what="the other replica leads",
        )
        assert old.leading
        # A write (a submit) is refused by etcd: the old leader steps down at once.
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await _submit(old.address, "r-old")
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        await wait_for(lambda: not old.leading, WAIT_S, what="the fenced leader steps down")
        assert not term.may_send()
        # Its session with the node is closed, and nothing of the refused submit went out.
        kinds = await _drain(node)
        assert "reserve_port" not in kinds and "assign" not in kinds, kinds
        await node.close()
        # The refused job is nowhere: not in etcd, not on the new leader.
        await wait_for(lambda: other.leading, WAIT_S, what="the new leader serves")
        listed = await _call(
            other.address, lambda s: s.ListJobs(pb.ListJobsRequest(include_finished=True))
        )
        assert isinstance(listed, pb.ListJobsResponse) and list(listed.jobs) == []


async def test_the_leader_steps_down_on_its_own_timer_before_the_ttl(
    tmp_path: Path,
) -> None:
    etcd = EtcdServer(tmp_path / "etcd")
    etcd.start()
    try:
        async with Coordinator(_config(etcd.url("g"), tmp_path)) as c:
            assert c.leading and c.leadership is not None
            epoch = c.leadership.epoch
            term = c.service
            node = FakeNode(c.address, "node-a", "127.0.0.1", slots=1)
            await node.connect()
            assert etcd.proc is not None
            frozen = time.monotonic()
            etcd.proc.send_signal(signal.SIGSTOP)  # etcd answers nothing, keepalives included
            try:
                await wait_for(lambda: not c.leading, 3 * TTL, what="the leader steps down")
                assert c.leadership.last_step_down is not None
                at, confirmed = c.leadership.last_step_down
                # Before etcd could have expired the lease: etcd counts the TTL from when it
                # handled the last keepalive, which is after this replica sent it.
                assert at - confirmed < TTL, (at - confirmed, TTL)
                assert confirmed <= frozen + 0.1
                assert not term.may_send()
                await _drain(node)  # the coordinator ended the session
                code, details, _ = await _refusal(c.address)
                assert code == grpc.StatusCode.UNAVAILABLE and details == "no leader elected yet"
            finally:
                etcd.proc.send_signal(signal.SIGCONT)
            await node.close()
            # etcd answers again: the replica campaigns again and leads a new term.
            await wait_for(lambda: c.leading, 3 * TTL + 10, what="it leads again")
            assert c.leadership.epoch > epoch
    finally:
        etcd.stop()


async def test_a_leader_whose_event_loop_is_stalled_past_the_ttl_keeps_its_lease(
    tmp_path: Path,
) -> None:
    """The lease is kept on a thread of its own: a loop busy for longer than the TTL (a
    thousand agents reconnecting at once) does not make the leader step down, nor let etcd
    expire its lease and elect another."""
    etcd = EtcdServer(tmp_path / "etcd")
    etcd.start()
    try:
        async with Coordinator(_config(etcd.url("g"), tmp_path)) as c:
            assert c.leading and c.leadership is not None
            epoch, terms = c.leadership.epoch, c.leadership.terms
            time.sleep(TTL + 1.0)  # the event loop runs nothing meanwhile
            assert c.leading, "the lease was not kept while the loop was stalled"
            # Let the loop see whatever the stall caused: a step-down would end this term.
            for _ in range(10):
                await asyncio.sleep(0.1)
            assert c.leading
            assert (c.leadership.epoch, c.leadership.terms) == (epoch, terms)
    finally:
        etcd.stop()


async def test_an_agent_that_comes_while_no_leader_is_known_is_held_then_served(
    tmp_path: Path,
) -> None:
    """While no replica is known to lead (here: etcd stopped answering, so the only replica
    stepped down), an agent's session is held rather than refused, and goes on into the
    replica's service the moment it leads again: no refusal, no new attempt, no pause."""
    etcd = EtcdServer(tmp_path / "etcd")
    etcd.start()
    try:
        async with Coordinator(_config(etcd.url("g"), tmp_path)) as c:
            assert c.leading and c.leadership is not None and c._gate is not None
            epoch = c.leadership.epoch
            assert etcd.proc is not None
            etcd.proc.send_signal(signal.SIGSTOP)
            try:
                await wait_for(lambda: not c.leading, 3 * TTL, what="the leader steps down")
                assert c.leadership.leader_addr == ""
                # Long enough that the test does not race the take-over on a slow host.
                c._gate.hold_s = WAIT_S
                node = FakeNode(c.address, "node-h", "127.0.0.1", slots=1)
                welcome = asyncio.ensure_future(node.connect())
                await wait_for(
                    lambda: c._gate is not None and c._gate.held, WAIT_S, what="the session is held"
                )
                assert not welcome.done()
            finally:
                etcd.proc.send_signal(signal.SIGCONT)
            msg = await asyncio.wait_for(welcome, WAIT_S)
            assert msg.epoch > epoch and c.leading and c.leadership.epoch == msg.epoch
            assert c.service.cluster.node_is_live("node-h", node.incarnation)
            assert c._gate.held == 0
            await node.close()
    finally:
        etcd.stop()


async def test_the_standby_an_agent_waits_on_takes_over_and_serves_it_without_a_reconnect(
    etcd_server: EtcdServer, etcd_url: str, tmp_path: Path
) -> None:
    """The leader is gone while its key still names it: a standby that an agent tells it could
    not reach the leader holds the agent's session, wins the election (a standby no agent
    waits on gives it a poll's head start), and serves that same session when it leads."""
    async with _replicas(etcd_url, tmp_path) as coords:
        first = await _leader_elected(coords)
        assert first.leadership is not None
        epoch = first.leadership.epoch
        # The last standby started: the others poll the leader key first in each round.
        waiting_on = [c for c in coords if c is not first][-1]
        assert waiting_on._gate is not None
        node = FakeNode(waiting_on.address, "node-w", "127.0.0.1", slots=1)
        gone = ((UNREACHABLE_HEADER, first.advertised()),)
        welcome = asyncio.ensure_future(node.connect(metadata=gone))
        await wait_for(
            lambda: bool(waiting_on._gate and waiting_on._gate.held),
            WAIT_S,
            what="the session is held",
        )
        await asyncio.to_thread(_revoke_leader_lease, etcd_server, etcd_url)
        msg = await asyncio.wait_for(welcome, WAIT_S)
        assert waiting_on.leading and msg.epoch > epoch
        assert waiting_on.leadership is not None and waiting_on.leadership.epoch == msg.epoch
        assert waiting_on.service.cluster.node_is_live("node-w", node.incarnation)
        await node.close()


async def test_a_held_session_is_sent_to_the_leader_once_one_is_known() -> None:
    """Another replica is known to lead: the held session is answered with its address at
    once; with no leader known by the end of the hold, as before; a leader the agent could not
    reach counts as none; past MAX_HELD, nothing is held."""
    addr = ""
    gate = LeaderGate(lambda: addr)
    gate.configure_hold("10.0.0.1:29400", 30.0)
    assert gate._may_hold()
    waiting = asyncio.ensure_future(gate._leads_within(30.0))
    await asyncio.sleep(0)
    addr = "10.0.0.1:29400"  # this replica won; it serves once its state is loaded
    gate.changed()
    await asyncio.sleep(0)
    assert not waiting.done()
    addr = "10.0.0.2:29400"  # another one leads after all
    gate.changed()
    assert await asyncio.wait_for(waiting, 5.0) is None
    assert not gate._may_hold()
    addr = ""
    started = time.monotonic()
    assert await gate._leads_within(0.2) is None
    assert time.monotonic() - started >= 0.2
    # The agent could not reach the replica the key still names (its lease has not run out):
    # held until another replica leads, not sent back there.
    addr = "10.0.0.3:29400"
    assert gate._may_hold("10.0.0.3:29400") and not gate._may_hold("10.0.0.4:29400")
    waiting = asyncio.ensure_future(gate._leads_within(30.0, "10.0.0.3:29400"))
    gate.changed()
    await asyncio.sleep(0.05)
    assert not waiting.done()
    addr = "10.0.0.2:29400"
    gate.changed()
    assert await asyncio.wait_for(waiting, 5.0) is None
    gate.held = MAX_HELD
    addr = ""
    assert not gate._may_hold()


async def test_a_coordinator_restarted_at_the_leaders_address_takes_over_at_once(
    etcd_server: EtcdServer, etcd_url: str, tmp_path: Path
) -> None:
    # What a coordinator killed with SIGKILL leaves: the leader key on a lease still alive.
    port = free_port()
    key = (parse_etcd_url(etcd_url)[1] + "/leader").encode()
    with etcd_server.channel() as ch:
        lease = epb_grpc.LeaseStub(ch).LeaseGrant(epb.LeaseGrantRequest(TTL=60), timeout=5).ID
        value = json.dumps({"id": "0" * 32, "addr": f"127.0.0.1:{port}"}).encode()
        epb_grpc.KVStub(ch).Put(epb.PutRequest(key=key, value=value, lease=lease), timeout=5)
    other = Coordinator(_config(etcd_url, tmp_path))
    await other.start()
    try:
        # Another address waits for the lease to run out...
        assert not other.leading
        started = time.monotonic()
        # ...the same address listens here now: whoever held it is gone.
        async with Coordinator(_config(etcd_url, tmp_path, port=port)) as c:
            assert c.leading and c.advertised() == f"127.0.0.1:{port}"
            assert time.monotonic() - started < 10
            await wait_for(
                lambda: (
                    other.leadership is not None and other.leadership.leader_addr == c.advertised()
                ),
                WAIT_S,
                what="the other replica knows the leader",
            )
    finally:
        await other.stop()


async def test_every_message_to_an_agent_carries_the_epoch(
    etcd_server: EtcdServer, etcd_url: str, tmp_path: Path
) -> None:
    async with Coordinator(_config(etcd_url, tmp_path)) as c:
        assert c.leadership is not None
        epoch = c.leadership.epoch
        node = FakeNode(c.address, "node-a", "127.0.0.1", slots=1)
        assert (await node.connect()).epoch == epoch
        job = await _submit(c.address, "r1")
        rp = await node.expect("reserve_port")
        assert rp.epoch == epoch
        await node.send(
            port_reserved=pb.PortReserved(job_id=job, round=rp.reserve_port.round, port=40000)
        )
        assert (await node.expect("assign")).epoch == epoch
        await _call(c.address, lambda s: s.CancelJob(pb.CancelJobRequest(job_id=job)))
        assert (await node.expect("stop")).epoch == epoch
        await node.close()


async def test_sqlite_mode_has_no_election_and_epoch_zero(tmp_path: Path) -> None:
    config = CoordinatorConfig(state_dir=str(tmp_path / "state"), port=0)
    async with Coordinator(config) as c:
        assert c.leading and c.leadership is None
        node = FakeNode(c.address, "node-a", "127.0.0.1", slots=1)
        welcome = await node.connect()
        assert welcome.HasField("welcome") and welcome.epoch == 0
        await node.close()


@pytest.mark.parametrize(
    ("kw", "error"),
    [
        ({"leader_ttl": 0.5}, "leader_ttl"),
        ({"leader_ttl": 61.0}, "leader_ttl"),
        ({"advertise": "host:29400"}, "needs --store etcd"),
    ],
)
def test_replica_options_are_bounded(tmp_path: Path, kw: dict[str, object], error: str) -> None:
    config = CoordinatorConfig(state_dir=str(tmp_path / "state"), port=0, **kw)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=error):
        config.validate()


@pytest.mark.parametrize(
    "addr", ["host", "host:0", "host:99999", "a b:1", "h:1\n", "x" * 300 + ":1"]
)
def test_a_bad_advertise_address_is_refused(etcd_url: str, tmp_path: Path, addr: str) -> None:
    with pytest.raises(ValueError, match="advertise"):
        _config(etcd_url, tmp_path, advertise=addr).validate()


async def test_the_dashboard_and_metrics_of_a_standby_say_so(
    etcd_server: EtcdServer, etcd_url: str, tmp_path: Path
) -> None:
    coords = [
        Coordinator(
            _config(
                etcd_url,
                tmp_path,
                dashboard_port=free_port(),
                dashboard_without_token=True,
                metrics_port=free_port(),
            )
        )
        for _ in range(2)
    ]
    try:
        for c in coords:
            await c.start()
        leader = await _leader_elected(coords)
        standby = next(c for c in coords if c is not leader)
        assert leader.dashboard is not None and standby.dashboard is not None
        assert "standby" not in leader.dashboard.model.overview()
        said = standby.dashboard.model.overview()["standby"]
        assert said == f"Standby replica (not the leader; the leader is at {leader.advertised()})."
        for c, value in ((leader, 1.0), (standby, 0.0)):
            assert c.metrics is not None
            assert c.metrics.registry.get_sample_value("gelastic_coordinator_leader") == value
    finally:
        for c in coords:
            await c.stop()
