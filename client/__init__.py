"""gelastic's public Python API: submit jobs, wait for their RunResult, read logs and events."""

from __future__ import annotations

import os as _os

# The agent forks workers; grpc's fork handlers would run in those children (between fork and
# exec) and abort them. gelastic never uses grpc across fork, so the handlers stay off.
_os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")


from typing import TYPE_CHECKING, Any

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
    Role,
    RunResult,
    SpecError,
    WorkerState,
    WorkerStatus,
)
from client.preempt import PreemptNotice, preempted
from client.progress import progress

if TYPE_CHECKING:
    from client._client import Client, GelasticError, Job, submit
    from client.security import Security

# The gRPC client loads on first use: the coordinator's decision code and a worker importing
# client.errors reach this package too, and they must not pay for (or depend on) grpc.
_LAZY = frozenset({"Client", "GelasticError", "Job", "submit"})


def __getattr__(name: str) -> Any:
    if name == "Security":
        from client.security import Security

        globals()[name] = Security
        return Security
    if name in _LAZY:
        from client import _client

        value = getattr(_client, name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'client' has no attribute {name!r}")


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
    "PreemptNotice",
    "ProcessFailure",
    "Role",
    "RunResult",
    "Security",
    "SpecError",
    "WorkerState",
    "WorkerStatus",
    "preempted",
    "progress",
    "submit",
]
