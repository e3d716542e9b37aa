"""Specs at and around every documented limit: refused naming the field, or run to the end.

Hypothesis builds wire-form specs whose sizes and values sit on, just under and just over each
limit of docs/python-api.md (env, argv, pickled arguments, the encoded spec, counts, seconds,
names, cwd). Each goes straight to Submit (no client-side check first). Either the coordinator
refuses it with INVALID_ARGUMENT naming the field the client's own checks name, or the job runs
to a terminal state on two scripted agents that receive the spec intact. No spec ever costs a
node: both agents keep their one session throughout, and no job records a lost node.

The coordinator and the agents run on their own event loop in a thread; hypothesis drives them
through a blocking stub. The ci profile is derandomized; `make fuzz` runs more examples.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import grpc
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from client.model import (
    MAX_ARGV_ITEMS,
    MAX_ENV_ITEMS,
    MAX_FUNCTION_ARGS_BYTES,
    MAX_NODES,
    MAX_NPROC_PER_NODE,
    MAX_RESTARTS,
    MAX_SPEC_BYTES,
    MAX_STRING,
    MAX_TIMEOUT_S,
    SpecError,
)
from client.wire import check_spec_size, spec_from_pb, spec_to_pb
from coordinator.server import Coordinator, CoordinatorConfig
from protos.gelastic.v1 import gelastic_pb2 as pb
from protos.gelastic.v1 import gelastic_pb2_grpc as pb_grpc
from tests.service._fakes import FakeNode

T = TypeVar("T")
NODES = 2
SLOTS = MAX_NPROC_PER_NODE
MESSAGE_LIMIT = 16 * 1024 * 1024
"""gRPC's message limit on the coordinator's and the agents' streams."""
RUN_BOUND_S = 60.0
"""How long an admitted job has to reach a terminal state (it takes well under a second)."""
SPEC_FIELDS = {
    "entrypoint",
    "args",
    "function_args",
    "env",
    "nproc_per_node",
    "min_nodes",
    "max_nodes",
    "max_restarts",
    "role",
    "name",
    "redirects",
    "tee",
    "join_timeout",
    "last_call_timeout",
    "exit_barrier_timeout",
    "stop_grace",
    "restart_backoff",
    "unhealthy_timeout",
    "scale_up",
    "cwd",
    "stderr_tail_lines",
}


class _Agent:
    """A scripted agent: takes every round, starts its workers, and has them exit 0."""

    def __init__(self, address: str, name: str) -> None:
        self.node = FakeNode(address, name, "127.0.0.1", slots=SLOTS)
        self.specs: dict[str, pb.JobSpec] = {}
        self.ended = False
        self.task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        await self.node.connect()
        self.task = asyncio.get_running_loop().create_task(self._serve())

    async def _serve(self) -> None:
        call = self.node.call
        assert call is not None
        try:
            while True:
                msg = await call.read()
                if msg is grpc.aio.EOF:
                    break
                await self._on(msg)
        except (grpc.aio.AioRpcError, asyncio.CancelledError):
            pass
        finally:
            self.ended = True

    async def _on(self, msg: pb.CoordinatorMessage) -> None:
        kind = msg.WhichOneof("kind")
        if kind == "reserve_port":
            r = msg.reserve_port
            await self.node.send(
                port_reserved=pb.PortReserved(job_id=r.job_id, round=r.round, port=40000)
            )
        elif kind == "assign":
            a = msg.assign
            self.specs[a.job_id] = a.spec
            await self.node.send(
                workers_started=pb.WorkersStarted(
                    job_id=a.job_id,
                    round=a.round,
                    workers=[
                        pb.WorkerPid(local_rank=w.local_rank, pid=1000 + w.local_rank)
                        for w in a.workers
                    ],
                )
            )
            for w in a.workers:
                await self.node.send(
                    worker_exited=pb.WorkerExited(
                        job_id=a.job_id,
                        round=a.round,
                        exit=pb.WorkerExit(
                            local_rank=w.local_rank,
                            global_rank=w.global_rank,
                            pid=1000 + w.local_rank,
                            exitcode=0,
                        ),
                    )
                )
        elif kind == "stop":
            s = msg.stop
            await self.node.send(group_stopped=pb.GroupStopped(job_id=s.job_id, round=s.round))


