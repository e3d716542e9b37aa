"""The coordinator's decisions: node registry, job queue, rendezvous rounds, restarts, barrier.

`Cluster.handle(event, now)` takes one fact (a node connected, a worker exited, a job was
submitted, time passed) and returns the effects to carry out (send this node an assignment, stop
that round, the job changed). It never touches the network, the disk or the clock, so every
decision is tested directly with a fake clock.

Rounds are fenced: every node message names its job and round, and a message from any round but
the job's current one is refused. Restart accounting is one budget per job; a change of membership
(a node lost, a node joined) re-forms the job without spending it.
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import hashlib
import logging
import math
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from client.assignment import RoundAssignment, WorkerRanks
from client.model import (
    MAX_RESULT_BYTES_PER_JOB,
    MAX_RETURN_VALUE_BYTES,
    AttemptSummary,
    FailureCategory,
    GpuDevice,
    GpuHealth,
    JobEvent,
    JobSpec,
    JobState,
    JobStatus,
    Member,
    NodeInfo,
    ProcessFailure,
    RunResult,
    WorkerGpu,
    WorkerState,
    WorkerStatus,
    first_failure,
)
from client.redaction import describe_command
from coordinator._codec import decode, encode
from coordinator._failure_class import no_restart_reason
from coordinator._ranks import GroupRanks, NodeRole, assign_worker_ranks

__all__ = [
    "AssignRound",
    "CloseSession",
    "Cluster",
    "ClusterConfig",
    "Effect",
    "EventRecorded",
    "JobChanged",
    "JobNotFound",
    "NodeChanged",
    "NodeIsLive",
    "NodeNameInUse",
    "ReleaseRound",
    "RequestPort",
    "StopRound",
]

logger = logging.getLogger(__name__)

PORT_TIMEOUT_S = 10.0
MAX_FAILURE_TEXT = 64 * 1024
PORT_RETRY_MAX_S = 10.0
STALE_HOLD_S = 60.0
STOP_MARGIN_S = 15.0
NODE_RETENTION_EVERY_S = 60.0
MAX_EVENTS_PER_JOB = 10_000
"""Events kept per job: the first EVENTS_HEAD, a note of how many were cut, then the latest."""
EVENTS_HEAD = 100
MAX_ATTEMPTS_KEPT = 100
"""Attempt summaries kept per job: the first, a note of how many were cut, then the latest."""
MAX_FAILURES_PER_ATTEMPT = 32
"""Failures an attempt's summary keeps (root cause first); the count of the rest is said."""
MAX_NODES_NAMED = 8
MAX_NODES_KEPT = 1_000
"""Nodes an attempt's summary lists."""
"""Nodes a round's text names; the rest are counted ("... and 9,992 more")."""


class JobNotFound(KeyError):
    """No job has this id."""


class NodeIsLive(ValueError):
    """A request that only a lost node allows named a live one."""


class NodeNameInUse(ValueError):
    """A different live agent already uses this node name."""


# ------------------------------------------------------------------------------------------------
# Inputs
# ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class WorkerExitReport:
    """One worker's exit as its agent saw it."""

    local_rank: int
    global_rank: int
    pid: int
    exitcode: int
    stopped_by_agent: bool = False
    failure: ProcessFailure | None = None
    return_value: bytes | None = None
    timestamp: float = 0.0


@dataclass(frozen=True)
class RunningGroupReport:
    """What a (re)connecting agent still holds for one job round."""

    job_id: str
    round: int
    attempt: int
    pids: tuple[tuple[int, int], ...]  # (local_rank, pid)
    exits: tuple[WorkerExitReport, ...] = ()
    stopped: bool = False


@dataclass(frozen=True)
class WorkerHealthSample:
    local_rank: int
    pid: int
    cpu_percent: float
    rss_bytes: int
    proc_state: str


# ------------------------------------------------------------------------------------------------
# Outputs
# ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RequestPort:
    """Ask group rank 0's agent for a free MASTER_PORT for this round."""

    node: str
    job_id: str
    round: int


@dataclass(frozen=True)
class AssignRound:
    node: str
    assignment: RoundAssignment


@dataclass(frozen=True)
class StopRound:
    node: str
    job_id: str
    round: int
    grace: float
    reason: str
    replaced: bool = False
    """A new round of the job follows (a restart or a re-form), so the grace may be cut short;
    False for the final stop, a cancel, and a stale round."""


@dataclass(frozen=True)
class ReleaseRound:
    """The exit barrier let this node go."""

    node: str
    job_id: str
    round: int


@dataclass(frozen=True)
class CloseSession:
    """Drop a node's stream (its lease expired)."""

    node: str
    incarnation: str
    reason: str


@dataclass(frozen=True)
class JobChanged:
    job_id: str
    durable: bool = True
    """False when only the reason text moved (a countdown): tell watchers, write nothing."""


@dataclass(frozen=True)
class EventRecorded:
    event: JobEvent


@dataclass(frozen=True)
class EventsCut:
    """Events of a job between two numbers (exclusive) are no longer kept: delete them."""

    job_id: str
    after_seq: int
    before_seq: int


@dataclass(frozen=True)
class NodeChanged:
    """A node's durable state changed (quarantined, cleared): write it."""

    node: str


@dataclass(frozen=True)
class Forgotten:
    """A finished job (with its events and result) or a lost node is past retention: delete it."""

    job_id: str = ""
    node: str = ""


Effect = (
    RequestPort
    | AssignRound
    | StopRound
    | ReleaseRound
    | CloseSession
    | JobChanged
    | EventRecorded
    | EventsCut
    | Forgotten
    | NodeChanged
)


# ------------------------------------------------------------------------------------------------
# State
# ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ClusterConfig:
    """Coordinator-wide timing."""

    heartbeat_interval: float = 1.0
    """Seconds between agent heartbeats."""
    lease: float = 5.0
    """Seconds without any message after which a node is lost."""
    retain_jobs: int = 10_000
    """Finished jobs kept (with their events and results); the oldest beyond are deleted."""
    retain_seconds: float = 7 * 24 * 3600.0
    """How long a finished job, and a node that is gone, is kept."""
    lost_node_retention: float = 24 * 3600.0
    """How long a lost node stays listed (from when it was last seen) before it is dropped."""
    max_lost_nodes: int = 1000
    """Lost nodes kept at most; past it the longest unseen are dropped first."""
    start_timeout: float = 120.0
    """Seconds a node has, from a round's assignment, until every worker of it reported started.
    Past it the round fails: a platform failure of each rank that did not start, which spends
    one restart of the job's budget however many ranks or nodes missed it. Mind slow starts (a
    big image, a cold cache, `import torch` on a busy host)."""
    quarantine_ttl: float = 3600.0
    """Seconds a node stays quarantined (a GPU lost or with new uncorrectable errors, or a
    flaky node) unless an operator clears it first."""
    flaky_rounds: int = 3
    """Rounds whose first failure was on one node, while the round's other nodes were healthy,
    that quarantine that node as flaky (0 = never)."""
    flaky_window: float = 600.0
    """Seconds within which `flaky_rounds` such rounds quarantine the node."""

    def __post_init__(self) -> None:
        if not self.start_timeout > 0:
            raise ValueError(f"start_timeout: must be > 0 seconds, got {self.start_timeout}")
        if self.retain_jobs < 0:
            raise ValueError(f"retain_jobs: must be >= 0, got {self.retain_jobs}")
        if not self.retain_seconds >= 0:
            raise ValueError(f"retain_seconds: must be >= 0, got {self.retain_seconds}")
        if not self.lost_node_retention >= 0:
            raise ValueError(f"lost_node_retention: must be >= 0, got {self.lost_node_retention}")
        if self.max_lost_nodes < 0:
            raise ValueError(f"max_lost_nodes: must be >= 0, got {self.max_lost_nodes}")
        if not self.quarantine_ttl > 0:
            raise ValueError(f"quarantine_ttl: must be > 0 seconds, got {self.quarantine_ttl}")


@dataclass
class _Node:
    name: str
    addr: str
    slots: int
    incarnation: str
    live: bool
    last_seen: float
    jobs: dict[str, int] = field(default_factory=dict)  # job id -> slots used
    attached: bool = True  # a session of this incarnation is open (False: restored from disk)
    # Stale rounds still running here, told to stop: "job#round" -> (slots, hold until).
    fenced: dict[str, tuple[int, float]] = field(default_factory=dict)
    gpus: list[GpuDevice] = field(default_factory=list)  # what its agent offers (hello)
    gpu_health: dict[int, GpuHealth] = field(default_factory=dict)  # index -> latest sample
    gpu_jobs: dict[str, list[int]] = field(default_factory=dict)  # job id -> GPU indices held
    ecc_accepted: dict[str, int] = field(default_factory=dict)
    """GPU uuid -> uncorrectable ECC count already accepted (as of the last clear): only a
    count above it quarantines the node (0 for a GPU never cleared)."""
    quarantine_reason: str = ""
    quarantined_until: float = 0.0
    failed_rounds: tuple[float, ...] = ()
    """When rounds of several nodes failed first here (the latest `flaky_rounds`, in order)."""

    def free_slots(self) -> int:
        return self.slots - sum(self.jobs.values()) - sum(n for n, _ in self.fenced.values())

    def free_gpus(self) -> list[int]:
        """Indices of the GPUs no round holds and no sample calls lost, in index order."""
        held = {i for indices in self.gpu_jobs.values() for i in indices}
        lost = {i for i, h in self.gpu_health.items() if h.lost}
        return [g.index for g in self.gpus if g.index not in held and g.index not in lost]

    def fits(self, nproc: int) -> bool:
        """Room for `nproc` workers now: slots, and on a GPU node one free GPU each."""
        return self.free_slots() >= nproc and (not self.gpus or len(self.free_gpus()) >= nproc)


class _WorkerPhase(enum.Enum):
    INIT = "INIT"
    RUNNING = "RUNNING"
    SUCCEEDED = "SUCCEEDED"
    FAILED = "FAILED"
    STOPPED = "STOPPED"


@dataclass
class _Worker:
    local_rank: int
    global_rank: int
    phase: _WorkerPhase = _WorkerPhase.INIT
    pid: int = 0
    exitcode: int | None = None
    cpu_percent: float = 0.0
    rss_bytes: int = 0
    proc_state: str = ""
    early: bool = False
    """Its failure was reported when recorded; its exit only completes it (exit code)."""


@dataclass
class _Member:
    node: str
    addr: str
    group_rank: int
    ranks: GroupRanks
    workers: dict[int, _Worker]
    done: bool = False  # all workers exited 0; waiting in the exit barrier
    stopped: bool = False  # no worker of this round runs there any more
    released: bool = False  # slots given back
    lost: bool = False
    seen_exits: set[tuple[int, int]] = field(default_factory=set)
    group_state: WorkerState = WorkerState.INIT
    """The node's worker group as a unit: what its agent last reported, or the coordinator saw."""
    gpus: tuple[int, ...] = ()  # the node's GPU indices its workers hold, in local-rank order


def _replaced(job: _Job) -> bool:
    """Whether the stop under way leads to a new round of the job (restart or re-form)."""
    if job.stop_kind == _StopKind.MEMBERSHIP:
        return True
    return job.stop_kind == _StopKind.FAILURE and job.attempt < job.spec.max_restarts


class _StopKind(enum.Enum):
    FAILURE = "failure"
    MEMBERSHIP = "membership"
    CANCEL = "cancel"
    INPUT = "input"
    """The spec itself cannot run: the job fails without spending its restart budget."""


