"""An assignment too big to send fails its job as an input failure; the node stays.

Before the fix the coordinator wrote the oversized Assign to the node's stream, the write failed,
the stream ended and the node was lost; the job re-formed on the next node without spending its
budget, and so on through the cluster. Submit now refuses such a spec (test_spec_cap.py); this
test puts one in the queue past Submit, as a spec admitted by an earlier version and restored
from disk would be.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import coordinator._node_sessions as sessions_module
from client import Client, JobSpec, JobState
from client.assignment import RoundAssignment, WorkerRanks
from client.model import MAX_STRING, FailureCategory
from client.node_protocol import PortReserved
from coordinator._cluster import AssignRound, Cluster, ClusterConfig, RequestPort, StopRound
from coordinator._node_sessions import MAX_NODE_MESSAGE_BYTES
from coordinator._service import CoordinatorService
from coordinator.server import Coordinator, CoordinatorConfig
from protos.gelastic.v1 import gelastic_pb2 as pb
from tests._helpers import wait_for
from tests.service._fakes import FakeNode
from tests.unit import test_cluster_fuzz as cluster_fuzz

WAIT_S = 20.0


@pytest.fixture
async def coordinator() -> AsyncIterator[Coordinator]:
    cfg = CoordinatorConfig(state_dir=":memory:", port=0, lease=600.0, heartbeat_interval=1.0)
    async with Coordinator(cfg) as c:
        yield c


async def test_an_unsendable_assignment_fails_the_job_and_keeps_the_node(
    coordinator: Coordinator,
) -> None:
    svc = coordinator.service
    node = FakeNode(coordinator.address, "n1", "127.0.0.1", slots=2)
    await node.connect()
    count = MAX_NODE_MESSAGE_BYTES // (MAX_STRING - 16) + 4
    spec = JobSpec(
        entrypoint=["true"],
        env={f"V{i}": "x" * (MAX_STRING - 16) for i in range(count)},
        max_restarts=5,
    )
    spec.validate()  # within every per-field limit, as an earlier version admitted it
    job_id = "big-0001"
    svc.apply(svc.cluster.submit(job_id, spec, svc.now()))
    rp = (await node.expect("reserve_port")).reserve_port
    await node.send(port_reserved=pb.PortReserved(job_id=rp.job_id, round=rp.round, port=40000))
    await wait_for(
        lambda: svc.cluster.job_state(job_id).is_terminal(), WAIT_S, what="the job to end"
    )

    assert svc.cluster.job_state(job_id) == JobState.FAILED
    status = svc.cluster.job_status(job_id)
    assert status.attempt == 0 and status.round == rp.round  # no restart, no re-form
    assert f"{MAX_NODE_MESSAGE_BYTES:,}" in status.reason and "bytes" in status.reason
    result = svc.cluster.job_result(job_id)
    assert result is not None and result.failures
    assert {f.category for f in result.failures.values()} == {FailureCategory.INPUT}
    kinds = [e.kind for e in svc.cluster.job_events(job_id)]
    assert "assign_undeliverable" in kinds and "node_lost" not in kinds and "reform" not in kinds

    # The node is live, its stream open, and it takes the next job.
    (info,) = svc.cluster.nodes()
    assert info.name == "n1" and info.state == "live" and info.jobs == ()
    client = Client(coordinator.address, timeout=10)
    try:
        job = await asyncio.to_thread(client.submit, JobSpec(entrypoint=["true"]))
        rp2 = (await node.expect("reserve_port")).reserve_port
        assert rp2.job_id == job.job_id
    finally:
        client.close()
        await node.close()


def test_the_state_machine_fails_the_job_once_every_assignment_is_undeliverable() -> None:
    """Two nodes, neither assignment sendable: an INPUT failure, no restart, no node lost."""
    c = Cluster(ClusterConfig(heartbeat_interval=1.0, lease=5.0))
    now = 1000.0
    for name in ("a", "b"):
        c.node_connected(name, "127.0.0.1", 1, f"inc-{name}", now)
    spec = JobSpec(entrypoint=["true"], min_nodes=2, max_nodes=2, max_restarts=3)
    submitted = c.submit("j1", spec, now)
    rp = next(e for e in submitted + c.tick(now + 1) if isinstance(e, RequestPort))
    effects = c.step(rp.node, f"inc-{rp.node}", PortReserved("j1", rp.round, 40000, ""), now + 1)
    assigned = [e.node for e in effects if isinstance(e, AssignRound)]
    assert sorted(assigned) == ["a", "b"]

    first = c.assign_undeliverable(assigned[0], "j1", rp.round, "too big", now + 1)
    # The node that never got the round is not asked to stop it; the other one is.
    assert [e.node for e in first if isinstance(e, StopRound)] == [assigned[1]]
    assert c.job_state("j1") == JobState.STOPPING
    c.assign_undeliverable(assigned[1], "j1", rp.round, "too big", now + 1)
    assert c.job_state("j1") == JobState.FAILED
    status = c.job_status("j1")
    assert status.attempt == 0  # the budget of 3 restarts is untouched
    assert "cannot be sent: too big" in status.reason
    result = c.job_result("j1")
    assert result is not None
    assert {f.category for f in result.failures.values()} == {FailureCategory.INPUT}
    assert sorted((n.name, n.state, n.jobs) for n in c.nodes()) == [
        ("a", "live", ()),
        ("b", "live", ()),
    ]
    # A late or repeated report changes nothing.
    c.assign_undeliverable(assigned[0], "j1", rp.round, "too big", now + 2)
    assert c.job_state("j1") == JobState.FAILED


undeliverable = st.tuples(
    st.just("undeliverable"), cluster_fuzz.node, cluster_fuzz.job, cluster_fuzz.rnd
)


@settings(
    max_examples=2 * settings().max_examples,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(st.lists(st.one_of(cluster_fuzz.action, undeliverable), max_size=40))
def test_undeliverable_reports_among_random_messages_never_break_the_cluster(
    actions: list[tuple[Any, ...]],
) -> None:
    """The cluster fuzz's messages with undeliverable reports mixed in, at any moment."""
    d = cluster_fuzz._Driver()
    for a in actions:
        if a[0] != "undeliverable":
            d.step(a)
        else:
            _, name, job_id, round_ = a
            nodes = sorted((n.name, n.state) for n in d.c.nodes())
            was = d.c.job_status(job_id) if d.c.has_job(job_id) else None
            d.c.assign_undeliverable(name, job_id, round_, "too big", d.now)
            # Never a node lost, never a restart spent.
            assert sorted((n.name, n.state) for n in d.c.nodes()) == nodes
            if was is not None and d.c.has_job(job_id):
                assert d.c.job_status(job_id).attempt == was.attempt
        d.check()


