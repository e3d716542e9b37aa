"""What a job and the cluster look like now: the states of jobs and worker groups, and the
snapshots `job.status()`, `list_nodes()` and `events()` return.

`JobState` is a lifecycle with an explicit transition table (`can_become`).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


class WorkerState(enum.Enum):
    """torchelastic's worker-group states; a group changes state as a unit."""

    UNKNOWN = "UNKNOWN"
    INIT = "INIT"
    HEALTHY = "HEALTHY"
    UNHEALTHY = "UNHEALTHY"
    STOPPED = "STOPPED"
    SUCCEEDED = "SUCCEEDED"
    FAILED = "FAILED"

    def is_running(self) -> bool:
        return self in (WorkerState.HEALTHY, WorkerState.UNHEALTHY)


class JobState(enum.Enum):
    """Lifecycle of a job on the coordinator."""

    QUEUED = "QUEUED"
    RENDEZVOUS = "RENDEZVOUS"
    RUNNING = "RUNNING"
    STOPPING = "STOPPING"
    SUCCEEDED = "SUCCEEDED"
    FAILED = "FAILED"
    CANCELED = "CANCELED"

    def is_terminal(self) -> bool:
        return self in _TERMINAL

    def can_become(self, other: JobState) -> bool:
        return other in _JOB_TRANSITIONS[self]


_TERMINAL = frozenset({JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELED})
_JOB_TRANSITIONS: dict[JobState, frozenset[JobState]] = {
    JobState.QUEUED: frozenset({JobState.RENDEZVOUS, JobState.FAILED, JobState.CANCELED}),
    JobState.RENDEZVOUS: frozenset(
        {JobState.QUEUED, JobState.RUNNING, JobState.STOPPING, JobState.FAILED, JobState.CANCELED}
    ),
    JobState.RUNNING: frozenset(
        {JobState.STOPPING, JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELED}
    ),
    JobState.STOPPING: frozenset(
        {JobState.QUEUED, JobState.FAILED, JobState.CANCELED, JobState.SUCCEEDED}
    ),
    JobState.SUCCEEDED: frozenset(),
    JobState.FAILED: frozenset(),
    JobState.CANCELED: frozenset(),
}


@dataclass(frozen=True)
class Member:
    node: str
    addr: str
    group_rank: int
    nproc: int
    done: bool = False
    role: str = ""
    """The role whose group runs on this node."""
    group_state: WorkerState | None = None
    """The node's worker group as a unit (INIT while starting, HEALTHY, UNHEALTHY, STOPPED,
    SUCCEEDED, FAILED, UNKNOWN: its agent could no longer supervise it); None = not reported."""


@dataclass(frozen=True)
class GpuDevice:
    """One GPU a node offers, as its agent found it through NVML."""

    index: int
    """NVML index on its node."""
    uuid: str
    name: str
    memory_total: int
    """Bytes."""


@dataclass(frozen=True)
class GpuHealth:
    """The latest sample of one GPU, from its node's heartbeat."""

    index: int
    utilization_percent: float = 0.0
    memory_used: int = 0
    """Bytes."""
    temperature_c: int = 0
    uncorrectable_ecc: int = 0
    """Volatile uncorrected ECC errors since the driver loaded (0 when not supported)."""
    lost: bool = False
    """The GPU fell off the bus, or NVML can no longer read it."""


@dataclass(frozen=True)
class WorkerGpu:
    """The GPU one rank holds (device LOCAL_RANK of its CUDA_VISIBLE_DEVICES), and its state."""

    index: int
    uuid: str
    utilization_percent: float = 0.0
    memory_used: int = 0
    memory_total: int = 0
    temperature_c: int = 0


@dataclass(frozen=True)
class WorkerStatus:
    global_rank: int
    local_rank: int
    node: str
    state: WorkerState
    pid: int = 0
    cpu_percent: float = 0.0
    rss_bytes: int = 0
    proc_state: str = ""
    exitcode: int | None = None
    role: str = ""
    role_rank: int = 0
    """Rank among the workers of its role (ROLE_RANK)."""
    world_size: int = 0
    """Workers of the round, all roles (WORLD_SIZE)."""
    role_world_size: int = 0
    """Workers of its role in the round (ROLE_WORLD_SIZE)."""
    gpu: WorkerGpu | None = None
    """None on a node without GPUs."""
    step: int | None = None
    """The step the rank last reported (`client.progress`); None: it never reported one."""
    steps_per_s: float = 0.0
    """Its steps per second, as measured by the worker over about a second."""
    last_step_age: float | None = None
    """Seconds since its step last advanced (None: no step reported)."""
    metrics: dict[str, float] = field(default_factory=dict)
    """The metrics it reported with its step (`progress(step, loss=...)`)."""
    behind: bool = False
    """The job's current stall names this rank as behind."""
    straggler: bool = False
    """Flagged a straggler: slower than the median rank by the job's straggler_factor."""


@dataclass(frozen=True)
class JobStatus:
    """A snapshot of a job, as `job.status()` returns it."""

    job_id: str
    name: str
    state: JobState
    reason: str
    attempt: int
    round: int
    max_restarts: int
    min_nodes: int
    max_nodes: int
    members: tuple[Member, ...] = ()
    workers: tuple[WorkerStatus, ...] = ()
    nodes_joined: int = 0
    last_call_deadline: float = 0.0
    world_size: int = 0
    submitted_at: float = 0.0
    finished_at: float = 0.0
    stall_reason: str = ""
    """Set while the job is stalled (`JobSpec.stall_timeout`): why, naming the ranks behind."""
    stalled_since: float = 0.0

    @property
    def stalled(self) -> bool:
        return bool(self.stall_reason)


@dataclass(frozen=True)
class NodeInfo:
    name: str
    addr: str
    slots: int
    slots_used: int
    state: str
    last_seen: float
    jobs: tuple[str, ...] = ()
    incarnation: str = ""
    gpus: tuple[GpuDevice, ...] = ()
    gpu_health: tuple[GpuHealth, ...] = ()
    gpus_used: tuple[int, ...] = ()
    """Indices of the GPUs jobs' rounds hold."""
    quarantine_reason: str = ""
    """Why the node is quarantined (state "quarantined"): no new round is placed there."""
    quarantined_until: float = 0.0
    """When the quarantine ends by itself (seconds since the epoch), unless cleared first."""
    clock_offset: float = 0.0
    """Seconds the node's clock is ahead of the coordinator's (negative: behind), as the
    coordinator measures it over the node's session; failures' times are corrected by it."""
    clock_uncertainty: float = 0.0
    """+/- seconds of `clock_offset`; 0.0 when it is not measured (yet)."""
    drain_reason: str = ""
    """Why the node is drained (state "draining" while workers of its rounds still run there,
    "drained" once none does): no new round is placed there until it is undrained."""
    drain_deadline: float = 0.0
    """When the drain's workers are killed (seconds since the epoch); 0: each job's
    stop_grace after the drain began."""
    drained_since: float = 0.0
    """When the drain began (seconds since the epoch)."""
    drain_by_agent: bool = False
    """Its agent asked for the drain (a SIGTERM): a new agent under the name lifts it."""


@dataclass(frozen=True)
class JobEvent:
    """One entry of a job's timeline."""

    seq: int
    job_id: str
    timestamp: float
    kind: str
    reason: str
    attempt: int = 0
    round: int = 0
    node: str = ""
    rank: int = -1