@dataclass
class _Job:
    job_id: str
    spec: JobSpec
    state: JobState
    reason: str
    submitted_at: float
    join_deadline: float
    attempt: int = 0
    round: int = 0
    members: list[_Member] = field(default_factory=list)
    last_call_deadline: float | None = None
    port_deadline: float | None = None
    start_deadline: float | None = None
    """Set by the assignment; cleared when every worker of the round reported started."""
    master_port: int = 0
    stop_kind: _StopKind | None = None
    stop_reason: str = ""
    away_at_failure: tuple[str, ...] = ()
    """Members of the round whose node had no session (a coordinator that took over and has not
    heard from it yet) when the failure that stops the round came: should one of them turn out
    lost, the failure followed its loss and the round re-forms without spending a restart."""
    stop_deadline: float | None = None
    barrier_deadline: float | None = None
    not_before: float = 0.0
    port_failures: int = 0
    failures: dict[int, ProcessFailure] = field(default_factory=dict)
    return_values: dict[int, bytes] = field(default_factory=dict)
    attempts: list[AttemptSummary] = field(default_factory=list)
    round_started_at: float = 0.0
    finished_at: float = 0.0
    result: RunResult | None = None
    events: list[JobEvent] = field(default_factory=list)
    request_id: str = ""
    """The client's id for the submit that made this job (a retry returns this job)."""
    awaiting_write: bool = False
    """Submitted, not yet on disk: not scheduled until `confirm_written`, dropped by `withdraw`."""

    def member(self, node: str) -> _Member | None:
        # Indexed: every node message looks its member up, and a round may have 10,000 of them.
        cached = self.__dict__.get("_member_index")
        if cached is None or cached[0] is not self.members or len(cached[1]) != len(self.members):
            cached = (self.members, {m.node: m for m in self.members})
            self.__dict__["_member_index"] = cached
        found: _Member | None = cached[1].get(node)
        return found

    def unstarted(self) -> int:
        """Workers of the current round not started yet (kept as a count: asked on every start)."""
        cached = self.__dict__.get("_unstarted")
        if cached is None or cached[0] is not self.members:
            n = sum(
                1 for m in self.members for w in m.workers.values() if w.phase == _WorkerPhase.INIT
            )
            cached = [self.members, n]
            self.__dict__["_unstarted"] = cached
        return int(cached[1])

    def pending_count(self) -> int:
        """Members not done yet (a count kept up to date: asked whenever a node finishes)."""
        cached = self.__dict__.get("_pending")
        if cached is None or cached[0] is not self.members:
            cached = [self.members, sum(1 for m in self.members if not m.done)]
            self.__dict__["_pending"] = cached
        return int(cached[1])

    def note_done(self) -> None:
        cached = self.__dict__.get("_pending")
        if cached is not None and cached[0] is self.members:
            cached[1] -= 1

    def set_phase(self, w: _Worker, phase: _WorkerPhase) -> None:
        if w.phase == phase:
            return
        cached = self.__dict__.get("_unstarted")
        if cached is not None and cached[0] is self.members:
            if w.phase == _WorkerPhase.INIT:
                cached[1] -= 1
            elif phase == _WorkerPhase.INIT:
                cached[1] += 1
        w.phase = phase


# ------------------------------------------------------------------------------------------------
# The state machine
# ------------------------------------------------------------------------------------------------


