"""Hostile input against a live coordinator: every request gets a status code, the server stays up.

The coordinator runs on its own event loop in a thread; hypothesis drives it through plain
blocking gRPC stubs, thousands of cases in all.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import Iterator
from typing import Any

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from coordinator.server import Coordinator, CoordinatorConfig
from protos.gelastic.v1 import gelastic_pb2 as pb
from protos.gelastic.v1 import gelastic_pb2_grpc as pb_grpc

# UNAVAILABLE is not here: nothing in these cases may find the coordinator unable to serve (its
# store is in memory, no job has a node holding logs), so UNAVAILABLE means the server broke.
ACCEPTABLE = {
    grpc.StatusCode.OK,
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.ALREADY_EXISTS,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
}


class _Server:
    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.ready = threading.Event()
        self.coord: Coordinator | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        assert self.ready.wait(30)
        assert self.coord is not None
        self.address = self.coord.address

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)

        async def main() -> None:
            self.coord = Coordinator(CoordinatorConfig(state_dir=":memory:", port=0, lease=60))
            await self.coord.start()
            self.ready.set()
            self.stop_event = asyncio.Event()
            await self.stop_event.wait()
            await self.coord.stop(0.5)

        try:
            self.loop.run_until_complete(main())
        finally:
            self.loop.close()

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.stop_event.set)
        self.thread.join(30)


@pytest.fixture(scope="module")
def server() -> Iterator[_Server]:
    s = _Server()
    yield s
    s.close()


@pytest.fixture(scope="module")
def channel(server: _Server) -> Iterator[grpc.Channel]:
    ch = grpc.insecure_channel(server.address)
    yield ch
    ch.close()


def _code(fn: Any, *args: Any, **kw: Any) -> grpc.StatusCode:
    try:
        fn(*args, timeout=10, **kw)
        return grpc.StatusCode.OK
    except grpc.RpcError as exc:
        return exc.code()  # type: ignore[attr-defined,no-any-return]


texts = st.text(max_size=30)
big_ints = st.integers(min_value=-(2**63), max_value=2**63 - 1)
i32 = st.integers(min_value=-(2**31), max_value=2**31 - 1)

specs = st.builds(
    pb.JobSpec,
    name=texts,
    role=texts,
    entrypoint=st.lists(texts, max_size=4),
    function=st.one_of(texts, st.just("pkg.mod:fn")),
    args=st.lists(texts, max_size=3),
    function_args=st.binary(max_size=64),
    nproc_per_node=i32,
    min_nodes=i32,
    max_nodes=i32,
    max_restarts=i32,
    env=st.dictionaries(texts, texts, max_size=3),
    redirects=texts,
    tee=texts,
    join_timeout_ms=big_ints,
    last_call_timeout_ms=big_ints,
    exit_barrier_timeout_ms=big_ints,
    stop_grace_ms=big_ints,
    restart_backoff_ms=big_ints,
    scale_up=texts,
    watchdog=st.booleans(),
    cwd=texts,
    stderr_tail_lines=i32,
    unhealthy_timeout_ms=big_ints,
)


@settings(
    max_examples=15 * settings().max_examples,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(spec=specs)
def test_submit_of_any_spec_is_accepted_or_refused_naming_a_field(
    channel: grpc.Channel, spec: pb.JobSpec
) -> None:
    stub = pb_grpc.CoordinatorStub(channel)
    try:
        resp = stub.Submit(pb.SubmitRequest(spec=spec), timeout=10)
    except grpc.RpcError as exc:
        assert exc.code() == grpc.StatusCode.INVALID_ARGUMENT, exc  # type: ignore[attr-defined]
        assert exc.details().startswith("invalid spec: ")  # type: ignore[attr-defined]
        return
    stub.CancelJob(pb.CancelJobRequest(job_id=resp.job_id), timeout=10)


@settings(
    max_examples=6 * settings().max_examples,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(job_id=texts, rank=i32, stream=texts, attempt=i32, after=big_ints)
def test_reads_with_any_arguments_get_a_status(
    channel: grpc.Channel, job_id: str, rank: int, stream: str, attempt: int, after: int
) -> None:
    stub = pb_grpc.CoordinatorStub(channel)
    codes = [
        _code(stub.GetJob, pb.GetJobRequest(job_id=job_id)),
        _code(stub.GetEvents, pb.GetEventsRequest(job_id=job_id, after_seq=after)),
        _code(stub.CancelJob, pb.CancelJobRequest(job_id=job_id)),
        _code(
            lambda req, timeout: list(stub.ReadLogs(req, timeout=timeout)),
            pb.ReadLogsRequest(job_id=job_id, rank=rank, stream=stream, attempt=attempt),
        ),
    ]
    assert set(codes) <= ACCEPTABLE, codes


node_messages = st.one_of(
    st.builds(
        lambda s, g: pb.NodeMessage(heartbeat=pb.Heartbeat(seq=s, groups=g)),
        big_ints,
        st.lists(
            st.builds(
                pb.GroupHealth,
                job_id=texts,
                round=i32,
                workers=st.lists(
                    st.builds(
                        pb.WorkerHealth,
                        local_rank=i32,
                        pid=i32,
                        cpu_percent=st.floats(),
                        rss_bytes=big_ints,
                        proc_state=texts,
                    ),
                    max_size=2,
                ),
            ),
            max_size=2,
        ),
    ),
    st.builds(
        lambda j, r, p, e: pb.NodeMessage(
            port_reserved=pb.PortReserved(job_id=j, round=r, port=p, error=e)
        ),
        texts,
        i32,
        i32,
        texts,
    ),
    st.builds(
        lambda j, r, w: pb.NodeMessage(
            workers_started=pb.WorkersStarted(job_id=j, round=r, workers=w)
        ),
        texts,
        i32,
        st.lists(st.builds(pb.WorkerPid, local_rank=i32, pid=i32, global_rank=i32), max_size=3),
    ),
    st.builds(
        lambda j, r, x: pb.NodeMessage(worker_exited=pb.WorkerExited(job_id=j, round=r, exit=x)),
        texts,
        i32,
        st.builds(
            pb.WorkerExit,
            local_rank=i32,
            global_rank=i32,
            pid=i32,
            exitcode=i32,
            stopped_by_agent=st.booleans(),
            has_failure=st.booleans(),
            failure=st.builds(pb.ProcessFailure, message=texts, timestamp=st.floats()),
            return_value=st.binary(max_size=32),
            has_return_value=st.booleans(),
            timestamp=st.floats(),
        ),
    ),
    st.builds(
        lambda j, r, u: pb.NodeMessage(
            group_stopped=pb.GroupStopped(job_id=j, round=r, unkillable_pids=u)
        ),
        texts,
        i32,
        st.lists(i32, max_size=3),
    ),
    st.builds(
        lambda i, d: pb.NodeMessage(log_chunk=pb.LogChunk(request_id=i, data=d)),
        big_ints,
        st.binary(max_size=32),
    ),
    st.builds(
        lambda h: pb.NodeMessage(hello=h),
        st.builds(pb.Hello, name=texts, addr=texts, slots=i32, incarnation=texts),
    ),
    st.just(pb.NodeMessage()),
)

_counter = iter(range(10**9))


@settings(
    max_examples=8 * settings().max_examples,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(
    first=st.builds(pb.Hello, name=texts, addr=texts, slots=i32, incarnation=texts) | st.just(None),
    messages=st.lists(node_messages, max_size=8),
)
def test_node_sessions_with_any_messages_never_hurt_the_server(
    channel: grpc.Channel, first: pb.Hello | None, messages: list[pb.NodeMessage]
) -> None:
    outbox: queue.Queue[pb.NodeMessage | None] = queue.Queue()
    if first is None:
        first = pb.Hello(name=f"fuzz-{next(_counter)}", addr="127.0.0.1", slots=2, incarnation="i")
    outbox.put(pb.NodeMessage(hello=first))
    for m in messages:
        outbox.put(m)
    outbox.put(None)

    def gen() -> Iterator[pb.NodeMessage]:
        while (m := outbox.get()) is not None:
            yield m

    call = pb_grpc.NodeSessionStub(channel).Session(gen(), timeout=5)
    try:
        for _ in call:
            pass
    except grpc.RpcError as exc:
        assert exc.code() in ACCEPTABLE | {
            grpc.StatusCode.CANCELLED,
            grpc.StatusCode.DEADLINE_EXCEEDED,
        }, exc  # type: ignore[attr-defined]
    # Still serving, and still sane.
    stub = pb_grpc.CoordinatorStub(channel)
    stub.ListNodes(pb.ListNodesRequest(), timeout=10)
    stub.ListJobs(pb.ListJobsRequest(include_finished=True), timeout=10)
