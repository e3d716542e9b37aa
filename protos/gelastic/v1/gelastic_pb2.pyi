from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class JobState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    JOB_STATE_UNSPECIFIED: _ClassVar[JobState]
    JOB_STATE_QUEUED: _ClassVar[JobState]
    JOB_STATE_RENDEZVOUS: _ClassVar[JobState]
    JOB_STATE_RUNNING: _ClassVar[JobState]
    JOB_STATE_STOPPING: _ClassVar[JobState]
    JOB_STATE_SUCCEEDED: _ClassVar[JobState]
    JOB_STATE_FAILED: _ClassVar[JobState]
    JOB_STATE_CANCELED: _ClassVar[JobState]

class WorkerState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    WORKER_STATE_UNKNOWN: _ClassVar[WorkerState]
    WORKER_STATE_INIT: _ClassVar[WorkerState]
    WORKER_STATE_HEALTHY: _ClassVar[WorkerState]
    WORKER_STATE_UNHEALTHY: _ClassVar[WorkerState]
    WORKER_STATE_STOPPED: _ClassVar[WorkerState]
    WORKER_STATE_SUCCEEDED: _ClassVar[WorkerState]
    WORKER_STATE_FAILED: _ClassVar[WorkerState]

class GroupState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    GROUP_STATE_UNSPECIFIED: _ClassVar[GroupState]
    GROUP_STATE_INIT: _ClassVar[GroupState]
    GROUP_STATE_HEALTHY: _ClassVar[GroupState]
    GROUP_STATE_UNHEALTHY: _ClassVar[GroupState]
    GROUP_STATE_STOPPED: _ClassVar[GroupState]
    GROUP_STATE_SUCCEEDED: _ClassVar[GroupState]
    GROUP_STATE_FAILED: _ClassVar[GroupState]
    GROUP_STATE_UNKNOWN: _ClassVar[GroupState]

