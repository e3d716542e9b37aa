"""The coordinator's client RPCs (the Coordinator gRPC service): requests in, domain calls on the
service, answers out.

`_CoordinatorServicer` checks what a request names, waits until what it would read is on disk,
and pages what could be big (jobs, events, attempts, results). Every handler's error reaches the
client as the status `status_for` gives it; anything else is an internal error, logged.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import (
    AsyncGenerator,
    AsyncIterator,
    Awaitable,
    Callable,
    Collection,
    Coroutine,
    Sequence,
)
from typing import Any, Protocol, TypeVar

import grpc

from client.model import JobSpec, SpecError, is_job_id, is_name
from client.stacks import CAPTURE_ID, StackCapture
from client.stacks_wire import capture_to_pb
from client.wire import attempt_to_pb, event_to_pb, node_to_pb, spec_from_pb
from coordinator._cluster import Cluster, Effect, NodeChanged, NodeIsLive
from coordinator._cluster_drain import MAX_DRAIN_S
from coordinator._errors import RequestError, status_for
from coordinator._job_list import list_page
from protos.gelastic.v1 import gelastic_pb2 as pb
from protos.gelastic.v1 import gelastic_pb2_grpc as pb_grpc

logger = logging.getLogger(__name__)

_S = TypeVar("_S")
_Q = TypeVar("_Q")
_R = TypeVar("_R")

WATCH_KEEPALIVE_S = 5.0
RESULT_CHUNK_BYTES = 1024 * 1024
"""Largest piece of a return value in one GetResult message."""
EVENTS_PAGE_MAX = 1000
"""Most events in one GetEvents response or WatchJob update."""
EVENTS_PAGE_BYTES = 1024 * 1024
"""About the most event bytes in one GetEvents response or WatchJob update."""
ATTEMPTS_PAGE_MAX = 20
"""Most attempts in one GetAttempts response."""
ATTEMPTS_PAGE_BYTES = 1024 * 1024
"""About the most attempt bytes in one GetAttempts response (one attempt always goes)."""


class Logs(Protocol):
    """What the client RPCs ask of the log relay (`coordinator._log_relay.LogRelay`, which
    imports the node sessions, which import this module)."""

    def read_logs(self, req: pb.ReadLogsRequest, client: str = "") -> AsyncIterator[bytes]: ...


class Service(Protocol):
    """What the client RPCs ask of the coordinator's service (`CoordinatorService`)."""

    cluster: Cluster
    dashboard: tuple[str, str, int] | None

    @property
    def log_relay(self) -> Logs: ...

    def now(self) -> float: ...

    def apply(self, effects: list[Effect]) -> None: ...

    async def flush(self) -> None: ...

    async def written(self, job_ids: Collection[str] | None = None) -> None: ...

    async def submit(self, spec: JobSpec, request_id: str = "") -> str: ...

    def job_message(self, job_id: str, *, with_spec: bool = False) -> pb.Job: ...

    def job_version(self, job_id: str) -> int: ...

    async def wait_changed(self, job_id: str, seen_version: int, timeout: float) -> int: ...

    def watch_interval(self, job_id: str) -> float: ...

    async def capture_stacks(
        self,
        job_id: str,
        reason: str,
        *,
        rank: int | None = None,
        native: bool = False,
        wait: float = ...,
    ) -> StackCapture: ...


async def _abort_for(context: grpc.aio.ServicerContext, exc: BaseException) -> None:
    """End the call with the status `status_for` gives `exc`; INTERNAL, logged, for a bug."""
    mapped = status_for(exc)
    if mapped is None:
        logger.exception("internal error", exc_info=exc)
        await context.abort(
            grpc.StatusCode.INTERNAL, f"internal error: {type(exc).__name__}: {exc}"
        )
    else:
        await context.abort(*mapped)


async def _mapping_errors(context: grpc.aio.ServicerContext, work: Awaitable[_R]) -> _R:
    """What `work` returns; what it raises also ends the call with its status (`_abort_for`)."""
    try:
        return await work
    except Exception as exc:
        await _abort_for(context, exc)
        raise


def _unary(
    handler: Callable[[_S, _Q, grpc.aio.ServicerContext], Awaitable[_R]],
) -> Callable[[_S, _Q, grpc.aio.ServicerContext], Coroutine[Any, Any, _R]]:
    """A handler of one answer, each of its errors answered with its status."""

    @functools.wraps(handler)
    async def answer(self: _S, request: _Q, context: grpc.aio.ServicerContext) -> _R:
        return await _mapping_errors(context, handler(self, request, context))

    return answer


