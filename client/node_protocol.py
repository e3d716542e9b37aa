"""The node session's messages, as typed values: what an agent and its coordinator say.

One dataclass per message of the `NodeSession` stream (`protos/gelastic/v1/gelastic.proto`),
pure data with no transport: the coordinator's decision code takes `NodeMsg` values
(`Cluster.step`) and the agent's core makes them. `client.node_codec` is the one place that turns
them into protobuf messages and back.

Agent to coordinator: `Hello` (first, once), then `Heartbeat`, `PortReserved`, `WorkersStarted`,
`WorkerExited`, `WorkerFailing`, `GroupStopped`, `GroupUnknown`, `LogChunk`, `ClockReply`,
`DrainRequest`, `StackReply` and `ProgressReport`.
Coordinator to agent: `Welcome` (first, once), then `ReservePort`, `Assign`, `Stop`, `Release`,
`StartLogs`, `CancelLogs`, `LogCredit`, `ClockProbe`, `DrainAccepted` and `StackRequest`, each
under the leader
epoch of the coordinator that sent it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from client.assignment import RoundAssignment
from client.model import GpuDevice, GpuHealth, ProcessFailure, WorkerState

__all__ = [
    "Assign",
    "CancelLogs",
    "ClockProbe",
    "ClockReply",
    "CoordinatorMsg",
    "DrainAccepted",
    "DrainRequest",
    "GroupHealth",
    "GroupStopped",
    "GroupUnknown",
    "Heartbeat",
    "Hello",
    "LogChunk",
    "LogCredit",
    "NodeMsg",
    "PortReserved",
    "ProgressReport",
    "RankProgress",
    "Release",
    "ReservePort",
    "RoundMsg",
    "RunningGroup",
    "StackReply",
    "StackRequest",
    "StartLogs",
    "Stop",
    "TorchMetric",
    "Welcome",
    "WorkerExit",
    "WorkerExited",
    "WorkerFailing",
    "WorkerHealthSample",
    "WorkerStack",
    "WorkersStarted",
]


# ---- parts -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class WorkerExit:
    """One worker is gone: how, and what it left."""

    local_rank: int
    global_rank: int
    pid: int
    """0 when the worker could not be started."""
    exitcode: int
    """Negative = killed by that signal; 126/127 = could not be started."""
    stopped_by_agent: bool = False
    """The exit was caused by a stop of the agent's; it is neither a failure nor a result."""
    failure: ProcessFailure | None = None
    return_value: bytes | None = None
    """Pickled return value of a function entrypoint that succeeded (never unpickled here)."""
    timestamp: float = 0.0
    """When the agent observed the exit (seconds since the epoch)."""

    @property
    def succeeded(self) -> bool:
        return self.failure is None and not self.stopped_by_agent


@dataclass(frozen=True)
class RunningGroup:
    """What a (re)connecting agent still holds for one job round."""

    job_id: str
    round: int
    attempt: int
    pids: tuple[tuple[int, int], ...]
    """(local_rank, pid) of each worker started."""
    exits: tuple[WorkerExit, ...] = ()
    """The exits that happened, in order."""
    stopped: bool = False
    """Every worker is gone after a stop."""
    global_ranks: tuple[int, ...] = ()
    """The global rank of each of `pids`, in the same order; () when not said."""


@dataclass(frozen=True)
class WorkerHealthSample:
    """One worker's resource use, from one heartbeat."""

    local_rank: int
    pid: int
    cpu_percent: float
    rss_bytes: int
    proc_state: str
    """psutil's status: "running", "sleeping", "disk-sleep", "stopped", ..."""
    global_rank: int = -1


@dataclass(frozen=True)
class GroupHealth:
    """One round's workers on the node, from one heartbeat."""

    job_id: str
    round: int
    workers: tuple[WorkerHealthSample, ...] = ()
    state: WorkerState | None = None
    """None: not reported."""
    reason: str = ""
    """Why the state is what it is (UNHEALTHY, UNKNOWN)."""


