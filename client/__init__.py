"""gelastic's public Python API: submit jobs, wait for their RunResult, read logs and events."""

from __future__ import annotations

import os as _os

# The agent forks workers; grpc's fork handlers would run in those children (between fork and
# exec) and abort them. gelastic never uses grpc across fork, so the handlers stay off.
_os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")


from client._client import Client, GelasticError, Job, submit
from client.model import (
    AttemptSummary,
    FailureCategory,
    JobEvent,
    JobSpec,
    JobState,
    JobStatus,
    Member,
    NodeInfo,
    ProcessFailure,
    RunResult,
    SpecError,
    WorkerState,
    WorkerStatus,
)

__all__ = [
    "AttemptSummary",
    "Client",
    "FailureCategory",
    "GelasticError",
    "Job",
    "JobEvent",
    "JobSpec",
    "JobState",
    "JobStatus",
    "Member",
    "NodeInfo",
    "ProcessFailure",
    "RunResult",
    "SpecError",
    "WorkerState",
    "WorkerStatus",
    "submit",
]