def _streaming(
    handler: Callable[[_S, _Q, grpc.aio.ServicerContext], AsyncGenerator[_R, None]],
) -> Callable[[_S, _Q, grpc.aio.ServicerContext], AsyncGenerator[_R, None]]:
    """A handler of a stream of answers, each of its errors answered with its status.

    The handler's generator is closed with this one (a call that ends early closes it), so its
    `finally` blocks run then, as they would were this try in the handler itself.
    """

    @functools.wraps(handler)
    async def answers(
        self: _S, request: _Q, context: grpc.aio.ServicerContext
    ) -> AsyncGenerator[_R, None]:
        try:
            async with contextlib.aclosing(handler(self, request, context)) as items:
                async for item in items:
                    yield item
        except Exception as exc:
            await _abort_for(context, exc)
            raise

    return answers


class _CoordinatorServicer(pb_grpc.CoordinatorServicer):
    """The client RPCs, each on whichever service `current` returns at the call."""

    def __init__(self, current: Callable[[], Service]) -> None:
        self._current = current

    @property
    def _svc(self) -> Service:
        return self._current()

    @_unary
    async def Submit(
        self, request: pb.SubmitRequest, context: grpc.aio.ServicerContext
    ) -> pb.SubmitResponse:
        if not request.HasField("spec"):
            raise SpecError("spec", "missing")
        spec = spec_from_pb(request.spec)
        spec.validate()
        job_id = await self._svc.submit(spec, request.request_id)
        return pb.SubmitResponse(job_id=job_id)

    @_unary
    async def GetJob(self, request: pb.GetJobRequest, context: grpc.aio.ServicerContext) -> pb.Job:
        _check_job_ref(self._svc, request.job_id)
        await self._svc.written([request.job_id])
        return self._svc.job_message(request.job_id, with_spec=True)

    @_streaming
    async def WatchJob(
        self, request: pb.WatchJobRequest, context: grpc.aio.ServicerContext
    ) -> AsyncGenerator[pb.JobUpdate, None]:
        _check_job_ref(self._svc, request.job_id)
        svc, job_id = self._svc, request.job_id
        version = svc.job_version(job_id)
        after = 0
        while True:
            await svc.written([job_id])
            events, more = _event_page(svc.cluster.job_events(job_id, after))
            if events:
                after = events[-1].seq
            yield pb.JobUpdate(job=svc.job_message(job_id), events=events)
            if more:
                continue  # the rest of a long timeline, a page per update
            if svc.cluster.job_state(job_id).is_terminal():
                return
            version = await svc.wait_changed(job_id, version, WATCH_KEEPALIVE_S)
            if not svc.cluster.job_state(job_id).is_terminal():
                # A snapshot is O(ranks): coalesce bursts (10,000 starts) into a few updates.
                await asyncio.sleep(svc.watch_interval(job_id))

    async def ListJobs(
        self, request: pb.ListJobsRequest, context: grpc.aio.ServicerContext
    ) -> pb.ListJobsResponse:
        c = self._svc.cluster
        ids = [
            j for j in c.job_ids() if request.include_finished or not c.job_state(j).is_terminal()
        ]
        # The wait's error is answered with its status, as is a bad page token or size.
        await _mapping_errors(context, self._svc.written(ids))

        async def page() -> tuple[list[pb.Job], str]:
            # No await since the wait: what is read now of these jobs is on disk.
            return list_page(c, ids, request.page_size, request.page_token)

        jobs, token = await _mapping_errors(context, page())
        return pb.ListJobsResponse(jobs=jobs, next_page_token=token)

    async def ListNodes(
        self, request: pb.ListNodesRequest, context: grpc.aio.ServicerContext
    ) -> pb.ListNodesResponse:
        return pb.ListNodesResponse(nodes=[node_to_pb(n) for n in self._svc.cluster.nodes()])

    @_unary
    async def ForgetNode(
        self, request: pb.ForgetNodeRequest, context: grpc.aio.ServicerContext
    ) -> pb.ForgetNodeResponse:
        _check_node_name(request.name)
        svc = self._svc
        known = svc.cluster.dump_node(request.name) is not None
        try:
            effects = svc.cluster.forget_node(request.name, svc.now())
        except NodeIsLive as exc:
            raise RequestError(
                grpc.StatusCode.FAILED_PRECONDITION, f"{exc}: only a lost node can be forgotten"
            ) from None
        svc.apply(effects)
        await svc.flush()
        if known:
            logger.info("node %s forgotten on request", request.name)
        return pb.ForgetNodeResponse(forgotten=known)

    @_unary
    async def ClearQuarantine(
        self, request: pb.ClearQuarantineRequest, context: grpc.aio.ServicerContext
    ) -> pb.ClearQuarantineResponse:
        _check_node_name(request.name)
        svc = self._svc
        cleared, effects = svc.cluster.clear_quarantine(request.name, svc.now())
        svc.apply(effects)
        await svc.flush()
        if cleared:
            logger.info("node %s: quarantine cleared on request", request.name)
        return pb.ClearQuarantineResponse(cleared=cleared)

    @_unary
    async def DrainNode(
        self, request: pb.DrainNodeRequest, context: grpc.aio.ServicerContext
    ) -> pb.DrainNodeResponse:
        _check_node_name(request.name)
        if not 0 <= request.deadline_ms <= MAX_DRAIN_S * 1000:
            raise RequestError(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"deadline_ms: must be 0-{MAX_DRAIN_S * 1000:.0f}, got {request.deadline_ms}",
            )
        if len(request.reason) > 1000 or not request.reason.isprintable():
            raise RequestError(
                grpc.StatusCode.INVALID_ARGUMENT, "reason: at most 1000 printable characters"
            )
        svc = self._svc
        known = svc.cluster.dump_node(request.name) is not None
        deadline = request.deadline_ms / 1000 if request.deadline_ms else None
        svc.apply(svc.cluster.drain(request.name, deadline, svc.now(), reason=request.reason))
        await svc.flush()
        state = next((n.state for n in svc.cluster.nodes() if n.name == request.name), "")
        if known:
            logger.info("node %s: drained on request (%s)", request.name, state)
        return pb.DrainNodeResponse(drained=known, state=state)

    @_unary
    async def UndrainNode(
        self, request: pb.UndrainNodeRequest, context: grpc.aio.ServicerContext
    ) -> pb.UndrainNodeResponse:
        _check_node_name(request.name)
        svc = self._svc
        effects = svc.cluster.undrain(request.name, svc.now())
        svc.apply(effects)
        await svc.flush()
        undrained = any(isinstance(e, NodeChanged) and e.node == request.name for e in effects)
        if undrained:
            logger.info("node %s: undrained on request", request.name)
        return pb.UndrainNodeResponse(undrained=undrained)

    @_unary
    async def CancelJob(
        self, request: pb.CancelJobRequest, context: grpc.aio.ServicerContext
    ) -> pb.Job:
        _check_job_ref(self._svc, request.job_id)
        self._svc.apply(self._svc.cluster.cancel(request.job_id, self._svc.now()))
        await self._svc.flush()
        await self._svc.written([request.job_id])
        return self._svc.job_message(request.job_id)

    @_unary
    async def GetEvents(
        self, request: pb.GetEventsRequest, context: grpc.aio.ServicerContext
    ) -> pb.GetEventsResponse:
        _check_job_ref(self._svc, request.job_id)
        await self._svc.written([request.job_id])
        events, more = _event_page(self._svc.cluster.job_events(request.job_id, request.after_seq))
        return pb.GetEventsResponse(events=events, more=more)

    @_unary
    async def GetAttempts(
        self, request: pb.GetAttemptsRequest, context: grpc.aio.ServicerContext
    ) -> pb.GetAttemptsResponse:
        _check_job_ref(self._svc, request.job_id)
        await self._svc.written([request.job_id])
        attempts = self._svc.cluster.job_attempts(request.job_id)
        page, more = _attempt_page(attempts[max(0, request.start) :])
        return pb.GetAttemptsResponse(attempts=page, more=more)

    @_streaming
    async def GetResult(
        self, request: pb.GetResultRequest, context: grpc.aio.ServicerContext
    ) -> AsyncGenerator[pb.ResultChunk, None]:
        _check_job_ref(self._svc, request.job_id)
        await self._svc.written([request.job_id])
        result = self._svc.cluster.job_result(request.job_id)
        values = dict(result.return_values) if result is not None else {}
        for rank in sorted(values):
            data = values[rank]
            if not isinstance(data, bytes):
                continue
            for offset in range(0, max(len(data), 1), RESULT_CHUNK_BYTES):
                yield pb.ResultChunk(
                    rank=rank,
                    offset=offset,
                    total=len(data),
                    data=data[offset : offset + RESULT_CHUNK_BYTES],
                )

    async def GetDashboard(
        self, request: pb.GetDashboardRequest, context: grpc.aio.ServicerContext
    ) -> pb.GetDashboardResponse:
        where = self._svc.dashboard
        if where is None:
            return pb.GetDashboardResponse(serving=False)
        scheme, host, port = where
        return pb.GetDashboardResponse(serving=True, scheme=scheme, host=host, port=port)

    @_streaming
    async def ReadLogs(
        self, request: pb.ReadLogsRequest, context: grpc.aio.ServicerContext
    ) -> AsyncGenerator[pb.LogData, None]:
        _check_job_id(request.job_id)
        async for data in self._svc.log_relay.read_logs(request, _peer_host(context.peer())):
            yield pb.LogData(data=data)

    @_unary
    async def CaptureStacks(
        self, request: pb.CaptureStacksRequest, context: grpc.aio.ServicerContext
    ) -> pb.StackCapture:
        _check_job_ref(self._svc, request.job_id)
        if request.rank < -1:
            raise RequestError(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"rank: -1 (every rank) or a rank, got {request.rank}",
            )
        wait = {"wait": request.timeout_ms / 1000} if request.timeout_ms > 0 else {}
        capture = await self._svc.capture_stacks(
            request.job_id,
            "requested by a client",
            rank=None if request.rank < 0 else request.rank,
            native=request.native,
            **wait,
        )
        return capture_to_pb(capture)

    @_unary
    async def GetStacks(
        self, request: pb.GetStacksRequest, context: grpc.aio.ServicerContext
    ) -> pb.GetStacksResponse:
        _check_job_ref(self._svc, request.job_id)
        if request.capture_id and not CAPTURE_ID.fullmatch(request.capture_id):
            raise RequestError(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"capture_id: not a capture id: {request.capture_id[:80]!r}",
            )
        await self._svc.written([request.job_id])
        captures = [
            c
            for c in self._svc.cluster.job_stacks(request.job_id)
            if request.capture_id in ("", c.capture_id)
        ]
        if request.capture_id and not captures:
            raise RequestError(
                grpc.StatusCode.NOT_FOUND,
                f"job {request.job_id} keeps no capture {request.capture_id}",
            )
        return pb.GetStacksResponse(captures=[capture_to_pb(c) for c in captures])


