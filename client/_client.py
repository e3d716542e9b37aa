"""The Python client: `submit()` a JobSpec and follow the `Job` it returns.

Blocking calls over gRPC channels, one per listed coordinator replica, made when first used.
Every call has a total deadline and a cap on tries; only idempotent calls are retried, and a
call goes to the leader a standby names only when that address is in the list
(`client.coordinators`). The last leader that answered is remembered. Results come back as domain objects, never protobuf messages. Function arguments are
pickled here; return values are unpickled here only by the `Job` that submitted them, after
their tag checks out against the job's key (`client.results`): the coordinator only ever sees
bytes, and a result looked up without the key is never unpickled.
"""

from __future__ import annotations

import functools
import os
import pickle
import secrets
import sys
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace
from types import TracebackType
from typing import Any, TextIO, TypeVar

import grpc

from client._client_stacks import STACK_WAIT_S, _StackCalls
from client._progress import _Progress
from client._replica_channels import ReplicaChannels, Stub
from client.coordinators import (
    LEADER_HEADER,
    is_standby_answer,
    leader_hint,
    next_coordinator,
    parse_coordinators,
)
from client.model import (
    MAX_RESULT_BYTES_PER_JOB,
    MAX_RETURN_VALUE_BYTES,
    RESULT_KEY_BYTES,
    AttemptSummary,
    GelasticError,
    JobEvent,
    JobSpec,
    JobStatus,
    NodeInfo,
    RunResult,
)
from client.results import ReturnValueError, decode
from client.security import Security
from client.stacks import StackCapture
from client.wire import (
    attempt_from_pb,
    check_spec_size,
    event_from_pb,
    job_status_from_pb,
    node_from_pb,
    result_from_pb,
    spec_to_pb,
)
from protos.gelastic.v1 import gelastic_pb2 as pb

__all__ = ["Client", "GelasticError", "Job", "ReturnValueError", "submit"]

DEFAULT_COORDINATOR = "127.0.0.1:29400"
CALL_TIMEOUT_S = 30.0
SUBMIT_RETRY_CODES = (
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.INTERNAL,
)
"""What a submit retries on, with the same request id."""
RETRIES = 5
"""Passes over the coordinator list one call makes (with a pause between passes)."""
LIST_PASSES = 8
"""Passes over a list of several replicas: their pauses (about 7 s in all) outlast a failover
of the default leader TTL (3 s), within the call's deadline."""
MAX_PAUSE_S = 2.0
MAX_DETAILS_CHARS = 500
"""Of each replica's answer in the error of a call that gave up."""
MAX_EVENT_PAGES = 1000
"""Most GetEvents pages one `events()` call reads (a job keeps at most 10,000 events)."""
MAX_ATTEMPT_PAGES = 200
"""Most GetAttempts pages one `attempts()` call reads (a job keeps at most 100 attempts)."""
JOBS_PAGE_SIZE = 500
"""Jobs asked for in each ListJobs page (the coordinator may give fewer)."""
MAX_LISTED_JOBS = 100_000
"""Most jobs one `list_jobs()` call reads (a coordinator keeps 10,000 finished ones by default)."""

T = TypeVar("T")
R = TypeVar("R")


def _coordinator_address(address: str | None) -> str:
    return address or os.environ.get("GELASTIC_COORDINATOR") or DEFAULT_COORDINATOR


def _wrap(exc: grpc.RpcError) -> GelasticError:
    code = exc.code() if hasattr(exc, "code") else None
    details = exc.details() if hasattr(exc, "details") else str(exc)
    return GelasticError(code, f"{code.name if code else 'ERROR'}: {details}")


def _details(exc: grpc.RpcError) -> str:
    d = exc.details() if hasattr(exc, "details") else str(exc)
    text = " ".join(str(d or "").split())
    return text if len(text) <= MAX_DETAILS_CHARS else text[: MAX_DETAILS_CHARS - 3] + "..."


