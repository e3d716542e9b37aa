"""gelastic's public Python API: submit jobs, wait for their RunResult, read logs and events."""

from __future__ import annotations

from client._client import Client, GelasticError, Job, submit
from client._model import (
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
    "Client",
    "GelasticError",
    "Job",
    "submit",
    "AttemptSummary",
    "FailureCategory",
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
]