class FailureCategory(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FAILURE_CATEGORY_UNSPECIFIED: _ClassVar[FailureCategory]
    FAILURE_CATEGORY_USER: _ClassVar[FailureCategory]
    FAILURE_CATEGORY_PLATFORM: _ClassVar[FailureCategory]
    FAILURE_CATEGORY_INFRA: _ClassVar[FailureCategory]
    FAILURE_CATEGORY_INPUT: _ClassVar[FailureCategory]
    FAILURE_CATEGORY_HANG: _ClassVar[FailureCategory]
JOB_STATE_UNSPECIFIED: JobState
JOB_STATE_QUEUED: JobState
JOB_STATE_RENDEZVOUS: JobState
JOB_STATE_RUNNING: JobState
JOB_STATE_STOPPING: JobState
JOB_STATE_SUCCEEDED: JobState
JOB_STATE_FAILED: JobState
JOB_STATE_CANCELED: JobState
WORKER_STATE_UNKNOWN: WorkerState
WORKER_STATE_INIT: WorkerState
WORKER_STATE_HEALTHY: WorkerState
WORKER_STATE_UNHEALTHY: WorkerState
WORKER_STATE_STOPPED: WorkerState
WORKER_STATE_SUCCEEDED: WorkerState
WORKER_STATE_FAILED: WorkerState
GROUP_STATE_UNSPECIFIED: GroupState
GROUP_STATE_INIT: GroupState
GROUP_STATE_HEALTHY: GroupState
GROUP_STATE_UNHEALTHY: GroupState
GROUP_STATE_STOPPED: GroupState
GROUP_STATE_SUCCEEDED: GroupState
GROUP_STATE_FAILED: GroupState
GROUP_STATE_UNKNOWN: GroupState
FAILURE_CATEGORY_UNSPECIFIED: FailureCategory
FAILURE_CATEGORY_USER: FailureCategory
FAILURE_CATEGORY_PLATFORM: FailureCategory
FAILURE_CATEGORY_INFRA: FailureCategory
FAILURE_CATEGORY_INPUT: FailureCategory
FAILURE_CATEGORY_HANG: FailureCategory

class JobSpec(_message.Message):
    __slots__ = ("name", "role", "entrypoint", "function", "main_path", "args", "function_args", "nproc_per_node", "min_nodes", "max_nodes", "max_restarts", "env", "redirects", "tee", "join_timeout_ms", "last_call_timeout_ms", "exit_barrier_timeout_ms", "stop_grace_ms", "restart_backoff_ms", "scale_up", "watchdog", "cwd", "stderr_tail_lines", "unhealthy_timeout_ms", "result_key", "preload", "standby_linger_ms", "master_addr", "master_port", "roles", "wait_for_nodes", "restart_policy", "stall_timeout_ms", "stall_action", "straggler_factor", "straggler_window_ms", "torch_metrics")
    class EnvEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    NAME_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    ENTRYPOINT_FIELD_NUMBER: _ClassVar[int]
    FUNCTION_FIELD_NUMBER: _ClassVar[int]
    MAIN_PATH_FIELD_NUMBER: _ClassVar[int]
    ARGS_FIELD_NUMBER: _ClassVar[int]
    FUNCTION_ARGS_FIELD_NUMBER: _ClassVar[int]
    NPROC_PER_NODE_FIELD_NUMBER: _ClassVar[int]
    MIN_NODES_FIELD_NUMBER: _ClassVar[int]
    MAX_NODES_FIELD_NUMBER: _ClassVar[int]
    MAX_RESTARTS_FIELD_NUMBER: _ClassVar[int]
    ENV_FIELD_NUMBER: _ClassVar[int]
    REDIRECTS_FIELD_NUMBER: _ClassVar[int]
    TEE_FIELD_NUMBER: _ClassVar[int]
    JOIN_TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    LAST_CALL_TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    EXIT_BARRIER_TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    STOP_GRACE_MS_FIELD_NUMBER: _ClassVar[int]
    RESTART_BACKOFF_MS_FIELD_NUMBER: _ClassVar[int]
    SCALE_UP_FIELD_NUMBER: _ClassVar[int]
    WATCHDOG_FIELD_NUMBER: _ClassVar[int]
    CWD_FIELD_NUMBER: _ClassVar[int]
    STDERR_TAIL_LINES_FIELD_NUMBER: _ClassVar[int]
    UNHEALTHY_TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    RESULT_KEY_FIELD_NUMBER: _ClassVar[int]
    PRELOAD_FIELD_NUMBER: _ClassVar[int]
    STANDBY_LINGER_MS_FIELD_NUMBER: _ClassVar[int]
    MASTER_ADDR_FIELD_NUMBER: _ClassVar[int]
    MASTER_PORT_FIELD_NUMBER: _ClassVar[int]
    ROLES_FIELD_NUMBER: _ClassVar[int]
    WAIT_FOR_NODES_FIELD_NUMBER: _ClassVar[int]
    RESTART_POLICY_FIELD_NUMBER: _ClassVar[int]
    STALL_TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    STALL_ACTION_FIELD_NUMBER: _ClassVar[int]
    STRAGGLER_FACTOR_FIELD_NUMBER: _ClassVar[int]
    STRAGGLER_WINDOW_MS_FIELD_NUMBER: _ClassVar[int]
    TORCH_METRICS_FIELD_NUMBER: _ClassVar[int]
    name: str
    role: str
    entrypoint: _containers.RepeatedScalarFieldContainer[str]
    function: str
    main_path: str
    args: _containers.RepeatedScalarFieldContainer[str]
    function_args: bytes
    nproc_per_node: int
    min_nodes: int
    max_nodes: int
    max_restarts: int
    env: _containers.ScalarMap[str, str]
    redirects: str
    tee: str
    join_timeout_ms: int
    last_call_timeout_ms: int
    exit_barrier_timeout_ms: int
    stop_grace_ms: int
    restart_backoff_ms: int
    scale_up: str
    watchdog: bool
    cwd: str
    stderr_tail_lines: int
    unhealthy_timeout_ms: int
    result_key: bytes
    preload: _containers.RepeatedScalarFieldContainer[str]
    standby_linger_ms: int
    master_addr: str
    master_port: int
    roles: _containers.RepeatedCompositeFieldContainer[Role]
    wait_for_nodes: bool
    restart_policy: str
    stall_timeout_ms: int
    stall_action: str
    straggler_factor: float
    straggler_window_ms: int
    torch_metrics: bool
    def __init__(self, name: _Optional[str] = ..., role: _Optional[str] = ..., entrypoint: _Optional[_Iterable[str]] = ..., function: _Optional[str] = ..., main_path: _Optional[str] = ..., args: _Optional[_Iterable[str]] = ..., function_args: _Optional[bytes] = ..., nproc_per_node: _Optional[int] = ..., min_nodes: _Optional[int] = ..., max_nodes: _Optional[int] = ..., max_restarts: _Optional[int] = ..., env: _Optional[_Mapping[str, str]] = ..., redirects: _Optional[str] = ..., tee: _Optional[str] = ..., join_timeout_ms: _Optional[int] = ..., last_call_timeout_ms: _Optional[int] = ..., exit_barrier_timeout_ms: _Optional[int] = ..., stop_grace_ms: _Optional[int] = ..., restart_backoff_ms: _Optional[int] = ..., scale_up: _Optional[str] = ..., watchdog: _Optional[bool] = ..., cwd: _Optional[str] = ..., stderr_tail_lines: _Optional[int] = ..., unhealthy_timeout_ms: _Optional[int] = ..., result_key: _Optional[bytes] = ..., preload: _Optional[_Iterable[str]] = ..., standby_linger_ms: _Optional[int] = ..., master_addr: _Optional[str] = ..., master_port: _Optional[int] = ..., roles: _Optional[_Iterable[_Union[Role, _Mapping]]] = ..., wait_for_nodes: _Optional[bool] = ..., restart_policy: _Optional[str] = ..., stall_timeout_ms: _Optional[int] = ..., stall_action: _Optional[str] = ..., straggler_factor: _Optional[float] = ..., straggler_window_ms: _Optional[int] = ..., torch_metrics: _Optional[bool] = ...) -> None: ...

class Role(_message.Message):
    __slots__ = ("name", "entrypoint", "args", "env", "nproc_per_node", "min_nodes", "max_nodes")
    class EnvEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    NAME_FIELD_NUMBER: _ClassVar[int]
    ENTRYPOINT_FIELD_NUMBER: _ClassVar[int]
    ARGS_FIELD_NUMBER: _ClassVar[int]
    ENV_FIELD_NUMBER: _ClassVar[int]
    NPROC_PER_NODE_FIELD_NUMBER: _ClassVar[int]
    MIN_NODES_FIELD_NUMBER: _ClassVar[int]
    MAX_NODES_FIELD_NUMBER: _ClassVar[int]
    name: str
    entrypoint: _containers.RepeatedScalarFieldContainer[str]
    args: _containers.RepeatedScalarFieldContainer[str]
    env: _containers.ScalarMap[str, str]
    nproc_per_node: int
    min_nodes: int
    max_nodes: int
    def __init__(self, name: _Optional[str] = ..., entrypoint: _Optional[_Iterable[str]] = ..., args: _Optional[_Iterable[str]] = ..., env: _Optional[_Mapping[str, str]] = ..., nproc_per_node: _Optional[int] = ..., min_nodes: _Optional[int] = ..., max_nodes: _Optional[int] = ...) -> None: ...

class ProcessFailure(_message.Message):
    __slots__ = ("node", "global_rank", "local_rank", "pid", "exitcode", "signal", "error_file", "message", "traceback", "timestamp", "attempt", "round", "root_cause", "category", "stderr_tail", "role_rank", "role", "clock_offset", "time_uncertainty", "executable", "detail")
    NODE_FIELD_NUMBER: _ClassVar[int]
    GLOBAL_RANK_FIELD_NUMBER: _ClassVar[int]
    LOCAL_RANK_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    EXITCODE_FIELD_NUMBER: _ClassVar[int]
    SIGNAL_FIELD_NUMBER: _ClassVar[int]
    ERROR_FILE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    TRACEBACK_FIELD_NUMBER: _ClassVar[int]
    TIMESTAMP_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    ROOT_CAUSE_FIELD_NUMBER: _ClassVar[int]
    CATEGORY_FIELD_NUMBER: _ClassVar[int]
    STDERR_TAIL_FIELD_NUMBER: _ClassVar[int]
    ROLE_RANK_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CLOCK_OFFSET_FIELD_NUMBER: _ClassVar[int]
    TIME_UNCERTAINTY_FIELD_NUMBER: _ClassVar[int]
    EXECUTABLE_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    node: str
    global_rank: int
    local_rank: int
    pid: int
    exitcode: int
    signal: str
    error_file: str
    message: str
    traceback: str
    timestamp: float
    attempt: int
    round: int
    root_cause: bool
    category: FailureCategory
    stderr_tail: str
    role_rank: int
    role: str
    clock_offset: float
    time_uncertainty: float
    executable: str
    detail: str
    def __init__(self, node: _Optional[str] = ..., global_rank: _Optional[int] = ..., local_rank: _Optional[int] = ..., pid: _Optional[int] = ..., exitcode: _Optional[int] = ..., signal: _Optional[str] = ..., error_file: _Optional[str] = ..., message: _Optional[str] = ..., traceback: _Optional[str] = ..., timestamp: _Optional[float] = ..., attempt: _Optional[int] = ..., round: _Optional[int] = ..., root_cause: _Optional[bool] = ..., category: _Optional[_Union[FailureCategory, str]] = ..., stderr_tail: _Optional[str] = ..., role_rank: _Optional[int] = ..., role: _Optional[str] = ..., clock_offset: _Optional[float] = ..., time_uncertainty: _Optional[float] = ..., executable: _Optional[str] = ..., detail: _Optional[str] = ...) -> None: ...

class AttemptSummary(_message.Message):
    __slots__ = ("attempt", "round", "nodes", "end_reason", "failures", "started_at", "ended_at")
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    NODES_FIELD_NUMBER: _ClassVar[int]
    END_REASON_FIELD_NUMBER: _ClassVar[int]
    FAILURES_FIELD_NUMBER: _ClassVar[int]
    STARTED_AT_FIELD_NUMBER: _ClassVar[int]
    ENDED_AT_FIELD_NUMBER: _ClassVar[int]
    attempt: int
    round: int
    nodes: _containers.RepeatedScalarFieldContainer[str]
    end_reason: str
    failures: _containers.RepeatedCompositeFieldContainer[ProcessFailure]
    started_at: float
    ended_at: float
    def __init__(self, attempt: _Optional[int] = ..., round: _Optional[int] = ..., nodes: _Optional[_Iterable[str]] = ..., end_reason: _Optional[str] = ..., failures: _Optional[_Iterable[_Union[ProcessFailure, _Mapping]]] = ..., started_at: _Optional[float] = ..., ended_at: _Optional[float] = ...) -> None: ...

class RunResult(_message.Message):
    __slots__ = ("state", "return_values", "failures", "root_cause_rank", "attempts", "reason", "return_value_sizes")
    class ReturnValuesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: bytes
        def __init__(self, key: _Optional[int] = ..., value: _Optional[bytes] = ...) -> None: ...
    class FailuresEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: ProcessFailure
        def __init__(self, key: _Optional[int] = ..., value: _Optional[_Union[ProcessFailure, _Mapping]] = ...) -> None: ...
    class ReturnValueSizesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: int
        def __init__(self, key: _Optional[int] = ..., value: _Optional[int] = ...) -> None: ...
    STATE_FIELD_NUMBER: _ClassVar[int]
    RETURN_VALUES_FIELD_NUMBER: _ClassVar[int]
    FAILURES_FIELD_NUMBER: _ClassVar[int]
    ROOT_CAUSE_RANK_FIELD_NUMBER: _ClassVar[int]
    ATTEMPTS_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    RETURN_VALUE_SIZES_FIELD_NUMBER: _ClassVar[int]
    state: WorkerState
    return_values: _containers.ScalarMap[int, bytes]
    failures: _containers.MessageMap[int, ProcessFailure]
    root_cause_rank: int
    attempts: _containers.RepeatedCompositeFieldContainer[AttemptSummary]
    reason: str
    return_value_sizes: _containers.ScalarMap[int, int]
    def __init__(self, state: _Optional[_Union[WorkerState, str]] = ..., return_values: _Optional[_Mapping[int, bytes]] = ..., failures: _Optional[_Mapping[int, ProcessFailure]] = ..., root_cause_rank: _Optional[int] = ..., attempts: _Optional[_Iterable[_Union[AttemptSummary, _Mapping]]] = ..., reason: _Optional[str] = ..., return_value_sizes: _Optional[_Mapping[int, int]] = ...) -> None: ...

class Member(_message.Message):
    __slots__ = ("node", "addr", "group_rank", "nproc", "done", "role", "group_state")
    NODE_FIELD_NUMBER: _ClassVar[int]
    ADDR_FIELD_NUMBER: _ClassVar[int]
    GROUP_RANK_FIELD_NUMBER: _ClassVar[int]
    NPROC_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    GROUP_STATE_FIELD_NUMBER: _ClassVar[int]
    node: str
    addr: str
    group_rank: int
    nproc: int
    done: bool
    role: str
    group_state: GroupState
    def __init__(self, node: _Optional[str] = ..., addr: _Optional[str] = ..., group_rank: _Optional[int] = ..., nproc: _Optional[int] = ..., done: _Optional[bool] = ..., role: _Optional[str] = ..., group_state: _Optional[_Union[GroupState, str]] = ...) -> None: ...

class WorkerStatus(_message.Message):
    __slots__ = ("global_rank", "local_rank", "node", "state", "pid", "cpu_percent", "rss_bytes", "proc_state", "exitcode", "role", "role_rank", "world_size", "role_world_size", "gpu_index", "gpu_uuid", "gpu_utilization_percent", "gpu_memory_used_bytes", "gpu_temperature_c", "gpu_memory_total_bytes", "has_progress", "step", "steps_per_s", "last_step_age_s", "metrics", "behind", "straggler")
    class MetricsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    GLOBAL_RANK_FIELD_NUMBER: _ClassVar[int]
    LOCAL_RANK_FIELD_NUMBER: _ClassVar[int]
    NODE_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    CPU_PERCENT_FIELD_NUMBER: _ClassVar[int]
    RSS_BYTES_FIELD_NUMBER: _ClassVar[int]
    PROC_STATE_FIELD_NUMBER: _ClassVar[int]
    EXITCODE_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    ROLE_RANK_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    ROLE_WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    GPU_INDEX_FIELD_NUMBER: _ClassVar[int]
    GPU_UUID_FIELD_NUMBER: _ClassVar[int]
    GPU_UTILIZATION_PERCENT_FIELD_NUMBER: _ClassVar[int]
    GPU_MEMORY_USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    GPU_TEMPERATURE_C_FIELD_NUMBER: _ClassVar[int]
    GPU_MEMORY_TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    HAS_PROGRESS_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    STEPS_PER_S_FIELD_NUMBER: _ClassVar[int]
    LAST_STEP_AGE_S_FIELD_NUMBER: _ClassVar[int]
    METRICS_FIELD_NUMBER: _ClassVar[int]
    BEHIND_FIELD_NUMBER: _ClassVar[int]
    STRAGGLER_FIELD_NUMBER: _ClassVar[int]
    global_rank: int
    local_rank: int
    node: str
    state: WorkerState
    pid: int
    cpu_percent: float
    rss_bytes: int
    proc_state: str
    exitcode: int
    role: str
    role_rank: int
    world_size: int
    role_world_size: int
    gpu_index: int
    gpu_uuid: str
    gpu_utilization_percent: float
    gpu_memory_used_bytes: int
    gpu_temperature_c: int
    gpu_memory_total_bytes: int
    has_progress: bool
    step: int
    steps_per_s: float
    last_step_age_s: float
    metrics: _containers.ScalarMap[str, float]
    behind: bool
    straggler: bool
    def __init__(self, global_rank: _Optional[int] = ..., local_rank: _Optional[int] = ..., node: _Optional[str] = ..., state: _Optional[_Union[WorkerState, str]] = ..., pid: _Optional[int] = ..., cpu_percent: _Optional[float] = ..., rss_bytes: _Optional[int] = ..., proc_state: _Optional[str] = ..., exitcode: _Optional[int] = ..., role: _Optional[str] = ..., role_rank: _Optional[int] = ..., world_size: _Optional[int] = ..., role_world_size: _Optional[int] = ..., gpu_index: _Optional[int] = ..., gpu_uuid: _Optional[str] = ..., gpu_utilization_percent: _Optional[float] = ..., gpu_memory_used_bytes: _Optional[int] = ..., gpu_temperature_c: _Optional[int] = ..., gpu_memory_total_bytes: _Optional[int] = ..., has_progress: _Optional[bool] = ..., step: _Optional[int] = ..., steps_per_s: _Optional[float] = ..., last_step_age_s: _Optional[float] = ..., metrics: _Optional[_Mapping[str, float]] = ..., behind: _Optional[bool] = ..., straggler: _Optional[bool] = ...) -> None: ...

class Job(_message.Message):
    __slots__ = ("job_id", "name", "state", "reason", "attempt", "round", "max_restarts", "members", "workers", "spec", "result", "has_result", "submitted_at", "finished_at", "min_nodes", "max_nodes", "nodes_joined", "last_call_deadline", "world_size", "stall_reason", "stalled_since")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    MAX_RESTARTS_FIELD_NUMBER: _ClassVar[int]
    MEMBERS_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    SPEC_FIELD_NUMBER: _ClassVar[int]
    RESULT_FIELD_NUMBER: _ClassVar[int]
    HAS_RESULT_FIELD_NUMBER: _ClassVar[int]
    SUBMITTED_AT_FIELD_NUMBER: _ClassVar[int]
    FINISHED_AT_FIELD_NUMBER: _ClassVar[int]
    MIN_NODES_FIELD_NUMBER: _ClassVar[int]
    MAX_NODES_FIELD_NUMBER: _ClassVar[int]
    NODES_JOINED_FIELD_NUMBER: _ClassVar[int]
    LAST_CALL_DEADLINE_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    STALL_REASON_FIELD_NUMBER: _ClassVar[int]
    STALLED_SINCE_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    name: str
    state: JobState
    reason: str
    attempt: int
    round: int
    max_restarts: int
    members: _containers.RepeatedCompositeFieldContainer[Member]
    workers: _containers.RepeatedCompositeFieldContainer[WorkerStatus]
    spec: JobSpec
    result: RunResult
    has_result: bool
    submitted_at: float
    finished_at: float
    min_nodes: int
    max_nodes: int
    nodes_joined: int
    last_call_deadline: float
    world_size: int
    stall_reason: str
    stalled_since: float
    def __init__(self, job_id: _Optional[str] = ..., name: _Optional[str] = ..., state: _Optional[_Union[JobState, str]] = ..., reason: _Optional[str] = ..., attempt: _Optional[int] = ..., round: _Optional[int] = ..., max_restarts: _Optional[int] = ..., members: _Optional[_Iterable[_Union[Member, _Mapping]]] = ..., workers: _Optional[_Iterable[_Union[WorkerStatus, _Mapping]]] = ..., spec: _Optional[_Union[JobSpec, _Mapping]] = ..., result: _Optional[_Union[RunResult, _Mapping]] = ..., has_result: _Optional[bool] = ..., submitted_at: _Optional[float] = ..., finished_at: _Optional[float] = ..., min_nodes: _Optional[int] = ..., max_nodes: _Optional[int] = ..., nodes_joined: _Optional[int] = ..., last_call_deadline: _Optional[float] = ..., world_size: _Optional[int] = ..., stall_reason: _Optional[str] = ..., stalled_since: _Optional[float] = ...) -> None: ...

class Node(_message.Message):
    __slots__ = ("name", "addr", "slots", "slots_used", "state", "last_seen", "jobs", "incarnation", "quarantine_reason", "quarantined_until", "gpus", "gpu_health", "gpus_used", "drain_reason", "drain_deadline", "drained_since", "drain_by_agent", "clock_offset", "clock_uncertainty")
    NAME_FIELD_NUMBER: _ClassVar[int]
    ADDR_FIELD_NUMBER: _ClassVar[int]
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    SLOTS_USED_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    LAST_SEEN_FIELD_NUMBER: _ClassVar[int]
    JOBS_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    QUARANTINE_REASON_FIELD_NUMBER: _ClassVar[int]
    QUARANTINED_UNTIL_FIELD_NUMBER: _ClassVar[int]
    GPUS_FIELD_NUMBER: _ClassVar[int]
    GPU_HEALTH_FIELD_NUMBER: _ClassVar[int]
    GPUS_USED_FIELD_NUMBER: _ClassVar[int]
    DRAIN_REASON_FIELD_NUMBER: _ClassVar[int]
    DRAIN_DEADLINE_FIELD_NUMBER: _ClassVar[int]
    DRAINED_SINCE_FIELD_NUMBER: _ClassVar[int]
    DRAIN_BY_AGENT_FIELD_NUMBER: _ClassVar[int]
    CLOCK_OFFSET_FIELD_NUMBER: _ClassVar[int]
    CLOCK_UNCERTAINTY_FIELD_NUMBER: _ClassVar[int]
    name: str
    addr: str
    slots: int
    slots_used: int
    state: str
    last_seen: float
    jobs: _containers.RepeatedScalarFieldContainer[str]
    incarnation: str
    quarantine_reason: str
    quarantined_until: float
    gpus: _containers.RepeatedCompositeFieldContainer[GpuDevice]
    gpu_health: _containers.RepeatedCompositeFieldContainer[GpuHealth]
    gpus_used: _containers.RepeatedScalarFieldContainer[int]
    drain_reason: str
    drain_deadline: float
    drained_since: float
    drain_by_agent: bool
    clock_offset: float
    clock_uncertainty: float
    def __init__(self, name: _Optional[str] = ..., addr: _Optional[str] = ..., slots: _Optional[int] = ..., slots_used: _Optional[int] = ..., state: _Optional[str] = ..., last_seen: _Optional[float] = ..., jobs: _Optional[_Iterable[str]] = ..., incarnation: _Optional[str] = ..., quarantine_reason: _Optional[str] = ..., quarantined_until: _Optional[float] = ..., gpus: _Optional[_Iterable[_Union[GpuDevice, _Mapping]]] = ..., gpu_health: _Optional[_Iterable[_Union[GpuHealth, _Mapping]]] = ..., gpus_used: _Optional[_Iterable[int]] = ..., drain_reason: _Optional[str] = ..., drain_deadline: _Optional[float] = ..., drained_since: _Optional[float] = ..., drain_by_agent: _Optional[bool] = ..., clock_offset: _Optional[float] = ..., clock_uncertainty: _Optional[float] = ...) -> None: ...

class GpuDevice(_message.Message):
    __slots__ = ("index", "uuid", "name", "memory_total")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    UUID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    MEMORY_TOTAL_FIELD_NUMBER: _ClassVar[int]
    index: int
    uuid: str
    name: str
    memory_total: int
    def __init__(self, index: _Optional[int] = ..., uuid: _Optional[str] = ..., name: _Optional[str] = ..., memory_total: _Optional[int] = ...) -> None: ...

class GpuHealth(_message.Message):
    __slots__ = ("index", "utilization_percent", "memory_used", "temperature_c", "uncorrectable_ecc", "lost")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    UTILIZATION_PERCENT_FIELD_NUMBER: _ClassVar[int]
    MEMORY_USED_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_C_FIELD_NUMBER: _ClassVar[int]
    UNCORRECTABLE_ECC_FIELD_NUMBER: _ClassVar[int]
    LOST_FIELD_NUMBER: _ClassVar[int]
    index: int
    utilization_percent: float
    memory_used: int
    temperature_c: int
    uncorrectable_ecc: int
    lost: bool
    def __init__(self, index: _Optional[int] = ..., utilization_percent: _Optional[float] = ..., memory_used: _Optional[int] = ..., temperature_c: _Optional[int] = ..., uncorrectable_ecc: _Optional[int] = ..., lost: _Optional[bool] = ...) -> None: ...

class Event(_message.Message):
    __slots__ = ("seq", "job_id", "timestamp", "kind", "reason", "attempt", "round", "node", "rank")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    TIMESTAMP_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    NODE_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    seq: int
    job_id: str
    timestamp: float
    kind: str
    reason: str
    attempt: int
    round: int
    node: str
    rank: int
    def __init__(self, seq: _Optional[int] = ..., job_id: _Optional[str] = ..., timestamp: _Optional[float] = ..., kind: _Optional[str] = ..., reason: _Optional[str] = ..., attempt: _Optional[int] = ..., round: _Optional[int] = ..., node: _Optional[str] = ..., rank: _Optional[int] = ...) -> None: ...

class StackGroup(_message.Message):
    __slots__ = ("status", "text", "note", "ranks", "nodes")
    STATUS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    NOTE_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    NODES_FIELD_NUMBER: _ClassVar[int]
    status: str
    text: str
    note: str
    ranks: _containers.RepeatedScalarFieldContainer[int]
    nodes: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, status: _Optional[str] = ..., text: _Optional[str] = ..., note: _Optional[str] = ..., ranks: _Optional[_Iterable[int]] = ..., nodes: _Optional[_Iterable[str]] = ...) -> None: ...

