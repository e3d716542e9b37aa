"""Standard probes (gRPC health, server reflection) and Prometheus metrics of both programs.

An in-process coordinator on 127.0.0.1:0; probes are called through the stock grpc_health and
grpc_reflection stubs (what grpcurl and a Kubernetes gRPC probe use), metrics are scraped over
HTTP with urllib and parsed with prometheus_client's own parser. Jobs are driven by scripted node
sessions; tests/e2e/test_metrics.py runs the real programs with real workers.
"""

from __future__ import annotations

import asyncio
import socket
import time
import urllib.error
import urllib.request
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from client import Client, JobSpec, WorkerState
from client.model import FailureCategory, ProcessFailure
from client.node_protocol import GroupStopped, PortReserved, WorkerExited, WorkersStarted
from coordinator._cluster import Cluster, ClusterConfig, RunningGroupReport, WorkerExitReport
from coordinator._metrics import CoordinatorMetrics
from coordinator.server import Coordinator, CoordinatorConfig
from nodeagent._metrics import AgentMetrics
from protos.gelastic.v1 import gelastic_pb2 as pb
from protos.gelastic.v1 import gelastic_pb2_grpc as pb_grpc
from tests._helpers import free_port
from tests.service._fakes import FakeNode, run_round, worker_exit

STEP = 10.0
TOKEN = "probe-token-for-tests-0123456789"
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


# ---- helpers -----------------------------------------------------------------------------------


def _scrape(port: int) -> Samples:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        assert resp.status == 200
        text = resp.read().decode()
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


async def scrape(port: int) -> Samples:
    return await asyncio.to_thread(_scrape, port)


def value(samples: Samples, name: str, **labels: str) -> float | None:
    return samples.get((name, frozenset(labels.items())))


async def poll_metric(
    port: int, name: str, pred: Callable[[float | None], bool], timeout: float = STEP, **labels: str
) -> Samples:
    """Scrape until `pred(value)` holds; fail with the last value seen."""
    deadline = time.monotonic() + timeout
    while True:
        samples = await scrape(port)
        v = value(samples, name, **labels)
        if pred(v):
            return samples
        if time.monotonic() >= deadline:
            raise AssertionError(f"{name}{labels} is {v} after {timeout} s")
        await asyncio.sleep(0.05)


def refused(port: int) -> bool:
    try:
        _scrape(port)
    except (urllib.error.URLError, ConnectionError):
        return True
    return False


# ---- probes ------------------------------------------------------------------------------------


@pytest.fixture
async def guarded(tmp_path: Path) -> AsyncIterator[Coordinator]:
    """A coordinator that requires a token for every gelastic call."""
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN)
    async with Coordinator(
        CoordinatorConfig(state_dir=":memory:", port=0, token_file=str(token_file))
    ) as c:
        yield c


async def test_health_answers_serving_without_a_token(guarded: Coordinator) -> None:
    async with grpc.aio.insecure_channel(guarded.address) as ch:
        # The token check is on: a gelastic call without the token is refused ...
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await pb_grpc.CoordinatorStub(ch).ListNodes(pb.ListNodesRequest(), timeout=STEP)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        # ... while the standard health service answers anyone, for the server and each service.
        health = health_pb2_grpc.HealthStub(ch)
        for service in ("", "gelastic.v1.Coordinator", "gelastic.v1.NodeSession"):
            resp = await health.Check(health_pb2.HealthCheckRequest(service=service), timeout=STEP)
            assert resp.status == SERVING, service
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await health.Check(
                health_pb2.HealthCheckRequest(service="no.such.Service"), timeout=STEP
            )
        assert err.value.code() == grpc.StatusCode.NOT_FOUND


