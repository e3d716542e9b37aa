"""The node session's one codec: `client.node_protocol` values to protobuf and back.

Both ends use it: the agent encodes what it says and decodes what it is told; the coordinator
the other way round. Decoding is where a message from the other side is first bounded: a
field that no honest peer sends (too many GPUs, an unprintable uuid, an empty message) raises
`MessageError` naming it, and texts are cut to the length the receiver keeps.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable
from dataclasses import replace

from client.assignment import RoundAssignment, WorkerRanks
from client.model import GpuDevice, JobSpec
from client.node_protocol import (
    Assign,
    CancelLogs,
    ClockProbe,
    ClockReply,
    CoordinatorMsg,
    DrainAccepted,
    DrainRequest,
    GroupHealth,
    GroupStopped,
    GroupUnknown,
    Heartbeat,
    Hello,
    LogChunk,
    LogCredit,
    NodeMsg,
    PortReserved,
    ProgressReport,
    RankProgress,
    Release,
    ReservePort,
    RunningGroup,
    StackReply,
    StackRequest,
    StartLogs,
    Stop,
    TorchMetric,
    Welcome,
    WorkerExit,
    WorkerExited,
    WorkerFailing,
    WorkerHealthSample,
    WorkersStarted,
    WorkerStack,
)
from client.progress import MAX_METRICS, MAX_STEP, METRIC_NAME
from client.stacks import MAX_STACK_BYTES, MAX_STACK_NOTE, STACK_STATUSES, bounded_stack
from client.wire import (
    failure_from_pb,
    failure_to_pb,
    gpu_device_from_pb,
    gpu_device_to_pb,
    gpu_health_from_pb,
    gpu_health_to_pb,
    group_state_from_pb,
    group_state_to_pb,
    spec_from_pb,
    spec_to_pb,
)
from protos.gelastic.v1 import gelastic_pb2 as pb

__all__ = [
    "MAX_DRAIN_REASON",
    "MAX_DRAIN_S",
    "MAX_GPUS",
    "MAX_GPU_TEXT",
    "MAX_HEALTH_PROBLEM",
    "MAX_REASON_TEXT",
    "MAX_STACK_WAIT_S",
    "MAX_STACK_WORKERS",
    "MAX_TORCH_METRICS",
    "NODE_SECRET_PATTERN",
    "MessageError",
    "decode_coordinator",
    "decode_node",
    "encode_coordinator",
    "encode_node",
    "exit_from_pb",
    "exit_to_pb",
    "ranks_from_pb",
    "ranks_to_pb",
]

MAX_GPUS = 64
"""Most GPUs one node offers (NVML's own limit per host is lower in practice)."""
MAX_GPU_TEXT = 96
"""Longest GPU name or uuid."""
MAX_REASON_TEXT = 4000
"""Longest reason a GroupUnknown keeps."""
NODE_SECRET_PATTERN = re.compile(r"[A-Za-z0-9_-]{16,128}")
"""What a hello's node secret may be (fullmatch); empty is none."""
MAX_DRAIN_REASON = 1000
"""Longest reason a drain keeps."""
MAX_HEALTH_PROBLEM = 1000
"""Longest health problem a heartbeat keeps."""
MAX_TORCH_METRICS = 256
"""Most torch metric series one heartbeat carries (the rest wait for the next)."""
TORCH_METRIC_NAME = re.compile(r"[A-Za-z0-9_.:/@-]{1,128}")
"""A torch metric's job id, group and name (fullmatch)."""
MAX_DRAIN_S = 7 * 86400.0
"""Longest drain deadline a message may carry (seconds)."""
MAX_STACK_WORKERS = 1024
"""Most workers one stack request or reply names (more than a node runs)."""
MAX_STACK_WAIT_S = 60.0
"""Longest a stack request lets the reading of one worker's stack take."""
MAX_PROGRESS_RANKS = 4096
"""Ranks one progress report names at most (a node's workers of one round)."""


def _torch_metric_ok(t: pb.TorchMetricSample) -> bool:
    names = (t.job_id, t.group, t.name)
    return all(TORCH_METRIC_NAME.fullmatch(n) for n in names) and abs(t.value) <= 1e18


class MessageError(ValueError):
    """A node session message no honest peer sends; the text names the field."""


# ---- parts ---------------------------------------------------------------------------------------


def exit_to_pb(e: WorkerExit) -> pb.WorkerExit:
    msg = pb.WorkerExit(
        local_rank=e.local_rank,
        global_rank=e.global_rank,
        pid=e.pid,
        exitcode=e.exitcode,
        stopped_by_agent=e.stopped_by_agent,
        timestamp=e.timestamp,
    )
    if e.failure is not None:
        msg.failure.CopyFrom(failure_to_pb(e.failure))
        msg.has_failure = True
    if e.return_value is not None:
        msg.return_value = e.return_value
        msg.has_return_value = True
    return msg


def exit_from_pb(m: pb.WorkerExit) -> WorkerExit:
    return WorkerExit(
        local_rank=m.local_rank,
        global_rank=m.global_rank,
        pid=m.pid,
        exitcode=m.exitcode,
        stopped_by_agent=m.stopped_by_agent,
        failure=failure_from_pb(m.failure) if m.has_failure else None,
        return_value=bytes(m.return_value) if m.has_return_value else None,
        timestamp=m.timestamp,
    )


def ranks_to_pb(w: WorkerRanks) -> pb.WorkerRanks:
    return pb.WorkerRanks(
        local_rank=w.local_rank,
        global_rank=w.global_rank,
        role_rank=w.role_rank,
        world_size=w.world_size,
        role_world_size=w.role_world_size,
        role=w.role,
    )


def ranks_from_pb(m: pb.WorkerRanks) -> WorkerRanks:
    return WorkerRanks(
        m.local_rank, m.global_rank, m.role_rank, m.world_size, m.role_world_size, role=m.role
    )


def _pids_to_pb(pids: tuple[tuple[int, int], ...], ranks: tuple[int, ...]) -> list[pb.WorkerPid]:
    known = len(ranks) == len(pids)
    return [
        pb.WorkerPid(local_rank=lr, pid=pid, global_rank=ranks[i] if known else -1)
        for i, (lr, pid) in enumerate(pids)
    ]


def _pids_from_pb(
    workers: Iterable[pb.WorkerPid],
) -> tuple[tuple[tuple[int, int], ...], tuple[int, ...]]:
    listed = list(workers)
    return tuple((w.local_rank, w.pid) for w in listed), tuple(w.global_rank for w in listed)


def _running_to_pb(g: RunningGroup) -> pb.RunningGroup:
    return pb.RunningGroup(
        job_id=g.job_id,
        round=g.round,
        attempt=g.attempt,
        workers=_pids_to_pb(g.pids, g.global_ranks),
        exits=[exit_to_pb(e) for e in g.exits],
        stopped=g.stopped,
    )


def _running_from_pb(g: pb.RunningGroup) -> RunningGroup:
    pids, ranks = _pids_from_pb(g.workers)
    return RunningGroup(
        job_id=g.job_id,
        round=g.round,
        attempt=g.attempt,
        pids=pids,
        global_ranks=ranks,
        exits=tuple(exit_from_pb(e) for e in g.exits),
        stopped=g.stopped,
    )


def _secret_from_hello(hello: pb.Hello) -> str:
    """The hello's node secret, checked; the error never repeats it."""
    secret = hello.node_secret
    if secret and not NODE_SECRET_PATTERN.fullmatch(secret):
        raise MessageError(
            f"hello.node_secret: must be 16-128 of [A-Za-z0-9_-], got {len(secret)} characters"
        )
    return secret


def _gpus_from_hello(hello: pb.Hello) -> tuple[GpuDevice, ...]:
    """The GPUs a hello offers, checked: MessageError naming the field otherwise."""
    if len(hello.gpus) > MAX_GPUS:
        raise MessageError(f"hello.gpus: at most {MAX_GPUS} GPUs, got {len(hello.gpus)}")
    seen: set[int] = set()
    out = []
    for g in hello.gpus:
        bad = ""
        if not 0 <= g.index < 1024 or g.index in seen:
            bad = f"index {g.index} is out of range or given twice"
        elif not g.uuid or len(g.uuid) > MAX_GPU_TEXT or not g.uuid.isprintable() or "," in g.uuid:
            bad = f"GPU {g.index}: uuid must be 1-{MAX_GPU_TEXT} printable characters, no comma"
        elif len(g.name) > MAX_GPU_TEXT or not g.name.isprintable():
            bad = f"GPU {g.index}: name must be at most {MAX_GPU_TEXT} printable characters"
        elif g.memory_total < 0:
            bad = f"GPU {g.index}: memory_total must be >= 0"
        if bad:
            raise MessageError(f"hello.gpus: {bad}")
        seen.add(g.index)
        out.append(gpu_device_from_pb(g))
    return tuple(out)


def _group_health_to_pb(g: GroupHealth) -> pb.GroupHealth:
    return pb.GroupHealth(
        job_id=g.job_id,
        round=g.round,
        workers=[
            pb.WorkerHealth(
                local_rank=s.local_rank,
                global_rank=s.global_rank,
                pid=s.pid,
                cpu_percent=s.cpu_percent,
                rss_bytes=s.rss_bytes,
                proc_state=s.proc_state,
            )
            for s in g.workers
        ],
        state=group_state_to_pb(g.state),  # type: ignore[arg-type]
        reason=g.reason,
    )


def _group_health_from_pb(g: pb.GroupHealth) -> GroupHealth:
    return GroupHealth(
        job_id=g.job_id,
        round=g.round,
        workers=tuple(
            WorkerHealthSample(
                w.local_rank, w.pid, w.cpu_percent, w.rss_bytes, w.proc_state, w.global_rank
            )
            for w in g.workers
        ),
        state=group_state_from_pb(g.state),
        reason=g.reason,
    )


# ---- agent to coordinator ------------------------------------------------------------------------


def encode_node(msg: NodeMsg) -> pb.NodeMessage:
    """What an agent writes to its session."""
    if isinstance(msg, Heartbeat):
        return pb.NodeMessage(
            heartbeat=pb.Heartbeat(
                seq=msg.seq,
                groups=[_group_health_to_pb(g) for g in msg.groups],
                gpus=[gpu_health_to_pb(g) for g in msg.gpus],
                health_problem=msg.health_problem[:MAX_HEALTH_PROBLEM],
                torch_metrics=[
                    pb.TorchMetricSample(job_id=t.job_id, group=t.group, name=t.name, value=t.value)
                    for t in msg.torch_metrics
                ],
            )
        )
    if isinstance(msg, WorkerExited):
        return pb.NodeMessage(
            worker_exited=pb.WorkerExited(
                job_id=msg.job_id, round=msg.round, exit=exit_to_pb(msg.exit)
            )
        )
    if isinstance(msg, LogChunk):
        return pb.NodeMessage(
            log_chunk=pb.LogChunk(
                request_id=msg.request_id, data=msg.data, eof=msg.eof, error=msg.error
            )
        )
    if isinstance(msg, WorkersStarted):
        return pb.NodeMessage(
            workers_started=pb.WorkersStarted(
                job_id=msg.job_id,
                round=msg.round,
                workers=_pids_to_pb(msg.pids, msg.global_ranks),
            )
        )
    if isinstance(msg, PortReserved):
        return pb.NodeMessage(
            port_reserved=pb.PortReserved(
                job_id=msg.job_id, round=msg.round, port=msg.port, error=msg.error
            )
        )
    if isinstance(msg, WorkerFailing):
        f = msg.failure
        return pb.NodeMessage(
            worker_failing=pb.WorkerFailing(
                job_id=msg.job_id,
                round=msg.round,
                local_rank=f.local_rank,
                global_rank=f.global_rank,
                pid=f.pid,
                failure=failure_to_pb(f),
            )
        )
    if isinstance(msg, GroupStopped):
        return pb.NodeMessage(
            group_stopped=pb.GroupStopped(
                job_id=msg.job_id, round=msg.round, unkillable_pids=list(msg.unkillable_pids)
            )
        )
    if isinstance(msg, GroupUnknown):
        return pb.NodeMessage(
            group_unknown=pb.GroupUnknown(job_id=msg.job_id, round=msg.round, reason=msg.reason)
        )
    if isinstance(msg, ClockReply):
        return pb.NodeMessage(
            clock_reply=pb.ClockReply(
                probe_sent_at=msg.probe_sent_at, received_at=msg.received_at, sent_at=msg.sent_at
            )
        )
    if isinstance(msg, Hello):
        return pb.NodeMessage(
            hello=pb.Hello(
                name=msg.name,
                addr=msg.addr,
                slots=msg.slots,
                incarnation=msg.incarnation,
                version=msg.version,
                running=[_running_to_pb(g) for g in msg.running],
                gpus=[gpu_device_to_pb(d) for d in msg.gpus],
                node_secret=msg.node_secret,
            )
        )
    if isinstance(msg, StackReply):
        return pb.NodeMessage(
            stack_reply=pb.StackReply(
                request_id=msg.request_id,
                error=msg.error,
                stacks=[
                    pb.WorkerStack(
                        local_rank=w.local_rank,
                        pid=w.pid,
                        status=w.status,
                        text=w.text,
                        note=w.note,
                    )
                    for w in msg.stacks
                ],
            )
        )
    if isinstance(msg, ProgressReport):
        return pb.NodeMessage(progress_report=_progress_to_pb(msg))
    if isinstance(msg, DrainRequest):
        return pb.NodeMessage(
            drain_request=pb.DrainRequest(deadline_ms=_deadline_ms(msg.deadline), reason=msg.reason)
        )
    raise TypeError(f"not a node message: {type(msg).__name__}")


def _deadline_ms(deadline: float | None) -> int:
    """A drain's deadline on the wire: milliseconds, at least 1 (0 means none given)."""
    return 0 if deadline is None else max(1, round(deadline * 1000))


def _deadline_from_ms(ms: int, field: str) -> float | None:
    if ms < 0 or ms > MAX_DRAIN_S * 1000:
        raise MessageError(f"{field}: must be 0-{MAX_DRAIN_S * 1000:.0f} ms, got {ms}")
    return ms / 1000 if ms else None


def decode_node(m: pb.NodeMessage) -> NodeMsg:
    """What a coordinator reads from a session; MessageError for one no agent sends."""
    kind = m.WhichOneof("kind")
    if kind == "heartbeat":
        h = m.heartbeat
        return Heartbeat(
            seq=h.seq,
            groups=tuple(_group_health_from_pb(g) for g in h.groups),
            gpus=tuple(gpu_health_from_pb(g) for g in h.gpus[:MAX_GPUS]),
            health_problem=" ".join(h.health_problem[:MAX_HEALTH_PROBLEM].split()),
            torch_metrics=tuple(
                TorchMetric(t.job_id, t.group, t.name, t.value)
                for t in h.torch_metrics[:MAX_TORCH_METRICS]
                if _torch_metric_ok(t)
            ),
        )
    if kind == "worker_exited":
        e = m.worker_exited
        return WorkerExited(e.job_id, e.round, exit_from_pb(e.exit))
    if kind == "log_chunk":
        c = m.log_chunk
        return LogChunk(c.request_id, bytes(c.data), c.eof, c.error)
    if kind == "workers_started":
        w = m.workers_started
        pids, ranks = _pids_from_pb(w.workers)
        return WorkersStarted(w.job_id, w.round, pids, ranks)
    if kind == "port_reserved":
        p = m.port_reserved
        return PortReserved(p.job_id, p.round, p.port, p.error)
    if kind == "worker_failing":
        f = m.worker_failing
        failure = replace(
            failure_from_pb(f.failure),
            local_rank=f.local_rank,
            global_rank=f.global_rank,
            pid=f.pid,
        )
        return WorkerFailing(f.job_id, f.round, failure)
    if kind == "group_stopped":
        g = m.group_stopped
        return GroupStopped(g.job_id, g.round, tuple(g.unkillable_pids))
    if kind == "group_unknown":
        u = m.group_unknown
        return GroupUnknown(u.job_id, u.round, u.reason[:MAX_REASON_TEXT])
    if kind == "clock_reply":
        r = m.clock_reply
        return ClockReply(r.probe_sent_at, r.received_at, r.sent_at)
    if kind == "hello":
        hello = m.hello
        return Hello(
            name=hello.name,
            addr=hello.addr,
            slots=hello.slots,
            incarnation=hello.incarnation,
            version=hello.version,
            running=tuple(_running_from_pb(g) for g in hello.running),
            gpus=_gpus_from_hello(hello),
            node_secret=_secret_from_hello(hello),
        )
    if kind == "drain_request":
        d = m.drain_request
        return DrainRequest(
            _deadline_from_ms(d.deadline_ms, "drain_request.deadline_ms"),
            d.reason[:MAX_DRAIN_REASON],
        )
    if kind == "stack_reply":
        return _stack_reply_from_pb(m.stack_reply)
    if kind == "progress_report":
        return _progress_from_pb(m.progress_report)
    raise MessageError("empty node message")


def _stack_reply_from_pb(r: pb.StackReply) -> StackReply:
    if len(r.stacks) > MAX_STACK_WORKERS:
        raise MessageError(f"stack_reply.stacks: at most {MAX_STACK_WORKERS}, got {len(r.stacks)}")
    return StackReply(
        r.request_id,
        tuple(
            WorkerStack(
                w.local_rank,
                w.pid,
                w.status if w.status in STACK_STATUSES else "error",
                bounded_stack(w.text, MAX_STACK_BYTES),
                w.note[:MAX_STACK_NOTE],
            )
            for w in r.stacks
        ),
        r.error[:MAX_STACK_NOTE],
    )


def _progress_to_pb(msg: ProgressReport) -> pb.ProgressReport:
    return pb.ProgressReport(
        job_id=msg.job_id,
        round=msg.round,
        ranks=[
            pb.RankProgress(
                local_rank=r.local_rank,
                global_rank=r.global_rank,
                step=r.step,
                steps_per_s=r.steps_per_s,
                metrics=dict(r.metrics),
            )
            for r in msg.ranks
        ],
    )


def _progress_from_pb(p: pb.ProgressReport) -> ProgressReport:
    """Bounded as a worker's own report is (`client.progress`): what no agent sends is refused."""
    if len(p.ranks) > MAX_PROGRESS_RANKS:
        raise MessageError(f"progress_report.ranks: at most {MAX_PROGRESS_RANKS}")
    ranks = []
    for r in p.ranks:
        if not 0 <= r.step <= MAX_STEP or not 0 <= r.steps_per_s <= 1e9:
            raise MessageError("progress_report.ranks: step or steps_per_s out of range")
        if len(r.metrics) > MAX_METRICS or not all(
            METRIC_NAME.fullmatch(k) and math.isfinite(v) for k, v in r.metrics.items()
        ):
            raise MessageError("progress_report.ranks.metrics: a bad name or value")
        ranks.append(
            RankProgress(
                r.local_rank, r.global_rank, r.step, r.steps_per_s, tuple(sorted(r.metrics.items()))
            )
        )
    return ProgressReport(p.job_id, p.round, tuple(ranks))


# ---- coordinator to agent ------------------------------------------------------------------------


class _SpecCache:
    """The wire form of the spec last encoded: every node of a round gets the same spec
    object, and encoding it again for each of ten thousand nodes was half of their Assigns'
    cost. Keyed by identity (a `JobSpec` is frozen), one entry."""

    def __init__(self) -> None:
        self._spec: JobSpec | None = None
        self._pb = pb.JobSpec()

    def get(self, spec: JobSpec) -> pb.JobSpec:
        if spec is not self._spec:
            self._pb, self._spec = spec_to_pb(spec), spec
        return self._pb  # copied into each Assign, never changed in place


_SPECS = _SpecCache()


def _assign_to_pb(a: RoundAssignment) -> pb.Assign:
    return pb.Assign(
        job_id=a.job_id,
        round=a.round,
        attempt=a.attempt,
        spec=_SPECS.get(a.spec),
        group_rank=a.group_rank,
        group_world_size=a.group_world_size,
        master_addr=a.master_addr,
        master_port=a.master_port,
        workers=[ranks_to_pb(w) for w in a.workers],
        run_id=a.run_id,
        gpus=list(a.gpus),
        gpu_uuids=list(a.gpu_uuids),
    )


def _assign_from_pb(m: pb.Assign) -> Assign:
    spec, error = JobSpec(), ""
    try:
        spec = spec_from_pb(m.spec)
    except (ValueError, TypeError) as exc:
        error = str(exc)
    assignment = RoundAssignment(
        job_id=m.job_id,
        round=m.round,
        attempt=m.attempt,
        spec=spec,
        group_rank=m.group_rank,
        group_world_size=m.group_world_size,
        master_addr=m.master_addr,
        master_port=m.master_port,
        workers=tuple(ranks_from_pb(w) for w in m.workers),
        run_id=m.run_id,
        gpus=tuple(m.gpus),
        gpu_uuids=tuple(m.gpu_uuids),
    )
    return Assign(assignment, spec_error=error)


def encode_coordinator(msg: CoordinatorMsg, epoch: int = 0) -> pb.CoordinatorMessage:
    """What a coordinator writes to a session, under its leader epoch (0: no election)."""
    if isinstance(msg, Assign):
        out = pb.CoordinatorMessage(assign=_assign_to_pb(msg.assignment))
    elif isinstance(msg, Stop):
        out = pb.CoordinatorMessage(
            stop=pb.Stop(
                job_id=msg.job_id,
                round=msg.round,
                grace_ms=round(msg.grace * 1000),
                reason=msg.reason,
                replaced=msg.replaced,
                notice=msg.notice,
                term_after_ms=round(msg.term_after * 1000),
                drain_node=msg.drain_node,
            )
        )
    elif isinstance(msg, ReservePort):
        out = pb.CoordinatorMessage(reserve_port=pb.ReservePort(job_id=msg.job_id, round=msg.round))
    elif isinstance(msg, Release):
        out = pb.CoordinatorMessage(release=pb.Release(job_id=msg.job_id, round=msg.round))
    elif isinstance(msg, LogCredit):
        out = pb.CoordinatorMessage(
            log_credit=pb.LogCredit(request_id=msg.request_id, chunks=msg.chunks)
        )
    elif isinstance(msg, StartLogs):
        out = pb.CoordinatorMessage(
            start_logs=pb.StartLogs(
                request_id=msg.request_id,
                job_id=msg.job_id,
                attempt=msg.attempt,
                rank=msg.rank,
                stream=msg.stream,
                follow=msg.follow,
                credit_chunks=msg.credit_chunks,
            )
        )
    elif isinstance(msg, CancelLogs):
        out = pb.CoordinatorMessage(cancel_logs=pb.CancelLogs(request_id=msg.request_id))
    elif isinstance(msg, ClockProbe):
        out = pb.CoordinatorMessage(clock_probe=pb.ClockProbe(sent_at=msg.sent_at))
    elif isinstance(msg, Welcome):
        out = pb.CoordinatorMessage(
            welcome=pb.Welcome(
                heartbeat_interval_ms=round(msg.heartbeat_interval * 1000),
                lease_ms=round(msg.lease * 1000),
                coordinator_id=msg.coordinator_id,
            )
        )
    elif isinstance(msg, DrainAccepted):
        out = pb.CoordinatorMessage(
            drain_accepted=pb.DrainAccepted(deadline_ms=_deadline_ms(msg.deadline))
        )
    elif isinstance(msg, StackRequest):
        out = pb.CoordinatorMessage(
            stack_request=pb.StackRequest(
                request_id=msg.request_id,
                job_id=msg.job_id,
                round=msg.round,
                local_ranks=list(msg.local_ranks),
                native=msg.native,
                timeout_ms=max(1, round(msg.timeout * 1000)),
            )
        )
    else:
        raise TypeError(f"not a coordinator message: {type(msg).__name__}")
    if epoch:
        out.epoch = epoch
    return out


def decode_coordinator(m: pb.CoordinatorMessage) -> CoordinatorMsg:
    """What an agent reads from its session (its epoch is `m.epoch`); MessageError if empty."""
    kind = m.WhichOneof("kind")
    if kind == "assign":
        return _assign_from_pb(m.assign)
    if kind == "stop":
        s = m.stop
        return Stop(
            s.job_id,
            s.round,
            s.grace_ms / 1000,
            s.reason,
            s.replaced,
            notice=s.notice,
            term_after=max(0, min(s.term_after_ms, round(MAX_DRAIN_S * 1000))) / 1000,
            drain_node=s.drain_node[:MAX_DRAIN_REASON],
        )
    if kind == "reserve_port":
        return ReservePort(m.reserve_port.job_id, m.reserve_port.round)
    if kind == "release":
        return Release(m.release.job_id, m.release.round)
    if kind == "log_credit":
        return LogCredit(m.log_credit.request_id, m.log_credit.chunks)
    if kind == "start_logs":
        lg = m.start_logs
        return StartLogs(
            lg.request_id, lg.job_id, lg.attempt, lg.rank, lg.stream, lg.follow, lg.credit_chunks
        )
    if kind == "cancel_logs":
        return CancelLogs(m.cancel_logs.request_id)
    if kind == "clock_probe":
        return ClockProbe(m.clock_probe.sent_at)
    if kind == "welcome":
        w = m.welcome
        return Welcome(w.heartbeat_interval_ms / 1000, w.lease_ms / 1000, w.coordinator_id)
    if kind == "drain_accepted":
        return DrainAccepted(
            _deadline_from_ms(m.drain_accepted.deadline_ms, "drain_accepted.deadline_ms")
        )
    if kind == "stack_request":
        q = m.stack_request
        if len(q.local_ranks) > MAX_STACK_WORKERS:
            raise MessageError(f"stack_request.local_ranks: at most {MAX_STACK_WORKERS}")
        timeout = min(max(q.timeout_ms, 1), round(MAX_STACK_WAIT_S * 1000)) / 1000
        return StackRequest(
            q.request_id, q.job_id, q.round, tuple(q.local_ranks), q.native, timeout
        )
    raise MessageError("empty coordinator message")
