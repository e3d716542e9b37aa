"""What the coordinator tells an agent to run for one round: the ranks of its workers.

Pure data, built by the session from an `Assign` message; the launch plan is made from it.
"""

from __future__ import annotations

from dataclasses import dataclass

from client.model import JobSpec

__all__ = ["RoundAssignment", "WorkerRanks"]


@dataclass(frozen=True)
class WorkerRanks:
    """The ranks of one local worker in a round."""

    local_rank: int
    global_rank: int
    role_rank: int
    world_size: int
    role_world_size: int
    role: str = ""
    """ROLE_NAME; for a multi-role job, which of the spec's roles this node runs."""


@dataclass(frozen=True)
class RoundAssignment:
    """One node's share of a job round."""

    job_id: str
    round: int
    attempt: int
    """Failure restarts so far: TORCHELASTIC_RESTART_COUNT, the same on every node."""
    spec: JobSpec
    group_rank: int
    group_world_size: int
    master_addr: str
    master_port: int
    workers: tuple[WorkerRanks, ...]
    run_id: str
    gpus: tuple[int, ...] = ()
    """The node's GPUs (NVML indices) this round's workers hold, in local-rank order; () on a
    node without GPUs."""
    gpu_uuids: tuple[str, ...] = ()
    """Their uuids, in the same order: what CUDA_VISIBLE_DEVICES lists."""