async def test_health_turns_not_serving_when_the_coordinator_stops() -> None:
    coord = Coordinator(CoordinatorConfig(state_dir=":memory:", port=0))
    await coord.start()
    try:
        async with grpc.aio.insecure_channel(coord.address) as ch:
            watch = health_pb2_grpc.HealthStub(ch).Watch(
                health_pb2.HealthCheckRequest(service="gelastic.v1.Coordinator")
            )
            first = await asyncio.wait_for(watch.read(), STEP)
            assert first.status == SERVING
            stopping = asyncio.create_task(coord.stop(grace=2.0))
            second = await asyncio.wait_for(watch.read(), STEP)
            assert second is not grpc.aio.EOF and second.status == NOT_SERVING
            await stopping
    finally:
        await coord.stop()


async def test_reflection_lists_and_describes_our_services(guarded: Coordinator) -> None:
    async with grpc.aio.insecure_channel(guarded.address) as ch:
        stub = reflection_pb2_grpc.ServerReflectionStub(ch)

        async def ask(
            req: reflection_pb2.ServerReflectionRequest,
        ) -> reflection_pb2.ServerReflectionResponse:
            call = stub.ServerReflectionInfo(iter([req]), timeout=STEP)
            responses = [r async for r in call]
            assert len(responses) == 1
            return responses[0]

        listed = await ask(reflection_pb2.ServerReflectionRequest(list_services=""))
        names = {s.name for s in listed.list_services_response.service}
        assert {
            "gelastic.v1.Coordinator",
            "gelastic.v1.NodeSession",
            "grpc.health.v1.Health",
        } <= names
        # What `grpcurl describe gelastic.v1.Coordinator` needs: the file that defines it.
        described = await ask(
            reflection_pb2.ServerReflectionRequest(file_containing_symbol="gelastic.v1.Coordinator")
        )
        files = described.file_descriptor_response.file_descriptor_proto
        assert files and any(b"gelastic.v1" in f for f in files)


# ---- coordinator metrics -----------------------------------------------------------------------


@pytest.fixture
async def metered() -> AsyncIterator[tuple[Coordinator, int]]:
    port = free_port()
    config = CoordinatorConfig(
        state_dir=":memory:", port=0, lease=30.0, heartbeat_interval=1.0, metrics_port=port
    )
    async with Coordinator(config) as c:
        yield c, port
    assert await asyncio.to_thread(refused, port), "the metrics endpoint outlived the coordinator"