_text = st.text(st.characters(codec="utf-8", exclude_characters="\x00"), max_size=40)


@settings(max_examples=settings().max_examples, deadline=None)
@given(
    argv=st.lists(_text, min_size=1, max_size=5),
    env=st.dictionaries(st.from_regex(r"[A-Z_][A-Z0-9_]{0,8}", fullmatch=True), _text, max_size=5),
    workers=st.integers(0, 300),
    big=st.integers(-(2**31), 2**31 - 1),
)
def test_the_cheap_size_bound_is_never_below_the_encoded_assignment(
    argv: list[str], env: dict[str, str], workers: int, big: int
) -> None:
    """The coordinator measures an Assign only when this bound says it might be too big."""
    argv[0] = argv[0] or "x"
    spec = JobSpec(entrypoint=argv, env=env, name="n" * 128, cwd="/" + "é" * 100)
    assignment = RoundAssignment(
        job_id="j" * 160,
        round=big,
        attempt=big,
        spec=spec,
        group_rank=big,
        group_world_size=big,
        master_addr="a" * 255,
        master_port=big,
        workers=tuple(WorkerRanks(big, big, big, big, big) for _ in range(workers)),
        run_id="j" * 160,
    )
    svc = CoordinatorService()
    session = sessions_module._Session("n1", "inc")
    svc._sessions["n1"] = session
    svc._send(AssignRound("n1", assignment))
    msg = session.outbox.get_nowait()
    assert msg.WhichOneof("kind") == "assign"
    assert sessions_module._assign_size_bound(assignment) >= msg.ByteSize()