class StackCapture(_message.Message):
    __slots__ = ("capture_id", "job_id", "reason", "taken_at", "native", "attempt", "round", "groups")
    CAPTURE_ID_FIELD_NUMBER: _ClassVar[int]
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    TAKEN_AT_FIELD_NUMBER: _ClassVar[int]
    NATIVE_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    GROUPS_FIELD_NUMBER: _ClassVar[int]
    capture_id: str
    job_id: str
    reason: str
    taken_at: float
    native: bool
    attempt: int
    round: int
    groups: _containers.RepeatedCompositeFieldContainer[StackGroup]
    def __init__(self, capture_id: _Optional[str] = ..., job_id: _Optional[str] = ..., reason: _Optional[str] = ..., taken_at: _Optional[float] = ..., native: _Optional[bool] = ..., attempt: _Optional[int] = ..., round: _Optional[int] = ..., groups: _Optional[_Iterable[_Union[StackGroup, _Mapping]]] = ...) -> None: ...

class CaptureStacksRequest(_message.Message):
    __slots__ = ("job_id", "rank", "native", "timeout_ms")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    NATIVE_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    rank: int
    native: bool
    timeout_ms: int
    def __init__(self, job_id: _Optional[str] = ..., rank: _Optional[int] = ..., native: _Optional[bool] = ..., timeout_ms: _Optional[int] = ...) -> None: ...