class Cluster:
    """Every decision of the coordinator. Not thread-safe: one event at a time."""

    def __init__(self, config: ClusterConfig | None = None) -> None:
        self.config = config or ClusterConfig()
        self._nodes: dict[str, _Node] = {}
        self._jobs: dict[str, _Job] = {}
        self._event_seq = 0
        self._by_request: dict[str, str] = {}
        self.bad_records: list[tuple[str, int, str]] = []
        """What the last `restore` could not read: (kind, index in its input, why)."""
        self._next_node_retention = 0.0
        self._finished: collections.deque[str] = collections.deque()
        """Finished jobs, oldest first: what retention deletes first."""
        self._effects: list[Effect] = []
        self._reschedule = True
        self._changed_keys: set[tuple[str, bool]] = set()
        self._n_live = 0  # kept as a count: a join must not cost O(nodes)

    # ---- queries ----------------------------------------------------------------------------

    def job_ids(self) -> list[str]:
        return list(self._jobs)

    def has_job(self, job_id: str) -> bool:
        return job_id in self._jobs

    def job_spec(self, job_id: str) -> JobSpec:
        return self._job(job_id).spec

    def job_state(self, job_id: str) -> JobState:
        return self._job(job_id).state

    def job_status(self, job_id: str) -> JobStatus:
        job = self._job(job_id)
        workers: list[WorkerStatus] = []
        for m in job.members:
            node = self._nodes.get(m.node) if m.gpus else None
            for w in m.workers.values():
                workers.append(
                    WorkerStatus(
                        global_rank=w.global_rank,
                        local_rank=w.local_rank,
                        node=m.node,
                        state=_worker_state(w.phase, w.proc_state),
                        pid=w.pid,
                        cpu_percent=w.cpu_percent,
                        rss_bytes=w.rss_bytes,
                        proc_state=w.proc_state,
                        exitcode=w.exitcode,
                        role=m.ranks.role,
                        role_rank=m.ranks.role_rank(w.local_rank),
                        world_size=m.ranks.world_size,
                        role_world_size=m.ranks.role_world_size,
                        gpu=_worker_gpu(node, m, w.local_rank, sampled=not job.state.is_terminal()),
                    )
                )
        workers.sort(key=lambda w: w.global_rank)
        return JobStatus(
            job_id=job.job_id,
            name=job.spec.name,
            state=job.state,
            reason=job.reason,
            attempt=job.attempt,
            round=job.round,
            max_restarts=job.spec.max_restarts,
            min_nodes=job.spec.min_nodes,
            max_nodes=job.spec.max_nodes,
            members=tuple(
                Member(
                    m.node,
                    m.addr,
                    m.group_rank,
                    m.ranks.local_world_size,
                    m.done,
                    role=m.ranks.role,
                    group_state=m.group_state,
                )
                for m in job.members
            ),
            workers=tuple(workers),
            nodes_joined=len(job.members) if job.members else self._free_count(job),
            last_call_deadline=job.last_call_deadline or 0.0,
            world_size=sum(m.ranks.local_world_size for m in job.members),
            submitted_at=job.submitted_at,
            finished_at=job.finished_at,
        )

    def job_result(self, job_id: str) -> RunResult | None:
        return self._job(job_id).result

    def job_attempts(self, job_id: str) -> list[AttemptSummary]:
        """The attempts kept for the job so far, oldest first (finished or not)."""
        return list(self._job(job_id).attempts)

    def job_events(self, job_id: str, after_seq: int = 0) -> list[JobEvent]:
        return [e for e in self._job(job_id).events if e.seq > after_seq]

    def nodes(self) -> list[NodeInfo]:
        return [
            NodeInfo(
                name=n.name,
                addr=n.addr,
                slots=n.slots,
                slots_used=min(n.slots, n.slots - n.free_slots()),
                state=_node_state(n),
                last_seen=n.last_seen,
                jobs=tuple(n.jobs),
                incarnation=n.incarnation,
                gpus=tuple(n.gpus),
                gpu_health=tuple(n.gpu_health[g.index] for g in n.gpus if g.index in n.gpu_health),
                gpus_used=tuple(sorted(i for indices in n.gpu_jobs.values() for i in indices)),
                quarantine_reason=n.quarantine_reason,
                quarantined_until=n.quarantined_until,
            )
            for n in sorted(self._nodes.values(), key=lambda n: n.name)
        ]

    def node_is_live(self, name: str, incarnation: str) -> bool:
        n = self._nodes.get(name)
        return n is not None and n.live and n.incarnation == incarnation

    def log_location(self, job_id: str, rank: int, attempt: int | None) -> tuple[str, int] | None:
        """(node, attempt) that holds the logs of `rank`; the latest round when attempt is None."""
        job = self._job(job_id)
        if attempt is None or attempt == job.attempt:
            for m in job.members:
                for w in m.workers.values():
                    if w.global_rank == rank:
                        return m.node, job.attempt
        for summary in reversed(job.attempts):
            if attempt is not None and summary.attempt != attempt:
                continue
            node = self._rank_node_in_summary(job, summary, rank)
            if node:
                return node, summary.attempt
        return None

    # ---- persistence ------------------------------------------------------------------------

    def dump_job(self, job_id: str) -> dict[str, Any]:
        """The job as a JSON-compatible document (its events are stored on their own)."""
        doc: dict[str, Any] = encode(self._job(job_id))
        doc.pop("events", None)
        return doc

    def dump_nodes(self) -> list[dict[str, Any]]:
        return [encode(n) for n in self._nodes.values()]

    def dump_node(self, name: str) -> dict[str, Any] | None:
        node = self._nodes.get(name)
        return encode(node) if node is not None else None

    def job_submitted_at(self, job_id: str) -> float:
        return self._job(job_id).submitted_at

    def round_progress(self, job_id: str) -> tuple[JobState, int, bool]:
        """(state, round, every worker of the round started) in O(1): asked on every start."""
        job = self._job(job_id)
        return job.state, job.round, bool(job.members) and job.unstarted() == 0

    def failure(self, job_id: str, rank: int, round_: int) -> ProcessFailure | None:
        """The failure of `rank` in `round_`, while its attempt runs or after it ended."""
        job = self._jobs.get(job_id)
        if job is None:
            return None
        found = job.failures.get(rank)
        if found is not None and found.round == round_:
            return found
        for summary in reversed(job.attempts):
            if summary.round == round_:
                return next((f for f in summary.failures if f.global_rank == rank), None)
        return None

    def restore(
        self,
        jobs: Sequence[dict[str, Any]],
        events: Sequence[dict[str, Any]],
        nodes: Sequence[dict[str, Any]],
        now: float,
        reconnect_grace: float,
        event_seq_floor: int = 0,
    ) -> list[Effect]:
        """Load state written by an earlier coordinator process.

        Event numbers go on after `event_seq_floor` (the reservation the service kept on disk)
        or the last stored event, whichever is higher: a number is never given out twice.

        Nodes come back as live but without a session: each has `reconnect_grace` seconds to
        reconnect and report what it runs before it counts as lost. Running jobs wait for that;
        a round still choosing its master port is formed again (nothing of it started).
        """
        self._reschedule = True
        if self._jobs or self._nodes:
            raise RuntimeError("restore() needs an empty cluster")
        self._event_seq = max(self._event_seq, event_seq_floor)
        self.bad_records = []
        for i, d in enumerate(nodes):
            try:
                n = decode(_Node, d)
            except Exception as exc:
                self.bad_records.append(("nodes", i, f"{type(exc).__name__}: {exc}"))
                continue
            n.jobs = {}
            n.gpu_jobs = {}
            n.gpu_health = {}
            n.attached = False
            if n.live:
                # A lost node keeps the time it was really last seen; a live one gets the grace.
                n.last_seen = now + max(0.0, reconnect_grace - self.config.lease)
            self._nodes[n.name] = n
            self._n_live += 1 if n.live else 0
        for i, d in enumerate(jobs):
            try:
                job = decode(_Job, d)
            except Exception as exc:
                self.bad_records.append(("jobs", i, f"{type(exc).__name__}: {exc}"))
                continue
            job.awaiting_write = False  # it is on disk: the write it waited for happened
            self._jobs[job.job_id] = job
            if job.request_id:
                self._by_request[job.request_id] = job.job_id
        for i, d in enumerate(events):
            try:
                e = decode(JobEvent, d)
            except Exception as exc:
                self.bad_records.append(("events", i, f"{type(exc).__name__}: {exc}"))
                continue
            job = self._jobs.get(e.job_id)
            if job is not None:
                job.events.append(e)
            self._event_seq = max(self._event_seq, e.seq)
        finished = sorted(
            (j for j in self._jobs.values() if j.state.is_terminal()), key=lambda j: j.finished_at
        )
        self._finished.extend(j.job_id for j in finished)
        for job in self._jobs.values():
            if job.state.is_terminal():
                continue
            if job.port_deadline is not None:
                # The assignment may have gone out just before the crash: give the members the
                # reconnect grace to report the round (then it is adopted), else form it again.
                job.port_deadline = now + reconnect_grace
            if job.start_deadline is not None:
                # Starts reported while the coordinator was away come with the reconnect.
                job.start_deadline = max(job.start_deadline, now + reconnect_grace)
            for m in job.members:
                node = self._nodes.get(m.node)
                if node is None or m.released or m.lost:
                    continue
                if node.live:
                    node.jobs[job.job_id] = m.ranks.local_world_size
                    if m.gpus:
                        node.gpu_jobs[job.job_id] = list(m.gpus)
            self._event(
                job,
                now,
                "recovered",
                f"coordinator restarted; {job.state.value.lower()} job recovered",
            )
        logger.info("restored %d jobs and %d nodes", len(self._jobs), len(self._nodes))
        self._retain(now)
        return self._finish(now)

    # ---- inputs -----------------------------------------------------------------------------

    def submit(
        self,
        job_id: str,
        spec: JobSpec,
        now: float,
        *,
        request_id: str = "",
        awaiting_write: bool = False,
    ) -> list[Effect]:
        """A validated spec enters the queue.

        With `awaiting_write` the job waits, unscheduled, until `confirm_written` (its write is on
        disk) or `withdraw` (the write failed): a job the client was not told of never runs.
        """
        self._reschedule = True
        if job_id in self._jobs:
            raise ValueError(f"job id {job_id} already exists")
        if request_id and request_id in self._by_request:
            raise ValueError(
                f"request id {request_id} already made job {self._by_request[request_id]}"
            )
        job = _Job(
            job_id=job_id,
            spec=spec,
            state=JobState.QUEUED,
            reason="queued",
            submitted_at=now,
            join_deadline=now + spec.join_timeout,
            request_id=request_id,
            awaiting_write=awaiting_write,
        )
        self._jobs[job_id] = job
        if request_id:
            self._by_request[request_id] = job_id
        self._event(job, now, "submitted", _describe_spec(spec))
        self._changed(job)
        return self._finish(now)

    @property
    def event_seq(self) -> int:
        """The number of the latest event (0 before the first)."""
        return self._event_seq

    def job_for_request(self, request_id: str) -> str | None:
        """The job an earlier submit with this request id made, if it is still kept."""
        return self._by_request.get(request_id)

    def confirm_written(self, job_id: str, now: float) -> list[Effect]:
        """The submitted job is on disk: it may be scheduled."""
        job = self._job(job_id)
        if job.awaiting_write:
            job.awaiting_write = False
            job.join_deadline = now + job.spec.join_timeout
            self._reschedule = True
        return self._finish(now)

    def withdraw(self, job_id: str) -> None:
        """Forget a job whose submit could not be written (it was never scheduled)."""
        job = self._jobs.get(job_id)
        if job is None or not job.awaiting_write:
            raise ValueError(f"job {job_id} is not awaiting its write")
        del self._jobs[job_id]
        if job.request_id:
            self._by_request.pop(job.request_id, None)

    def cancel(self, job_id: str, now: float) -> list[Effect]:
        self._reschedule = True
        job = self._job(job_id)
        if job.state.is_terminal():
            return self._finish(now)
        if job.state in (JobState.QUEUED, JobState.RENDEZVOUS) and not self._assigned(job):
            self._release_all(job)
            self._end(job, JobState.CANCELED, WorkerState.STOPPED, "canceled by the user", now)
        else:
            self._begin_stop(job, _StopKind.CANCEL, "canceled by the user", now)
        return self._finish(now)

    def node_connected(
        self,
        name: str,
        addr: str,
        slots: int,
        incarnation: str,
        now: float,
        running: Sequence[RunningGroupReport] = (),
        gpus: Sequence[GpuDevice] = (),
    ) -> list[Effect]:
        node = self._nodes.get(name)
        if node is not None and node.live and node.incarnation != incarnation:
            if node.attached:
                raise NodeNameInUse(f"node name {name!r} is already used by a live agent")
            # Known only from the coordinator's state on disk: the name stays its own agent's
            # for the reconnect grace, so no other agent can take over its rounds meanwhile. An
            # agent that restarted while the coordinator was away gets in once the grace ends.
            raise NodeNameInUse(
                f"node name {name!r} is kept for the agent that held it before the coordinator "
                "restarted, until it reconnects or its reconnect grace ends"
            )
        if node is None:
            self._reschedule = True
            node = _Node(name, addr, slots, incarnation, True, now, gpus=list(gpus))
            self._n_live += 1
            self._nodes[name] = node
            logger.info("node %s joined (%s, %d slots, %d GPUs)", name, addr, slots, len(gpus))
        else:
            resumed = node.incarnation == incarnation
            if (
                not resumed
                or not node.live
                or (node.addr, node.slots) != (addr, slots)
                or node.gpus != list(gpus)
            ):
                self._reschedule = True
            node.addr, node.slots, node.incarnation = addr, slots, incarnation
            if not node.live:
                self._n_live += 1
            node.live, node.last_seen, node.attached = True, now, True
            if not resumed:
                node.jobs.clear()
                node.fenced.clear()
                node.gpu_jobs.clear()
                node.gpu_health.clear()
            node.gpus = list(gpus)
            logger.info("node %s %s", name, "reconnected" if resumed else "rejoined")
        for report in running:
            self._adopt(node, report, now)
        held = {(r.job_id, r.round) for r in running}
        for job in self._active_jobs():
            m = job.member(name)
            if (
                job.state == JobState.STOPPING
                and m is not None
                and not m.stopped
                and (job.job_id, job.round) not in held
            ):
                # The agent stopped the round and forgot it; its confirmation went down with the
                # old stream. Nothing of the round runs there: waiting for the stop deadline
                # would only delay the restart.
                self._event(
                    job,
                    now,
                    "adopted",
                    f"node {name} reconnected with round {job.round} already stopped",
                    node=name,
                )
                self._member_stopped(job, m, now)
                continue
            if (
                m is None
                or job.state != JobState.RUNNING
                or m.done
                or m.stopped
                or m.lost
                or (job.job_id, job.round) in held
            ):
                continue
            # Its assignment went down with the old stream: nothing of this round runs there, and
            # nothing would ever report. Re-form rather than wait forever (no budget spent).
            self._infra_failures(
                job,
                m,
                f"node {name} reconnected without round {job.round} (its agent restarted or "
                "lost the assignment); its workers of that round are gone",
                now,
            )
            m.stopped = True
            self._begin_stop(
                job,
                _StopKind.MEMBERSHIP,
                f"node {name} reconnected without round {job.round}; re-forming",
                now,
            )
        # A node back with every slot still held changes no placement (a round it adopted that
        # ended freed its slots, and asked for one): with a thousand agents reconnecting to a
        # new coordinator, each would otherwise run an O(nodes) placement. The tick places anyway.
        if node.free_slots() > 0:
            self._reschedule = True
        return self._finish(now)

    def node_disconnected(self, name: str, incarnation: str, now: float) -> list[Effect]:
        self._reschedule = True
        node = self._nodes.get(name)
        if node is None or node.incarnation != incarnation or not node.live:
            return self._finish(now)
        self._lose_node(node, "its stream to the coordinator ended", now)
        return self._finish(now)

    def heartbeat(
        self,
        name: str,
        incarnation: str,
        now: float,
        health: Sequence[tuple[str, int, Sequence[WorkerHealthSample]]] = (),
        group_states: Sequence[tuple[str, int, WorkerState]] = (),
        gpus: Sequence[GpuHealth] = (),
    ) -> list[Effect]:
        node = self._live(name, incarnation)
        if node is None:
            return []
        node.last_seen = now
        for job_id, round_, state in group_states:
            job = self._jobs.get(job_id)
            if job is None or job.round != round_:
                continue
            m = job.member(name)
            # UNKNOWN stays: it is how the round ended there, whatever follows.
            if m is None or m.lost or m.group_state in (state, WorkerState.UNKNOWN):
                continue
            if state == WorkerState.STOPPED and m.group_state in _ENDED_GROUP:
                continue  # stopped after it failed or finished: that is how it ended
            m.group_state = state
            self._changed(job, durable=False)
        if gpus and node.gpus:
            problem = self._gpu_samples(node, gpus)
            if problem and not node.quarantine_reason:
                self._quarantine(node, problem, now)
                return self._finish(now)
        for job_id, round_, samples in health:
            job = self._jobs.get(job_id)
            if job is None or job.round != round_:
                continue
            m = job.member(name)
            if m is None:
                continue
            for s in samples:
                w = m.workers.get(s.local_rank)
                if w is not None and w.pid == s.pid:
                    w.cpu_percent, w.rss_bytes, w.proc_state = (
                        s.cpu_percent,
                        s.rss_bytes,
                        s.proc_state,
                    )
        return self._finish(now) if self._effects else []

    def port_reserved(
        self,
        name: str,
        incarnation: str,
        job_id: str,
        round_: int,
        port: int,
        error: str,
        now: float,
    ) -> list[Effect]:
        self._reschedule = True
        node = self._live(name, incarnation)
        job = self._jobs.get(job_id)
        if node is None or job is None or job.round != round_ or job.port_deadline is None:
            return self._finish(now)
        node.last_seen = now
        if job.members[0].node != name:
            return self._finish(now)
        job.port_deadline = None
        if error or not 0 < port < 65536:
            # Back off, doubling, so an agent that cannot bind does not spin the rendezvous.
            job.port_failures += 1
            job.not_before = now + min(PORT_RETRY_MAX_S, 0.25 * 2 ** (job.port_failures - 1))
            self._reform(job, f"node {name} could not reserve a master port: {error or port}", now)
            return self._finish(now)
        job.port_failures = 0
        job.master_port = port
        self._assign(job, now)
        return self._finish(now)

    def workers_started(
        self,
        name: str,
        incarnation: str,
        job_id: str,
        round_: int,
        pids: Iterable[tuple[int, int]],
        now: float,
    ) -> list[Effect]:
        node = self._live(name, incarnation)
        if node is None:
            return []
        node.last_seen = now
        job, member = self._fenced(node, job_id, round_, now)
        if job is None or member is None:
            return self._finish(now)
        started = []
        for local_rank, pid in pids:
            w = member.workers.get(local_rank)
            if w is None:
                continue
            w.pid = pid
            if w.phase == _WorkerPhase.INIT:
                job.set_phase(w, _WorkerPhase.RUNNING)
            started.append(f"{w.global_rank}:{pid}")
        if member.group_state == WorkerState.INIT and all(
            w.phase != _WorkerPhase.INIT for w in member.workers.values()
        ):
            member.group_state = WorkerState.HEALTHY
        self._event(
            job,
            now,
            "workers_started",
            f"node {name} started ranks {', '.join(started)}",
            node=name,
        )
        if self._all_started(job):
            job.start_deadline = None
        if job.state == JobState.RUNNING and self._all_started(job):
            self._set_reason(
                job,
                f"attempt {job.attempt} running: {_count(self._worker_count(job), 'worker')}",
                now,
            )
        self._changed(job)
        return self._finish(now)

    def worker_exited(
        self,
        name: str,
        incarnation: str,
        job_id: str,
        round_: int,
        report: WorkerExitReport,
        now: float,
    ) -> list[Effect]:
        node = self._live(name, incarnation)
        if node is None:
            return []
        node.last_seen = now
        job, member = self._fenced(node, job_id, round_, now)
        if job is None or member is None:
            return self._finish(now)
        self._apply_exit(job, member, report, now)
        return self._finish(now)

    def worker_failing(
        self,
        name: str,
        incarnation: str,
        job_id: str,
        round_: int,
        local_rank: int,
        failure: ProcessFailure,
        now: float,
    ) -> list[Effect]:
        """A worker recorded its failure and is still tearing down: it failed, now.

        The round starts stopping at once, as for a failed exit. The exit that follows completes
        this failure (exit code, signal) and counts no second failure nor a second restart; a
        notice for a worker already gone, or for another round, changes nothing.
        """
        node = self._live(name, incarnation)
        if node is None:
            return []
        node.last_seen = now
        job, member = self._fenced(node, job_id, round_, now)
        if job is None or member is None:
            return self._finish(now)
        w = member.workers.get(local_rank)
        if w is None or w.early or w.phase not in (_WorkerPhase.INIT, _WorkerPhase.RUNNING):
            return self._finish(now)
        if failure.pid and w.pid and failure.pid != w.pid:
            return self._finish(now)  # not the process this round started
        report = _sanitized(
            WorkerExitReport(
                local_rank=local_rank,
                global_rank=w.global_rank,
                pid=failure.pid,
                exitcode=failure.exitcode,
                failure=failure,
                timestamp=failure.timestamp,
            ),
            now,
        )
        assert report.failure is not None
        w.early = True
        self._record_failure(job, member, w, report.failure, now)
        return self._finish(now)

    def group_stopped(
        self,
        name: str,
        incarnation: str,
        job_id: str,
        round_: int,
        unkillable: Sequence[int],
        now: float,
    ) -> list[Effect]:
        self._reschedule = True
        node = self._live(name, incarnation)
        if node is None:
            return []
        node.last_seen = now
        node.fenced.pop(f"{job_id}#{round_}", None)
        job = self._jobs.get(job_id)
        if job is None or job.round != round_:
            return self._finish(now)
        member = job.member(name)
        if member is None:
            return self._finish(now)
        if unkillable:
            self._event(
                job,
                now,
                "unkillable",
                f"node {name}: pids {', '.join(map(str, unkillable))} could not be killed "
                "(uninterruptible sleep); abandoned",
                node=name,
            )
        self._member_stopped(job, member, now)
        return self._finish(now)

    def group_unknown(
        self, name: str, incarnation: str, job_id: str, round_: int, reason: str, now: float
    ) -> list[Effect]:
        """The agent of `name` can no longer supervise its workers of the round: UNKNOWN.

        It killed what it could before saying so. As for a lost node, the workers that were
        starting or running there are INFRA failures; unlike a lost node the agent is still
        here and may fail the same way again, so the round ends as a failure: the job restarts
        within its budget, or fails when none is left.
        """
        self._reschedule = True
        node = self._live(name, incarnation)
        if node is None:
            return []
        node.last_seen = now
        job, member = self._fenced(node, job_id, round_, now)
        if job is None or member is None or member.group_state == WorkerState.UNKNOWN:
            return self._finish(now)
        member.group_state = WorkerState.UNKNOWN
        why = _clip(" ".join(reason.split()), 1000) or "no reason given"
        message = f"node {name}: worker group UNKNOWN (the agent cannot supervise it): {why}"
        self._event(job, now, "group_unknown", message, node=name)
        if job.state == JobState.RUNNING and not member.done:  # done: nothing of it runs
            self._infra_failures(job, member, message, now)
            self._begin_stop(job, _StopKind.FAILURE, f"{message}; {_then(job)}", now)
        self._changed(job)
        return self._finish(now)

    def assign_undeliverable(
        self, name: str, job_id: str, round_: int, why: str, now: float
    ) -> list[Effect]:
        """The round's assignment to node `name` could not be sent (say, over the message limit).

        The spec is what makes it unsendable, so every round would fail alike: an input failure
        of the job, which ends it without spending its budget, and never a lost node. The node
        never received the round, so it counts as stopped and is not asked to stop it.
        """
        self._reschedule = True
        job = self._jobs.get(job_id)
        if job is None or job.round != round_ or not self._assigned(job):
            return self._finish(now)
        member = job.member(name)
        if member is None or member.stopped:
            return self._finish(now)
        reason = f"the assignment for node {name} cannot be sent: {_clip(why, 1000)}"
        member.stopped = True
        for w in member.workers.values():
            if w.phase in (_WorkerPhase.INIT, _WorkerPhase.RUNNING):
                job.set_phase(w, _WorkerPhase.FAILED)
                job.failures[w.global_rank] = _stamp(
                    ProcessFailure(
                        global_rank=w.global_rank,
                        local_rank=w.local_rank,
                        pid=0,
                        exitcode=-1,
                        message=reason,
                        timestamp=now,
                        category=FailureCategory.INPUT,
                    ),
                    name,
                    w,
                    job,
                )
        self._event(job, now, "assign_undeliverable", reason, node=name)
        if job.state == JobState.STOPPING:
            if job.stop_kind != _StopKind.CANCEL:
                job.stop_kind, job.stop_reason = _StopKind.INPUT, reason
                self._set_reason(job, reason, now)
            if all(m.stopped for m in job.members):
                self._after_stop(job, now)
        else:
            self._begin_stop(job, _StopKind.INPUT, reason, now)
        self._changed(job)
        return self._finish(now)

    def tick(self, now: float) -> list[Effect]:
        """Time passed: leases, last calls, join timeouts, barrier and stop deadlines, retention."""
        self._retain(now)
        if now >= self._next_node_retention:
            # O(nodes): once a minute is plenty for a bound measured in days.
            self._next_node_retention = now + NODE_RETENTION_EVERY_S
            self._retain_nodes(now)
        for node in list(self._nodes.values()):
            if node.fenced:
                for key, (_, until) in list(node.fenced.items()):
                    if now >= until:
                        del node.fenced[key]
            if node.quarantine_reason and now >= node.quarantined_until:
                self._clear_quarantine(node, "its quarantine time passed", now)
            if node.live and now - node.last_seen > self.config.lease:
                self._effects.append(CloseSession(node.name, node.incarnation, "lease expired"))
                self._lose_node(
                    node,
                    f"no message for {now - node.last_seen:.1f} s (lease {self.config.lease:g} s)",
                    now,
                )
        for job in self._active_jobs():
            if job.port_deadline is not None and now >= job.port_deadline:
                job.port_deadline = None
                self._reform(
                    job, f"node {job.members[0].node} did not reserve a master port in time", now
                )
            elif (
                job.start_deadline is not None
                and now >= job.start_deadline
                and job.state == JobState.RUNNING
            ):
                self._start_timed_out(job, now)
            elif job.stop_deadline is not None and now >= job.stop_deadline:
                for m in job.members:
                    if not m.stopped:
                        self._event(
                            job,
                            now,
                            "stop_timeout",
                            f"node {m.node} did not confirm the stop in time; treating it as stopped",
                            node=m.node,
                        )
                        m.stopped = True
                self._after_stop(job, now)
            elif job.barrier_deadline is not None and now >= job.barrier_deadline:
                job.barrier_deadline = None
                waiting = [m for m in job.members if m.done and not m.released]
                self._event(
                    job,
                    now,
                    "barrier_timeout",
                    f"exit barrier timed out after {job.spec.exit_barrier_timeout:g} s; released "
                    f"{', '.join(m.node for m in waiting)}; still running: "
                    f"{', '.join(m.node for m in job.members if not m.done)}",
                )
                for m in waiting:
                    m.released = True
                    m.stopped = True
                    self._effects.append(ReleaseRound(m.node, job.job_id, job.round))
                    self._free_member(job, m)
                self._changed(job)
        return self._finish(now, force=True)

    # ---- internals: scheduling ----------------------------------------------------------------

    def _finish(self, now: float, *, force: bool = False) -> list[Effect]:
        # Placement only changes when capacity or the queue does (or time passes, on a tick):
        # skipping it otherwise keeps a worker message O(1) however large the cluster.
        if force or self._reschedule:
            self._reschedule = False
            self._schedule(now, tick=force)
        effects, self._effects = self._effects, []
        self._changed_keys.clear()
        return effects

    def _schedule(self, now: float, *, tick: bool = False) -> None:
        claimed: set[str] = set()
        waiting = [
            j
            for j in self._jobs.values()
            if j.state in (JobState.QUEUED, JobState.RENDEZVOUS) and not j.awaiting_write
        ]
        for job in sorted(waiting, key=lambda j: j.submitted_at):
            if job.round == 0 and "_fit_checked" not in job.__dict__:
                # Once per job (O(nodes)): a job no node could ever hold fails now, not at its
                # join timeout, unless it asked to wait for one to join.
                job.__dict__["_fit_checked"] = True
                never = "" if job.spec.wait_for_nodes else self._never_fits(job)
                if never:
                    self._end(
                        job,
                        JobState.FAILED,
                        WorkerState.FAILED,
                        never,
                        now,
                        category=FailureCategory.INFRA,
                    )
                    continue
            if len(waiting) == 1 and self._cannot_change_yet(job, now, tick):
                continue
            if self._assigned(job) or job.port_deadline is not None:
                claimed.update(m.node for m in job.members)
                continue
            if now < job.not_before:
                self._set_reason(job, f"next round in {job.not_before - now:.1f} s (backoff)", now)
                # Hold the nodes it will restart on: a later job must not take them meanwhile.
                backoff_free = [n for n in self._candidates(job) if n.name not in claimed]
                claimed.update(n.name for n in backoff_free[: job.spec.max_nodes])
                continue
            free = [n for n in self._candidates(job) if n.name not in claimed]
            spec = job.spec
            placed = _place(spec, free)
            if placed is not None:
                chosen, full = placed
                # With wait_for_nodes more nodes are on their way (the launchers of a
                # multi-node `gelastic run`): the last call waits for them.
                everyone = (
                    not full and not spec.wait_for_nodes and self._all_with_room_joined(job, chosen)
                )
                if full or spec.last_call_timeout == 0 or everyone:
                    # Every live node that could take a group is in: no one to wait for (a node
                    # that registers later scales the job up).
                    why = (
                        f"every live node with room joined ({len(chosen)} of "
                        f"max_nodes={spec.max_nodes}); closed without the last call"
                        if everyone and spec.last_call_timeout
                        else ""
                    )
                    self._form(job, chosen, now, why=why)
                    claimed.update(n.name for n, _ in chosen)
                    continue
                if job.last_call_deadline is None:
                    job.last_call_deadline = now + spec.last_call_timeout
                    self._transition(job, JobState.RENDEZVOUS, now)
                if now >= job.last_call_deadline:
                    self._form(job, chosen, now)
                else:
                    self._set_reason(
                        job,
                        f"rendezvous: {len(chosen)}/{spec.max_nodes} nodes, last call closes in "
                        f"{job.last_call_deadline - now:.0f} s",
                        now,
                    )
                claimed.update(n.name for n, _ in chosen)
                continue
            if job.last_call_deadline is not None:
                job.last_call_deadline = None
                self._transition(job, JobState.QUEUED, now)
            capacity = self._capacity(job)
            if capacity >= spec.min_nodes:
                job.join_deadline = now + spec.join_timeout
                self._set_reason(
                    job,
                    f"waiting for free nodes: {len(free)}/{spec.min_nodes} free "
                    f"({_count(capacity, 'node')} fit this job once busy ones finish)",
                    now,
                )
            elif now >= job.join_deadline:
                self._end(
                    job,
                    JobState.FAILED,
                    WorkerState.FAILED,
                    f"rendezvous timed out after {spec.join_timeout:g} s: only {capacity} of "
                    f"min_nodes={spec.min_nodes} nodes with {_count(spec.nproc_per_node, 'free slot')} "
                    "joined",
                    now,
                    category=FailureCategory.INFRA,
                )
            else:
                self._set_reason(
                    job,
                    f"rendezvous: {capacity}/{spec.min_nodes} nodes, waiting up to "
                    f"{job.join_deadline - now:.0f} s more for min_nodes"
                    + self._too_small(job, capacity),
                    now,
                )
        self._scale_up(claimed, now)

    def _all_with_room_joined(self, job: _Job, chosen: Sequence[tuple[_Node, NodeRole]]) -> bool:
        """No live node outside `chosen` could take a group of `job`, even once it is free."""
        taken = {n.name for n, _ in chosen}
        need = _smallest_group(job.spec)
        return not any(
            n.live
            and not n.quarantine_reason
            and n.name not in taken
            and job.job_id not in n.jobs
            and _total_room(n) >= need
            for n in self._nodes.values()
        )

    def _never_fits(self, job: _Job) -> str:
        """Why no node known (live or not) could ever hold a group of `job`; "" when one could,
        or when no node is known yet (the nodes may still be starting)."""
        known = list(self._nodes.values())
        if not known:
            return ""
        spec = job.spec
        needs = [(r.name, r.nproc_per_node) for r in spec.roles] or [
            (spec.role, spec.nproc_per_node)
        ]
        for role, need in needs:
            if any(_total_room(n) >= need for n in known):
                continue
            largest = max(known, key=lambda n: (_total_room(n), n.name))
            group = f"a group of role {role!r}" if spec.roles else "one group of this job"
            return (
                f"no live or known node could ever hold {group} ({_count(need, 'worker')}): "
                f"the largest, {largest.name}, has room for "
                f"{_count(_total_room(largest), 'worker')}; submit with wait_for_nodes "
                "(--wait-for-nodes) to wait for a bigger node to join"
            )
        return ""

    def _too_small(self, job: _Job, capacity: int) -> str:
        """Why the live nodes do not count for `job` when none of them can hold a group."""
        if capacity:
            return ""
        live = [n for n in self._nodes.values() if n.live and not n.quarantine_reason]
        if not live:
            return ""
        need = _smallest_group(job.spec)
        largest = max(_total_room(n) for n in live)
        return f" (no live node has {need} free slots; the largest has {largest})"

    def _cannot_change_yet(self, job: _Job, now: float, tick: bool) -> bool:
        """A cheap answer for a lone waiting job while nodes join one by one (10,000 of them).

        Counting live nodes bounds what a full placement could find; when that cannot form the
        round (yet), skip the O(nodes) placement. Deadlines are checked on ticks.
        """
        spec, live = job.spec, self._n_live
        if job.port_deadline is not None or self._assigned(job) or now < job.not_before:
            return False
        if job.last_call_deadline is None:
            if live < spec.min_nodes and now < job.join_deadline:
                self._set_reason(
                    job,
                    f"rendezvous: {live}/{spec.min_nodes} nodes, waiting up to "
                    f"{job.join_deadline - now:.0f} s more for min_nodes",
                    now,
                )
                return True
            return False
        return not tick and now < job.last_call_deadline and spec.min_nodes <= live < spec.max_nodes

    def _scale_up(self, claimed: set[str], now: float) -> None:
        for job in self._active_jobs():
            if job.state != JobState.RUNNING or job.spec.scale_up != "restart":
                continue
            if len(job.members) >= job.spec.max_nodes or any(m.done for m in job.members):
                continue
            if not self._all_started(job):
                continue
            extra = [n for n in self._candidates(job) if n.name not in claimed]
            if job.spec.roles:
                extra = _growth(job.spec, [m.ranks.role for m in job.members], extra)
            if extra:
                self._begin_stop(
                    job,
                    _StopKind.MEMBERSHIP,
                    f"node {extra[0].name} joined; re-forming to grow from {len(job.members)} "
                    f"nodes (max_nodes={job.spec.max_nodes})",
                    now,
                )
                claimed.update(n.name for n in extra[: job.spec.max_nodes - len(job.members)])

    def _candidates(self, job: _Job) -> list[_Node]:
        need = _smallest_group(job.spec)
        nodes = [
            n
            for n in self._nodes.values()
            if n.live
            and n.attached
            and not n.quarantine_reason
            and job.job_id not in n.jobs
            and n.fits(need)
        ]
        return sorted(nodes, key=lambda n: (n.addr, n.name))

    def _capacity(self, job: _Job) -> int:
        need = _smallest_group(job.spec)
        fit = [
            n
            for n in self._nodes.values()
            if n.live
            and not n.quarantine_reason
            and n.slots >= need
            and (not n.gpus or len(n.gpus) >= need)
        ]
        if job.spec.roles and _place(job.spec, fit, room=_total_room) is None:
            # Enough nodes, but not of the sizes the roles need: short of min_nodes until
            # nodes that fit join, and the join timeout runs.
            return min(len(fit), job.spec.min_nodes - 1)
        return len(fit)

    def _free_count(self, job: _Job) -> int:
        return len(self._candidates(job)) if not job.state.is_terminal() else 0

    def _form(
        self, job: _Job, placed: Sequence[tuple[_Node, NodeRole]], now: float, *, why: str = ""
    ) -> None:
        spec = job.spec
        # Group ranks follow the nodes' order whatever their roles; ranks are torch's prefix sums.
        in_order = sorted(placed, key=lambda p: (p[0].addr, p[0].name))
        ordered = [n for n, _ in in_order]
        ranks = assign_worker_ranks([r for _, r in in_order])
        job.round += 1
        job.members = []
        for node, gr in zip(ordered, ranks, strict=True):
            workers = {
                lr: _Worker(local_rank=lr, global_rank=gr.global_rank(lr))
                for lr in range(gr.local_world_size)
            }
            gpus = tuple(node.free_gpus()[: gr.local_world_size]) if node.gpus else ()
            job.members.append(_Member(node.name, node.addr, gr.group_rank, gr, workers, gpus=gpus))
            node.jobs[job.job_id] = gr.local_world_size
            if gpus:
                node.gpu_jobs[job.job_id] = list(gpus)
        job.last_call_deadline = None
        job.failures = {}
        job.return_values = {}
        job.stop_kind = None
        job.stop_reason = ""
        job.away_at_failure = ()
        job.barrier_deadline = None
        job.start_deadline = None
        job.master_port = 0
        job.round_started_at = now
        if job.state == JobState.QUEUED:
            self._transition(job, JobState.RENDEZVOUS, now)
        if not spec.master_port:
            job.port_deadline = now + PORT_TIMEOUT_S
            self._effects.append(RequestPort(ordered[0].name, job.job_id, job.round))
        self._event(
            job,
            now,
            "round_formed",
            f"round {job.round} formed with {_count(len(ordered), 'node')} "
            f"({_named(f'{m.node}=group {m.group_rank}' for m in job.members[: MAX_NODES_NAMED + 1])}"
            f"{_more(len(job.members))}); world size {ranks[0].world_size}"
            + (f"; {why}" if why else ""),
        )
        if spec.master_port:
            # A fixed port: nothing to reserve; the store host (or worker RANK 0) binds it, and
            # fails the round naming it if it is taken.
            job.master_port = spec.master_port
            self._assign(job, now)
        else:
            # What the job waits for now; the reason of the wait before ("queued", "last call
            # closes in 0 s") is over.
            self._set_reason(
                job,
                f"rendezvous: round {job.round} formed; waiting for {ordered[0].name} to "
                "reserve a master port",
                now,
            )
        self._changed(job)

    def _assign(self, job: _Job, now: float) -> None:
        master = job.members[0]
        for m in job.members:
            node = self._nodes.get(m.node)
            uuids = {g.index: g.uuid for g in node.gpus} if node is not None else {}
            workers = tuple(
                WorkerRanks(
                    local_rank=lr,
                    global_rank=m.ranks.global_rank(lr),
                    role_rank=m.ranks.role_rank(lr),
                    world_size=m.ranks.world_size,
                    role_world_size=m.ranks.role_world_size,
                    role=m.ranks.role,
                )
                for lr in range(m.ranks.local_world_size)
            )
            self._effects.append(
                AssignRound(
                    m.node,
                    RoundAssignment(
                        job_id=job.job_id,
                        round=job.round,
                        attempt=job.attempt,
                        spec=job.spec,
                        group_rank=m.group_rank,
                        group_world_size=len(job.members),
                        master_addr=job.spec.master_addr or master.addr,
                        master_port=job.master_port,
                        workers=workers,
                        run_id=job.job_id,
                        gpus=m.gpus,
                        gpu_uuids=tuple(uuids.get(i, "") for i in m.gpus),
                    ),
                )
            )
        job.start_deadline = now + self.config.start_timeout
        self._transition(job, JobState.RUNNING, now)
        self._set_reason(
            job, f"attempt {job.attempt} starting: {_count(self._worker_count(job), 'worker')}", now
        )
        self._changed(job)

    def _assigned(self, job: _Job) -> bool:
        return job.state in (JobState.RUNNING, JobState.STOPPING)

    # ---- internals: exits, stops, restarts ------------------------------------------------------

    def _apply_exit(self, job: _Job, member: _Member, report: WorkerExitReport, now: float) -> None:
        key = (report.local_rank, report.pid)
        if key in member.seen_exits:
            return
        w = member.workers.get(report.local_rank)
        if w is None:
            return
        member.seen_exits.add(key)
        report = _sanitized(report, now)
        if report.return_value is not None:
            report = _within_result_budget(job, w.global_rank, report)
        w.exitcode = report.exitcode
        if report.pid:
            w.pid = report.pid
        if w.early and w.phase == _WorkerPhase.FAILED:
            self._complete_failure(job, member, w, report, now)
            return
        if job.state.is_terminal() and (report.stopped_by_agent or w.phase != _WorkerPhase.RUNNING):
            # The job failed before this worker ended, and the agent stopped it as told.
            if w.phase in (_WorkerPhase.INIT, _WorkerPhase.RUNNING):
                job.set_phase(w, _WorkerPhase.STOPPED)
            return
        if report.stopped_by_agent and job.state == JobState.STOPPING:
            if w.phase in (_WorkerPhase.INIT, _WorkerPhase.RUNNING):
                job.set_phase(w, _WorkerPhase.STOPPED)  # a failed one stays failed
            return
        if report.stopped_by_agent and report.failure is None:
            # Nobody asked for this stop (an agent shutting down, or a confused one): the worker
            # is gone all the same, and waiting for it would wedge the job.
            report = dataclasses.replace(
                report,
                failure=ProcessFailure(
                    global_rank=w.global_rank,
                    local_rank=w.local_rank,
                    pid=report.pid,
                    exitcode=report.exitcode,
                    message=f"stopped by the agent on {member.node} without the coordinator "
                    "asking (was the agent shut down?)",
                    timestamp=report.timestamp or now,
                    category=FailureCategory.PLATFORM,
                ),
            )
        if report.exitcode == 0 and report.failure is None:
            job.set_phase(w, _WorkerPhase.SUCCEEDED)
            if report.return_value is not None:
                job.return_values[w.global_rank] = report.return_value
            self._event(
                job,
                now,
                "worker_exited",
                f"rank {w.global_rank} on {member.node} exited 0",
                node=member.node,
                rank=w.global_rank,
            )
            if all(x.phase == _WorkerPhase.SUCCEEDED for x in member.workers.values()):
                self._member_done(job, member, now)
            self._changed(job)
            return
        failure = report.failure or ProcessFailure(
            global_rank=w.global_rank,
            local_rank=w.local_rank,
            pid=report.pid,
            exitcode=report.exitcode,
            message=f"Process exited with exit code {report.exitcode} (pid {report.pid})",
            timestamp=report.timestamp or now,
        )
        self._record_failure(job, member, w, failure, now)

    def _attached(self, name: str) -> bool:
        node = self._nodes.get(name)
        return node is not None and node.attached

    def _record_failure(
        self, job: _Job, member: _Member, w: _Worker, failure: ProcessFailure, now: float
    ) -> None:
        job.set_phase(w, _WorkerPhase.FAILED)
        if member.group_state != WorkerState.UNKNOWN:
            member.group_state = WorkerState.FAILED
        failure = _stamp(failure, member.node, w, job)
        # A failure of the running attempt that no restart can mend fails the job at once.
        no_restart = (
            no_restart_reason(job.spec, failure)
            if job.state == JobState.RUNNING and failure.category == FailureCategory.USER
            else ""
        )
        if no_restart:
            failure = replace(failure, category=FailureCategory.INPUT)
        job.failures[w.global_rank] = failure
        how = "recorded its error" if w.early else _exit_text(failure)
        self._event(
            job,
            now,
            "worker_failed",
            f"rank {w.global_rank} failed on {member.node} ({how}): {_first_line(failure.message)}",
            node=member.node,
            rank=w.global_rank,
        )
        if job.state == JobState.RUNNING and no_restart:
            self._begin_stop(
                job,
                _StopKind.INPUT,
                f"rank {w.global_rank} failed on {member.node} ({how}): {no_restart}; failing "
                "the job without a restart (restart_policy 'always' retries it)",
                now,
            )
        elif job.state == JobState.RUNNING:
            job.away_at_failure = tuple(
                m.node
                for m in job.members
                if m is not member and not m.done and not m.stopped and not self._attached(m.node)
            )
            self._begin_stop(
                job,
                _StopKind.FAILURE,
                f"rank {w.global_rank} failed on {member.node} ({how}); {_then(job)}",
                now,
            )
        elif job.state.is_terminal():
            self._amend_result(job)
        self._changed(job)

    def _complete_failure(
        self, job: _Job, member: _Member, w: _Worker, report: WorkerExitReport, now: float
    ) -> None:
        """The exit of a worker whose failure came at record time: add how it ended.

        The recorded message, traceback and time stay (the first complete record wins).
        """
        known = job.failures.get(w.global_rank)
        if known is None:
            return
        exited = report.failure
        job.failures[w.global_rank] = replace(
            known,
            exitcode=report.exitcode,
            pid=report.pid or known.pid,
            signal=exited.signal if exited is not None else known.signal,
            stderr_tail=exited.stderr_tail if exited is not None else known.stderr_tail,
        )
        self._event(
            job,
            now,
            "worker_exited",
            f"rank {w.global_rank} on {member.node} exited "
            f"({_exit_text(job.failures[w.global_rank])}) after recording its failure",
            node=member.node,
            rank=w.global_rank,
        )
        if job.state.is_terminal():
            self._amend_result(job)
        self._changed(job)

    def _start_timed_out(self, job: _Job, now: float) -> None:
        """The round's workers did not all start in time: each late rank is a platform failure.

        One stop for the whole round, so however many ranks or nodes were late it spends one
        restart, exactly as one failed rank does; the deadline is cleared so it fires once.
        """
        job.start_deadline = None
        timeout = self.config.start_timeout
        late_nodes: list[str] = []
        late_ranks = 0
        for m in job.members:
            late = [w for w in m.workers.values() if w.phase == _WorkerPhase.INIT]
            if not late:
                continue
            late_nodes.append(m.node)
            late_ranks += len(late)
            for w in late:
                job.set_phase(w, _WorkerPhase.FAILED)
                job.failures[w.global_rank] = _stamp(
                    ProcessFailure(
                        global_rank=w.global_rank,
                        local_rank=w.local_rank,
                        pid=0,
                        exitcode=-1,
                        message=f"rank {w.global_rank} did not start on node {m.node} within "
                        f"{timeout:g} s of the assignment (start timeout): its agent never "
                        "reported it started",
                        timestamp=now,
                        category=FailureCategory.PLATFORM,
                    ),
                    m.node,
                    w,
                    job,
                )
        if not late_nodes:
            return
        nodes = _named(late_nodes[: MAX_NODES_NAMED + 1]) + _more(len(late_nodes))
        reason = (
            f"{late_ranks} rank(s) on {nodes} did not start within {timeout:g} s of the "
            f"assignment (start timeout); {_then(job)}"
        )
        self._event(job, now, "start_timeout", reason)
        self._begin_stop(job, _StopKind.FAILURE, reason, now)
        self._changed(job)

    def _member_done(self, job: _Job, member: _Member, now: float) -> None:
        if not member.done:
            member.done = True
            job.note_done()
            member.group_state = WorkerState.SUCCEEDED
        member.stopped = True
        pending = job.pending_count()
        if job.state != JobState.RUNNING:
            return
        if not pending:
            for m in job.members:
                if not m.released:
                    self._effects.append(ReleaseRound(m.node, job.job_id, job.round))
            self._close_attempt(job, "all workers succeeded", now)
            self._release_all(job)
            self._end(job, JobState.SUCCEEDED, WorkerState.SUCCEEDED, "all workers succeeded", now)
            return
        if job.barrier_deadline is None:
            job.barrier_deadline = now + job.spec.exit_barrier_timeout
        if pending <= 5:
            waiting_for = ", ".join(m.node for m in job.members if not m.done)
        else:
            waiting_for = f"{pending} nodes"
        self._event(
            job,
            now,
            "barrier_wait",
            f"node {member.node} finished; waiting in the exit barrier for {waiting_for}",
            node=member.node,
        )
        self._set_reason(
            job,
            f"exit barrier: {len(job.members) - pending}/{len(job.members)} nodes done",
            now,
        )

    def _begin_stop(self, job: _Job, kind: _StopKind, reason: str, now: float) -> None:
        if job.state == JobState.STOPPING:
            # A cancel overrides a restart that was under way; nothing overrides a cancel.
            if kind == _StopKind.CANCEL and job.stop_kind != _StopKind.CANCEL:
                job.stop_kind, job.stop_reason = kind, reason
                self._set_reason(job, reason, now)
            return
        if job.state in (JobState.QUEUED, JobState.RENDEZVOUS):
            # Nothing runs yet: go straight to what the stop would lead to.
            self._release_all(job)
            job.port_deadline = None
            if kind == _StopKind.CANCEL:
                self._end(job, JobState.CANCELED, WorkerState.STOPPED, reason, now)
            else:
                self._back_to_queue(job, reason, now)
            return
        job.stop_kind, job.stop_reason = kind, reason
        if job.barrier_deadline is not None:
            waiting = [m.node for m in job.members if m.done and not m.released]
            self._event(
                job,
                now,
                "barrier_released",
                f"exit barrier released at once for {len(waiting)} finished node(s): {reason}",
            )
        job.barrier_deadline = None
        self._transition(job, JobState.STOPPING, now)
        self._set_reason(job, reason, now)
        self._event(job, now, "stopping", reason)
        job.stop_deadline = now + job.spec.stop_grace + STOP_MARGIN_S
        for m in job.members:
            if not m.stopped or (m.done and not m.released):
                self._effects.append(
                    StopRound(
                        m.node,
                        job.job_id,
                        job.round,
                        job.spec.stop_grace,
                        reason,
                        _replaced(job),
                    )
                )
        if all(m.stopped for m in job.members):
            self._after_stop(job, now)
        elif kind == _StopKind.FAILURE and not _replaced(job) and not job.away_at_failure:
            # (With a member away the outcome is not known yet: its loss would make this a
            # re-form.)
            self._fail_now(job, reason, now)
        self._changed(job)

    def _fail_now(self, job: _Job, reason: str, now: float) -> None:
        """A failure with no restart left: the job is FAILED now, while its workers still stop.

        The outcome cannot change any more, so the client learns it when the failure is known,
        not after every process has torn down (seconds, for a torch worker). The slots stay held
        by a fence until each node confirms its stop (or the stop deadline passes), so no other
        job starts beside the dying workers; exits that arrive later still complete the result.
        """
        hold_until = now + job.spec.stop_grace + STOP_MARGIN_S
        for m in job.members:
            node = self._nodes.get(m.node)
            if m.stopped or node is None:
                continue
            held = node.jobs.pop(job.job_id, None)
            if held:
                node.fenced[f"{job.job_id}#{job.round}"] = (held, hold_until)
        self._close_attempt(job, reason, now)
        self._release_all(job)
        self._end(job, JobState.FAILED, WorkerState.FAILED, reason, now, with_failures=True)

    def _amend_result(self, job: _Job) -> None:
        """A FAILED job's exits came after its result: add what they tell (exit codes, later
        failures) to the result and to its last attempt, keeping the root cause."""
        result = job.result
        if result is None or result.state != WorkerState.FAILED or not job.attempts:
            return
        last = job.attempts[-1]
        if last.attempt == job.attempt and last.round == job.round:
            job.attempts[-1] = replace(last, failures=self._attempt_failures(job)[0])
        job.result = replace(
            result, failures=_label_failures(job.failures), attempts=tuple(job.attempts)
        )
        self._changed(job)

    def _member_stopped(self, job: _Job, member: _Member, now: float) -> None:
        member.stopped = True
        if member.group_state in (WorkerState.INIT, WorkerState.HEALTHY, WorkerState.UNHEALTHY):
            member.group_state = WorkerState.STOPPED
        for w in member.workers.values():
            if w.phase in (_WorkerPhase.INIT, _WorkerPhase.RUNNING):
                job.set_phase(w, _WorkerPhase.STOPPED)
        if job.state == JobState.STOPPING and all(m.stopped for m in job.members):
            self._after_stop(job, now)
        self._changed(job)

    def _after_stop(self, job: _Job, now: float) -> None:
        job.stop_deadline = None
        kind, reason = job.stop_kind, job.stop_reason
        # Every rank exited 0 before a re-form for membership took effect: the job is done, and
        # running it again would repeat finished work (torchelastic never scales up a SUCCEEDED
        # group either).
        done = kind == _StopKind.MEMBERSHIP and bool(job.members)
        done = done and all(m.done for m in job.members)
        if done:
            reason = "all workers succeeded"
        suspect = self._flaky_suspect(job) if kind == _StopKind.FAILURE else None
        self._close_attempt(job, reason, now)
        self._release_all(job)
        if done:
            self._end(job, JobState.SUCCEEDED, WorkerState.SUCCEEDED, reason, now)
        elif kind == _StopKind.CANCEL:
            self._end(job, JobState.CANCELED, WorkerState.STOPPED, reason, now)
        elif kind == _StopKind.INPUT:
            self._end(job, JobState.FAILED, WorkerState.FAILED, reason, now, with_failures=True)
        elif kind == _StopKind.FAILURE:
            if job.attempt < job.spec.max_restarts:
                job.attempt += 1
                job.not_before = now + _jittered(job.spec.restart_backoff, job.job_id, job.attempt)
                self._event(
                    job,
                    now,
                    "restart",
                    f"restarting: attempt {job.attempt} ({job.attempt}/{job.spec.max_restarts} restarts used)",
                )
                self._back_to_queue(job, f"restarting: attempt {job.attempt}", now)
            else:
                self._end(job, JobState.FAILED, WorkerState.FAILED, reason, now, with_failures=True)
        else:
            self._back_to_queue(job, reason, now)
        if suspect is not None:
            self._count_flaky(suspect[0], job.job_id, suspect[1], now)

    def _back_to_queue(self, job: _Job, reason: str, now: float) -> None:
        self._reschedule = True
        job.members = []
        # The ended round's failures live on in its AttemptSummary; a result made later (say, a
        # rendezvous timeout) must not present them as its own.
        job.failures = {}
        job.stop_kind = None
        job.away_at_failure = ()
        job.last_call_deadline = None
        job.join_deadline = now + job.spec.join_timeout
        self._transition(job, JobState.QUEUED, now)
        self._set_reason(job, reason, now)
        self._changed(job)

    def _reform(self, job: _Job, reason: str, now: float) -> None:
        self._event(job, now, "reform", reason)
        self._release_all(job)
        self._back_to_queue(job, reason, now)

    def _close_attempt(self, job: _Job, reason: str, now: float) -> None:
        if not job.members:
            return
        failures, cut = self._attempt_failures(job)
        if cut:
            reason += f" ({cut:,} more failures not kept)"
        nodes = [m.node for m in job.members]
        job.attempts.append(
            AttemptSummary(
                attempt=job.attempt,
                round=job.round,
                nodes=tuple(nodes[:MAX_NODES_KEPT]),
                end_reason=reason
                + (
                    f" ({len(nodes) - MAX_NODES_KEPT:,} more nodes not listed)"
                    if len(nodes) > MAX_NODES_KEPT
                    else ""
                ),
                failures=failures,
                started_at=job.round_started_at,
                ended_at=now,
            )
        )
        if len(job.attempts) > MAX_ATTEMPTS_KEPT:
            self._cut_attempts(job)

    def _attempt_failures(self, job: _Job) -> tuple[tuple[ProcessFailure, ...], int]:
        """The round's failures as an attempt keeps them (root cause first), and how many were cut."""
        failures = sorted(
            _label_failures(job.failures).values(),
            key=lambda f: (not f.root_cause, f.timestamp, f.global_rank),
        )
        cut = max(0, len(failures) - MAX_FAILURES_PER_ATTEMPT)
        return tuple(failures[:MAX_FAILURES_PER_ATTEMPT]), cut

    def _cut_attempts(self, job: _Job) -> None:
        # The first attempt, a note for the cut ones, then the latest.
        first, rest = job.attempts[0], job.attempts[1:]
        note = rest[0] if rest and rest[0].round == 0 and rest[0].ended_at == 0.0 else None
        tail = rest[1:] if note is not None else rest
        keep = MAX_ATTEMPTS_KEPT - 2
        cut = tail[: len(tail) - keep]
        if not cut:
            return
        start = note.attempt if note is not None else cut[0].attempt
        end = cut[-1].attempt
        marker = AttemptSummary(
            attempt=start,
            round=0,
            nodes=(),
            end_reason=f"attempts {start:,}-{end:,} not kept (a job keeps at most {MAX_ATTEMPTS_KEPT})",
        )
        job.attempts = [first, marker, *tail[len(cut) :]]

    def _end(
        self,
        job: _Job,
        state: JobState,
        wstate: WorkerState,
        reason: str,
        now: float,
        *,
        with_failures: bool = False,
        category: FailureCategory = FailureCategory.PLATFORM,
    ) -> None:
        failures = (
            _label_failures(job.failures) if with_failures or state == JobState.FAILED else {}
        )
        if state == JobState.FAILED and not failures:
            # No worker failed (a rendezvous timeout, a job no node could hold): the job's own
            # failure, under JOB_FAILURE_RANK, so that a FAILED result always has a root cause.
            failures = {JOB_FAILURE_RANK: _job_failure(job, reason, category, now)}
        job.finished_at = now
        job.result = RunResult(
            state=wstate,
            return_values=dict(job.return_values) if state == JobState.SUCCEEDED else {},
            failures=failures,
            attempts=tuple(job.attempts),
            reason=reason,
            job_id=job.job_id,
            name=job.spec.name,
        )
        job.port_deadline = job.stop_deadline = job.barrier_deadline = None
        job.last_call_deadline = None
        self._transition(job, state, now)
        self._set_reason(job, reason, now)
        self._event(job, now, "finished", f"{state.value}: {reason}")
        self._changed(job)
        self._finished.append(job.job_id)
        self._retain(now)

    def _retain(self, now: float) -> None:
        """Delete finished jobs past retention (count, then age), oldest first."""
        cfg = self.config
        while self._finished:
            job = self._jobs.get(self._finished[0])
            if job is None or not job.state.is_terminal():
                self._finished.popleft()  # withdrawn, or a stale entry
                continue
            too_many = len(self._finished) > cfg.retain_jobs
            if not too_many and now - job.finished_at <= cfg.retain_seconds:
                break
            self._finished.popleft()
            del self._jobs[job.job_id]
            if job.request_id:
                self._by_request.pop(job.request_id, None)
            self._effects.append(Forgotten(job_id=job.job_id))

    def _retain_nodes(self, now: float) -> None:
        """Drop lost nodes past `lost_node_retention`, then the longest unseen past the count."""
        lost = sorted(
            (n for n in self._nodes.values() if not n.live and not n.jobs),
            key=lambda n: n.last_seen,
        )
        named = {m.node for job in self._active_jobs() for m in job.members}
        keep_for = min(self.config.lost_node_retention, self.config.retain_seconds)
        excess = len(lost) - self.config.max_lost_nodes
        for node in lost:
            too_old = now - node.last_seen > keep_for
            if not (too_old or excess > 0):
                continue
            if node.name in named:
                continue  # an active job's history still names it
            excess -= 1
            del self._nodes[node.name]
            self._effects.append(Forgotten(node=node.name))

    def forget_node(self, name: str, now: float) -> list[Effect]:
        """Drop a lost node from the list now. A live node is refused (NodeIsLive); an unknown
        name is nothing to do."""
        node = self._nodes.get(name)
        if node is not None:
            if node.live:
                raise NodeIsLive(f"node {name!r} is {'live' if node.attached else 'reconnecting'}")
            del self._nodes[name]
            self._effects.append(Forgotten(node=name))
        return self._finish(now)

    def _release_all(self, job: _Job) -> None:
        for m in job.members:
            self._free_member(job, m)

    def _free_member(self, job: _Job, member: _Member) -> None:
        node = self._nodes.get(member.node)
        if node is not None:
            node.gpu_jobs.pop(job.job_id, None)
        if node is not None and node.jobs.pop(job.job_id, None) is not None:
            self._reschedule = True

    # ---- internals: nodes -----------------------------------------------------------------------

    def _lose_node(self, node: _Node, why: str, now: float) -> None:
        self._reschedule = True
        if node.live:
            self._n_live -= 1
        node.live = False
        node.attached = False
        logger.warning("node %s lost: %s", node.name, why)
        for job in self._active_jobs():
            m = job.member(node.name)
            if m is None:
                continue
            self._free_member(job, m)
            if m.done:
                continue
            if job.state == JobState.RUNNING:  # while stopping, its workers were being stopped
                self._infra_failures(job, m, f"node {node.name} lost: {why}", now)
            m.lost = True
            m.stopped = True
            m.group_state = WorkerState.UNKNOWN
            self._event(job, now, "node_lost", f"node {node.name} lost: {why}", node=node.name)
            if job.stop_kind == _StopKind.FAILURE and node.name in job.away_at_failure:
                # The failure came while this node was away and it is gone now: its ranks went
                # first and the others failed on them (a peer's collective error), so this is a
                # lost node, which costs no restart.
                job.stop_kind = _StopKind.MEMBERSHIP
                job.stop_reason = (
                    f"node {node.name} lost ({why}); the failures on the other nodes came after "
                    "it went away; re-forming with the remaining nodes"
                )
                self._set_reason(job, job.stop_reason, now)
            if job.state == JobState.STOPPING:
                if all(x.stopped for x in job.members):
                    self._after_stop(job, now)
            elif job.state in (JobState.RUNNING, JobState.RENDEZVOUS):
                self._begin_stop(
                    job,
                    _StopKind.MEMBERSHIP,
                    f"node {node.name} lost ({why}); re-forming with the remaining nodes",
                    now,
                )
            self._changed(job)
        node.jobs.clear()
        node.fenced.clear()
        node.gpu_jobs.clear()

    def clear_quarantine(self, name: str, now: float) -> tuple[bool, list[Effect]]:
        """An operator lets a quarantined node take new rounds again: (it was quarantined,
        effects). The uncorrectable ECC counts it shows now are accepted: only a new error
        quarantines it again. A GPU still lost quarantines it again at its next heartbeat."""
        node = self._nodes.get(name)
        if node is None or not node.quarantine_reason:
            return False, self._finish(now)
        self._clear_quarantine(node, "cleared by an operator", now)
        return True, self._finish(now)

    def _gpu_samples(self, node: _Node, samples: Sequence[GpuHealth]) -> str:
        """Keep the node's GPU samples; what makes it unhealthy ("" = nothing)."""
        uuids = {g.index: g.uuid for g in node.gpus}
        problem = ""
        for s in samples[: len(node.gpus)]:
            uuid = uuids.get(s.index)
            if uuid is None:
                continue
            node.gpu_health[s.index] = s
            if problem:
                continue
            if s.lost:
                problem = f"GPU {s.index} ({uuid}) is lost (fell off the bus or cannot be read)"
            elif s.uncorrectable_ecc > node.ecc_accepted.get(uuid, 0):
                problem = (
                    f"GPU {s.index} ({uuid}) has {s.uncorrectable_ecc} uncorrectable ECC errors"
                )
        return problem

    def _flaky_suspect(self, job: _Job) -> tuple[str, ProcessFailure] | None:
        """(node, failure) when the round that just stopped for a failure failed on one node
        alone: its first failure was there, and no other node's rank failed with the same error
        (a job that fails everywhere is the job's fault, not a node's). Ranks of other nodes that
        failed after it with other errors (a peer's collective error) do not clear the node."""
        if len(job.members) < 2 or not job.failures:
            return None
        root = first_failure(job.failures)
        if root is None or root.category not in (FailureCategory.USER, FailureCategory.PLATFORM):
            return None
        same = _bare_message(root.message)
        for f in job.failures.values():
            if f.node != root.node and _bare_message(f.message) == same:
                return None
        return root.node, root

    def _count_flaky(self, name: str, job_id: str, failure: ProcessFailure, now: float) -> None:
        """One more round failed on node `name` alone; `flaky_rounds` of them within
        `flaky_window` quarantine it."""
        cfg = self.config
        node = self._nodes.get(name)
        if node is None or cfg.flaky_rounds <= 0:
            return
        recent = [t for t in node.failed_rounds if now - t <= cfg.flaky_window]
        node.failed_rounds = (*recent, now)[-cfg.flaky_rounds :]
        if len(node.failed_rounds) >= cfg.flaky_rounds and not node.quarantine_reason:
            self._quarantine(
                node,
                f"flaky: {len(node.failed_rounds)} rounds failed first on this node within "
                f"{cfg.flaky_window:g} s while their other nodes were healthy (the last: rank "
                f"{failure.global_rank} of job {job_id}: {_first_line(failure.message)})",
                now,
            )

    def _quarantine(self, node: _Node, reason: str, now: float) -> None:
        """No new round goes to the node; a round running there re-forms as for a lost node."""
        self._reschedule = True
        node.quarantine_reason = _clip(reason, 1000)
        node.quarantined_until = now + self.config.quarantine_ttl
        self._effects.append(NodeChanged(node.name))
        logger.warning(
            "node %s quarantined for %g s: %s", node.name, self.config.quarantine_ttl, reason
        )
        why = f"node {node.name} quarantined: {reason}"
        for job in self._active_jobs():
            m = job.member(node.name)
            if m is None or m.done or m.stopped:
                continue
            if job.state == JobState.RUNNING:
                self._infra_failures(job, m, why, now)
            self._event(job, now, "node_quarantined", why, node=node.name)
            if job.state in (JobState.RUNNING, JobState.RENDEZVOUS):
                self._begin_stop(
                    job, _StopKind.MEMBERSHIP, f"{why}; re-forming with the remaining nodes", now
                )
            self._changed(job)

    def _clear_quarantine(self, node: _Node, why: str, now: float) -> None:
        logger.info("node %s: quarantine lifted (%s)", node.name, why)
        uuids = {g.index: g.uuid for g in node.gpus}
        for index, h in node.gpu_health.items():
            if index in uuids:
                node.ecc_accepted[uuids[index]] = h.uncorrectable_ecc
        if len(node.ecc_accepted) > 4 * len(node.gpus) + 64:  # GPUs long gone: bounded
            node.ecc_accepted = {u: node.ecc_accepted.get(u, 0) for u in uuids.values()}
        node.quarantine_reason, node.quarantined_until = "", 0.0
        node.failed_rounds = ()
        self._reschedule = True
        self._effects.append(NodeChanged(node.name))

    def _infra_failures(self, job: _Job, member: _Member, message: str, now: float) -> None:
        """The workers of `member` that were starting or running are gone with their node or
        agent: INFRA failures of this round (a re-form for membership spends no budget)."""
        if member.stopped:
            return
        for w in member.workers.values():
            if w.phase not in (_WorkerPhase.INIT, _WorkerPhase.RUNNING):
                continue
            job.set_phase(w, _WorkerPhase.FAILED)
            job.failures.setdefault(
                w.global_rank,
                _stamp(
                    ProcessFailure(
                        global_rank=w.global_rank,
                        local_rank=w.local_rank,
                        pid=w.pid,
                        exitcode=-1,
                        message=message,
                        timestamp=now,
                        signal="<N/A>",  # the exit is unknown: not a SIGHUP (-1)
                        category=FailureCategory.INFRA,
                    ),
                    member.node,
                    w,
                    job,
                ),
            )

    def _adopt(self, node: _Node, report: RunningGroupReport, now: float) -> None:
        job = self._jobs.get(report.job_id)
        member = job.member(node.name) if job is not None else None
        if (
            job is None
            or member is None
            or job.round != report.round
            or job.state.is_terminal()
            or member.lost
        ):
            if not report.stopped:
                self._effects.append(
                    StopRound(
                        node.name,
                        report.job_id,
                        report.round,
                        0.0,
                        "stale round: the job has moved on without this node",
                    )
                )
                # Its old workers still hold the slots until the stop is confirmed: a new
                # round must not start beside them (a GPU would still be busy).
                key = f"{report.job_id}#{report.round}"
                node.fenced.pop(key, None)
                held = min(max(1, len(report.pids)), max(0, node.free_slots()))
                if held:
                    node.fenced[key] = (held, now + STALE_HOLD_S)
            return
        if member.released:
            # The exit barrier already let it go and its slots may serve another job now: repeat
            # the release (it was lost with the old stream) instead of booking the slots again.
            self._effects.append(ReleaseRound(node.name, job.job_id, job.round))
            return
        node.jobs[job.job_id] = member.ranks.local_world_size
        if member.gpus:
            node.gpu_jobs[job.job_id] = list(member.gpus)
        was_stopping = job.state == JobState.STOPPING
        if job.state == JobState.RENDEZVOUS and job.port_deadline is not None:
            # The round was assigned just before the coordinator went down: it runs.
            job.port_deadline = None
            self._transition(job, JobState.RUNNING, now)
            self._event(job, now, "assigned", f"round {job.round} was assigned before the restart")
            silent = [
                m.node
                for m in job.members
                if m is not member
                and (n := self._nodes.get(m.node)) is not None
                and n.attached
                and all(w.phase == _WorkerPhase.INIT for w in m.workers.values())
            ]
            if silent:
                # Those reconnected first without the round: it never reached them.
                for m in job.members:
                    if m.node in silent:
                        m.stopped = True
                self._begin_stop(
                    job,
                    _StopKind.MEMBERSHIP,
                    f"round {job.round} never reached {', '.join(silent[:5])}; re-forming",
                    now,
                )
        for local_rank, pid in report.pids:
            w = member.workers.get(local_rank)
            if w is not None and w.phase == _WorkerPhase.INIT:
                w.pid = pid
                job.set_phase(w, _WorkerPhase.RUNNING)
        for ex in report.exits:
            self._apply_exit(job, member, ex, now)
        if report.stopped:
            self._member_stopped(job, member, now)
        elif was_stopping and not member.stopped:
            # The stop may have gone down with the old stream: say it again (the agent treats
            # a repeated stop of a stopping group as one).
            self._effects.append(
                StopRound(
                    node.name,
                    job.job_id,
                    job.round,
                    job.spec.stop_grace,
                    job.stop_reason,
                    _replaced(job),
                )
            )
        self._event(
            job,
            now,
            "adopted",
            f"node {node.name} reconnected with round {report.round}",
            node=node.name,
        )
        self._changed(job)

    def _fenced(
        self, node: _Node, job_id: str, round_: int, now: float
    ) -> tuple[_Job | None, _Member | None]:
        job = self._jobs.get(job_id)
        member = job.member(node.name) if job is not None else None
        if job is None or member is None or job.round != round_ or member.lost:
            logger.info(
                "refused a message from node %s for stale round %s/%d", node.name, job_id, round_
            )
            self._effects.append(
                StopRound(node.name, job_id, round_, 0.0, "stale round: the job has moved on")
            )
            return None, None
        return job, member

    def _live(self, name: str, incarnation: str) -> _Node | None:
        node = self._nodes.get(name)
        if node is None or not node.live or node.incarnation != incarnation:
            return None
        return node

    # ---- internals: bookkeeping -----------------------------------------------------------------

    def _job(self, job_id: str) -> _Job:
        job = self._jobs.get(job_id)
        if job is None:
            raise JobNotFound(job_id)
        return job

    def _active_jobs(self) -> list[_Job]:
        return [j for j in self._jobs.values() if not j.state.is_terminal()]

    def _all_started(self, job: _Job) -> bool:
        return job.unstarted() == 0

    def _worker_count(self, job: _Job) -> int:
        return sum(len(m.workers) for m in job.members)

    def _transition(self, job: _Job, state: JobState, now: float) -> None:
        if job.state == state:
            return
        if not job.state.can_become(state):
            raise RuntimeError(
                f"job {job.job_id}: illegal transition {job.state.value} -> {state.value}"
            )
        logger.info("job %s: %s -> %s", job.job_id, job.state.value, state.value)
        job.state = state

    def _set_reason(self, job: _Job, reason: str, now: float) -> None:
        if reason != job.reason:
            job.reason = reason
            self._changed(job, durable=False)

    def _changed(self, job: _Job, *, durable: bool = True) -> None:
        key = (job.job_id, durable)
        if key not in self._changed_keys:
            self._changed_keys.add(key)
            self._effects.append(JobChanged(job.job_id, durable))

    def _event(
        self, job: _Job, now: float, kind: str, reason: str, *, node: str = "", rank: int = -1
    ) -> None:
        self._event_seq += 1
        event = JobEvent(
            seq=self._event_seq,
            job_id=job.job_id,
            timestamp=now,
            kind=kind,
            reason=reason,
            attempt=job.attempt,
            round=job.round,
            node=node,
            rank=rank,
        )
        job.events.append(event)
        logger.info("job %s attempt %d round %d: %s", job.job_id, job.attempt, job.round, reason)
        self._effects.append(EventRecorded(event))
        if len(job.events) > MAX_EVENTS_PER_JOB:
            self._cut_events(job)

    def _cut_events(self, job: _Job) -> None:
        # Keep the head (how the job started) and the latest; in between one note says how
        # many were cut. The note takes the number of the last event it replaces.
        head = job.events[:EVENTS_HEAD]
        note = job.events[EVENTS_HEAD] if job.events[EVENTS_HEAD].kind == "events_cut" else None
        cut_before = len(job.events) - (MAX_EVENTS_PER_JOB - EVENTS_HEAD - 1)
        dropped = job.events[EVENTS_HEAD + (1 if note else 0) : cut_before]
        if not dropped:
            return
        earlier = int(note.node) if note is not None and note.node.isdigit() else 0
        total = earlier + len(dropped)
        last = dropped[-1]
        marker = JobEvent(
            seq=last.seq,
            job_id=job.job_id,
            timestamp=last.timestamp,
            kind="events_cut",
            reason=f"... {total:,} events not kept here (a job keeps at most {MAX_EVENTS_PER_JOB:,})",
            attempt=last.attempt,
            round=last.round,
            node=str(total),
        )
        first_cut = (note.seq if note is not None else dropped[0].seq) - 1
        job.events = [*head, marker, *job.events[cut_before:]]
        self._effects.append(EventsCut(job.job_id, first_cut, last.seq))
        self._effects.append(EventRecorded(marker))

    def _rank_node_in_summary(self, job: _Job, summary: AttemptSummary, rank: int) -> str:
        if job.spec.roles:
            # Groups differ in size: only a failed rank's node is kept with the attempt.
            return next((f.node for f in summary.failures if f.global_rank == rank), "")
        nproc = job.spec.nproc_per_node
        index = rank // nproc if nproc else -1
        if 0 <= index < len(summary.nodes):
            return summary.nodes[index]
        return ""


