"""The node agent's decisions: what it runs, what it refuses, and what it tells a coordinator.

The agent's I/O (`nodeagent.session.NodeAgent`, its session link, its worker groups) carries
out the session; what to say and what to accept is decided here, on `client.node_protocol`
values, with no transport, no event loop and no clock (`now` is a parameter):

- an assignment: `check_assignment` turns one into the `RoundAssignment` this node runs (the
  spec checked, a multi-role job's spec cut to the node's role, the GPUs checked against the
  node's own and given their uuids), or a `Refusal` naming why, with the exit of each of its
  ranks that the refusal takes (`Refusal.exits`);
- the leader epoch: `EpochGuard` keeps the newest one seen and refuses an older one
  (`StaleEpoch`), with the warning to log, rate-limited;
- what the agent holds: `HeldRound` is the bookkeeping of one round it runs (or ran and was
  not released from); from the held rounds come the `hello` of a new session, what follows its
  welcome (`replay`), and each `heartbeat`, built from the groups' health samples
  (`group_health`, `heartbeat_of`); `rank_running` answers a log request that follows a rank;
- a stop of the agent: `stop_grace` is the grace each group gets;
- a drain's stop: `preempt_notice` is what its workers read (`client.preempt`).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Protocol

from client.assignment import RoundAssignment
from client.model import (
    FailureCategory,
    GpuDevice,
    GpuHealth,
    ProcessFailure,
    WorkerState,
    is_job_id,
)
from client.node_protocol import (
    Assign,
    CoordinatorMsg,
    GroupHealth,
    GroupStopped,
    GroupUnknown,
    Heartbeat,
    Hello,
    NodeMsg,
    RunningGroup,
    Stop,
    TorchMetric,
    WorkerExit,
    WorkerExited,
    WorkerFailing,
    WorkerHealthSample,
    WorkersStarted,
)
from client.preempt import notice_json
from nodeagent._launch import role_spec

__all__ = [
    "STALE_LOG_EVERY_S",
    "VERSION",
    "EpochGuard",
    "HealthReading",
    "HeldRound",
    "HeldRounds",
    "Refusal",
    "StaleEpoch",
    "check_assignment",
    "group_health",
    "heartbeat_of",
    "hello",
    "message_kind",
    "preempt_notice",
    "rank_running",
    "replay",
    "stop_grace",
]

VERSION = "0.1.0"
STALE_LOG_EVERY_S = 10.0
"""Refusals of messages from an older leader epoch are logged at most this often."""


# ---- the leader epoch ----------------------------------------------------------------------------


class StaleEpoch(Exception):
    """A coordinator message from a leader older than the newest this agent has seen."""

    REPORT = (
        "refused %s from %s: it carries leader epoch %d, older than epoch %d seen before "
        "(a deposed leader); closing that session%s"
    )
    """The warning about a refusal, %-style: `report_args` fill it in."""

    def __init__(self, text: str, report_args: tuple[object, ...] = ()) -> None:
        super().__init__(text)
        self.report_args = report_args
        """() while such refusals are not logged again yet."""

    @property
    def report(self) -> str:
        """The warning to log about it ("" while such refusals are not logged again yet)."""
        return self.REPORT % self.report_args if self.report_args else ""


def message_kind(msg: CoordinatorMsg | None) -> str:
    """What a coordinator message is called on the wire ("assign", "reserve_port", ...);
    "message" for one this agent could not read."""
    if msg is None:
        return "message"
    return re.sub(r"(?<!^)(?=[A-Z])", "_", type(msg).__name__).lower()


class EpochGuard:
    """The newest leader epoch any coordinator message carried, for the life of the agent.

    Epoch 0 (one coordinator, no election) passes only while no coordinator has spoken with a
    higher one.
    """

    def __init__(self) -> None:
        self.newest = 0
        self._logged_at = -float("inf")
        self._unlogged = 0
        """Refusals since the last one logged."""

    def check(self, epoch: int, kind: str, peer: str, now: float) -> None:
        """Raise StaleEpoch for a message (`kind`, from `peer`) of a leader older than the
        newest seen; a newer epoch becomes the newest."""
        if epoch >= self.newest:
            self.newest = epoch
            return
        report: tuple[object, ...] = ()
        if now - self._logged_at >= STALE_LOG_EVERY_S:
            since = self._unlogged
            more = f" ({since} more refused since the last report)" if since else ""
            report = (kind, peer, epoch, self.newest, more)
            self._logged_at, self._unlogged = now, 0
        else:
            self._unlogged += 1
        raise StaleEpoch(
            f"coordinator {peer} speaks for leader epoch {epoch}, older than {self.newest}; "
            f"its {kind} was not acted on",
            report,
        )


# ---- an assignment -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Refusal:
    """Why this node will not run an assignment.

    Dropping it silently would leave the round assigned with no worker ever starting. Each
    rank of this node exits at once with a platform failure naming the reason, so the round
    fails now (and the job follows its restart budget) instead of at the start deadline.
    """

    why: str
    category: FailureCategory = FailureCategory.PLATFORM
    """PLATFORM: the agent cannot run it; INFRA: the host is not fit to (a plug-in's veto)."""

    def message(self, node: str, round_: int) -> str:
        return f"node {node} refused the assignment of round {round_}: {self.why}"

    def exits(self, a: RoundAssignment, node: str, now: float) -> list[WorkerExited]:
        """The exit of each of the assignment's ranks that the refusal takes."""
        message = self.message(node, a.round)
        out = []
        for w in a.workers:
            failure = ProcessFailure(
                global_rank=w.global_rank,
                local_rank=w.local_rank,
                pid=0,
                exitcode=-1,
                message=message,
                timestamp=now,
                node=node,
                category=self.category,
            )
            exit_ = WorkerExit(
                local_rank=w.local_rank,
                global_rank=w.global_rank,
                pid=0,
                exitcode=-1,
                failure=failure,
                timestamp=now,
            )
            out.append(WorkerExited(a.job_id, a.round, exit_))
        return out


def check_assignment(msg: Assign, gpus: Sequence[GpuDevice]) -> RoundAssignment | Refusal:
    """The share of a round this node runs, or why it will not: the job id, the spec (one the
    codec could not read, or that does not validate), a multi-role job's one role, and the
    GPUs, which must be this node's own (`gpus`), one per worker."""
    a = msg.assignment
    if not is_job_id(a.job_id):
        return Refusal(f"job id {a.job_id[:80]!r} is not one this agent accepts")
    spec = a.spec
    if msg.spec_error:
        return Refusal(f"its spec does not validate here: {msg.spec_error}")
    try:
        spec.validate()
    except (ValueError, TypeError) as exc:
        return Refusal(f"its spec does not validate here: {exc}")
    if spec.roles:
        # A multi-role job: this node runs the group of one role, as a one-role spec.
        roles = {w.role for w in a.workers}
        if len(roles) != 1 or spec.role_named(next(iter(roles))) is None:
            return Refusal(
                f"its workers name no single role of the spec ({sorted(roles)[:2]!r:.80})"
            )
        spec = role_spec(spec, next(iter(roles)))
    uuids = {d.index: d.uuid for d in gpus}
    if a.gpus:
        if len(a.gpus) != len(a.workers) or len(set(a.gpus)) != len(a.gpus):
            return Refusal(f"it gives {len(a.gpus)} GPUs to {len(a.workers)} workers")
        if any(i not in uuids for i in a.gpus):
            return Refusal(f"it names GPUs {list(a.gpus)[:8]} but this node offers {sorted(uuids)}")
    # This agent's own uuids for those indices, not the message's.
    return replace(a, spec=spec, gpu_uuids=tuple(uuids[i] for i in a.gpus))


# ---- what the agent holds ------------------------------------------------------------------------


@dataclass
class HeldRound:
    """One round this agent runs (or ran and has not been released from)."""

    assignment: RoundAssignment
    pids: dict[int, int] = field(default_factory=dict)
    """local rank -> pid of each worker started."""
    exits: list[WorkerExit] = field(default_factory=list)
    failing: dict[int, ProcessFailure] = field(default_factory=dict)
    """Failures recorded by workers still running (local rank -> failure), sent before the exit."""
    stopped: bool = False
    unknown: str = ""
    """Why the group became UNKNOWN ("" = it did not); re-reported on every new session."""

    def global_rank(self, local_rank: int) -> int:
        for w in self.assignment.workers:
            if w.local_rank == local_rank:
                return w.global_rank
        return -1

    def workers_started(self) -> WorkersStarted:
        a = self.assignment
        return WorkersStarted(
            a.job_id,
            a.round,
            tuple(self.pids.items()),
            tuple(self.global_rank(lr) for lr in self.pids),
        )


HeldRounds = Mapping[tuple[str, int], HeldRound]
"""The rounds an agent holds, by (job id, round)."""


def hello(
    held: HeldRounds,
    *,
    name: str,
    addr: str,
    slots: int,
    incarnation: str,
    gpus: Sequence[GpuDevice],
    node_secret: str = "",
) -> Hello:
    """The first message of a session: the node, and the groups and pids it holds.

    It must fit one message however big the results: the exits follow the welcome (`replay`),
    and a stopped group with exits to report says so after them, so they are not fenced off.
    """
    running = tuple(
        RunningGroup(
            job_id=job_id,
            round=round_,
            attempt=h.assignment.attempt,
            pids=tuple(h.pids.items()),
            global_ranks=tuple(h.global_rank(lr) for lr in h.pids),
            stopped=h.stopped and not h.exits,
        )
        for (job_id, round_), h in held.items()
    )
    return Hello(name, addr, slots, incarnation, VERSION, running, tuple(gpus), node_secret)


def replay(held: HeldRounds) -> list[NodeMsg]:
    """What follows a welcome, for every held group, each in a message of its own: the failure
    notices of ranks that have not exited, the exits, the group's UNKNOWN, then its stop."""
    out: list[NodeMsg] = []
    for (job_id, round_), h in held.items():
        exited = {ex.local_rank for ex in h.exits}
        for lr, failure in h.failing.items():
            if lr not in exited:  # the coordinator ignores one it already has
                out.append(WorkerFailing(job_id, round_, failure))
        out.extend(WorkerExited(job_id, round_, ex) for ex in h.exits)
        if h.unknown:
            out.append(GroupUnknown(job_id, round_, h.unknown))
        if h.stopped and h.exits:
            out.append(GroupStopped(job_id, round_))
    return out


class HealthReading(Protocol):
    """One worker's latest health sample, as a worker group takes it."""

    @property
    def local_rank(self) -> int: ...
    @property
    def global_rank(self) -> int: ...
    @property
    def pid(self) -> int: ...
    @property
    def cpu_percent(self) -> float: ...
    @property
    def rss_bytes(self) -> int: ...
    @property
    def status(self) -> str: ...


def group_health(
    job_id: str,
    round_: int,
    samples: Iterable[HealthReading],
    state: WorkerState,
    reason: str,
) -> GroupHealth:
    """One held group's part of a heartbeat."""
    workers = tuple(
        WorkerHealthSample(
            local_rank=s.local_rank,
            pid=s.pid,
            cpu_percent=s.cpu_percent,
            rss_bytes=s.rss_bytes,
            proc_state=s.status,
            global_rank=s.global_rank,
        )
        for s in samples
    )
    return GroupHealth(job_id, round_, workers, state, reason)


def heartbeat_of(
    seq: int,
    groups: Iterable[GroupHealth],
    gpus: Iterable[GpuHealth],
    health_problem: str = "",
    torch_metrics: tuple[TorchMetric, ...] = (),
) -> Heartbeat:
    return Heartbeat(seq, tuple(groups), tuple(gpus), health_problem, torch_metrics)


def rank_running(held: HeldRounds, job_id: str, rank: int) -> bool:
    """Whether global rank `rank` of the job still runs here (a followed log goes on)."""
    for (jid, _), h in held.items():
        if jid != job_id or h.stopped:
            continue
        exited = {e.global_rank for e in h.exits}
        if any(w.global_rank == rank and w.global_rank not in exited for w in h.assignment.workers):
            return True
    return False


def stop_grace(spec_grace: float, grace: float | None, *, leave_first: bool) -> float:
    """The grace a group gets when the agent stops: `grace` None gives the job's own; a drain
    (`leave_first`) bounds it by `grace`; else `grace` is the grace."""
    if grace is None:
        return spec_grace
    return min(grace, spec_grace) if leave_first else grace


def preempt_notice(stop: Stop, now: float) -> bytes:
    """The preemption notice of a drain's stop received at `now` (this host's clock): the
    workers are killed `term_after + grace` seconds from now."""
    return notice_json(now + stop.term_after + stop.grace, stop.drain_node, stop.reason)