async def test_metrics_follow_a_job_through_a_failure_and_a_restart(
    metered: tuple[Coordinator, int],
) -> None:
    coord, port = metered
    samples = await scrape(port)
    assert value(samples, "gelastic_jobs", state="QUEUED") == 0
    assert value(samples, "gelastic_restarts_total") == 0
    assert value(samples, "gelastic_failures_total", category="USER") == 0
    assert (value(samples, "process_resident_memory_bytes") or 0) > 0

    client = Client(coord.address, timeout=STEP)
    spec = JobSpec(
        entrypoint=["python", "train.py"],
        nproc_per_node=2,
        min_nodes=2,
        max_nodes=2,
        max_restarts=1,
    )
    job = await asyncio.to_thread(client.submit, spec)
    samples = await scrape(port)
    assert value(samples, "gelastic_jobs", state="QUEUED") == 1
    assert value(samples, "gelastic_rendezvous_duration_seconds_count") == 0

    a = FakeNode(coord.address, "node-a", "127.0.0.1")
    b = FakeNode(coord.address, "node-b", "127.0.0.2")
    await a.connect()
    await b.connect()
    aa, ab = await run_round(a, b)
    samples = await poll_metric(port, "gelastic_jobs", lambda v: v == 1, state="RUNNING")
    assert value(samples, "gelastic_jobs", state="QUEUED") == 0
    assert value(samples, "gelastic_rendezvous_duration_seconds_count") == 1
    await poll_metric(port, "gelastic_nodes", lambda v: v == 2, state="live")

    # Rank 3 fails (a user error); the peers are stopped; the job restarts.
    failure = pb.ProcessFailure(
        message="boom",
        exitcode=3,
        pid=1003,
        timestamp=time.time(),
        local_rank=1,
        category=pb.FAILURE_CATEGORY_USER,
    )
    await b.outbox.put(worker_exit(ab, 1, 3, failure=failure, has_failure=True))
    await a.expect("stop")
    await b.expect("stop")
    for node, asg in ((a, aa), (b, ab)):
        await node.send(group_stopped=pb.GroupStopped(job_id=asg.job_id, round=asg.round))
    samples = await poll_metric(port, "gelastic_restarts_total", lambda v: v == 1)
    assert value(samples, "gelastic_failures_total", category="USER") == 1
    assert value(samples, "gelastic_failures_total", category="INFRA") == 0
    assert value(samples, "gelastic_failure_to_restart_seconds_count") == 0

    # The next round's workers all start: the recovery is measured, and so is the second wait.
    aa, ab = await run_round(a, b)
    samples = await poll_metric(port, "gelastic_failure_to_restart_seconds_count", lambda v: v == 1)
    assert value(samples, "gelastic_rendezvous_duration_seconds_count") == 2
    assert value(samples, "gelastic_jobs", state="RUNNING") == 1

    for node, asg in ((a, aa), (b, ab)):
        for lr in range(2):
            await node.outbox.put(worker_exit(asg, lr, 0))
    result = await asyncio.to_thread(job.wait, STEP)
    assert result.state == WorkerState.SUCCEEDED
    samples = await poll_metric(port, "gelastic_jobs", lambda v: v == 1, state="SUCCEEDED")
    assert value(samples, "gelastic_jobs", state="RUNNING") == 0
    assert value(samples, "gelastic_failures_total", category="USER") == 1

    await b.close()
    await poll_metric(port, "gelastic_nodes", lambda v: v == 1, state="lost")
    await a.close()
    client.close()


async def test_node_loss_counts_as_an_infra_failure_and_platform_failures_are_labelled(
    metered: tuple[Coordinator, int],
) -> None:
    coord, port = metered
    client = Client(coord.address, timeout=STEP)
    spec = JobSpec(
        entrypoint=["python", "train.py"],
        nproc_per_node=2,
        min_nodes=1,
        max_nodes=2,
        max_restarts=3,
        last_call_timeout=0,
    )
    a = FakeNode(coord.address, "node-a", "127.0.0.1")
    b = FakeNode(coord.address, "node-b", "127.0.0.2")
    await a.connect()
    await b.connect()
    job = await asyncio.to_thread(client.submit, spec)  # both nodes are free: it takes both
    aa, _ = await run_round(a, b)
    await poll_metric(port, "gelastic_jobs", lambda v: v == 1, state="RUNNING")

    await b.close()  # node-b is lost: the job re-forms on node-a alone, spending no restart
    stop = await a.expect("stop")
    await a.send(group_stopped=pb.GroupStopped(job_id=aa.job_id, round=stop.stop.round))
    samples = await poll_metric(port, "gelastic_failures_total", lambda v: v == 1, category="INFRA")
    assert value(samples, "gelastic_restarts_total") == 0
    rp = await a.expect("reserve_port")
    await a.send(
        port_reserved=pb.PortReserved(job_id=job.job_id, round=rp.reserve_port.round, port=40001)
    )
    asg = (await a.expect("assign")).assign
    await a.send(
        workers_started=pb.WorkersStarted(
            job_id=asg.job_id,
            round=asg.round,
            workers=[
                pb.WorkerPid(
                    local_rank=w.local_rank, pid=1000 + w.global_rank, global_rank=w.global_rank
                )
                for w in asg.workers
            ],
        )
    )
    await poll_metric(port, "gelastic_failure_to_restart_seconds_count", lambda v: v == 1)

    # The agent could not launch a worker: a PLATFORM failure.
    failure = pb.ProcessFailure(
        message="cannot fork",
        exitcode=1,
        pid=1000,
        timestamp=time.time(),
        category=pb.FAILURE_CATEGORY_PLATFORM,
    )
    await a.outbox.put(worker_exit(asg, 0, 1, failure=failure, has_failure=True))
    samples = await poll_metric(
        port, "gelastic_failures_total", lambda v: v == 1, category="PLATFORM"
    )
    assert value(samples, "gelastic_failures_total", category="USER") == 0
    await asyncio.to_thread(job.cancel)
    await a.close()
    client.close()


