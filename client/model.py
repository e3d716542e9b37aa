"""The domain types every part of gelastic shares: job specs, states, failures and results.

Pure data, validation and the failure table's text only: nothing here imports grpc or the
generated protos, so the coordinator's decision code, the node agent and the client all speak
these types. This is their public home; they live, by concern, in

- `client._spec`: `JobSpec` and `Role`, their checks and the roles' JSON form;
- `client._spec_fields`: the spec's limits, the checks of its fields, `SpecError`;
- `client._spec_function`: a function entrypoint's reference and its arguments' checks;
- `client._status`: job and worker states, and the snapshots of jobs, nodes and events;
- `client._outcome`: `RunResult`, its failures and attempts, and the failure table;
- `client._failure_order`: which failure is the root cause when their times are uncertain.

The limits the spec checks that are not in `__all__` (`MAX_NODES`, `MAX_STRING`, ...) and
`function_reference` are importable from here too.
"""

from __future__ import annotations

from client._failure_order import is_collective_error, order_note
from client._outcome import (
    AttemptSummary,
    FailureCategory,
    ProcessFailure,
    RunResult,
    executable_note,
    first_failure,
    format_failures,
    signal_message,
    signal_name,
)
from client._spec import JobSpec, Role, roles_from_json
from client._spec_fields import MAX_ARGV_ITEMS as MAX_ARGV_ITEMS
from client._spec_fields import MAX_ENV_ITEMS as MAX_ENV_ITEMS
from client._spec_fields import MAX_FUNCTION_ARGS_BYTES as MAX_FUNCTION_ARGS_BYTES
from client._spec_fields import MAX_NODES as MAX_NODES
from client._spec_fields import MAX_NPROC_PER_NODE as MAX_NPROC_PER_NODE
from client._spec_fields import MAX_PRELOAD as MAX_PRELOAD
from client._spec_fields import MAX_RESTARTS as MAX_RESTARTS
from client._spec_fields import (
    MAX_RESULT_BYTES_PER_JOB,
    MAX_RETURN_VALUE_BYTES,
    MAX_ROLES,
    MAX_SPEC_BYTES,
    MAX_STANDBY_LINGER_S,
    RESULT_KEY_BYTES,
    GelasticError,
    SpecError,
    is_function_reference,
    is_host,
    is_job_id,
    is_name,
    parse_restart_policy,
    parse_std_mapping,
    std_form,
)
from client._spec_fields import MAX_STRING as MAX_STRING
from client._spec_fields import MAX_TIMEOUT_S as MAX_TIMEOUT_S
from client._spec_function import MAX_MAIN_PATH as MAX_MAIN_PATH
from client._spec_function import function_reference as function_reference
from client._status import (
    GpuDevice,
    GpuHealth,
    JobEvent,
    JobState,
    JobStatus,
    Member,
    NodeInfo,
    WorkerGpu,
    WorkerState,
    WorkerStatus,
)

__all__ = [
    "MAX_RESULT_BYTES_PER_JOB",
    "MAX_RETURN_VALUE_BYTES",
    "MAX_ROLES",
    "MAX_SPEC_BYTES",
    "MAX_STANDBY_LINGER_S",
    "RESULT_KEY_BYTES",
    "AttemptSummary",
    "FailureCategory",
    "GelasticError",
    "GpuDevice",
    "GpuHealth",
    "JobEvent",
    "JobSpec",
    "JobState",
    "JobStatus",
    "Member",
    "NodeInfo",
    "ProcessFailure",
    "Role",
    "RunResult",
    "SpecError",
    "WorkerGpu",
    "WorkerState",
    "WorkerStatus",
    "executable_note",
    "first_failure",
    "format_failures",
    "is_collective_error",
    "is_function_reference",
    "is_host",
    "is_job_id",
    "is_name",
    "order_note",
    "parse_restart_policy",
    "parse_std_mapping",
    "roles_from_json",
    "signal_message",
    "signal_name",
    "std_form",
]