class GetStacksRequest(_message.Message):
    __slots__ = ("job_id", "capture_id")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    CAPTURE_ID_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    capture_id: str
    def __init__(self, job_id: _Optional[str] = ..., capture_id: _Optional[str] = ...) -> None: ...

class GetStacksResponse(_message.Message):
    __slots__ = ("captures",)
    CAPTURES_FIELD_NUMBER: _ClassVar[int]
    captures: _containers.RepeatedCompositeFieldContainer[StackCapture]
    def __init__(self, captures: _Optional[_Iterable[_Union[StackCapture, _Mapping]]] = ...) -> None: ...

class SubmitRequest(_message.Message):
    __slots__ = ("spec", "request_id")
    SPEC_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    spec: JobSpec
    request_id: str
    def __init__(self, spec: _Optional[_Union[JobSpec, _Mapping]] = ..., request_id: _Optional[str] = ...) -> None: ...

class SubmitResponse(_message.Message):
    __slots__ = ("job_id",)
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    def __init__(self, job_id: _Optional[str] = ...) -> None: ...

class GetJobRequest(_message.Message):
    __slots__ = ("job_id",)
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    def __init__(self, job_id: _Optional[str] = ...) -> None: ...

class WatchJobRequest(_message.Message):
    __slots__ = ("job_id",)
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    def __init__(self, job_id: _Optional[str] = ...) -> None: ...