class _Cluster:
    """A coordinator and NODES scripted agents on an event loop of their own."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.ready = threading.Event()
        self.coord: Coordinator | None = None
        self.agents: list[_Agent] = []
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        assert self.ready.wait(30)
        assert self.coord is not None
        self.address = self.coord.address

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)

        async def main() -> None:
            self.coord = Coordinator(CoordinatorConfig(state_dir=":memory:", port=0, lease=600))
            await self.coord.start()
            self.agents = [_Agent(self.coord.address, f"n{i}") for i in range(NODES)]
            for a in self.agents:
                await a.start()
            self.stop_event = asyncio.Event()
            self.ready.set()
            await self.stop_event.wait()
            for a in self.agents:
                if a.task is not None:
                    a.task.cancel()
                await a.node.close()
            await self.coord.stop(0.5)

        try:
            self.loop.run_until_complete(main())
        finally:
            self.loop.close()

    def on_loop(self, fn: Callable[[], T]) -> T:
        """Run `fn` on the cluster's loop (where its state lives) and return what it returns."""

        async def call() -> T:
            return fn()

        return asyncio.run_coroutine_threadsafe(call(), self.loop).result(30)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.stop_event.set)
        self.thread.join(30)


@pytest.fixture(scope="module")
def cluster() -> Iterator[_Cluster]:
    c = _Cluster()
    yield c
    c.close()


@pytest.fixture(scope="module")
def stub(cluster: _Cluster) -> Iterator[pb_grpc.CoordinatorStub]:
    ch = grpc.insecure_channel(
        cluster.address,
        options=[
            ("grpc.max_send_message_length", 16 << 20),
            ("grpc.max_receive_message_length", 16 << 20),
        ],
    )
    yield pb_grpc.CoordinatorStub(ch)
    ch.close()


# ---- specs near the limits ---------------------------------------------------------------------


def _near(limit: int, low: int = 0) -> st.SearchStrategy[int]:
    """On, just under and just over a limit, or at its low end."""
    return st.sampled_from(sorted({low, low + 1, limit - 1, limit, limit + 1}))


def _seconds_ms() -> st.SearchStrategy[int | None]:
    top = int(MAX_TIMEOUT_S * 1000)
    return st.none() | st.sampled_from([0, 1, 50, top, top + 1])


@st.composite
def _strings(draw: st.DrawFn, max_count: int) -> list[str]:
    """A list near `max_count` items, or a few items near MAX_STRING each, or near the spec cap."""
    shape = draw(st.sampled_from(["count", "long", "cap"]))
    if shape == "count":
        return ["a"] * draw(_near(max_count))
    if shape == "long":
        return ["b" * draw(_near(MAX_STRING))] * draw(st.integers(1, 3))
    # Each item under its own limit, the lot around the encoded-spec limit.
    per = MAX_STRING - draw(st.sampled_from([0, 8, 64]))
    count = MAX_SPEC_BYTES // per + draw(st.integers(-1, 1))
    return ["c" * per] * count


STRESSED = (
    "env",
    "env",
    "args",
    "args",
    "function_args",
    "function_args",
    "env_name",
    "nproc_per_node",
    "nodes",
    "max_restarts",
    "seconds",
    "name",
    "role",
    "cwd",
    "stderr_tail_lines",
    "std",
    "exact_cap",
    "exact_cap",
)
"""What an example pushes to its limits (one or two of these; the rest keep valid defaults).
The sizes come twice: they are what the encoded-spec limit is about."""


