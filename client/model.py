"""The domain types every part of gelastic shares: job specs, states, failures and results.

Pure data, validation and the failure table's text only: nothing here imports grpc or the
generated protos, so the coordinator's decision code, the node agent and the client all speak
these types.
"""

from __future__ import annotations

import dataclasses
import enum
import ipaddress
import json
import math
import os
import pickle
import re
import signal as _signal
import sys
import types
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from datetime import datetime
from typing import Any, cast

from client.errors import (
    NOT_AVAILABLE,
    format_failure_block,
    format_failure_table,
    indent_continuation,
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
    "is_function_reference",
    "is_host",
    "is_job_id",
    "is_name",
    "parse_restart_policy",
    "parse_std_mapping",
    "roles_from_json",
    "signal_message",
    "signal_name",
    "std_form",
]

# Limits that keep one job from hurting the coordinator or another job (docs/python-api.md).
MAX_NODES = 100_000
MAX_NPROC_PER_NODE = 4096
MAX_RESTARTS = 10_000
MAX_TIMEOUT_S = 7 * 24 * 3600.0
MAX_SPEC_BYTES = 1024 * 1024
"""The whole spec in its wire form (client.wire.check_spec_size). Every message that carries a
spec (an assignment, a job with its spec) must stay far below the 16 MiB gRPC message limit
however many workers it lists; the per-field limits below only bound each piece."""
MAX_FUNCTION_ARGS_BYTES = MAX_SPEC_BYTES
MAX_RETURN_VALUE_BYTES = 4 * 1024 * 1024
"""Largest return value one rank may report (tagged bytes, as the worker wrote them)."""
MAX_RESULT_BYTES_PER_JOB = 32 * 1024 * 1024
"""Largest sum of the return values of all ranks of one job; going over fails the job."""
RESULT_KEY_BYTES = 32
"""Length of the key a function job's workers tag their return values with."""
MAX_ARGV_ITEMS = 4096
MAX_STRING = 64 * 1024
MAX_ENV_ITEMS = 1024
MAX_ROLES = 16
"""Most roles one job may have (`JobSpec.roles`)."""

# Always used with fullmatch: `$` with match() accepts a trailing newline, and a name that
# ends in one makes a job id that the job's own lookups then refuse.
_FUNCTION_REF = re.compile(r"[A-Za-z_][\w.]*:[A-Za-z_][\w.]*")
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.\-]{0,127}")
MAX_PRELOAD = 32
MAX_STANDBY_LINGER_S = 3600.0
"""Longest `standby_linger`: idle interpreters hold memory on the nodes."""
"""Most modules a spec may ask its standby workers to preload."""
_MODULE_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,127}(\.[A-Za-z_][A-Za-z0-9_]{0,127}){0,15}")
_STD_MAPPING = re.compile(r"(\d+:[0123],)*(\d+:[0123])")
_HOST_NAME = re.compile(
    r"[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?(\.[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*\.?"
)
_JOB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.\-]{0,159}")


def is_name(value: str) -> bool:
    """A node name, role or job name: 1-128 of [A-Za-z0-9_.-], not starting with [_.-]."""
    return bool(_NAME.fullmatch(value))


_EXIT_CODES = re.compile(r"\d{1,3}(?:,\d{1,3}){0,31}")


def parse_restart_policy(value: str) -> frozenset[int] | None:
    """The exit codes that never restart (empty: the default), or None for "always"."""
    if not isinstance(value, str):
        raise SpecError("restart_policy", "must be a string")
    text = value.replace(" ", "")
    if text == "always":
        return None
    if not text:
        return frozenset()
    if not _EXIT_CODES.fullmatch(text) or any(int(c) > 255 for c in text.split(",")):
        raise SpecError(
            "restart_policy",
            f"must be '', 'always' or exit codes 0-255 such as '2,127', got {value[:60]!r}",
        )
    return frozenset(int(c) for c in text.split(","))


def is_host(value: str) -> bool:
    """A host name (RFC 1123 labels, at most 253 characters) or an IPv4/IPv6 address."""
    if not isinstance(value, str) or len(value) > 253:
        return False
    if _HOST_NAME.fullmatch(value):
        return True
    try:
        ipaddress.ip_address(value)
    except ValueError:
        return False
    return True


def is_job_id(value: str) -> bool:
    """A job id as the coordinator makes them; also safe as a directory name."""
    return bool(_JOB_ID.fullmatch(value))


def is_function_reference(value: str) -> bool:
    """ "pkg.module:qualname"."""
    return bool(_FUNCTION_REF.fullmatch(value))


class GelasticError(RuntimeError):
    """A call to the coordinator failed, or was refused before it was sent.

    `code` is the gRPC status code (a `grpc.StatusCode`), or None when nothing was sent.
    """

    def __init__(self, code: Any, message: str) -> None:
        super().__init__(message)
        self.code = code


class SpecError(GelasticError, ValueError):
    """A job spec (or request) field is invalid. `field` names it.

    Raised by the client before anything is sent, so its `code` is None; the coordinator
    refuses the same spec with INVALID_ARGUMENT naming the same field.
    """

    def __init__(self, field_name: str, message: str) -> None:
        super().__init__(None, f"{field_name}: {message}")
        self.field = field_name
        self.detail = message


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


class FailureCategory(enum.Enum):
    """torchelastic's error categories: who is to blame for a failure."""

    USER = "USER"  # the worker failed
    PLATFORM = "PLATFORM"  # the agent failed
    INFRA = "INFRA"  # the host or the network failed
    INPUT = "INPUT"  # the spec was invalid