# ---- agent to coordinator ------------------------------------------------------------------------


@dataclass(frozen=True)
class Hello:
    """The first message of a session: who the agent is, what it offers and still runs."""

    name: str
    addr: str
    slots: int
    incarnation: str
    """Unique per agent process."""
    version: str = ""
    running: tuple[RunningGroup, ...] = ()
    gpus: tuple[GpuDevice, ...] = ()
    node_secret: str = field(default="", repr=False)
    """Random, kept in the agent's state dir: a restarted agent proves with it that it is the
    same node ("" = none, an older agent). Never logged or shown; the coordinator keeps a hash."""


@dataclass(frozen=True)
class TorchMetric:
    """The latest value a job's workers put through torch.distributed.elastic.metrics."""

    job_id: str
    group: str
    name: str
    value: float


@dataclass(frozen=True)
class Heartbeat:
    seq: int = 0
    groups: tuple[GroupHealth, ...] = ()
    gpus: tuple[GpuHealth, ...] = ()
    health_problem: str = ""
    """Why the node's health-check plug-ins find it unhealthy ("" = healthy); at most
    MAX_HEALTH_PROBLEM characters."""
    torch_metrics: tuple[TorchMetric, ...] = ()
    """Series changed since the last heartbeat, of jobs with torch_metrics."""


@dataclass(frozen=True)
class PortReserved:
    """Group rank 0's agent found a free MASTER_PORT for the round (or says why not)."""

    job_id: str
    round: int
    port: int = 0
    error: str = ""


@dataclass(frozen=True)
class WorkersStarted:
    job_id: str
    round: int
    pids: tuple[tuple[int, int], ...] = ()
    """(local_rank, pid) of each worker started."""
    global_ranks: tuple[int, ...] = ()
    """The global rank of each of `pids`, in the same order; () when not said."""


@dataclass(frozen=True)
class WorkerExited:
    job_id: str
    round: int
    exit: WorkerExit


@dataclass(frozen=True)
class WorkerFailing:
    """A worker recorded its failure and is still tearing down; its exit follows."""

    job_id: str
    round: int
    failure: ProcessFailure
    """It names the worker: its local rank, global rank and pid."""

    @property
    def local_rank(self) -> int:
        return self.failure.local_rank


@dataclass(frozen=True)
class GroupStopped:
    job_id: str
    round: int
    unkillable_pids: tuple[int, ...] = ()
    """Pids that could not be killed (uninterruptible sleep): reported, never waited on."""


@dataclass(frozen=True)
class GroupUnknown:
    """The agent can no longer supervise the round's workers: it stopped what it could."""

    job_id: str
    round: int
    reason: str = ""


@dataclass(frozen=True)
class LogChunk:
    request_id: int
    data: bytes = b""
    eof: bool = False
    error: str = ""


@dataclass(frozen=True)
class ClockReply:
    """The answer to a `ClockProbe`, sent at once: with the probe's own time, the four times of
    an NTP exchange (`coordinator._clock_offset`)."""

    probe_sent_at: float
    """The probe's `sent_at`, echoed (the coordinator's clock)."""
    received_at: float
    """When the agent read the probe (its own clock, seconds since the epoch)."""
    sent_at: float
    """When the agent sent this answer (its own clock)."""


@dataclass(frozen=True)
class DrainRequest:
    """The agent asks to be drained (it got SIGTERM): its rounds are replaced on the other
    nodes, its workers stopped with a notice, and no new round comes to it."""

    deadline: float | None = None
    """Seconds its workers have until SIGKILL; None: each job's stop_grace."""
    reason: str = ""


@dataclass(frozen=True)
class WorkerStack:
    """One worker's stack, as its agent read it."""

    local_rank: int
    pid: int
    status: str
    """"ok", "ptrace_refused" (faulthandler wrote it to the worker's log), "error"."""
    text: str = ""
    note: str = ""


@dataclass(frozen=True)
class StackReply:
    """The answer to a `StackRequest`: one stack per worker asked for."""

    request_id: int
    stacks: tuple[WorkerStack, ...] = ()
    error: str = ""
    """Why none could be read ("" when they were)."""