class JobUpdate(_message.Message):
    __slots__ = ("job", "events")
    JOB_FIELD_NUMBER: _ClassVar[int]
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    job: Job
    events: _containers.RepeatedCompositeFieldContainer[Event]
    def __init__(self, job: _Optional[_Union[Job, _Mapping]] = ..., events: _Optional[_Iterable[_Union[Event, _Mapping]]] = ...) -> None: ...

class ListJobsRequest(_message.Message):
    __slots__ = ("include_finished", "page_size", "page_token")
    INCLUDE_FINISHED_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    include_finished: bool
    page_size: int
    page_token: str
    def __init__(self, include_finished: _Optional[bool] = ..., page_size: _Optional[int] = ..., page_token: _Optional[str] = ...) -> None: ...

class ListJobsResponse(_message.Message):
    __slots__ = ("jobs", "next_page_token")
    JOBS_FIELD_NUMBER: _ClassVar[int]
    NEXT_PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    jobs: _containers.RepeatedCompositeFieldContainer[Job]
    next_page_token: str
    def __init__(self, jobs: _Optional[_Iterable[_Union[Job, _Mapping]]] = ..., next_page_token: _Optional[str] = ...) -> None: ...

class ListNodesRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetDashboardRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetDashboardResponse(_message.Message):
    __slots__ = ("serving", "scheme", "host", "port")
    SERVING_FIELD_NUMBER: _ClassVar[int]
    SCHEME_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    PORT_FIELD_NUMBER: _ClassVar[int]
    serving: bool
    scheme: str
    host: str
    port: int
    def __init__(self, serving: _Optional[bool] = ..., scheme: _Optional[str] = ..., host: _Optional[str] = ..., port: _Optional[int] = ...) -> None: ...

class ListNodesResponse(_message.Message):
    __slots__ = ("nodes",)
    NODES_FIELD_NUMBER: _ClassVar[int]
    nodes: _containers.RepeatedCompositeFieldContainer[Node]
    def __init__(self, nodes: _Optional[_Iterable[_Union[Node, _Mapping]]] = ...) -> None: ...

class ForgetNodeRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class ForgetNodeResponse(_message.Message):
    __slots__ = ("forgotten",)
    FORGOTTEN_FIELD_NUMBER: _ClassVar[int]
    forgotten: bool
    def __init__(self, forgotten: _Optional[bool] = ...) -> None: ...

class ClearQuarantineRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class ClearQuarantineResponse(_message.Message):
    __slots__ = ("cleared",)
    CLEARED_FIELD_NUMBER: _ClassVar[int]
    cleared: bool
    def __init__(self, cleared: _Optional[bool] = ...) -> None: ...

class DrainNodeRequest(_message.Message):
    __slots__ = ("name", "deadline_ms", "reason")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_MS_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    name: str
    deadline_ms: int
    reason: str
    def __init__(self, name: _Optional[str] = ..., deadline_ms: _Optional[int] = ..., reason: _Optional[str] = ...) -> None: ...

class DrainNodeResponse(_message.Message):
    __slots__ = ("drained", "state")
    DRAINED_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    drained: bool
    state: str
    def __init__(self, drained: _Optional[bool] = ..., state: _Optional[str] = ...) -> None: ...

class UndrainNodeRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class UndrainNodeResponse(_message.Message):
    __slots__ = ("undrained",)
    UNDRAINED_FIELD_NUMBER: _ClassVar[int]
    undrained: bool
    def __init__(self, undrained: _Optional[bool] = ...) -> None: ...

class CancelJobRequest(_message.Message):
    __slots__ = ("job_id",)
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    def __init__(self, job_id: _Optional[str] = ...) -> None: ...

class GetEventsRequest(_message.Message):
    __slots__ = ("job_id", "after_seq")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    AFTER_SEQ_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    after_seq: int
    def __init__(self, job_id: _Optional[str] = ..., after_seq: _Optional[int] = ...) -> None: ...

class GetEventsResponse(_message.Message):
    __slots__ = ("events", "more")
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    MORE_FIELD_NUMBER: _ClassVar[int]
    events: _containers.RepeatedCompositeFieldContainer[Event]
    more: bool
    def __init__(self, events: _Optional[_Iterable[_Union[Event, _Mapping]]] = ..., more: _Optional[bool] = ...) -> None: ...

class GetAttemptsRequest(_message.Message):
    __slots__ = ("job_id", "start")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    start: int
    def __init__(self, job_id: _Optional[str] = ..., start: _Optional[int] = ...) -> None: ...

class GetAttemptsResponse(_message.Message):
    __slots__ = ("attempts", "more")
    ATTEMPTS_FIELD_NUMBER: _ClassVar[int]
    MORE_FIELD_NUMBER: _ClassVar[int]
    attempts: _containers.RepeatedCompositeFieldContainer[AttemptSummary]
    more: bool
    def __init__(self, attempts: _Optional[_Iterable[_Union[AttemptSummary, _Mapping]]] = ..., more: _Optional[bool] = ...) -> None: ...

class GetResultRequest(_message.Message):
    __slots__ = ("job_id",)
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    def __init__(self, job_id: _Optional[str] = ...) -> None: ...