# ------------------------------------------------------------------------------------------------
# Helpers
# ------------------------------------------------------------------------------------------------


def _smallest_group(spec: JobSpec) -> int:
    """The fewest free slots a node needs to take a group of the job."""
    if spec.roles:
        return min(r.nproc_per_node for r in spec.roles)
    return spec.nproc_per_node


def _free_slots(node: _Node) -> int:
    """The workers a node could take now: its free slots, and its free GPUs when it has any."""
    return min(node.free_slots(), len(node.free_gpus())) if node.gpus else node.free_slots()


def _total_room(node: _Node) -> int:
    """The most workers a node could ever take: its slots, and its GPUs when it has any."""
    return min(node.slots, len(node.gpus)) if node.gpus else node.slots


def _fit_order(
    nodes: Sequence[_Node], need: int, taken: set[str], room: Callable[[_Node], int] = _free_slots
) -> list[_Node]:
    """The nodes that have `room` for a group of `need` slots, the tightest first (best fit): a
    role with small groups does not take the big nodes another role needs."""
    fit = [n for n in nodes if n.name not in taken and room(n) >= need]
    return sorted(fit, key=room)


def _place(
    spec: JobSpec, free: Sequence[_Node], room: Callable[[_Node], int] = _free_slots
) -> tuple[list[tuple[_Node, NodeRole]], bool] | None:
    """The nodes a round would take and the role of each, and whether it is full (every role at
    its max_nodes); None while some role cannot have its min_nodes.

    One node runs one group of the job: a node never carries two roles of one job.
    """
    if not spec.roles:
        if len(free) < spec.min_nodes:
            return None
        chosen = free[: spec.max_nodes]
        role = NodeRole(spec.role, spec.nproc_per_node)
        return [(n, role) for n in chosen], len(free) >= spec.max_nodes
    taken: set[str] = set()
    placed: list[tuple[_Node, NodeRole]] = []
    # Minimums first, the biggest groups first (they fit the fewest nodes); then each role grows
    # toward its maximum in the spec's order.
    by_size = sorted(spec.roles, key=lambda r: -r.nproc_per_node)
    for want in ("min", "max"):
        for r in by_size if want == "min" else spec.roles:
            have = sum(1 for _, p in placed if p.role == r.name)
            goal = r.min_nodes if want == "min" else r.max_nodes
            for n in _fit_order(free, r.nproc_per_node, taken, room)[: max(0, goal - have)]:
                taken.add(n.name)
                placed.append((n, NodeRole(r.name, r.nproc_per_node)))
            if want == "min" and sum(1 for _, p in placed if p.role == r.name) < r.min_nodes:
                return None
    full = all(sum(1 for _, p in placed if p.role == r.name) >= r.max_nodes for r in spec.roles)
    return placed, full