def _hint(exc: grpc.RpcError, listed: Sequence[str]) -> tuple[str, bool]:
    """(the listed leader a standby named, whether it named one at all)."""
    try:
        md: Any = exc.trailing_metadata() if hasattr(exc, "trailing_metadata") else None
    except Exception:  # a call that never started has none
        md = None
    named = any(k == LEADER_HEADER for k, _ in md or ())
    return leader_hint(md, listed), named


class Client(_StackCalls):
    """A connection to a coordinator, or to the leader of a list of replicas
    ("a:29400,b:29400"). Usable as a context manager."""

    def __init__(
        self,
        coordinator: str | None = None,
        *,
        timeout: float = CALL_TIMEOUT_S,
        security: Security | None = None,
        token_file: str | None = None,
        tls_ca: str | None = None,
        tls_cert: str | None = None,
        tls_key: str | None = None,
        tls_server_name: str | None = None,
    ) -> None:
        self.addresses = parse_coordinators(_coordinator_address(coordinator))
        """Every listed replica, in the given order."""
        self.timeout = timeout
        if security is None:
            security = Security.from_env(
                token_file,
                tls_ca,
                tls_cert=tls_cert,
                tls_key=tls_key,
                tls_server_name=tls_server_name,
            )
        self.security = security
        for address in self.addresses:
            security.check_target(address)  # no token in plain text to any of them
        self._md = security.metadata
        self._replicas = ReplicaChannels(security, several=len(self.addresses) > 1)
        self._leader = self.addresses[0]

    @property
    def address(self) -> str:
        """The coordinator calls go to first: the leader that last answered (at first, the
        first listed address)."""
        return self._leader

    @property
    def _channel(self) -> grpc.Channel:
        return self._replicas.channel(self._leader)

    def close(self) -> None:
        self._replicas.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def _call(
        self,
        fn: Callable[[Stub, float], T],
        *,
        idempotent: bool,
        retry_on: tuple[grpc.StatusCode, ...] = (grpc.StatusCode.UNAVAILABLE,),
    ) -> T:
        """`fn(stub, timeout)` on the leader, within `self.timeout` in all.

        A standby's answer (the call was not acted on) sends it to the leader the standby names
        when that is listed, else to the next listed address; an idempotent call also moves on
        after an error in `retry_on`. Every address tried once is a pass; passes are bounded
        and paused between (0.1 s, doubling to MAX_PAUSE_S).
        """
        listed = self.addresses
        deadline = time.monotonic() + self.timeout
        passes = RETRIES if len(listed) == 1 else LIST_PASSES
        current = self._leader
        tried: set[str] = set()
        answers: dict[str, str] = {}
        said_as_leader: set[str] = set()
        last: grpc.RpcError | None = None
        delay = 0.1
        pass_no = 1
        for _ in range(2 * passes * len(listed)):  # a hint is followed at most once a try
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            tried.add(current)
            try:
                out = fn(self._replicas.stub(current), remaining)
            except grpc.RpcError as exc:
                last = exc
                code = exc.code()
                hint, named = _hint(exc, listed)
                standby = code == grpc.StatusCode.UNAVAILABLE and is_standby_answer(
                    _details(exc), named
                )
                # What a replica said as the leader (its store unreachable, say) outlasts its
                # later standby answers: it is the reason worth showing.
                if not (standby and current in said_as_leader):
                    answers[current] = f"{code.name if code else 'ERROR'}: {_details(exc)}"
                if not standby:
                    said_as_leader.add(current)
                if not (standby or (idempotent and code in retry_on)):
                    raise _wrap(exc) from None
                nxt = next_coordinator(listed, current, tried, hint)
                if nxt is None:
                    if pass_no >= passes:
                        break
                    pass_no += 1
                    time.sleep(max(0.0, min(delay, deadline - time.monotonic())))
                    delay = min(delay * 2, MAX_PAUSE_S)
                    tried.clear()
                    nxt = next_coordinator(listed, current, tried, hint)
                current = nxt or current
                continue
            self._leader = current
            return out
        raise self._gave_up(last, answers)

    def _gave_up(self, last: grpc.RpcError | None, answers: dict[str, str]) -> GelasticError:
        if len(self.addresses) == 1 and last is not None:
            return _wrap(last)
        code = last.code() if last is not None else grpc.StatusCode.DEADLINE_EXCEEDED
        said = "; ".join(f"{a}: {answers[a]}" for a in self.addresses if a in answers)
        return GelasticError(
            code,
            f"{code.name}: no coordinator of {', '.join(self.addresses)} took the call within "
            f"{self.timeout:g} s ({said or 'none answered'})",
        )

    def _stream(self, open_call: Callable[[Stub], Iterator[R]]) -> Iterator[R]:
        """The items of a server stream from the leader.

        Before the first item a standby's answer (or an unreachable replica) sends the stream to
        the listed leader named, else the next listed address, each tried once; after it an
        error ends the stream (the caller resumes it, as after a coordinator restart), and the
        leader a standby named is remembered for the next call.
        """
        listed = self.addresses
        current = self._leader
        tried: set[str] = set()
        while True:
            tried.add(current)
            call = open_call(self._replicas.stub(current))
            got = False
            try:
                for item in call:
                    if not got:
                        got = True
                        self._leader = current
                    yield item
                return
            except grpc.RpcError as exc:
                hint, _ = _hint(exc, listed)
                nxt = next_coordinator(listed, current, tried, hint)
                if got or exc.code() != grpc.StatusCode.UNAVAILABLE or nxt is None:
                    if hint:
                        self._leader = hint
                    raise _wrap(exc) from None
                current = nxt
            finally:
                cancel = getattr(call, "cancel", None)
                if cancel is not None:
                    cancel()

    # ---- calls -----------------------------------------------------------------------------

    def submit(self, spec: JobSpec, *, request_id: str = "") -> Job:
        """Queue the job and return its handle.

        `request_id` (1-128 of [A-Za-z0-9_.-]) makes the submit idempotent across callers: a
        second submit of the same spec under it returns the first one's job; a different spec
        under it is refused (INVALID_ARGUMENT) naming the fields that differ. Without it each
        submit is a job of its own (its retries reuse one made-up id).
        """
        if spec.is_function and not spec.function_args:
            payload = pickle.dumps((tuple(spec.args), dict(spec.kwargs)), protocol=4)
            spec = replace(spec, function_args=payload)
        if spec.is_function and not spec.result_key:
            # Only this Job and the job's nodes know it: it proves a value came from a node of
            # the job (not from the channel or the coordinator), never that it is safe to load.
            spec = replace(spec, result_key=secrets.token_bytes(RESULT_KEY_BYTES))
        spec.validate()
        check_spec_size(spec)  # the coordinator refuses it too; this names the field sooner
        # One id for every try: a retry after a timeout or an internal error returns the job the
        # first try made, so a submit never makes two jobs.
        msg = pb.SubmitRequest(spec=spec_to_pb(spec), request_id=request_id or uuid.uuid4().hex)
        resp = self._call(
            lambda stub, t: stub.Submit(msg, timeout=t, metadata=self._md),
            idempotent=True,
            retry_on=SUBMIT_RETRY_CODES,
        )
        return Job(self, resp.job_id, result_key=spec.result_key)

    def job(self, job_id: str, *, result_key: bytes = b"") -> Job:
        """A handle on a job by id. With the job's `result_key` each return value's tag is
        checked before it is decoded; without it nothing is verified. Pickles are never
        loaded unless asked (`wait(trust_pickles=True)`, `RunResult.trusted_return_values`)."""
        return Job(self, job_id, result_key=result_key)

    def get_job(self, job_id: str) -> pb.Job:
        req = pb.GetJobRequest(job_id=job_id)
        return self._call(
            lambda stub, t: stub.GetJob(req, timeout=t, metadata=self._md), idempotent=True
        )

    def list_jobs(self, include_finished: bool = True) -> list[JobStatus]:
        """Every job (or only those not finished), oldest submit first, read a bounded page at
        a time (at most `MAX_LISTED_JOBS`). Each is a summary: no workers and no members
        (`nodes_joined` counts them); `job(id).status()` has the rest."""

        def page(req: pb.ListJobsRequest) -> pb.ListJobsResponse:
            call = functools.partial(_unary, "ListJobs", req, metadata=self._md)
            return self._call(call, idempotent=True)

        return _all_pages(page, include_finished)

    def list_nodes(self) -> list[NodeInfo]:
        req = pb.ListNodesRequest()
        resp = self._call(
            lambda stub, t: stub.ListNodes(req, timeout=t, metadata=self._md),
            idempotent=True,
        )
        return [node_from_pb(n) for n in resp.nodes]

    def dashboard_url(self) -> str:
        """The URL of the coordinator's web dashboard ("" when it serves none).

        A coordinator listening on a wildcard address is reached by the host this client dials.
        """
        req = pb.GetDashboardRequest()
        resp = self._call(
            lambda stub, t: stub.GetDashboard(req, timeout=t, metadata=self._md),
            idempotent=True,
        )
        if not resp.serving:
            return ""
        host = resp.host
        if host in ("", "0.0.0.0", "::", "[::]"):
            host = self.address.rpartition(":")[0] or "127.0.0.1"
        host = host.strip("[]")
        shown = f"[{host}]" if ":" in host else host
        return f"{resp.scheme}://{shown}:{resp.port}/"

    def forget_node(self, name: str) -> bool:
        """Drop a lost node from the coordinator's list; False when no node had that name.

        A live node is refused (GelasticError with FAILED_PRECONDITION)."""
        req = pb.ForgetNodeRequest(name=name)
        resp = self._call(
            lambda stub, t: stub.ForgetNode(req, timeout=t, metadata=self._md),
            idempotent=True,
        )
        return bool(resp.forgotten)

    def clear_quarantine(self, name: str) -> bool:
        """Let quarantined node `name` take new rounds again now; False when no node had that
        name or it was not quarantined."""
        req = pb.ClearQuarantineRequest(name=name)
        resp = self._call(
            lambda stub, t: stub.ClearQuarantine(req, timeout=t, metadata=self._md),
            idempotent=True,
        )
        return bool(resp.cleared)

    def drain_node(self, name: str, deadline: float | None = None, reason: str = "") -> str:
        """Drain node `name`: no new round goes there, and its rounds are replaced on the other
        nodes without spending a restart, their workers told first, SIGKILLed at `deadline`
        seconds (None: each job's stop_grace). Returns the node's state then ("draining" while
        workers run there, "drained"), or "" when no node had that name."""
        ms = 0 if deadline is None else max(1, round(deadline * 1000))
        req = pb.DrainNodeRequest(name=name, deadline_ms=ms, reason=reason)
        call = lambda stub, t: stub.DrainNode(req, timeout=t, metadata=self._md)  # noqa: E731
        resp = self._call(call, idempotent=True)
        return str(resp.state or "drained") if resp.drained else ""

    def undrain_node(self, name: str) -> bool:
        """Let drained node `name` take new rounds again; False when it was not drained."""
        req = pb.UndrainNodeRequest(name=name)
        call = lambda stub, t: stub.UndrainNode(req, timeout=t, metadata=self._md)  # noqa: E731
        return bool(self._call(call, idempotent=True).undrained)

    def cancel(self, job_id: str) -> JobStatus:
        req = pb.CancelJobRequest(job_id=job_id)
        # Cancelling twice is harmless, so the call is safe to retry.
        resp = self._call(
            lambda stub, t: stub.CancelJob(req, timeout=t, metadata=self._md),
            idempotent=True,
        )
        return job_status_from_pb(resp)

    def events(self, job_id: str, after_seq: int = 0) -> list[JobEvent]:
        """Every event after `after_seq`, read a bounded page at a time."""
        out: list[JobEvent] = []
        for _ in range(MAX_EVENT_PAGES):
            req = pb.GetEventsRequest(job_id=job_id, after_seq=after_seq)
            resp = self._call(
                functools.partial(_unary, "GetEvents", req, metadata=self._md),
                idempotent=True,
            )
            out.extend(event_from_pb(e) for e in resp.events)
            if not resp.more or not resp.events or resp.events[-1].seq <= after_seq:
                break
            after_seq = resp.events[-1].seq
        return out

    def attempts(self, job_id: str) -> list[AttemptSummary]:
        """Every attempt the coordinator keeps for the job, read a bounded page at a time:
        whole, even where GetJob had to shorten them."""
        out: list[AttemptSummary] = []
        for _ in range(MAX_ATTEMPT_PAGES):
            areq = pb.GetAttemptsRequest(job_id=job_id, start=len(out))
            resp = self._call(
                functools.partial(_unary, "GetAttempts", areq, metadata=self._md),
                idempotent=True,
            )
            out.extend(attempt_from_pb(a) for a in resp.attempts)
            if not resp.more or not resp.attempts:
                break
        return out

    def get_result(self, job_id: str, sizes: dict[int, int]) -> dict[int, bytes]:
        """The tagged return values of a job, by rank, streamed by GetResult; never loaded.

        `sizes` is what the job's summary says; the bytes must match it, stay within the
        per-rank and per-job limits, and arrive in order, or GelasticError is raised.
        """
        if any(n < 0 or n > MAX_RETURN_VALUE_BYTES for n in sizes.values()) or (
            sum(sizes.values()) > MAX_RESULT_BYTES_PER_JOB
        ):
            raise GelasticError(
                None,
                f"job {job_id}: return values of {sum(sizes.values())} bytes over "
                f"{len(sizes)} ranks are over the limits; not fetched",
            )
        req = pb.GetResultRequest(job_id=job_id)

        def fetch(stub: Stub, timeout: float) -> dict[int, bytes]:
            parts: dict[int, bytearray] = {}
            call = stub.GetResult(req, timeout=timeout, metadata=self._md)
            try:
                for chunk in call:
                    rank = int(chunk.rank)
                    buf = parts.setdefault(rank, bytearray())
                    if (
                        rank not in sizes
                        or chunk.total != sizes[rank]
                        or chunk.offset != len(buf)
                        or len(buf) + len(chunk.data) > sizes[rank]
                    ):
                        raise GelasticError(
                            None, f"job {job_id}: GetResult sent bytes of rank {rank} out of order"
                        )
                    buf.extend(chunk.data)
            finally:
                call.cancel()
            return {r: bytes(b) for r, b in parts.items()}

        values = self._call(fetch, idempotent=True)
        if {r: len(v) for r, v in values.items()} != sizes:
            raise GelasticError(None, f"job {job_id}: GetResult sent incomplete return values")
        return values

    def watch(self, job_id: str, timeout: float | None = None) -> Iterator[pb.JobUpdate]:
        req = pb.WatchJobRequest(job_id=job_id)
        deadline = None if timeout is None else time.monotonic() + timeout

        def left() -> float | None:
            return None if deadline is None else max(0.0, deadline - time.monotonic())

        yield from self._stream(lambda stub: stub.WatchJob(req, timeout=left(), metadata=self._md))

    def logs(
        self,
        job_id: str,
        rank: int,
        stream: str = "stdout",
        attempt: int | None = None,
        follow: bool = False,
        timeout: float | None = None,
    ) -> Iterator[bytes]:
        req = pb.ReadLogsRequest(
            job_id=job_id,
            rank=rank,
            stream=stream,
            attempt=-1 if attempt is None else attempt,
            follow=follow,
        )
        if timeout is None and not follow:
            timeout = self.timeout
        deadline = None if timeout is None else time.monotonic() + timeout

        def left() -> float | None:
            return None if deadline is None else max(0.0, deadline - time.monotonic())

        for chunk in self._stream(
            lambda stub: stub.ReadLogs(req, timeout=left(), metadata=self._md)
        ):
            yield chunk.data