@st.composite
def wire_specs(draw: st.DrawFn) -> pb.JobSpec:
    stressed = set(draw(st.lists(st.sampled_from(STRESSED), min_size=1, max_size=2)))
    spec = pb.JobSpec()
    if "function_args" in stressed or ("args" not in stressed and draw(st.booleans())):
        spec.function = "os:getcwd"
        spec.function_args = b"x" * draw(
            st.sampled_from([0, 10])
            | _near(MAX_FUNCTION_ARGS_BYTES)
            | st.sampled_from([MAX_SPEC_BYTES - 64, MAX_SPEC_BYTES - 16])
        )
    else:
        spec.entrypoint.extend(["true"])
        if "args" in stressed:
            spec.args.extend(draw(_strings(MAX_ARGV_ITEMS)))
    if "env" in stressed:
        values = draw(_strings(MAX_ENV_ITEMS))
        spec.env.update({f"V{i}": v for i, v in enumerate(values)})
    if "env_name" in stressed:
        spec.env[draw(st.sampled_from(["BAD=NAME", "1X", "OK_NAME", "_"]))] = "v"
    if "nproc_per_node" in stressed:
        spec.nproc_per_node = draw(_near(MAX_NPROC_PER_NODE, 1) | st.just(0))
    if "nodes" in stressed:
        spec.min_nodes = draw(_near(MAX_NODES, 1) | st.sampled_from([0, 2]))
        spec.max_nodes = draw(_near(MAX_NODES, 1) | st.sampled_from([0, 2]))
        if draw(st.booleans()):
            spec.last_call_timeout_ms = 0
    if "stderr_tail_lines" in stressed:
        spec.stderr_tail_lines = draw(_near(10_000) | st.just(-1))
    if "max_restarts" in stressed:
        spec.max_restarts = draw(_near(MAX_RESTARTS) | st.just(-1))
    if "seconds" in stressed:
        for field in (
            "join_timeout_ms",
            "last_call_timeout_ms",
            "exit_barrier_timeout_ms",
            "stop_grace_ms",
            "restart_backoff_ms",
            "unhealthy_timeout_ms",
        ):
            ms = draw(_seconds_ms())
            if ms is not None:
                setattr(spec, field, ms)
    if "name" in stressed:
        spec.name = "n" * draw(st.sampled_from([1, 127, 128, 129]))
    if "role" in stressed:
        spec.role = draw(st.sampled_from(["r" * 128, "r" * 129, "-bad", "ok.role"]))
    if "cwd" in stressed:
        spec.cwd = "/" * draw(st.sampled_from([1, 4095, 4096, 4097]))
    if "exact_cap" in stressed:
        _pad_to(spec, MAX_SPEC_BYTES + draw(st.sampled_from([-1, 0, 1])))
    if "std" in stressed:
        spec.redirects = draw(st.sampled_from(["3", "4", "0:3", "0:3,"]))
        spec.tee = draw(st.sampled_from(["0", "0:1", "9:1"]))
        spec.scale_up = draw(st.sampled_from(["never", "restart", "sometimes"]))
    return spec


def _pad_to(spec: pb.JobSpec, size: int) -> None:
    """Env entries, each under MAX_STRING, that bring the spec to exactly `size` bytes as the
    coordinator measures it (its normal form, defaults filled in), unless it is bigger already.
    """

    # The normal form differs from this message by a fixed set of fields: measure that once.
    extra = spec_to_pb(spec_from_pb(spec)).ByteSize() - spec.ByteSize()

    def measured() -> int:
        return spec.ByteSize() + extra

    if measured() + 16 > size:
        return
    i = 0
    while measured() + MAX_STRING + 64 < size:
        spec.env[f"P{i}"] = "p" * MAX_STRING
        i += 1
    spec.env["PAD"] = ""
    for _ in range(4):  # a length's own varint may grow by a byte: settle it in a few steps
        short = size - measured()
        spec.env["PAD"] = "p" * max(0, len(spec.env["PAD"]) + short)
    assert spec_to_pb(spec_from_pb(spec)).ByteSize() == size


def _expected_refusal(msg: pb.JobSpec) -> str | None:
    """The field the client's own checks refuse, or None when they admit the spec."""
    spec = spec_from_pb(msg)
    try:
        spec.validate()
        check_spec_size(spec)
    except SpecError as exc:
        return exc.field
    return None