async def test_two_coordinators_in_one_process_keep_their_own_metrics() -> None:
    p1, p2 = free_port(), free_port()
    async with (
        Coordinator(CoordinatorConfig(state_dir=":memory:", port=0, metrics_port=p1)) as c1,
        Coordinator(CoordinatorConfig(state_dir=":memory:", port=0, metrics_port=p2)) as c2,
    ):
        client = Client(c1.address, timeout=STEP)
        await asyncio.to_thread(client.submit, JobSpec(entrypoint=["true"]))
        client.close()
        assert value(await scrape(p1), "gelastic_jobs", state="QUEUED") == 1
        assert value(await scrape(p2), "gelastic_jobs", state="QUEUED") == 0
        assert c2.metrics is not None
    assert await asyncio.to_thread(refused, p1)
    assert await asyncio.to_thread(refused, p2)


async def test_a_taken_metrics_port_is_a_clear_error() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        taken = s.getsockname()[1]
        coord = Coordinator(CoordinatorConfig(state_dir=":memory:", port=0, metrics_port=taken))
        with pytest.raises(
            OSError,
            match=rf"cannot serve metrics \(--metrics-port\) on 127.0.0.1:{taken}: the port is in use",
        ):
            await coord.start()
    with pytest.raises(ValueError, match="metrics_port"):
        CoordinatorConfig(state_dir=":memory:", metrics_port=70000).validate()


# ---- agent metrics -----------------------------------------------------------------------------


async def test_agent_metrics_serve_the_heartbeat_snapshot() -> None:
    """AgentMetrics alone; a real agent with real workers is in tests/e2e/test_metrics.py."""
    port = free_port()
    metrics = AgentMetrics("node-x", "127.0.0.1", port)
    metrics.observe([])  # a heartbeat before any metrics are served: no error
    await asyncio.to_thread(metrics.start)
    try:
        samples = await scrape(port)
        assert value(samples, "gelastic_agent_workers", node="node-x") == 0
        assert (value(samples, "gelastic_agent_rss_bytes", node="node-x") or 0) > 0
        health = pb.GroupHealth(
            job_id="job-1",
            round=2,
            workers=[
                pb.WorkerHealth(
                    local_rank=0, global_rank=4, pid=11, cpu_percent=97.5, rss_bytes=1000
                ),
                pb.WorkerHealth(
                    local_rank=1, global_rank=5, pid=12, cpu_percent=3.0, rss_bytes=2000
                ),
            ],
        )
        metrics.observe([health])
        samples = await scrape(port)
        assert value(samples, "gelastic_agent_workers", node="node-x") == 2
        labels = {"node": "node-x", "job_id": "job-1"}
        assert value(samples, "gelastic_agent_worker_cpu_percent", rank="4", **labels) == 97.5
        assert value(samples, "gelastic_agent_worker_rss_bytes", rank="5", **labels) == 2000
        metrics.observe([])  # the group ended: its series go away
        samples = await scrape(port)
        assert not any(name == "gelastic_agent_worker_rss_bytes" for name, _ in samples)
    finally:
        await asyncio.to_thread(metrics.stop)
    assert await asyncio.to_thread(refused, port)
    await asyncio.to_thread(metrics.stop)  # idempotent
    assert AgentMetrics("node-y").endpoint is None  # port 0: nothing is served


# ---- the same accounting, driven straight through the state machine with a fake clock ----------


def _sample(metrics: CoordinatorMetrics, name: str, **labels: str) -> float | None:
    return metrics.registry.get_sample_value(name, labels)