@dataclass(frozen=True)
class RankProgress:
    """One rank's latest progress, as its worker reported it (`client.progress`)."""

    local_rank: int
    global_rank: int
    step: int
    steps_per_s: float = 0.0
    metrics: tuple[tuple[str, float], ...] = ()


@dataclass(frozen=True)
class ProgressReport:
    """The ranks of one round on the node whose progress changed since the agent's last report."""

    job_id: str
    round: int
    ranks: tuple[RankProgress, ...] = ()


NodeMsg = (
    Hello
    | Heartbeat
    | PortReserved
    | WorkersStarted
    | WorkerExited
    | WorkerFailing
    | GroupStopped
    | GroupUnknown
    | LogChunk
    | ClockReply
    | DrainRequest
    | StackReply
    | ProgressReport
)
"""Anything an agent sends."""

RoundMsg = (
    PortReserved | WorkersStarted | WorkerExited | WorkerFailing | GroupStopped | GroupUnknown
)
"""The messages about one job round: each names its job and round, and is fenced by them."""


# ---- coordinator to agent ------------------------------------------------------------------------


@dataclass(frozen=True)
class Welcome:
    heartbeat_interval: float
    """Seconds."""
    lease: float
    """Seconds without a message after which the coordinator counts the node lost."""
    coordinator_id: str = ""


@dataclass(frozen=True)
class ReservePort:
    job_id: str
    round: int


@dataclass(frozen=True)
class Assign:
    """Run this share of a round. The spec arrives as sent: the agent checks it before use."""

    assignment: RoundAssignment
    spec_error: str = ""
    """Why the spec could not be read (the assignment then holds an empty spec); "" when it was."""


@dataclass(frozen=True)
class Stop:
    job_id: str
    round: int
    grace: float
    """Seconds between SIGTERM and SIGKILL."""
    reason: str = ""
    replaced: bool = False
    """The round is stopped to be replaced by a new round of the same job (restart, re-form)."""
    notice: bool = False
    """A drain's stop: the workers get a preemption notice first (GELASTIC_PREEMPT_FILE)."""
    term_after: float = 0.0
    """With a notice: seconds the workers run on before SIGTERM, unless they all left first."""
    drain_node: str = ""
    """With a notice: the node whose drain stops the round."""


@dataclass(frozen=True)
class Release:
    """The exit barrier is passed: the node's group of the round may go."""

    job_id: str
    round: int


@dataclass(frozen=True)
class StartLogs:
    request_id: int
    job_id: str
    attempt: int
    rank: int
    stream: str
    follow: bool = False
    credit_chunks: int = 0
    """Chunks of data the agent may send before a LogCredit grants more (0: no limit)."""


@dataclass(frozen=True)
class CancelLogs:
    request_id: int


@dataclass(frozen=True)
class LogCredit:
    request_id: int
    chunks: int


@dataclass(frozen=True)
class ClockProbe:
    """A probe of the node's clock: answer at once with a `ClockReply`."""

    sent_at: float
    """The coordinator's clock, seconds since the epoch."""


@dataclass(frozen=True)
class DrainAccepted:
    """The coordinator recorded the drain its agent asked for; the stops it made came first."""

    deadline: float | None = None
    """Seconds the drain gives the workers; None: each job's stop_grace."""


@dataclass(frozen=True)
class StackRequest:
    """Read the stacks of the node's own workers of one round (no pid is ever named here)."""

    request_id: int
    job_id: str
    round: int
    local_ranks: tuple[int, ...] = ()
    """Empty: every worker of the round on the node."""
    native: bool = False
    timeout: float = 5.0
    """Seconds one worker's read may take."""


CoordinatorMsg = (
    Welcome
    | ReservePort
    | Assign
    | Stop
    | Release
    | StartLogs
    | CancelLogs
    | LogCredit
    | ClockProbe
    | DrainAccepted
    | StackRequest
)
"""Anything a coordinator sends."""