class ResultChunk(_message.Message):
    __slots__ = ("rank", "offset", "total", "data")
    RANK_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    TOTAL_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    rank: int
    offset: int
    total: int
    data: bytes
    def __init__(self, rank: _Optional[int] = ..., offset: _Optional[int] = ..., total: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...

class ReadLogsRequest(_message.Message):
    __slots__ = ("job_id", "rank", "stream", "attempt", "follow")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    STREAM_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    FOLLOW_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    rank: int
    stream: str
    attempt: int
    follow: bool
    def __init__(self, job_id: _Optional[str] = ..., rank: _Optional[int] = ..., stream: _Optional[str] = ..., attempt: _Optional[int] = ..., follow: _Optional[bool] = ...) -> None: ...

class LogData(_message.Message):
    __slots__ = ("data",)
    DATA_FIELD_NUMBER: _ClassVar[int]
    data: bytes
    def __init__(self, data: _Optional[bytes] = ...) -> None: ...

class WorkerPid(_message.Message):
    __slots__ = ("local_rank", "pid", "global_rank")
    LOCAL_RANK_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    GLOBAL_RANK_FIELD_NUMBER: _ClassVar[int]
    local_rank: int
    pid: int
    global_rank: int
    def __init__(self, local_rank: _Optional[int] = ..., pid: _Optional[int] = ..., global_rank: _Optional[int] = ...) -> None: ...

class WorkerExit(_message.Message):
    __slots__ = ("local_rank", "global_rank", "pid", "exitcode", "stopped_by_agent", "failure", "has_failure", "return_value", "has_return_value", "timestamp")
    LOCAL_RANK_FIELD_NUMBER: _ClassVar[int]
    GLOBAL_RANK_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    EXITCODE_FIELD_NUMBER: _ClassVar[int]
    STOPPED_BY_AGENT_FIELD_NUMBER: _ClassVar[int]
    FAILURE_FIELD_NUMBER: _ClassVar[int]
    HAS_FAILURE_FIELD_NUMBER: _ClassVar[int]
    RETURN_VALUE_FIELD_NUMBER: _ClassVar[int]
    HAS_RETURN_VALUE_FIELD_NUMBER: _ClassVar[int]
    TIMESTAMP_FIELD_NUMBER: _ClassVar[int]
    local_rank: int
    global_rank: int
    pid: int
    exitcode: int
    stopped_by_agent: bool
    failure: ProcessFailure
    has_failure: bool
    return_value: bytes
    has_return_value: bool
    timestamp: float
    def __init__(self, local_rank: _Optional[int] = ..., global_rank: _Optional[int] = ..., pid: _Optional[int] = ..., exitcode: _Optional[int] = ..., stopped_by_agent: _Optional[bool] = ..., failure: _Optional[_Union[ProcessFailure, _Mapping]] = ..., has_failure: _Optional[bool] = ..., return_value: _Optional[bytes] = ..., has_return_value: _Optional[bool] = ..., timestamp: _Optional[float] = ...) -> None: ...

class RunningGroup(_message.Message):
    __slots__ = ("job_id", "round", "attempt", "workers", "exits", "stopped")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    EXITS_FIELD_NUMBER: _ClassVar[int]
    STOPPED_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    round: int
    attempt: int
    workers: _containers.RepeatedCompositeFieldContainer[WorkerPid]
    exits: _containers.RepeatedCompositeFieldContainer[WorkerExit]
    stopped: bool
    def __init__(self, job_id: _Optional[str] = ..., round: _Optional[int] = ..., attempt: _Optional[int] = ..., workers: _Optional[_Iterable[_Union[WorkerPid, _Mapping]]] = ..., exits: _Optional[_Iterable[_Union[WorkerExit, _Mapping]]] = ..., stopped: _Optional[bool] = ...) -> None: ...

class Hello(_message.Message):
    __slots__ = ("name", "addr", "slots", "incarnation", "version", "running", "gpus", "node_secret")
    NAME_FIELD_NUMBER: _ClassVar[int]
    ADDR_FIELD_NUMBER: _ClassVar[int]
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    GPUS_FIELD_NUMBER: _ClassVar[int]
    NODE_SECRET_FIELD_NUMBER: _ClassVar[int]
    name: str
    addr: str
    slots: int
    incarnation: str
    version: str
    running: _containers.RepeatedCompositeFieldContainer[RunningGroup]
    gpus: _containers.RepeatedCompositeFieldContainer[GpuDevice]
    node_secret: str
    def __init__(self, name: _Optional[str] = ..., addr: _Optional[str] = ..., slots: _Optional[int] = ..., incarnation: _Optional[str] = ..., version: _Optional[str] = ..., running: _Optional[_Iterable[_Union[RunningGroup, _Mapping]]] = ..., gpus: _Optional[_Iterable[_Union[GpuDevice, _Mapping]]] = ..., node_secret: _Optional[str] = ...) -> None: ...

class WorkerHealth(_message.Message):
    __slots__ = ("local_rank", "global_rank", "pid", "cpu_percent", "rss_bytes", "proc_state")
    LOCAL_RANK_FIELD_NUMBER: _ClassVar[int]
    GLOBAL_RANK_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    CPU_PERCENT_FIELD_NUMBER: _ClassVar[int]
    RSS_BYTES_FIELD_NUMBER: _ClassVar[int]
    PROC_STATE_FIELD_NUMBER: _ClassVar[int]
    local_rank: int
    global_rank: int
    pid: int
    cpu_percent: float
    rss_bytes: int
    proc_state: str
    def __init__(self, local_rank: _Optional[int] = ..., global_rank: _Optional[int] = ..., pid: _Optional[int] = ..., cpu_percent: _Optional[float] = ..., rss_bytes: _Optional[int] = ..., proc_state: _Optional[str] = ...) -> None: ...

class GroupHealth(_message.Message):
    __slots__ = ("job_id", "round", "workers", "state", "reason")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    round: int
    workers: _containers.RepeatedCompositeFieldContainer[WorkerHealth]
    state: GroupState
    reason: str
    def __init__(self, job_id: _Optional[str] = ..., round: _Optional[int] = ..., workers: _Optional[_Iterable[_Union[WorkerHealth, _Mapping]]] = ..., state: _Optional[_Union[GroupState, str]] = ..., reason: _Optional[str] = ...) -> None: ...

class Heartbeat(_message.Message):
    __slots__ = ("seq", "groups", "gpus", "health_problem", "torch_metrics")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    GROUPS_FIELD_NUMBER: _ClassVar[int]
    GPUS_FIELD_NUMBER: _ClassVar[int]
    HEALTH_PROBLEM_FIELD_NUMBER: _ClassVar[int]
    TORCH_METRICS_FIELD_NUMBER: _ClassVar[int]
    seq: int
    groups: _containers.RepeatedCompositeFieldContainer[GroupHealth]
    gpus: _containers.RepeatedCompositeFieldContainer[GpuHealth]
    health_problem: str
    torch_metrics: _containers.RepeatedCompositeFieldContainer[TorchMetricSample]
    def __init__(self, seq: _Optional[int] = ..., groups: _Optional[_Iterable[_Union[GroupHealth, _Mapping]]] = ..., gpus: _Optional[_Iterable[_Union[GpuHealth, _Mapping]]] = ..., health_problem: _Optional[str] = ..., torch_metrics: _Optional[_Iterable[_Union[TorchMetricSample, _Mapping]]] = ...) -> None: ...

class TorchMetricSample(_message.Message):
    __slots__ = ("job_id", "group", "name", "value")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    GROUP_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    group: str
    name: str
    value: float
    def __init__(self, job_id: _Optional[str] = ..., group: _Optional[str] = ..., name: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...

class PortReserved(_message.Message):
    __slots__ = ("job_id", "round", "port", "error")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    PORT_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    round: int
    port: int
    error: str
    def __init__(self, job_id: _Optional[str] = ..., round: _Optional[int] = ..., port: _Optional[int] = ..., error: _Optional[str] = ...) -> None: ...

class WorkersStarted(_message.Message):
    __slots__ = ("job_id", "round", "workers")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    round: int
    workers: _containers.RepeatedCompositeFieldContainer[WorkerPid]
    def __init__(self, job_id: _Optional[str] = ..., round: _Optional[int] = ..., workers: _Optional[_Iterable[_Union[WorkerPid, _Mapping]]] = ...) -> None: ...

class WorkerExited(_message.Message):
    __slots__ = ("job_id", "round", "exit")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    EXIT_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    round: int
    exit: WorkerExit
    def __init__(self, job_id: _Optional[str] = ..., round: _Optional[int] = ..., exit: _Optional[_Union[WorkerExit, _Mapping]] = ...) -> None: ...

class WorkerFailing(_message.Message):
    __slots__ = ("job_id", "round", "local_rank", "global_rank", "pid", "failure")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    LOCAL_RANK_FIELD_NUMBER: _ClassVar[int]
    GLOBAL_RANK_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    FAILURE_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    round: int
    local_rank: int
    global_rank: int
    pid: int
    failure: ProcessFailure
    def __init__(self, job_id: _Optional[str] = ..., round: _Optional[int] = ..., local_rank: _Optional[int] = ..., global_rank: _Optional[int] = ..., pid: _Optional[int] = ..., failure: _Optional[_Union[ProcessFailure, _Mapping]] = ...) -> None: ...

class GroupStopped(_message.Message):
    __slots__ = ("job_id", "round", "unkillable_pids")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    UNKILLABLE_PIDS_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    round: int
    unkillable_pids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, job_id: _Optional[str] = ..., round: _Optional[int] = ..., unkillable_pids: _Optional[_Iterable[int]] = ...) -> None: ...

class GroupUnknown(_message.Message):
    __slots__ = ("job_id", "round", "reason")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    round: int
    reason: str
    def __init__(self, job_id: _Optional[str] = ..., round: _Optional[int] = ..., reason: _Optional[str] = ...) -> None: ...

class LogChunk(_message.Message):
    __slots__ = ("request_id", "data", "eof", "error")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    EOF_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    request_id: int
    data: bytes
    eof: bool
    error: str
    def __init__(self, request_id: _Optional[int] = ..., data: _Optional[bytes] = ..., eof: _Optional[bool] = ..., error: _Optional[str] = ...) -> None: ...

class ClockReply(_message.Message):
    __slots__ = ("probe_sent_at", "received_at", "sent_at")
    PROBE_SENT_AT_FIELD_NUMBER: _ClassVar[int]
    RECEIVED_AT_FIELD_NUMBER: _ClassVar[int]
    SENT_AT_FIELD_NUMBER: _ClassVar[int]
    probe_sent_at: float
    received_at: float
    sent_at: float
    def __init__(self, probe_sent_at: _Optional[float] = ..., received_at: _Optional[float] = ..., sent_at: _Optional[float] = ...) -> None: ...

class DrainRequest(_message.Message):
    __slots__ = ("deadline_ms", "reason")
    DEADLINE_MS_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    deadline_ms: int
    reason: str
    def __init__(self, deadline_ms: _Optional[int] = ..., reason: _Optional[str] = ...) -> None: ...

class WorkerStack(_message.Message):
    __slots__ = ("local_rank", "pid", "status", "text", "note")
    LOCAL_RANK_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    NOTE_FIELD_NUMBER: _ClassVar[int]
    local_rank: int
    pid: int
    status: str
    text: str
    note: str
    def __init__(self, local_rank: _Optional[int] = ..., pid: _Optional[int] = ..., status: _Optional[str] = ..., text: _Optional[str] = ..., note: _Optional[str] = ...) -> None: ...

class StackReply(_message.Message):
    __slots__ = ("request_id", "stacks", "error")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    STACKS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    request_id: int
    stacks: _containers.RepeatedCompositeFieldContainer[WorkerStack]
    error: str
    def __init__(self, request_id: _Optional[int] = ..., stacks: _Optional[_Iterable[_Union[WorkerStack, _Mapping]]] = ..., error: _Optional[str] = ...) -> None: ...

class RankProgress(_message.Message):
    __slots__ = ("local_rank", "global_rank", "step", "steps_per_s", "metrics")
    class MetricsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    LOCAL_RANK_FIELD_NUMBER: _ClassVar[int]
    GLOBAL_RANK_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    STEPS_PER_S_FIELD_NUMBER: _ClassVar[int]
    METRICS_FIELD_NUMBER: _ClassVar[int]
    local_rank: int
    global_rank: int
    step: int
    steps_per_s: float
    metrics: _containers.ScalarMap[str, float]
    def __init__(self, local_rank: _Optional[int] = ..., global_rank: _Optional[int] = ..., step: _Optional[int] = ..., steps_per_s: _Optional[float] = ..., metrics: _Optional[_Mapping[str, float]] = ...) -> None: ...

class ProgressReport(_message.Message):
    __slots__ = ("job_id", "round", "ranks")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    round: int
    ranks: _containers.RepeatedCompositeFieldContainer[RankProgress]
    def __init__(self, job_id: _Optional[str] = ..., round: _Optional[int] = ..., ranks: _Optional[_Iterable[_Union[RankProgress, _Mapping]]] = ...) -> None: ...

class NodeMessage(_message.Message):
    __slots__ = ("hello", "heartbeat", "port_reserved", "workers_started", "worker_exited", "group_stopped", "log_chunk", "worker_failing", "group_unknown", "drain_request", "clock_reply", "stack_reply", "progress_report")
    HELLO_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_FIELD_NUMBER: _ClassVar[int]
    PORT_RESERVED_FIELD_NUMBER: _ClassVar[int]
    WORKERS_STARTED_FIELD_NUMBER: _ClassVar[int]
    WORKER_EXITED_FIELD_NUMBER: _ClassVar[int]
    GROUP_STOPPED_FIELD_NUMBER: _ClassVar[int]
    LOG_CHUNK_FIELD_NUMBER: _ClassVar[int]
    WORKER_FAILING_FIELD_NUMBER: _ClassVar[int]
    GROUP_UNKNOWN_FIELD_NUMBER: _ClassVar[int]
    DRAIN_REQUEST_FIELD_NUMBER: _ClassVar[int]
    CLOCK_REPLY_FIELD_NUMBER: _ClassVar[int]
    STACK_REPLY_FIELD_NUMBER: _ClassVar[int]
    PROGRESS_REPORT_FIELD_NUMBER: _ClassVar[int]
    hello: Hello
    heartbeat: Heartbeat
    port_reserved: PortReserved
    workers_started: WorkersStarted
    worker_exited: WorkerExited
    group_stopped: GroupStopped
    log_chunk: LogChunk
    worker_failing: WorkerFailing
    group_unknown: GroupUnknown
    drain_request: DrainRequest
    clock_reply: ClockReply
    stack_reply: StackReply
    progress_report: ProgressReport
    def __init__(self, hello: _Optional[_Union[Hello, _Mapping]] = ..., heartbeat: _Optional[_Union[Heartbeat, _Mapping]] = ..., port_reserved: _Optional[_Union[PortReserved, _Mapping]] = ..., workers_started: _Optional[_Union[WorkersStarted, _Mapping]] = ..., worker_exited: _Optional[_Union[WorkerExited, _Mapping]] = ..., group_stopped: _Optional[_Union[GroupStopped, _Mapping]] = ..., log_chunk: _Optional[_Union[LogChunk, _Mapping]] = ..., worker_failing: _Optional[_Union[WorkerFailing, _Mapping]] = ..., group_unknown: _Optional[_Union[GroupUnknown, _Mapping]] = ..., drain_request: _Optional[_Union[DrainRequest, _Mapping]] = ..., clock_reply: _Optional[_Union[ClockReply, _Mapping]] = ..., stack_reply: _Optional[_Union[StackReply, _Mapping]] = ..., progress_report: _Optional[_Union[ProgressReport, _Mapping]] = ...) -> None: ...

class Welcome(_message.Message):
    __slots__ = ("heartbeat_interval_ms", "lease_ms", "coordinator_id")
    HEARTBEAT_INTERVAL_MS_FIELD_NUMBER: _ClassVar[int]
    LEASE_MS_FIELD_NUMBER: _ClassVar[int]
    COORDINATOR_ID_FIELD_NUMBER: _ClassVar[int]
    heartbeat_interval_ms: int
    lease_ms: int
    coordinator_id: str
    def __init__(self, heartbeat_interval_ms: _Optional[int] = ..., lease_ms: _Optional[int] = ..., coordinator_id: _Optional[str] = ...) -> None: ...

class ReservePort(_message.Message):
    __slots__ = ("job_id", "round")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    round: int
    def __init__(self, job_id: _Optional[str] = ..., round: _Optional[int] = ...) -> None: ...

class WorkerRanks(_message.Message):
    __slots__ = ("local_rank", "global_rank", "role_rank", "world_size", "role_world_size", "role")
    LOCAL_RANK_FIELD_NUMBER: _ClassVar[int]
    GLOBAL_RANK_FIELD_NUMBER: _ClassVar[int]
    ROLE_RANK_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    ROLE_WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    local_rank: int
    global_rank: int
    role_rank: int
    world_size: int
    role_world_size: int
    role: str
    def __init__(self, local_rank: _Optional[int] = ..., global_rank: _Optional[int] = ..., role_rank: _Optional[int] = ..., world_size: _Optional[int] = ..., role_world_size: _Optional[int] = ..., role: _Optional[str] = ...) -> None: ...

class Assign(_message.Message):
    __slots__ = ("job_id", "round", "attempt", "spec", "group_rank", "group_world_size", "master_addr", "master_port", "workers", "run_id", "gpus", "gpu_uuids")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    SPEC_FIELD_NUMBER: _ClassVar[int]
    GROUP_RANK_FIELD_NUMBER: _ClassVar[int]
    GROUP_WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    MASTER_ADDR_FIELD_NUMBER: _ClassVar[int]
    MASTER_PORT_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    GPUS_FIELD_NUMBER: _ClassVar[int]
    GPU_UUIDS_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    round: int
    attempt: int
    spec: JobSpec
    group_rank: int
    group_world_size: int
    master_addr: str
    master_port: int
    workers: _containers.RepeatedCompositeFieldContainer[WorkerRanks]
    run_id: str
    gpus: _containers.RepeatedScalarFieldContainer[int]
    gpu_uuids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, job_id: _Optional[str] = ..., round: _Optional[int] = ..., attempt: _Optional[int] = ..., spec: _Optional[_Union[JobSpec, _Mapping]] = ..., group_rank: _Optional[int] = ..., group_world_size: _Optional[int] = ..., master_addr: _Optional[str] = ..., master_port: _Optional[int] = ..., workers: _Optional[_Iterable[_Union[WorkerRanks, _Mapping]]] = ..., run_id: _Optional[str] = ..., gpus: _Optional[_Iterable[int]] = ..., gpu_uuids: _Optional[_Iterable[str]] = ...) -> None: ...