class Job:
    """A submitted job. Cheap to create; every method asks the coordinator."""

    def __init__(self, client: Client, job_id: str, *, result_key: bytes = b"") -> None:
        self.client = client
        self.job_id = job_id
        self._result_key = result_key

    def __repr__(self) -> str:
        return f"Job({self.job_id!r})"

    def status(self) -> JobStatus:
        return job_status_from_pb(self.client.get_job(self.job_id))

    def poll(self, *, trust_pickles: bool = False) -> RunResult | None:
        """The RunResult once the job is terminal, else None.

        `return_values` holds data: each value the worker stored as JSON, decoded; any other
        value a `client.results.PickledReturnValue`, NOT unpickled; a value that cannot be
        read a `client.results.UnreadableReturnValue`. When this handle holds the job's key (it
        submitted the job) each rank's tag is checked first; a bad or missing tag raises
        ReturnValueError. `trust_pickles=True` unpickles the pickles too: that runs code chosen
        by whoever wrote them, which includes any node placed on the job (any holder of the
        agent token); see `PickledReturnValue.trusted_load`.
        """
        msg = self.client.get_job(self.job_id)
        return self._complete(_result_of(msg), msg.state, trust_pickles)

    def _complete(
        self, result: RunResult | None, state: int, trust_pickles: bool
    ) -> RunResult | None:
        if result is None or not result.return_value_sizes:
            return result
        if state != pb.JOB_STATE_SUCCEEDED:
            return result
        raw = self.client.get_result(self.job_id, dict(result.return_value_sizes))
        values: dict[int, Any] = {
            rank: decode(raw[rank], key=self._result_key, job_id=self.job_id, rank=rank)
            for rank in sorted(raw)
        }
        result = replace(
            result,
            return_values=values,
            raw_return_values=raw,
            return_values_verified=bool(self._result_key),
        )
        if trust_pickles:
            result = replace(result, return_values=result.trusted_return_values())
        return result

    def wait(
        self,
        timeout: float | None = None,
        *,
        progress: bool | _Progress = False,
        out: TextIO | None = None,
        trust_pickles: bool = False,
    ) -> RunResult:
        """Block until the job is terminal and return its RunResult.

        Raises TimeoutError when `timeout` seconds pass first. With `progress`, prints one line
        per change of state (or one updating line on a terminal). Return values are as `poll`
        gives them: pickles stay unloaded unless `trust_pickles` (read `poll` first).
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        if isinstance(progress, _Progress):
            printer: _Progress | None = progress
        else:
            printer = _Progress(out or sys.stderr) if progress else None
        while True:
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                raise TimeoutError(f"job {self.job_id} did not finish within {timeout} s")
            try:
                for update in self.client.watch(self.job_id, timeout=remaining):
                    if printer is not None:
                        printer.show(update)
                    result = self._complete(_result_of(update.job), update.job.state, trust_pickles)
                    if result is not None:
                        if printer is not None:
                            printer.done()
                        return result
            except GelasticError as exc:
                if exc.code == grpc.StatusCode.DEADLINE_EXCEEDED:
                    raise TimeoutError(
                        f"job {self.job_id} did not finish within {timeout} s"
                    ) from None
                if exc.code != grpc.StatusCode.UNAVAILABLE:
                    raise
                time.sleep(0.2)
            # A watch that ended without a result (coordinator restarting): ask once, then rewatch.
            if printer is not None:
                printer.reattaching()
            with _suppress_unavailable():
                msg = self.client.get_job(self.job_id)
                if printer is not None:
                    # What happened meanwhile (a restart's recovery, the end): said once.
                    printer.show_status(job_status_from_pb(msg), self.events(printer.seen_seq))
                result = self._complete(_result_of(msg), msg.state, trust_pickles)
                if result is not None:
                    if printer is not None:
                        printer.done()
                    return result

    def cancel(self) -> JobStatus:
        return self.client.cancel(self.job_id)

    def events(self, after_seq: int = 0) -> list[JobEvent]:
        return self.client.events(self.job_id, after_seq)

    def attempts(self) -> list[AttemptSummary]:
        """The job's attempts so far, oldest first, each whole (paged by GetAttempts)."""
        return self.client.attempts(self.job_id)

    def stacks(
        self, *, rank: int | None = None, native: bool = False, wait: float = STACK_WAIT_S
    ) -> StackCapture:
        """Every running rank's stack now, grouped (see Client.capture_stacks)."""
        return self.client.capture_stacks(self.job_id, rank=rank, native=native, wait=wait)

    def stored_stacks(self) -> list[StackCapture]:
        """The stack captures the job keeps, oldest first (readable after the job ended)."""
        return self.client.stacks(self.job_id)

    def logs(
        self,
        rank: int = 0,
        stream: str = "stdout",
        attempt: int | None = None,
        follow: bool = False,
    ) -> Iterator[bytes]:
        """Stream a rank's log from the agent that holds it, through the coordinator."""
        return self.client.logs(self.job_id, rank, stream, attempt, follow)