def signal_message(signum: int, pid: int) -> str:
    """torchelastic's wording for a death by signal: `Signal 9 (SIGKILL) received by PID 1234`."""
    return f"Signal {signum} ({signal_name(signum)}) received by PID {pid}"


def signal_name(signum: int) -> str:
    try:
        return _signal.Signals(signum).name
    except ValueError:
        return "<N/A>"


def _seconds(field_name: str, value: float, *, allow_zero: bool = True) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise SpecError(field_name, f"must be a number of seconds, got {value!r}")
    if math.isnan(value) or value < 0 or (value == 0 and not allow_zero):
        raise SpecError(field_name, f"must be a positive number of seconds, got {value!r}")
    if value > MAX_TIMEOUT_S:
        raise SpecError(field_name, f"must be at most {MAX_TIMEOUT_S:.0f} s, got {value!r}")


def _count(field_name: str, value: int, low: int, high: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise SpecError(field_name, f"must be an integer, got {value!r}")
    if not low <= value <= high:
        raise SpecError(field_name, f"must be between {low} and {high}, got {value}")


def std_form(value: object) -> str | None:
    """`redirects`/`tee` as the wire carries them: torch's `Std` (any int enum 0-3), an int
    0-3, a `{local_rank: Std | int}` dict, or torchrun's string; None for anything else."""
    if isinstance(value, str):
        return value
    if isinstance(value, int) and not isinstance(value, bool):
        return str(int(value)) if 0 <= value <= 3 else None
    if isinstance(value, Mapping):
        if len(value) > MAX_NPROC_PER_NODE:
            return None
        parts: dict[int, int] = {}
        for k, v in value.items():
            ok = all(isinstance(x, int) and not isinstance(x, bool) for x in (k, v))
            if not ok or not 0 <= k < MAX_NPROC_PER_NODE or not 0 <= v <= 3:
                return None
            parts[int(k)] = int(v)
        return ",".join(f"{k}:{v}" for k, v in sorted(parts.items())) or "0"
    return None


def parse_std_mapping(field_name: str, value: str, nproc: int) -> dict[int, int]:
    """torchrun's `--redirects/--tee` syntax: "3" for every local rank, or "0:3,1:1".

    Returns {local_rank: mask} with mask bits 1 = stdout, 2 = stderr.
    """
    if not isinstance(value, str):
        raise SpecError(
            field_name,
            "must be a torch Std, an int 0-3, a {local_rank: Std} dict or torchrun's "
            f"'3' / '0:3,1:1' form, got {type(value).__name__}",
        )
    if len(value) > MAX_STRING:
        raise SpecError(field_name, f"at most {MAX_STRING} characters")
    value = value.strip() or "0"
    if value.isdigit():
        mask = int(value)
        if mask > 3:
            raise SpecError(field_name, f"must be 0-3 or 'local_rank:mask,...', got {value!r}")
        return dict.fromkeys(range(nproc), mask)
    if not _STD_MAPPING.fullmatch(value):
        raise SpecError(field_name, f"must be 0-3 or 'local_rank:mask,...', got {value!r}")
    out = dict.fromkeys(range(nproc), 0)
    for part in value.split(","):
        rank_s, mask_s = part.split(":")
        out[int(rank_s)] = int(mask_s)
    return out


@dataclass(frozen=True)
class Role:
    """One role of a multi-role job (e.g. parameter servers and trainers): what its workers run
    and on how many nodes. Every node of a round runs the group of one role.

    The entrypoint is a command (argv); function entrypoints are for single-role jobs.
    """

    name: str
    """ROLE_NAME of this role's workers: 1-128 of [A-Za-z0-9_.-], unique in the job."""
    entrypoint: Sequence[str] | str = ()
    """Command argv (a string is one program name)."""
    args: Sequence[str] = ()
    """Extra argv appended to the command."""
    env: Mapping[str, str] = field(default_factory=dict)
    """Environment of this role's workers, over the job's `env`."""
    nproc_per_node: int = 1
    """Workers per node of this role (its LOCAL_WORLD_SIZE)."""
    min_nodes: int = 1
    """Fewest nodes of this role a round forms with."""
    max_nodes: int = 1
    """Most nodes of this role in a round."""

    def __post_init__(self) -> None:
        ep = self.entrypoint
        if isinstance(ep, str):
            object.__setattr__(self, "entrypoint", (ep,))
        elif isinstance(ep, Sequence):
            object.__setattr__(self, "entrypoint", tuple(ep))
        if isinstance(self.args, Sequence) and not isinstance(self.args, str):
            object.__setattr__(self, "args", tuple(self.args))
        if isinstance(self.env, Mapping):
            object.__setattr__(self, "env", dict(self.env))

    def validate(self, index: int, job_env: Mapping[str, str]) -> None:
        """Raise SpecError naming the bad field as ``roles[index].field``."""
        at = f"roles[{index}]"
        if not isinstance(self.name, str) or not _NAME.fullmatch(self.name):
            raise SpecError(f"{at}.name", f"must be 1-128 of [A-Za-z0-9_.-], got {self.name!r:.80}")
        ep = self.entrypoint
        if not isinstance(ep, tuple) or not ep:
            raise SpecError(
                f"{at}.entrypoint",
                "must be a non-empty command (a role runs a command; function entrypoints are "
                "for single-role jobs)",
            )
        if not isinstance(self.args, tuple):
            raise SpecError(f"{at}.args", "must be a list of strings")
        argv = ep + self.args
        if len(argv) > MAX_ARGV_ITEMS:
            raise SpecError(f"{at}.args", f"at most {MAX_ARGV_ITEMS} items, got {len(argv)}")
        for i, a in enumerate(argv):
            where = f"{at}.entrypoint" if i < len(ep) else f"{at}.args"
            if not isinstance(a, str) or "\x00" in a or len(a) > MAX_STRING:
                raise SpecError(where, f"item {i} is not a valid argument")
        if not ep[0]:
            raise SpecError(f"{at}.entrypoint", "the program name must not be empty")
        if not isinstance(self.env, dict):
            raise SpecError(f"{at}.env", "must be a mapping of strings")
        if len(self.env) > MAX_ENV_ITEMS or len({*self.env, *job_env}) > MAX_ENV_ITEMS:
            raise SpecError(
                f"{at}.env", f"at most {MAX_ENV_ITEMS} variables with the job's env together"
            )
        for k, v in self.env.items():
            if not isinstance(k, str) or not _ENV_NAME.fullmatch(k):
                raise SpecError(
                    f"{at}.env", f"invalid variable name {k!r:.80} (letters, digits, _; no '=')"
                )
            if not isinstance(v, str) or "\x00" in v or len(v) > MAX_STRING:
                raise SpecError(f"{at}.env", f"invalid value for {k}")
        _count(f"{at}.nproc_per_node", self.nproc_per_node, 1, MAX_NPROC_PER_NODE)
        _count(f"{at}.min_nodes", self.min_nodes, 1, MAX_NODES)
        _count(f"{at}.max_nodes", self.max_nodes, 1, MAX_NODES)
        if self.min_nodes > self.max_nodes:
            raise SpecError(
                f"{at}.min_nodes",
                f"must be <= max_nodes (got {self.min_nodes} > {self.max_nodes})",
            )


_ROLE_KEYS = frozenset(f.name for f in fields(Role))


def roles_from_json(text: str | bytes) -> tuple[Role, ...]:
    """The roles of a JSON document: a list of objects with Role's fields, e.g.
    ``[{"name": "ps", "entrypoint": ["python", "ps.py"], "nproc_per_node": 1},
    {"name": "trainer", "entrypoint": ["python", "train.py"], "min_nodes": 1, "max_nodes": 2}]``.

    SpecError names the bad field (``roles[1].nproc_per_node``); the roles are then checked
    by `JobSpec.validate`.
    """
    if len(text) > MAX_SPEC_BYTES:
        raise SpecError("roles", f"the roles document is over {MAX_SPEC_BYTES} bytes")
    try:
        doc = json.loads(text)
    except (ValueError, UnicodeDecodeError) as exc:
        raise SpecError("roles", f"not valid JSON: {_cut(str(exc))}") from None
    if not isinstance(doc, list) or not doc:
        raise SpecError("roles", "must be a non-empty JSON list of role objects")
    if len(doc) > MAX_ROLES:
        raise SpecError("roles", f"at most {MAX_ROLES} roles, got {len(doc)}")
    out: list[Role] = []
    for i, item in enumerate(doc):
        if not isinstance(item, dict):
            raise SpecError(f"roles[{i}]", "must be a JSON object")
        for key in item:
            if key not in _ROLE_KEYS:
                raise SpecError(f"roles[{i}].{str(key)[:40]}", "unknown field")
        if "name" not in item:
            raise SpecError(f"roles[{i}].name", "missing")
        for key in ("entrypoint", "args"):
            value = item.get(key, [])
            if not isinstance(value, list | str):
                raise SpecError(f"roles[{i}].{key}", "must be a list of strings")
        env = item.get("env", {})
        if not isinstance(env, dict):
            raise SpecError(f"roles[{i}].env", "must be an object of strings")
        out.append(Role(**item))
    return tuple(out)


@dataclass(frozen=True)
class JobSpec:
    """What to run, on how many nodes, and how to treat failures.

    `entrypoint` is a command (a list of argv, e.g. ``["python", "train.py"]``), a function
    reference ``"pkg.module:function"``, or an importable callable. For a function, `args` and
    `kwargs` are pickled by the client and unpickled only inside the worker.
    """

    entrypoint: Sequence[str] | str | Callable[..., Any] = ()
    """Command argv, or a function reference / importable callable."""
    args: Sequence[Any] = ()
    """Extra argv for a command; positional arguments for a function."""
    kwargs: Mapping[str, Any] = field(default_factory=dict)
    """Keyword arguments for a function entrypoint."""
    nproc_per_node: int = 1
    """Workers per node (torchrun's --nproc-per-node, local_world_size)."""
    min_nodes: int = 1
    """Smallest number of nodes the job runs on."""
    max_nodes: int = 1
    """Largest number of nodes; the round closes at once when this many are free."""
    max_restarts: int = 0
    """Failure restarts allowed for the whole job (membership changes do not count)."""
    role: str = "default"
    """ROLE_NAME of the workers."""
    name: str = ""
    """A label for people; the coordinator makes the job id."""
    env: Mapping[str, str] = field(default_factory=dict)
    """Extra environment for every worker."""
    redirects: str = "0"
    """torchrun --redirects: 0 none, 1 stdout, 2 stderr, 3 both; or "0:3,1:1". torch's `Std`,
    an int or a `{local_rank: Std}` dict are accepted too and kept in this string form."""
    tee: str = "0"
    """torchrun --tee: like redirects, but also printed by the agent with a prefix."""
    join_timeout: float = 600.0
    """Seconds a job waits for min_nodes free nodes before it fails."""
    last_call_timeout: float = 30.0
    """Seconds a round waits for more nodes once min_nodes are there (0 = close at once)."""
    exit_barrier_timeout: float = 300.0
    """Seconds nodes that finished wait for the others before being released."""
    stop_grace: float = 30.0
    """Seconds between SIGTERM and SIGKILL when workers are stopped."""
    restart_backoff: float = 0.0
    """Seconds to wait before a failure restart (each wait drawn from [0.5, 1.5] of it)."""
    restart_policy: str = ""
    """Which failures restart the job. "" (the default): every one but an input error, which no
    restart mends and which fails the job at once, saying why (a SyntaxError, an ImportError of
    the entrypoint's own imports, a script or program that does not exist, an exit 2 with an
    argparse-style usage error); "always": every failure, input errors too; or exit codes
    ("2,127") that fail the job at once besides the input errors (Kubeflow's ExitCode policy)."""
    scale_up: str = "restart"
    """"restart": re-form when a node joins below max_nodes; "never": keep running."""
    watchdog: bool = False
    """Serve torch's FileTimer protocol at TORCHELASTIC_TIMER_FILE."""
    cwd: str = ""
    """Working directory of the workers ("" = the agent's)."""
    stderr_tail_lines: int = 50
    """Lines of stderr attached to a failure without an error file."""
    unhealthy_timeout: float = 60.0
    """Seconds a worker may stay in uninterruptible sleep or stopped before it is a failure."""
    function: str = field(default="", repr=False)
    """Internal: set from `entrypoint` when it names a function; "pkg.module:qualname"."""
    main_path: str = ""
    """For a function of the submitter's main script ("__main__:fn"): that script's path on the
    nodes (absolute, or relative to `cwd`). Set from `entrypoint` when it is such a function."""
    function_args: bytes = field(default=b"", repr=False)
    """Internal: pickled (args, kwargs) of a function entrypoint, as sent over the wire."""
    result_key: bytes = field(default=b"", repr=False)
    """Internal, function entrypoints: the key the workers tag their return values with. Made by
    `Client.submit`; a secret of the submitter and the job's workers, never shown."""
    preload: tuple[str, ...] = ()
    """Modules (e.g. ``("torch",)``) that warm standby interpreters import before their round;
    empty (the default) starts every worker cold. See docs/python-api.md, "Standby workers"."""
    standby_linger: float = 0.0
    """Seconds the standbys (and warm store host) of a job that succeeded stay on each node for
    the next job of the very same spec (a sweep); 0 (the default) kills them with the job."""
    master_addr: str = ""
    """A fixed MASTER_ADDR for every round ("" = group rank 0's node address), e.g. the
    interface to use on a multi-homed host; the round's c10d store listens there."""
    master_port: int = 0
    """A fixed MASTER_PORT for every round (0 = a free port group rank 0 reserves per round),
    e.g. one a firewall lets through. If it is taken, the round fails naming it."""
    wait_for_nodes: bool = False
    """More nodes are on their way: wait (up to `join_timeout`) for a node big enough for one
    group of the job to join, even when no node the coordinator knows could ever hold one, and
    keep a range round open for its whole last call even when every live node with room has
    joined. False (the default) fails a job no known node could hold at once, saying which
    node is the largest, and closes a round once every live node with room is in. A multi-node
    `gelastic run` sets it: its nodes' launchers arrive one by one."""
    roles: tuple[Role, ...] = ()
    """Several roles in one rendezvous and one world (e.g. parameter servers and trainers);
    empty (the default) is one role made of `role`, `entrypoint`, `nproc_per_node` and
    `min_nodes..max_nodes`. With roles, leave `entrypoint`/`args`/`kwargs` empty:
    `min_nodes`/`max_nodes` become the sums of the roles' and `nproc_per_node` the largest.
    See docs/python-api.md, "Multi-role jobs"."""

    def __post_init__(self) -> None:
        if not isinstance(self.roles, tuple) and isinstance(self.roles, Sequence):
            object.__setattr__(self, "roles", tuple(self.roles))
        if self.roles and all(isinstance(r, Role) for r in self.roles):
            counts = [(r.min_nodes, r.max_nodes, r.nproc_per_node) for r in self.roles]
            if all(isinstance(x, int) and not isinstance(x, bool) for c in counts for x in c):
                object.__setattr__(self, "min_nodes", sum(c[0] for c in counts))
                object.__setattr__(self, "max_nodes", sum(c[1] for c in counts))
                object.__setattr__(self, "nproc_per_node", max(c[2] for c in counts))
        ep = self.entrypoint
        if callable(ep):
            ref, main_path, bound_self = _function_entrypoint(ep)
            object.__setattr__(self, "function", ref)
            object.__setattr__(self, "entrypoint", ())
            if main_path and not self.main_path:
                object.__setattr__(self, "main_path", main_path)
            if bound_self is not _UNBOUND:  # obj.method runs as Class.method(obj, *args)
                object.__setattr__(self, "args", (bound_self, *tuple(self.args)))
        elif isinstance(ep, str):
            if _FUNCTION_REF.fullmatch(ep):
                object.__setattr__(self, "function", ep)
                object.__setattr__(self, "entrypoint", ())
            else:
                object.__setattr__(self, "entrypoint", (ep,))
        else:
            object.__setattr__(self, "entrypoint", tuple(ep))
        if not self.function:
            object.__setattr__(self, "args", tuple(self.args))
        elif not self.function_args:  # not yet pickled by submit(): say now what cannot be
            _check_picklable(self.function, self.args, self.kwargs)
        object.__setattr__(self, "env", dict(self.env))
        object.__setattr__(self, "preload", tuple(self.preload))
        object.__setattr__(self, "kwargs", dict(self.kwargs))
        for name in ("redirects", "tee"):
            form = std_form(getattr(self, name))
            if form is not None:
                object.__setattr__(self, name, form)
        addr = self.master_addr
        if isinstance(addr, str) and addr.startswith("[") and addr.endswith("]"):
            object.__setattr__(self, "master_addr", addr[1:-1])

    def __repr__(self) -> str:
        # The public fields only; a function entrypoint shows as the reference it was given.
        parts = []
        for f in fields(self):
            if not f.repr:
                continue
            value = getattr(self, f.name)
            if f.name == "entrypoint" and self.function:
                value = self.function
            parts.append(f"{f.name}={value!r}")
        return f"JobSpec({', '.join(parts)})"

    @property
    def is_function(self) -> bool:
        return bool(self.function)

    @property
    def command(self) -> tuple[str, ...]:
        """The command entrypoint, as normalised by __post_init__ (empty for a function)."""
        return cast(tuple[str, ...], self.entrypoint)

    @property
    def argv(self) -> tuple[str, ...]:
        """The full command of a command entrypoint."""
        return self.command + tuple(str(a) for a in self.args)

    def role_named(self, name: str) -> Role | None:
        """The role of this name (None when there is none, or the job has one role)."""
        return next((r for r in self.roles if r.name == name), None)

    def for_role(self, name: str) -> JobSpec:
        """The single-role spec that a node of role `name` runs: the role's command, workers
        per node and node counts, the job's env with the role's over it, ROLE_NAME = `name`.
        A single-role spec gives itself for its own role; SpecError for any other name."""
        if not self.roles:
            if name != self.role:
                raise SpecError("role", f"the job has no role {name!r:.80}")
            return self
        role = self.role_named(name)
        if role is None:
            raise SpecError("roles", f"the job has no role {name!r:.80}")
        return dataclasses.replace(
            self,
            roles=(),
            entrypoint=role.entrypoint,
            args=role.args,
            env={**self.env, **role.env},
            nproc_per_node=role.nproc_per_node,
            min_nodes=role.min_nodes,
            max_nodes=role.max_nodes,
            role=role.name,
        )

    def _validate_roles(self) -> None:
        if not isinstance(self.roles, tuple):
            raise SpecError("roles", "must be a list of Role")
        if len(self.roles) > MAX_ROLES:
            raise SpecError("roles", f"at most {MAX_ROLES} roles, got {len(self.roles)}")
        if self.entrypoint or self.function or self.args or self.kwargs:
            raise SpecError(
                "entrypoint", "with roles, give each role its entrypoint and args, not the job"
            )
        seen: set[str] = set()
        for i, r in enumerate(self.roles):
            if not isinstance(r, Role):
                raise SpecError(f"roles[{i}]", f"must be a Role, got {type(r).__name__}")
            r.validate(i, self.env)
            if r.name in seen:
                raise SpecError(f"roles[{i}].name", f"role {r.name!r} is given twice")
            seen.add(r.name)
        # Every role's nodes are distinct nodes of one round: the sums must fit together.
        if sum(r.max_nodes for r in self.roles) > MAX_NODES:
            raise SpecError("roles", f"the roles' max_nodes add up to more than {MAX_NODES} nodes")

    def validate(self) -> None:
        """Raise SpecError naming the first bad field."""
        if self.roles:
            self._validate_roles()
        elif self.function and self.entrypoint:
            raise SpecError("entrypoint", "give a command or a function, not both")
        elif not self.function:
            if not self.entrypoint:
                raise SpecError("entrypoint", "must not be empty")
            argv = self.argv
            if len(argv) > MAX_ARGV_ITEMS:
                raise SpecError("args", f"at most {MAX_ARGV_ITEMS} items, got {len(argv)}")
            for i, a in enumerate(argv):
                if not isinstance(a, str):
                    raise SpecError("entrypoint", f"item {i} must be a string, got {a!r}")
                if "\x00" in a or len(a) > MAX_STRING:
                    raise SpecError("entrypoint", f"item {i} is not a valid argument")
            if not self.command[0]:
                raise SpecError("entrypoint", "the program name must not be empty")
        elif not _FUNCTION_REF.fullmatch(self.function):
            raise SpecError(
                "entrypoint", f"not a function reference 'pkg.module:name': {self.function!r}"
            )
        _check_main_path(self.function, self.main_path)
        if len(self.function_args) > MAX_FUNCTION_ARGS_BYTES:
            raise SpecError(
                "args",
                f"pickled arguments are {len(self.function_args)} bytes, "
                f"over the limit of {MAX_FUNCTION_ARGS_BYTES}",
            )
        if self.result_key and (not self.function or len(self.result_key) != RESULT_KEY_BYTES):
            raise SpecError(
                "result_key",
                f"must be {RESULT_KEY_BYTES} bytes, and only for a function entrypoint",
            )
        _count("nproc_per_node", self.nproc_per_node, 1, MAX_NPROC_PER_NODE)
        _count("min_nodes", self.min_nodes, 1, MAX_NODES)
        _count("max_nodes", self.max_nodes, 1, MAX_NODES)
        if self.min_nodes > self.max_nodes:
            raise SpecError(
                "min_nodes", f"must be <= max_nodes (got {self.min_nodes} > {self.max_nodes})"
            )
        _count("max_restarts", self.max_restarts, 0, MAX_RESTARTS)
        if not isinstance(self.role, str) or not _NAME.fullmatch(self.role):
            raise SpecError("role", f"must be 1-128 of [A-Za-z0-9_.-], got {self.role!r}")
        if not isinstance(self.name, str) or (self.name and not _NAME.fullmatch(self.name)):
            raise SpecError("name", f"must be 1-128 of [A-Za-z0-9_.-], got {self.name!r}")
        if len(self.env) > MAX_ENV_ITEMS:
            raise SpecError("env", f"at most {MAX_ENV_ITEMS} variables, got {len(self.env)}")
        for k, v in self.env.items():
            if not isinstance(k, str) or not _ENV_NAME.fullmatch(k):
                raise SpecError("env", f"invalid variable name {k!r} (letters, digits, _; no '=')")
            if not isinstance(v, str) or "\x00" in v or len(v) > MAX_STRING:
                raise SpecError("env", f"invalid value for {k}")
        parse_std_mapping("redirects", self.redirects, self.nproc_per_node)
        parse_std_mapping("tee", self.tee, self.nproc_per_node)
        _seconds("join_timeout", self.join_timeout, allow_zero=False)
        _seconds("last_call_timeout", self.last_call_timeout)
        _seconds("exit_barrier_timeout", self.exit_barrier_timeout)
        _seconds("stop_grace", self.stop_grace)
        _seconds("restart_backoff", self.restart_backoff)
        parse_restart_policy(self.restart_policy)
        _seconds("unhealthy_timeout", self.unhealthy_timeout, allow_zero=False)
        if self.scale_up not in ("restart", "never"):
            raise SpecError("scale_up", f"must be 'restart' or 'never', got {self.scale_up!r}")
        if not isinstance(self.cwd, str) or "\x00" in self.cwd or len(self.cwd) > 4096:
            raise SpecError("cwd", "invalid path")
        _count("stderr_tail_lines", self.stderr_tail_lines, 0, 10_000)
        if len(self.preload) > MAX_PRELOAD:
            raise SpecError("preload", f"at most {MAX_PRELOAD} modules, got {len(self.preload)}")
        for mod in self.preload:
            if not isinstance(mod, str) or not _MODULE_NAME.fullmatch(mod):
                raise SpecError("preload", f"not a module name: {str(mod)[:80]!r}")
        _seconds("standby_linger", self.standby_linger)
        if self.standby_linger > MAX_STANDBY_LINGER_S:
            raise SpecError(
                "standby_linger",
                f"must be at most {MAX_STANDBY_LINGER_S:.0f} s, got {self.standby_linger!r}",
            )
        if self.standby_linger and not self.preload:
            raise SpecError("standby_linger", "needs preload: a spec without it has no standbys")
        if not isinstance(self.master_addr, str) or (
            self.master_addr and not is_host(self.master_addr)
        ):
            raise SpecError(
                "master_addr", f"must be a host name or IP address, got {self.master_addr!r:.80}"
            )
        if self.master_port:
            _count("master_port", self.master_port, 1, 65535)
        elif isinstance(self.master_port, bool) or self.master_port != 0:
            raise SpecError("master_port", f"must be 1-65535 (or 0), got {self.master_port!r}")


MAX_MAIN_PATH = 4096
"""Longest `JobSpec.main_path`, as for `cwd`."""
_UNBOUND = object()
_HOW = "define it at the top level of an importable module or of the script you run"


def function_reference(fn: Callable[..., Any]) -> str:
    """ "module:qualname" of an importable function; raises SpecError otherwise.

    A function of the main script gives "__main__:qualname"; `JobSpec` records the script's path
    with it (`main_path`). What a worker cannot import by name is refused, saying why.
    """
    return _function_entrypoint(fn)[0]


def _function_entrypoint(fn: Callable[..., Any]) -> tuple[str, str, Any]:
    """(reference, main script path or "", the object a bound method is bound to or _UNBOUND)."""
    bound_self: Any = _UNBOUND
    target: Any = fn
    if isinstance(fn, (types.BuiltinFunctionType, types.BuiltinMethodType)):
        raise SpecError(
            "entrypoint",
            f"{fn!r} is a builtin, which a worker cannot call by reference; wrap it in a "
            f"function and {_HOW}",
        )
    if isinstance(fn, types.MethodType):
        if isinstance(fn.__self__, type):  # a classmethod: Class.method is that very method
            target = fn
        else:
            target = fn.__func__
            bound_self = fn.__self__
    module = getattr(target, "__module__", None)
    qualname = getattr(target, "__qualname__", None)
    if not isinstance(module, str) or not module or not isinstance(qualname, str) or not qualname:
        raise SpecError(
            "entrypoint",
            f"{_shown(fn)} has no module:qualname a worker can import it by; {_HOW}",
        )
    name = f"{module}:{qualname}"
    if "<lambda>" in qualname:
        raise SpecError(
            "entrypoint",
            f"{name} is a lambda, which a worker cannot import by name; {_HOW}",
        )
    if "<locals>" in qualname or "<" in qualname:
        raise SpecError(
            "entrypoint",
            f"{name} is defined inside another function (a closure or nested function), "
            f"which a worker cannot import by name; {_HOW}",
        )
    main_path = ""
    main = sys.modules.get("__main__")
    if module == "__main__":
        file = getattr(main, "__file__", None)
        if not isinstance(file, str) or not file:
            raise SpecError(
                "entrypoint",
                f"{name} is defined in an interactive session (a REPL, notebook or python -c), "
                f"which the workers cannot run; {_HOW}",
            )
        main_path = os.path.abspath(file)
    resolved = _lookup(sys.modules.get(module), qualname)
    # A classmethod is bound anew on each lookup: equal (same class, same function), not identical.
    if not (resolved is target or (isinstance(target, types.MethodType) and resolved == target)):
        raise SpecError(
            "entrypoint",
            f"{name} does not name {_shown(fn)} (a worker importing {name} gets another "
            f"object); {_HOW}",
        )
    if bound_self is not _UNBOUND:
        try:
            pickle.dumps(bound_self, protocol=4)
        except Exception as e:
            raise SpecError(
                "entrypoint",
                f"{name} is a method bound to an object that cannot be pickled "
                f"({type(e).__name__}: {_cut(str(e))}); pass a picklable object or {_HOW}",
            ) from None
    # multiprocessing does the same: a return value of a class of the main script is pickled by
    # the workers as __mp_main__.<class>, which must resolve here to this very script.
    if module == "__main__" and main is not None:
        sys.modules.setdefault("__mp_main__", main)
    return name, main_path, bound_self


def _lookup(obj: Any, qualname: str) -> Any:
    for part in qualname.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj


def _shown(fn: Any) -> str:
    return _cut(repr(fn))


def _cut(text: str, limit: int = 200) -> str:
    return text if len(text) <= limit else text[:limit] + "..."


class _PickleSizeExceeded(Exception):
    pass


class _CountingSink:
    """Where the picklability check writes: counts, keeps nothing, stops past the limit."""

    def __init__(self, limit: int) -> None:
        self.size = 0
        self.limit = limit

    def write(self, data: bytes) -> int:
        self.size += len(data)
        if self.size > self.limit:
            raise _PickleSizeExceeded
        return len(data)


def _check_picklable(function: str, args: Sequence[Any], kwargs: Mapping[str, Any]) -> None:
    """SpecError naming the first argument of `function` that cannot be pickled."""
    items: list[tuple[str, str, Any]] = [("args", f"args[{i}]", a) for i, a in enumerate(args)]
    items += [("kwargs", f"kwargs[{k!r}]", v) for k, v in kwargs.items()]
    total = 0
    for field_name, label, value in items:
        sink = _CountingSink(MAX_FUNCTION_ARGS_BYTES - total)
        try:
            pickle.Pickler(sink, protocol=4).dump(value)
        except _PickleSizeExceeded:
            raise SpecError(
                field_name,
                f"the pickled arguments of {function} are over the limit of "
                f"{MAX_FUNCTION_ARGS_BYTES} bytes (at {label})",
            ) from None
        except Exception as e:
            raise SpecError(
                field_name,
                f"{label} of {function} cannot be pickled ({type(e).__name__}: "
                f"{_cut(str(e))}); pass a picklable value (its class {_HOW})",
            ) from None
        total += sink.size


def _check_main_path(function: str, main_path: str) -> None:
    is_main = function.partition(":")[0] == "__main__"
    if not isinstance(main_path, str):
        raise SpecError("main_path", "must be a string")
    if not main_path:
        if is_main:
            raise SpecError(
                "entrypoint",
                f"{function} is a function of a main script: give the function itself (its "
                "script's path is then recorded) or set main_path",
            )
        return
    if not is_main:
        raise SpecError("main_path", "only for a function of the main script ('__main__:fn')")
    if "\x00" in main_path or len(main_path) > MAX_MAIN_PATH:
        raise SpecError("main_path", f"invalid path (NUL, or over {MAX_MAIN_PATH} characters)")
    if not main_path.endswith(".py"):
        raise SpecError("main_path", f"must name a .py file, got {_cut(main_path)!r}")


@dataclass(frozen=True)
class ProcessFailure:
    """One worker's failure, as torchelastic reports it, plus where and when."""

    global_rank: int
    local_rank: int
    pid: int
    exitcode: int
    message: str
    timestamp: float
    """Seconds since the epoch; sub-second when gelastic's own writer or agent set it."""
    node: str = ""
    signal: str = ""
    error_file: str = "<N/A>"
    traceback: str = ""
    attempt: int = 0
    round: int = 0
    root_cause: bool = False
    category: FailureCategory = FailureCategory.USER
    stderr_tail: str = ""
    role: str = ""
    role_rank: int = -1

    def signal_name(self) -> str:
        return self.signal or "<N/A>"

    def timestamp_iso(self) -> str:
        return datetime.fromtimestamp(self.timestamp).isoformat(sep="_", timespec="seconds")


@dataclass(frozen=True)
class AttemptSummary:
    """One attempt (restart count) and why it ended."""

    attempt: int
    round: int
    nodes: tuple[str, ...]
    end_reason: str
    failures: tuple[ProcessFailure, ...] = ()
    started_at: float = 0.0
    ended_at: float = 0.0


@dataclass(frozen=True)
class RunResult:
    """The outcome of a job: torchelastic's RunResult, for every node of the job.

    `return_values` and `failures` are keyed by global rank and never share a key; workers
    that gelastic stopped on purpose are in neither.

    `return_values` holds loaded values only when they were verified: the result of a `Job`
    that this process submitted (it holds the job's key). A result fetched without the key (a
    job looked up by id, `gelastic result`) is never unpickled: `return_values` is empty and
    `raw_return_values` holds the tagged bytes; `client.results.trusted_load` loads one, and
    `client.results.verified_load` checks it against the key first.
    """

    state: WorkerState
    return_values: dict[int, Any] = field(default_factory=dict)
    failures: dict[int, ProcessFailure] = field(default_factory=dict)
    attempts: tuple[AttemptSummary, ...] = ()
    reason: str = ""
    job_id: str = ""
    name: str = ""
    raw_return_values: dict[int, bytes] = field(default_factory=dict, repr=False)
    """The return values as the workers wrote them (tag + pickle), by global rank; not loaded."""
    return_value_sizes: dict[int, int] = field(default_factory=dict)
    """Size in bytes of each rank's return value, as jobs, lists and watches report it."""

    def is_failed(self) -> bool:
        return self.state == WorkerState.FAILED

    @property
    def root_cause(self) -> ProcessFailure | None:
        """The first failure observed across all nodes (smallest timestamp)."""
        marked = [f for f in self.failures.values() if f.root_cause]
        if marked:
            return marked[0]
        return first_failure(self.failures)

    def format_failures(self, name: str = "") -> str:
        """A report shaped like torchelastic's ChildFailedError table, root cause first."""
        return format_failures(self, name or self.name or self.job_id)


def first_failure(failures: Mapping[int, ProcessFailure]) -> ProcessFailure | None:
    """Root cause: smallest timestamp; ties go to the smallest global rank."""
    if not failures:
        return None
    return min(failures.values(), key=lambda f: (f.timestamp, f.global_rank))


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


# --- the failure table ---------------------------------------------------------------------
# The shape of torchelastic's ChildFailedError message (same frame, width rule, rows and
# indentation) with the root cause first, plus where (node, executable) and when (attempt,
# round) each failure happened, and how each other failure relates to the root cause in time.
# Every report of a failed job (`gelastic run`, `submit --watch`, `result`, `wait`) is this one.


def format_failures(result: RunResult, name: str) -> str:
    """The failure table of `result`: root cause first, then the other failures by time."""
    title = f"{_one_line(name or result.name or result.job_id or 'job')} FAILED"
    root = result.root_cause
    # The same failure order as first_failure: time, then global rank.
    ordered = sorted(result.failures.values(), key=lambda f: (_sort_time(f), f.global_rank))
    others = [f for f in ordered if f is not root]
    root_block = format_failure_block(0, _rows(root, None)) if root is not None else ""
    other_blocks = [
        format_failure_block(idx, _rows(f, root))
        for idx, f in enumerate(others, start=1 if root is not None else 0)
    ]
    return format_failure_table(title, root_block, other_blocks)


def _rows(failure: ProcessFailure, root: ProcessFailure | None) -> list[tuple[str, str]]:
    rows = [("time", _time(failure.timestamp))]
    if root is not None:
        rows.append(("order", _order(failure, root)))
    signame = _one_line(failure.signal) or (
        signal_name(-failure.exitcode) if failure.exitcode < 0 else ""
    )
    signame_part = f" ({signame})" if signame and signame != NOT_AVAILABLE else ""
    # The agent's note on the message says which executable ran where: a row of its own, as
    # the node has, never part of the message or traceback shown.
    message, executable = _split_executable_note(failure.message)
    rows += [
        ("node", _one_line(failure.node) or NOT_AVAILABLE),
        ("attempt", f"{failure.attempt} (round: {failure.round})"),
        ("rank", f"{failure.global_rank} (local_rank: {failure.local_rank})"),
        # torchelastic's spacing, kept so the table reads the same: one space after the pid,
        # then " (SIGNAME)" only for a death by signal.
        ("exitcode", f"{failure.exitcode} (pid: {failure.pid}) {signame_part}"),
        ("error_file", _one_line(failure.error_file) or NOT_AVAILABLE),
    ]
    if executable:
        rows.append(("executable", _one_line(executable)))
    rows.append(("traceback", indent_continuation(failure.traceback or message or NOT_AVAILABLE)))
    tail = failure.stderr_tail.rstrip("\n")
    if tail.strip() and not failure.traceback:
        count = tail.count("\n") + 1
        noun = "line" if count == 1 else "lines"
        rows.append(("stderr", f"last {count} {noun}" + indent_continuation("\n" + tail, "    ")))
    return rows


_RAN_NOTE = re.compile(
    r"(?s)(?P<message>.*) \(ran (?P<executable>[^\n]+) on node (?P<node>[^\s()]+)\)"
)


def executable_note(executable: str, node: str) -> str:
    """What the agent appends to a worker's own failure message: which executable ran it on
    which node (e.g. a bare "python" that the agent's PATH resolved to the system's)."""
    return f"(ran {executable} on node {node})"


def _split_executable_note(message: str) -> tuple[str, str]:
    """(the message without its `executable_note`, the executable); "" when it has none."""
    m = _RAN_NOTE.fullmatch(message)
    if m is None:
        return message, ""
    return m.group("message"), m.group("executable")


def _one_line(text: str) -> str:
    # A newline in a one-line field would start a line that reads as a new row or entry.
    return text.replace("\r", "\\r").replace("\n", "\\n")


def _order(failure: ProcessFailure, root: ProcessFailure) -> str:
    t, root_t = _sort_time(failure), _sort_time(root)
    if t > root_t:
        later = f"{t - root_t:.3f} s after" if math.isfinite(t - root_t) else "after"
        if _split_executable_note(failure.message)[0] == _split_executable_note(root.message)[0]:
            # The same error on its own (every rank ran the same bad line), not a consequence.
            return f"also failed, {later} the root cause, with the same error"
        return f"failed {later} the root cause, perhaps because of it"
    if t == root_t:
        return "failed at the same time as the root cause"
    # Possible when the coordinator chose the root cause and nodes' clocks disagree.
    return "failed before the root cause by its node's clock (the root cause was seen first)"


def _sort_time(failure: ProcessFailure) -> float:
    # NaN would make every comparison false and the order depend on the input order.
    t = failure.timestamp
    return t if t == t else float("inf")


def _time(timestamp: float) -> str:
    # Milliseconds, because the root cause is decided below one second.
    try:
        return datetime.fromtimestamp(timestamp).isoformat(sep="_", timespec="milliseconds")
    except (ValueError, OverflowError, OSError, TypeError):
        return repr(timestamp)