class Stop(_message.Message):
    __slots__ = ("job_id", "round", "grace_ms", "reason", "replaced", "notice", "term_after_ms", "drain_node")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    GRACE_MS_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    REPLACED_FIELD_NUMBER: _ClassVar[int]
    NOTICE_FIELD_NUMBER: _ClassVar[int]
    TERM_AFTER_MS_FIELD_NUMBER: _ClassVar[int]
    DRAIN_NODE_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    round: int
    grace_ms: int
    reason: str
    replaced: bool
    notice: bool
    term_after_ms: int
    drain_node: str
    def __init__(self, job_id: _Optional[str] = ..., round: _Optional[int] = ..., grace_ms: _Optional[int] = ..., reason: _Optional[str] = ..., replaced: _Optional[bool] = ..., notice: _Optional[bool] = ..., term_after_ms: _Optional[int] = ..., drain_node: _Optional[str] = ...) -> None: ...

class Release(_message.Message):
    __slots__ = ("job_id", "round")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    round: int
    def __init__(self, job_id: _Optional[str] = ..., round: _Optional[int] = ...) -> None: ...

class StartLogs(_message.Message):
    __slots__ = ("request_id", "job_id", "attempt", "rank", "stream", "follow", "credit_chunks")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    STREAM_FIELD_NUMBER: _ClassVar[int]
    FOLLOW_FIELD_NUMBER: _ClassVar[int]
    CREDIT_CHUNKS_FIELD_NUMBER: _ClassVar[int]
    request_id: int
    job_id: str
    attempt: int
    rank: int
    stream: str
    follow: bool
    credit_chunks: int
    def __init__(self, request_id: _Optional[int] = ..., job_id: _Optional[str] = ..., attempt: _Optional[int] = ..., rank: _Optional[int] = ..., stream: _Optional[str] = ..., follow: _Optional[bool] = ..., credit_chunks: _Optional[int] = ...) -> None: ...

