"""The cluster's vocabulary: what comes in (the agents' reports), what goes out (effects), its
configuration, and the records it keeps of nodes, jobs, rounds and workers.
"""

from __future__ import annotations

import enum
import logging
from dataclasses import dataclass, field
from typing import Any

from client.assignment import RoundAssignment
from client.model import (
    AttemptSummary,
    GpuDevice,
    GpuHealth,
    JobEvent,
    JobSpec,
    JobState,
    ProcessFailure,
    RunResult,
    WorkerState,
)
from client.node_protocol import RunningGroup, WorkerExit
from client.stacks import StackCapture
from coordinator._ranks import GroupRanks

logger = logging.getLogger("coordinator._cluster")


PORT_TIMEOUT_S = 10.0
MAX_FAILURE_TEXT = 64 * 1024
PORT_RETRY_MAX_S = 10.0
STALE_HOLD_S = 60.0
STOP_MARGIN_S = 15.0
NODE_RETENTION_EVERY_S = 60.0
NODE_SWEEP_MAX_S = 1.0
"""The most time between two sweeps of every node for expired leases (a tenth of the lease
when that is shorter)."""
MAX_EVENTS_PER_JOB = 10_000
"""Events kept per job: the first EVENTS_HEAD, a note of how many were cut, then the latest."""
EVENTS_HEAD = 100
MAX_ATTEMPTS_KEPT = 100
"""Attempt summaries kept per job: the first, a note of how many were cut, then the latest."""
MAX_FAILURES_PER_ATTEMPT = 32
"""Failures an attempt's summary keeps (root cause first); the count of the rest is said."""
MAX_NODES_NAMED = 8
"""Nodes a round's text names; the rest are counted ("... and 9,992 more")."""
MAX_NODES_KEPT = 1_000
"""Nodes an attempt's summary lists."""


class JobNotFound(KeyError):
    """No job has this id."""


class NodeIsLive(ValueError):
    """A request that only a lost node allows named a live one."""


class NodeNameInUse(ValueError):
    """A different live agent already uses this node name; with `grace_left`, the name is kept
    for an agent that may still come back within that many seconds (a reconnect grace)."""

    def __init__(self, message: str, grace_left: float | None = None) -> None:
        super().__init__(message)
        self.grace_left = grace_left


WorkerExitReport = WorkerExit
"""One worker's exit as its agent saw it (the node protocol's one exit type)."""
RunningGroupReport = RunningGroup
"""What a (re)connecting agent still holds for one job round."""


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
    notice: bool = False
    """A drain's stop: the workers get a preemption notice at once, SIGTERM `term_after`
    seconds later (unless they all left by then), SIGKILL `grace` after that."""
    term_after: float = 0.0
    drain_node: str = ""
    """The node whose drain stops the round (with `notice`)."""


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
class DrainAccepted:
    """Tell the agent of this session that the drain it asked for is recorded (after the
    stops of its rounds)."""

    node: str
    incarnation: str
    deadline: float | None


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


@dataclass(frozen=True)
class StallDetected:
    """A job's round is stalled (`coordinator._cluster_stalls`): the ranks behind, and their
    nodes, in the same order. Neither written nor sent: the service's hook for what a stall
    asks of the nodes besides the job's stall_action (capturing every rank's stack)."""

    job_id: str
    round: int
    ranks: tuple[int, ...]
    nodes: tuple[str, ...]


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
    | DrainAccepted
    | StallDetected
)

Change = JobChanged | EventRecorded | EventsCut | Forgotten | NodeChanged | CloseSession
"""An effect on what the store holds."""
Action = RequestPort | AssignRound | StopRound | ReleaseRound | CloseSession | DrainAccepted
"""An effect carried out on a node's session."""


class Ready(list[Effect]):
    """What one input to `Cluster` produced: its effects in the order they were made, split as
    a raft node's Ready is. `persist`, the changes to the stored state, is recorded first;
    `send`, what goes to the nodes' sessions, follows, each message held until the write that
    makes it safe. A CloseSession is in both (its node's record changes, and its session
    closes). A list, so that it can be read, compared and joined as the effects it holds."""

    @property
    def persist(self) -> tuple[Change, ...]:
        return tuple(
            e
            for e in self
            if isinstance(
                e, JobChanged | EventRecorded | EventsCut | Forgotten | NodeChanged | CloseSession
            )
        )

    @property
    def send(self) -> tuple[Action, ...]:
        return tuple(
            e
            for e in self
            if isinstance(
                e,
                RequestPort | AssignRound | StopRound | ReleaseRound | CloseSession | DrainAccepted,
            )
        )


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
    secret_digest: str = ""
    """Hash of the node secret of the agent that holds the name ("" = it sent none): a new
    process that proves the same secret takes the name over. Kept, never shown."""
    drain_reason: str = ""
    """Set while the node is drained: no new round goes there (see `_cluster_drain`)."""
    drain_deadline: float = 0.0
    """When the drain's workers are killed (0: each job's stop_grace from `drained_since`)."""
    drained_since: float = 0.0
    drain_incarnation: str = ""
    """The agent process that asked for the drain (SIGTERM); "" for an operator's drain. A new
    agent under the name lifts an agent's drain; an operator's stays until undrained."""

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
    if job.current.stop_kind == _StopKind.MEMBERSHIP:
        return True
    return job.current.stop_kind == _StopKind.FAILURE and job.attempt < job.spec.max_restarts