P = TypeVar("P", pb.Event, pb.AttemptSummary)


def _page(
    items: Sequence[Any], to_pb: Callable[[Any], P], most: int, most_bytes: int
) -> tuple[list[P], bool]:
    """The first items that fit one response (at least one), and whether more follow."""
    page: list[P] = []
    size = 0
    for item in items:
        msg = to_pb(item)
        size += msg.ByteSize()
        if page and (len(page) >= most or size > most_bytes):
            return page, True
        page.append(msg)
    return page, False


def _event_page(events: Sequence[Any]) -> tuple[list[pb.Event], bool]:
    return _page(events, event_to_pb, EVENTS_PAGE_MAX, EVENTS_PAGE_BYTES)


def _attempt_page(attempts: Sequence[Any]) -> tuple[list[pb.AttemptSummary], bool]:
    return _page(attempts, attempt_to_pb, ATTEMPTS_PAGE_MAX, ATTEMPTS_PAGE_BYTES)


def _check_node_name(name: str) -> None:
    if not is_name(name):
        raise RequestError(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"name: must be 1-128 of [A-Za-z0-9_.-], got {name[:200]!r}",
        )


def _check_job_ref(svc: Service, job_id: str) -> None:
    """Refuse a job id that names no job and is not one the coordinator would make.

    The lookup comes first: a job the coordinator holds is always reachable (and cancellable)
    by its own id, even one made before today's id rules (a name with a trailing newline once
    made such ids), so no job is ever left running with no way to name it.
    """
    if not svc.cluster.has_job(job_id):
        _check_job_id(job_id)


def _check_job_id(job_id: str) -> None:
    if not is_job_id(job_id):
        raise RequestError(
            grpc.StatusCode.INVALID_ARGUMENT, f"job_id: not a job id: {job_id[:80]!r}"
        )


def _peer_host(peer: str) -> str:
    """The client's address without its port ("ipv4:10.0.0.5:41234" -> "ipv4:10.0.0.5")."""
    host, sep, port = peer.rpartition(":")
    return host if sep and port.isdigit() else peer