def _state(stub: Any, job_id: str) -> int:
    return int(stub.GetJob(pb.GetJobRequest(job_id=job_id), timeout=30).state)


_TERMINAL = {pb.JOB_STATE_SUCCEEDED, pb.JOB_STATE_FAILED, pb.JOB_STATE_CANCELED}


def _wait_terminal(stub: Any, job_id: str) -> int:
    deadline = time.monotonic() + RUN_BOUND_S
    while (state := _state(stub, job_id)) not in _TERMINAL:
        assert time.monotonic() < deadline, f"job {job_id} still in state {state}"
        time.sleep(0.01)
    return state


@settings(
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    max_examples=settings().max_examples,
)
@given(msg=wire_specs())
def test_a_spec_near_the_limits_is_refused_naming_its_field_or_runs(
    cluster: _Cluster, stub: Any, msg: pb.JobSpec
) -> None:
    expected = _expected_refusal(msg)
    try:
        job_id = stub.Submit(pb.SubmitRequest(spec=msg), timeout=60).job_id
    except grpc.RpcError as exc:
        assert exc.code() == grpc.StatusCode.INVALID_ARGUMENT, exc
        details = exc.details() or ""
        assert details.startswith("invalid spec: "), details
        field = details.removeprefix("invalid spec: ").split(":", 1)[0]
        assert field in SPEC_FIELDS, details
        assert field == expected, (details, expected)
        event(f"refused: {field}")
    else:
        assert expected is None, f"admitted a spec its client refuses ({expected})"
        spec = spec_from_pb(msg)
        fits = spec.min_nodes <= NODES and spec.nproc_per_node <= SLOTS
        waits = spec.max_nodes > NODES and spec.last_call_timeout > 1.0
        # A join timeout of a few ms may fire before the nodes of the last job are free again.
        runnable = fits and not waits and spec.join_timeout >= 5.0
        if not fits or waits:
            stub.CancelJob(pb.CancelJobRequest(job_id=job_id), timeout=30)
        state = _wait_terminal(stub, job_id)
        big = msg.ByteSize() > MAX_SPEC_BYTES * 0.9
        label = "ran" if runnable else "canceled" if not fits or waits else "ran or timed out"
        event(label + (" (near the cap)" if big else ""))
        if runnable:
            assert state == pb.JOB_STATE_SUCCEEDED, state
            got = [a.specs[job_id] for a in cluster.agents if job_id in a.specs]
            assert got, "no agent was assigned the job"
            for received in got:  # the agents get the spec whole, secrets and all
                assert dict(received.env) == dict(msg.env)
                assert list(received.args) == list(msg.args)
                assert received.function_args == msg.function_args
        elif not fits or waits:
            assert state == pb.JOB_STATE_CANCELED, state
    # No spec costs a node.
    assert not any(a.ended for a in cluster.agents)
    nodes = cluster.on_loop(lambda: cluster.coord.service.cluster.nodes())  # type: ignore[union-attr]
    assert sorted((n.name, n.state) for n in nodes) == [(f"n{i}", "live") for i in range(NODES)]


@pytest.mark.parametrize("short", [64, 1024])
def test_a_spec_that_fits_a_submit_but_not_an_assignment_is_refused(
    cluster: _Cluster, stub: Any, short: int
) -> None:
    """The 16 MiB message limit: each such example moves 16 MiB, so two fixed ones, not many."""
    msg = pb.JobSpec(entrypoint=["true"], nproc_per_node=4)
    _pad_to(msg, MESSAGE_LIMIT - short)
    with pytest.raises(grpc.RpcError) as err:
        stub.Submit(pb.SubmitRequest(spec=msg), timeout=60)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert (err.value.details() or "").startswith("invalid spec: env: ")
    assert not any(a.ended for a in cluster.agents)
    nodes = cluster.on_loop(lambda: cluster.coord.service.cluster.nodes())  # type: ignore[union-attr]
    assert sorted((n.name, n.state) for n in nodes) == [(f"n{i}", "live") for i in range(NODES)]