def _growth(spec: JobSpec, roles_now: Sequence[str], free: Sequence[_Node]) -> list[_Node]:
    """The free nodes a running multi-role round could grow by: ones that fit a role below its
    max_nodes."""
    out: list[_Node] = []
    taken: set[str] = set()
    for r in spec.roles:
        room = r.max_nodes - sum(1 for x in roles_now if x == r.name)
        for n in _fit_order(free, r.nproc_per_node, taken)[: max(0, room)]:
            taken.add(n.name)
            out.append(n)
    return out


_ENDED_GROUP = (WorkerState.FAILED, WorkerState.SUCCEEDED)


def _node_state(n: _Node) -> str:
    if not n.live:
        return "lost"
    if n.quarantine_reason:
        return "quarantined"
    return "live" if n.attached else "reconnecting"


def _worker_gpu(
    node: _Node | None, m: _Member, local_rank: int, *, sampled: bool
) -> WorkerGpu | None:
    """The GPU `local_rank` of member `m` holds, with its node's latest sample of it (none once
    the job is over: the GPU may serve another job by then)."""
    if node is None or not 0 <= local_rank < len(m.gpus):
        return None
    index = m.gpus[local_rank]
    device = next((g for g in node.gpus if g.index == index), None)
    h = node.gpu_health.get(index) if sampled else None
    return WorkerGpu(
        index=index,
        uuid=device.uuid if device is not None else "",
        utilization_percent=h.utilization_percent if h is not None else 0.0,
        memory_used=h.memory_used if h is not None else 0,
        memory_total=device.memory_total if device is not None else 0,
        temperature_c=h.temperature_c if h is not None else 0,
    )