class CancelLogs(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: int
    def __init__(self, request_id: _Optional[int] = ...) -> None: ...

class LogCredit(_message.Message):
    __slots__ = ("request_id", "chunks")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    CHUNKS_FIELD_NUMBER: _ClassVar[int]
    request_id: int
    chunks: int
    def __init__(self, request_id: _Optional[int] = ..., chunks: _Optional[int] = ...) -> None: ...

class ClockProbe(_message.Message):
    __slots__ = ("sent_at",)
    SENT_AT_FIELD_NUMBER: _ClassVar[int]
    sent_at: float
    def __init__(self, sent_at: _Optional[float] = ...) -> None: ...

class DrainAccepted(_message.Message):
    __slots__ = ("deadline_ms",)
    DEADLINE_MS_FIELD_NUMBER: _ClassVar[int]
    deadline_ms: int
    def __init__(self, deadline_ms: _Optional[int] = ...) -> None: ...

class StackRequest(_message.Message):
    __slots__ = ("request_id", "job_id", "round", "local_ranks", "native", "timeout_ms")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    LOCAL_RANKS_FIELD_NUMBER: _ClassVar[int]
    NATIVE_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    request_id: int
    job_id: str
    round: int
    local_ranks: _containers.RepeatedScalarFieldContainer[int]
    native: bool
    timeout_ms: int
    def __init__(self, request_id: _Optional[int] = ..., job_id: _Optional[str] = ..., round: _Optional[int] = ..., local_ranks: _Optional[_Iterable[int]] = ..., native: _Optional[bool] = ..., timeout_ms: _Optional[int] = ...) -> None: ...

class CoordinatorMessage(_message.Message):
    __slots__ = ("welcome", "reserve_port", "assign", "stop", "release", "start_logs", "cancel_logs", "log_credit", "drain_accepted", "clock_probe", "stack_request", "epoch")
    WELCOME_FIELD_NUMBER: _ClassVar[int]
    RESERVE_PORT_FIELD_NUMBER: _ClassVar[int]
    ASSIGN_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    RELEASE_FIELD_NUMBER: _ClassVar[int]
    START_LOGS_FIELD_NUMBER: _ClassVar[int]
    CANCEL_LOGS_FIELD_NUMBER: _ClassVar[int]
    LOG_CREDIT_FIELD_NUMBER: _ClassVar[int]
    DRAIN_ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    CLOCK_PROBE_FIELD_NUMBER: _ClassVar[int]
    STACK_REQUEST_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    welcome: Welcome
    reserve_port: ReservePort
    assign: Assign
    stop: Stop
    release: Release
    start_logs: StartLogs
    cancel_logs: CancelLogs
    log_credit: LogCredit
    drain_accepted: DrainAccepted
    clock_probe: ClockProbe
    stack_request: StackRequest
    epoch: int
    def __init__(self, welcome: _Optional[_Union[Welcome, _Mapping]] = ..., reserve_port: _Optional[_Union[ReservePort, _Mapping]] = ..., assign: _Optional[_Union[Assign, _Mapping]] = ..., stop: _Optional[_Union[Stop, _Mapping]] = ..., release: _Optional[_Union[Release, _Mapping]] = ..., start_logs: _Optional[_Union[StartLogs, _Mapping]] = ..., cancel_logs: _Optional[_Union[CancelLogs, _Mapping]] = ..., log_credit: _Optional[_Union[LogCredit, _Mapping]] = ..., drain_accepted: _Optional[_Union[DrainAccepted, _Mapping]] = ..., clock_probe: _Optional[_Union[ClockProbe, _Mapping]] = ..., stack_request: _Optional[_Union[StackRequest, _Mapping]] = ..., epoch: _Optional[int] = ...) -> None: ...