def _all_pages(
    page: Callable[[pb.ListJobsRequest], pb.ListJobsResponse], include_finished: bool
) -> list[JobStatus]:
    """ListJobs' pages one after the other, until the last or `MAX_LISTED_JOBS` jobs."""
    out: list[JobStatus] = []
    token = ""
    while len(out) < MAX_LISTED_JOBS:
        resp = page(
            pb.ListJobsRequest(
                include_finished=include_finished,
                page_size=min(JOBS_PAGE_SIZE, MAX_LISTED_JOBS - len(out)),
                page_token=token,
            )
        )
        out.extend(job_status_from_pb(j) for j in resp.jobs)
        # A coordinator that pages no more (or an older one that never did) says "".
        if not resp.next_page_token or resp.next_page_token == token or not resp.jobs:
            break
        token = resp.next_page_token
    return out[:MAX_LISTED_JOBS]


def _unary(name: str, req: Any, stub: Stub, timeout: float, *, metadata: Any) -> Any:
    return getattr(stub, name)(req, timeout=timeout, metadata=metadata)


class _suppress_unavailable:
    def __enter__(self) -> None:
        return None

    def __exit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> bool:
        return isinstance(ev, GelasticError) and ev.code == grpc.StatusCode.UNAVAILABLE


def _result_of(job: pb.Job) -> RunResult | None:
    """The result summary of a job message: never any return value bytes, never unpickled."""
    if not job.has_result:
        return None
    return result_from_pb(job.result, job_id=job.job_id, name=job.name)


def submit(
    spec: JobSpec,
    coordinator: str | None = None,
    *,
    timeout: float = CALL_TIMEOUT_S,
    token_file: str | None = None,
    tls_ca: str | None = None,
) -> Job:
    """Submit a job to the coordinator (default `$GELASTIC_COORDINATOR` or 127.0.0.1:29400).

    `token_file` and `tls_ca` default to `$GELASTIC_TOKEN_FILE` and `$GELASTIC_TLS_CA`;
    `$GELASTIC_TLS` and `$GELASTIC_INSECURE` are read too (see `Security.from_env`).
    """
    return Client(coordinator, timeout=timeout, token_file=token_file, tls_ca=tls_ca).submit(spec)