def test_durations_come_from_the_clock_of_the_effects() -> None:
    now = 100.0
    cluster = Cluster(ClusterConfig(lease=1000.0))
    metrics = CoordinatorMetrics(cluster, clock=lambda: now)
    spec = JobSpec(entrypoint=["x"], nproc_per_node=1, min_nodes=1, max_nodes=1, max_restarts=1)
    metrics.observe(cluster.submit("j1", spec, now))
    now = 102.0
    metrics.observe(cluster.node_connected("n1", "127.0.0.1", 1, "inc", now))
    now = 103.0
    metrics.observe(cluster.step("n1", "inc", PortReserved("j1", 1, 40000, ""), now))
    assert _sample(metrics, "gelastic_rendezvous_duration_seconds_sum") == 3.0
    metrics.observe(cluster.step("n1", "inc", WorkersStarted("j1", 1, ((0, 100),)), now))

    now = 110.0
    crash = WorkerExitReport(local_rank=0, global_rank=0, pid=100, exitcode=1, timestamp=now)
    metrics.observe(cluster.step("n1", "inc", WorkerExited("j1", 1, crash), now))
    now = 111.0
    metrics.observe(cluster.step("n1", "inc", GroupStopped("j1", 1, ()), now))
    assert _sample(metrics, "gelastic_restarts_total") == 1
    assert _sample(metrics, "gelastic_failures_total", category="USER") == 1
    now = 112.0
    metrics.observe(cluster.step("n1", "inc", PortReserved("j1", 2, 40001, ""), now))
    assert _sample(metrics, "gelastic_rendezvous_duration_seconds_sum") == 3.0 + 1.0
    assert _sample(metrics, "gelastic_failure_to_restart_seconds_count") == 0
    now = 114.0
    metrics.observe(cluster.step("n1", "inc", WorkersStarted("j1", 2, ((0, 101),)), now))
    assert _sample(metrics, "gelastic_failure_to_restart_seconds_count") == 1
    assert _sample(metrics, "gelastic_failure_to_restart_seconds_sum") == 4.0
    assert metrics.job_counts()["RUNNING"] == 1


def test_the_category_is_found_when_the_same_batch_ended_the_round() -> None:
    """A reconnecting agent reports a failed, already stopped group: failure, stop and restart
    happen in one batch, and the failure has moved into the closed attempt by then."""
    now = 0.0
    cluster = Cluster(ClusterConfig(lease=1000.0))
    metrics = CoordinatorMetrics(cluster, clock=lambda: now)
    spec = JobSpec(entrypoint=["x"], nproc_per_node=1, min_nodes=1, max_nodes=1, max_restarts=2)
    metrics.observe(cluster.submit("j1", spec, now))
    metrics.observe(cluster.node_connected("n1", "127.0.0.1", 1, "inc", now))
    metrics.observe(cluster.step("n1", "inc", PortReserved("j1", 1, 40000, ""), now))
    metrics.observe(cluster.step("n1", "inc", WorkersStarted("j1", 1, ((0, 100),)), now))
    failure = ProcessFailure(
        global_rank=0,
        local_rank=0,
        pid=100,
        exitcode=1,
        message="lost its workers",
        timestamp=now,
        category=FailureCategory.PLATFORM,
    )
    report = RunningGroupReport(
        job_id="j1",
        round=1,
        attempt=0,
        pids=((0, 100),),
        exits=(WorkerExitReport(0, 0, 100, 1, failure=failure, timestamp=now),),
        stopped=True,
    )
    metrics.observe(cluster.node_connected("n1", "127.0.0.1", 1, "inc", now, [report]))
    assert _sample(metrics, "gelastic_restarts_total") == 1
    assert _sample(metrics, "gelastic_failures_total", category="PLATFORM") == 1
    assert _sample(metrics, "gelastic_failures_total", category="USER") == 0