def _stop_round(job: _Job, node: str, reason: str, now: float) -> StopRound:
    """The stop of the job's round under way, for member `node`, as of `now`: with the job's
    stop_grace, or a drain's notice and what is left of its timeline."""
    r = job.current
    if not r.drain_node:
        return StopRound(node, job.job_id, job.round, job.spec.stop_grace, reason, _replaced(job))
    term = max(now, r.term_at)
    return StopRound(
        node,
        job.job_id,
        job.round,
        max(0.0, r.kill_at - term),
        reason,
        _replaced(job),
        notice=True,
        term_after=term - now,
        drain_node=r.drain_node,
    )


class _StopKind(enum.Enum):
    FAILURE = "failure"
    MEMBERSHIP = "membership"
    CANCEL = "cancel"
    INPUT = "input"
    """The spec itself cannot run (or a stall's action is "fail"): the job fails without
    spending its restart budget."""


@dataclass
class _Round:
    """One round of a job: formed whole by `_form`, dropped whole when the job goes back to the
    queue. Nothing of a round outlives it but its AttemptSummary (and, once the job ended, the
    last round itself, which its status shows)."""

    members: list[_Member] = field(default_factory=list)
    started_at: float = 0.0
    port_deadline: float | None = None
    """Set while the first member reserves the master port."""
    master_port: int = 0
    start_deadline: float | None = None
    """Set by the assignment; cleared when every worker of the round reported started."""
    stop_kind: _StopKind | None = None
    stop_reason: str = ""
    stop_deadline: float | None = None
    away_at_failure: tuple[str, ...] = ()
    """Members of the round whose node had no session (a coordinator that took over and has not
    heard from it yet) when the failure that stops the round came: should one of them turn out
    lost, the failure followed its loss and the round re-forms without spending a restart."""
    barrier_deadline: float | None = None
    drain_node: str = ""
    """Set when a drain of that node stops the round: its workers got a notice."""
    term_at: float = 0.0
    """With `drain_node`: when the workers get SIGTERM (a stop sent again keeps it)..."""
    kill_at: float = 0.0
    """... and when SIGKILL (the drain's deadline, or sooner: term_at + the job's grace)."""
    failures: dict[int, ProcessFailure] = field(default_factory=dict)
    return_values: dict[int, bytes] = field(default_factory=dict)


ROUND_FIELDS_BEFORE = {
    "members": "members",
    "round_started_at": "started_at",
    "port_deadline": "port_deadline",
    "master_port": "master_port",
    "start_deadline": "start_deadline",
    "stop_kind": "stop_kind",
    "stop_reason": "stop_reason",
    "stop_deadline": "stop_deadline",
    "away_at_failure": "away_at_failure",
    "barrier_deadline": "barrier_deadline",
    "failures": "failures",
    "return_values": "return_values",
}
"""Where a job record written before rounds were records of their own kept each round field
(its key there -> the `_Round` field)."""


def job_doc_with_round(doc: dict[str, Any]) -> dict[str, Any]:
    """A stored job record in today's form: one written with the round's fields beside the
    job's gets them gathered under `current`."""
    if not isinstance(doc, dict) or "current" in doc:
        return doc
    flat = dict(doc)
    flat["current"] = {new: flat.pop(old) for old, new in ROUND_FIELDS_BEFORE.items() if old in doc}
    return flat


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
    """The number of the round formed last (0: none yet)."""
    current: _Round = field(default_factory=_Round)
    """That round's state; an empty one before the first round and once a round was dropped."""
    last_call_deadline: float | None = None
    not_before: float = 0.0
    port_failures: int = 0
    attempts: list[AttemptSummary] = field(default_factory=list)
    finished_at: float = 0.0
    result: RunResult | None = None
    events: list[JobEvent] = field(default_factory=list)
    request_id: str = ""
    """The client's id for the submit that made this job (a retry returns this job)."""
    awaiting_write: bool = False
    """Submitted, not yet on disk: not scheduled until `confirm_written`, dropped by `withdraw`."""
    stacks: list[StackCapture] = field(default_factory=list)
    """The latest stack captures of the job's ranks (`coordinator._cluster_stacks`)."""

    def member(self, node: str) -> _Member | None:
        # Indexed: every node message looks its member up, and a round may have 10,000 of them.
        cached = self.__dict__.get("_member_index")
        if (
            cached is None
            or cached[0] is not self.current.members
            or len(cached[1]) != len(self.current.members)
        ):
            cached = (self.current.members, {m.node: m for m in self.current.members})
            self.__dict__["_member_index"] = cached
        found: _Member | None = cached[1].get(node)
        return found

    def unstarted(self) -> int:
        """Workers of the current round not started yet (kept as a count: asked on every start)."""
        cached = self.__dict__.get("_unstarted")
        if cached is None or cached[0] is not self.current.members:
            n = sum(
                1
                for m in self.current.members
                for w in m.workers.values()
                if w.phase == _WorkerPhase.INIT
            )
            cached = [self.current.members, n]
            self.__dict__["_unstarted"] = cached
        return int(cached[1])

    def pending_count(self) -> int:
        """Members not done yet (a count kept up to date: asked whenever a node finishes)."""
        cached = self.__dict__.get("_pending")
        if cached is None or cached[0] is not self.current.members:
            cached = [self.current.members, sum(1 for m in self.current.members if not m.done)]
            self.__dict__["_pending"] = cached
        return int(cached[1])

    def note_done(self) -> None:
        cached = self.__dict__.get("_pending")
        if cached is not None and cached[0] is self.current.members:
            cached[1] -= 1

    def set_phase(self, w: _Worker, phase: _WorkerPhase) -> None:
        if w.phase == phase:
            return
        cached = self.__dict__.get("_unstarted")
        if cached is not None and cached[0] is self.current.members:
            if w.phase == _WorkerPhase.INIT:
                cached[1] -= 1
            elif phase == _WorkerPhase.INIT:
                cached[1] += 1
        w.phase = phase