def _worker_state(phase: _WorkerPhase, proc_state: str) -> WorkerState:
    if phase == _WorkerPhase.RUNNING:
        if proc_state in ("disk-sleep", "stopped"):
            return WorkerState.UNHEALTHY
        return WorkerState.HEALTHY
    return {
        _WorkerPhase.INIT: WorkerState.INIT,
        _WorkerPhase.SUCCEEDED: WorkerState.SUCCEEDED,
        _WorkerPhase.FAILED: WorkerState.FAILED,
        _WorkerPhase.STOPPED: WorkerState.STOPPED,
    }[phase]


def _then(job: _Job) -> str:
    """What a failure of the running attempt leads to, in the words of the stop's reason."""
    if job.spec.max_restarts - job.attempt > 0:
        return f"restarting ({job.attempt + 1}/{job.spec.max_restarts} restarts used)"
    return "no restarts left; failing the job"


def _named(items: Iterable[str]) -> str:
    return ", ".join(list(items)[:MAX_NODES_NAMED])


def _count(n: int, noun: str) -> str:
    """``1 node``, ``2 nodes``."""
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def _more(count: int) -> str:
    return f" ... and {count - MAX_NODES_NAMED:,} more nodes" if count > MAX_NODES_NAMED else ""


def _clip(text: str, limit: int = MAX_FAILURE_TEXT) -> str:
    if len(text) <= limit:
        return text
    return (
        text[: limit // 2]
        + f"\n... [{len(text) - limit} characters cut] ...\n"
        + text[-limit // 2 :]
    )


def _sanitized(report: WorkerExitReport, now: float) -> WorkerExitReport:
    """An agent's report made safe to keep: bounded texts, finite times, bounded return value."""
    ts = report.timestamp if math.isfinite(report.timestamp) and report.timestamp > 0 else now
    f = report.failure
    if f is not None:
        f = replace(
            f,
            message=_clip(f.message),
            traceback=_clip(f.traceback),
            stderr_tail=_clip(f.stderr_tail),
            error_file=_clip(f.error_file, 4096),
            node=_clip(f.node, 256),
            signal=_clip(f.signal, 64),
            role=_clip(f.role, 256),
            timestamp=f.timestamp if math.isfinite(f.timestamp) and f.timestamp > 0 else ts,
        )
    value = report.return_value
    if value is not None and len(value) > MAX_RETURN_VALUE_BYTES:
        f = ProcessFailure(
            global_rank=report.global_rank,
            local_rank=report.local_rank,
            pid=report.pid,
            exitcode=report.exitcode,
            message=(
                f"the return value is {len(value)} bytes pickled, over the limit of "
                f"{MAX_RETURN_VALUE_BYTES} bytes; return less, or write it to a file"
            ),
            timestamp=ts,
        )
        value = None
    return replace(report, failure=f, return_value=value, timestamp=ts)


def _within_result_budget(job: _Job, rank: int, report: WorkerExitReport) -> WorkerExitReport:
    """The report with its return value kept only where one belongs and the job can hold it.

    A command job has no return values, whatever an agent says; a function job's ranks together
    may keep at most MAX_RESULT_BYTES_PER_JOB, and the rank that goes over fails the job.
    """
    value = report.return_value
    if value is None or not job.spec.is_function:
        return replace(report, return_value=None)
    held = sum(len(v) for r, v in job.return_values.items() if r != rank)
    if held + len(value) <= MAX_RESULT_BYTES_PER_JOB:
        return report
    return replace(
        report,
        return_value=None,
        failure=report.failure
        or ProcessFailure(
            global_rank=report.global_rank,
            local_rank=report.local_rank,
            pid=report.pid,
            exitcode=report.exitcode,
            message=(
                f"the return values of the job's ranks add up to {held + len(value)} bytes "
                f"with this rank's {len(value)}, over the per-job limit of "
                f"{MAX_RESULT_BYTES_PER_JOB} bytes; return less, or write it to a file"
            ),
            timestamp=report.timestamp,
        ),
    )


def _stamp(f: ProcessFailure, node: str, w: _Worker, job: _Job) -> ProcessFailure:
    member = job.member(node)
    role_rank = member.ranks.role_rank(w.local_rank) if member is not None else f.role_rank
    return replace(
        f,
        role_rank=role_rank,
        node=f.node or node,
        global_rank=w.global_rank,
        local_rank=w.local_rank,
        attempt=job.attempt,
        round=job.round,
        role=member.ranks.role if member is not None else (f.role or job.spec.role),
    )


def _jittered(backoff: float, job_id: str, attempt: int) -> float:
    """`backoff` scaled by a factor in [0.5, 1.5) that the job and attempt fix (so a replay, a
    restored coordinator and a test see the same), and that differs between jobs: jobs that
    failed together do not all restart at once."""
    if backoff <= 0:
        return 0.0
    digest = hashlib.sha256(f"{job_id}/{attempt}".encode()).digest()
    return backoff * (0.5 + int.from_bytes(digest[:4], "big") / 2**32)


JOB_FAILURE_RANK = -1
"""The key, in a FAILED result's failures, of the job's own failure when no worker's is there
(a rendezvous that timed out, a job no node could hold): torchelastic's code reads
`result.failures` and `root_cause` of every failed run."""


def _job_failure(job: _Job, reason: str, category: FailureCategory, now: float) -> ProcessFailure:
    return ProcessFailure(
        global_rank=JOB_FAILURE_RANK,
        local_rank=JOB_FAILURE_RANK,
        pid=0,
        exitcode=1,
        message=reason,
        timestamp=now,
        attempt=job.attempt,
        round=job.round,
        root_cause=True,
        category=category,
    )


def _label_failures(failures: dict[int, ProcessFailure]) -> dict[int, ProcessFailure]:
    """Mark the root cause (first observed across all nodes); the rest are collateral."""
    root = first_failure(failures)
    return {
        rank: replace(f, root_cause=(root is not None and rank == root.global_rank))
        for rank, f in sorted(failures.items())
    }


def _exit_text(f: ProcessFailure) -> str:
    if f.signal:
        return f"signal {f.signal}"
    return f"exit {f.exitcode}"


_RAN_NOTE = re.compile(r" \(ran [^\n]{1,4200} on node [^\s()]{1,128}\)$")


_PID = re.compile(r"\b(?:pid|PID) \d{1,10}\b")


def _bare_message(message: str) -> str:
    """A failure's message without what differs from rank to rank for the same error: the
    agent's note of where it ran, and the pid."""
    return _PID.sub("pid", _RAN_NOTE.sub("", message.strip()))


def _first_line(text: str) -> str:
    lines = [ln for ln in text.strip().splitlines() if ln.strip()]
    return lines[-1][:300] if lines else ""


def _describe_spec(spec: JobSpec) -> str:
    # Events are shown and logged: the program and counts, never an argument or an env value.
    if spec.roles:
        parts = [
            f"{r.name} ({describe_command(tuple(r.entrypoint) + tuple(r.args), len(r.env))}: "
            + (f"{r.min_nodes}" if r.min_nodes == r.max_nodes else f"{r.min_nodes}:{r.max_nodes}")
            + f" x {_count(r.nproc_per_node, 'worker')})"
            for r in spec.roles
        ]
        return (
            f"submitted {len(spec.roles)} roles with {len(spec.env)} job env variable(s): "
            f"{', '.join(parts)}, max_restarts={spec.max_restarts}"
        )
    what = (
        f"{spec.function[:200]!r} with {len(spec.env)} env variable(s)"
        if spec.function
        else describe_command(spec.argv, len(spec.env))
    )
    nodes = (
        f"{spec.min_nodes}"
        if spec.min_nodes == spec.max_nodes
        else f"{spec.min_nodes}:{spec.max_nodes}"
    )
    return (
        f"submitted {what}: {nodes} node{'' if nodes == '1' else 's'} x "
        f"{_count(spec.nproc_per_node, 'worker')}, "
        f"max_restarts={spec.max_restarts}"
    )
