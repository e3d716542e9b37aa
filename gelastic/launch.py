"""The in-process launcher: torchelastic's `elastic_launch(config, entrypoint)(*args)`, here.

``launch(LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=2), fn)(x)`` runs `fn(x)` on
`nproc_per_node` workers of a cluster embedded in this process for the call (a coordinator and
one node agent on loopback, behind a token only this process holds: `gelastic run`'s
`EmbeddedCluster`), and returns ``{global rank: return value}``; a failure raises
`ChildFailedError` whose failures are torch's own `ProcessFailure`s, built from the workers'
error files as torch builds them (torch's classes when torch can be imported, else the
look-alikes of `client.errors`). `config` is torch's own
`torch.distributed.launcher.api.LaunchConfig` or this module's `LaunchConfig`, which has the same
fields and defaults for a host without torch; docs/python-api.md says what each field does here.

Return values. The cluster lives and dies with this call, inside this process: its coordinator
and its agent are this process, every worker is a child of it running the caller's own function,
and the token that lets a process join as a node is in a 0600 file of a private 0700 directory.
The caller is then the only party that could have written a return value, so the pickles are
loaded (as torch's launcher does) unless `trust_pickles=False`; JSON values need no trust.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from client import Client
from client import errors as gelastic_errors
from client.model import JobSpec, ProcessFailure, RunResult, is_host, is_name
from gelastic._cli_run import EmbeddedCluster, settled

__all__ = [
    "LaunchConfig",
    "LaunchError",
    "child_failed_error",
    "entrypoint_name",
    "launch",
    "launch_spec",
]

DEFAULT_RDZV_TIMEOUT_S = 900
"""torch's rendezvous timeout when neither `rdzv_timeout` nor `rdzv_configs["timeout"]` is set."""
MAX_RUN_ID = 128
"""Longest `run_id` (it names the job)."""
_IGNORED_BACKENDS = frozenset({"c10d", "etcd", "etcd-v2", "static", "zeus-adapter"})


class LaunchError(ValueError):
    """A `LaunchConfig` this launcher cannot honour, naming the field and the value."""


@dataclass
class LaunchConfig:
    """torch's `LaunchConfig`, field for field, for a host without torch.

    `launch()` takes this or torch's own; the docstrings say what each field does here.
    """

    min_nodes: int
    """Must be 1: the embedded cluster is this one host."""
    max_nodes: int
    """At least `min_nodes`; the job runs on this host alone, so it never waits for more."""
    nproc_per_node: int
    """Workers on this host (LOCAL_WORLD_SIZE, and WORLD_SIZE)."""
    logs_specs: Any = None
    """Accepted; worker logs go to a directory of the call's own (kept when the job fails)."""
    run_id: str = ""
    """TORCHELASTIC_RUN_ID's job name; "" makes a random one, as torch does."""
    role: str = "default_role"
    """ROLE_NAME of the workers."""
    rdzv_endpoint: str = ""
    """Only for the "static" backend: host:port of MASTER_ADDR and MASTER_PORT."""
    rdzv_backend: str = "etcd"
    """Accepted; the embedded coordinator is the rendezvous, whatever the backend."""
    rdzv_configs: dict[str, Any] = field(default_factory=dict)
    """"join_timeout" (c10d's), else "timeout": seconds to wait for the node to join;
    "last_call_timeout" likewise."""
    rdzv_timeout: int = -1
    """Legacy: when not -1, becomes `rdzv_configs["timeout"]`, as in torch."""
    max_restarts: int = 3
    """Restarts of the whole group after a failure, as torchelastic's."""
    monitor_interval: float = 0.1
    """Accepted; the agent is told of a worker's exit at once, it does not poll."""
    start_method: str = "spawn"
    """Accepted; every worker is a fresh interpreter, as with "spawn"."""
    log_line_prefix_template: str | None = None
    """Accepted; the prefix is TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE's, as for `gelastic run`."""
    metrics_cfg: dict[str, str] = field(default_factory=dict)
    """Accepted, unused."""
    local_addr: str | None = None
    """The address of this node (MASTER_ADDR unless the static endpoint names one)."""
    event_log_handler: str = "null"
    """Accepted; the job's events are the coordinator's (`gelastic events`)."""
    numa_options: Any = None
    """Accepted, unused."""
    signals_to_handle: str = "SIGTERM,SIGINT,SIGHUP,SIGQUIT"
    """Accepted; the call's thread stops the workers when it is interrupted."""
    duplicate_stdout_filters: list[str] | None = None
    """Accepted, unused."""
    duplicate_stderr_filters: list[str] | None = None
    """Accepted, unused."""
    virtual_local_rank: bool = False
    """Must be False: every worker sees its own LOCAL_RANK."""
    shutdown_timeout: int | None = None
    """Seconds between SIGTERM and SIGKILL when workers are stopped; None reads
    TORCH_ELASTIC_SHUTDOWN_TIMEOUT (default 30), as torch."""

    def __post_init__(self) -> None:
        # torch's own defaults, in torch's order.
        if self.rdzv_timeout != -1:
            self.rdzv_configs["timeout"] = self.rdzv_timeout
        elif "timeout" not in self.rdzv_configs:
            self.rdzv_configs["timeout"] = DEFAULT_RDZV_TIMEOUT_S
        if self.shutdown_timeout is None:
            self.shutdown_timeout = int(os.environ.get("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "30"))
        elif self.shutdown_timeout < 0:
            raise ValueError(f"shutdown_timeout must be non-negative, got {self.shutdown_timeout}")


def _field(config: Any, name: str, default: Any = None) -> Any:
    return getattr(config, name, default)


def _seconds(config: Any, key: str, default: float) -> float:
    configs = _field(config, "rdzv_configs") or {}
    value = configs.get(key, default) if isinstance(configs, Mapping) else default
    try:
        seconds = float(value)
    except (TypeError, ValueError):
        raise LaunchError(
            f"rdzv_configs[{key!r}] must be a number of seconds, got {value!r:.80}"
        ) from None
    if not seconds > 0:
        raise LaunchError(f"rdzv_configs[{key!r}] must be over 0, got {value!r:.80}")
    return seconds


def _static_master(config: Any) -> tuple[str, int]:
    """MASTER_ADDR and MASTER_PORT of the "static" backend's endpoint, as torch reads them."""
    if _field(config, "rdzv_backend") != "static":
        return "", 0
    endpoint = str(_field(config, "rdzv_endpoint") or "").strip()
    host, sep, port = endpoint.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise LaunchError(
            f"rdzv_endpoint must be host:port for the static backend, got {endpoint!r:.80}"
        )
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not is_host(host):
        raise LaunchError(f"rdzv_endpoint's host is not a host name or address: {host!r:.80}")
    return host, int(port)


def launch_spec(
    config: Any, entrypoint: Callable[..., Any] | str, args: tuple[Any, ...]
) -> JobSpec:
    """The one-host job that `launch(config, entrypoint)(*args)` runs (pure; raises LaunchError
    for a config this launcher cannot honour, SpecError for a bad entrypoint or arguments)."""
    min_nodes, max_nodes = _field(config, "min_nodes"), _field(config, "max_nodes")
    if min_nodes != 1:
        raise LaunchError(
            f"min_nodes must be 1 (the embedded cluster is this host), got {min_nodes!r:.40}; "
            "run `gelastic run` with torchrun's multi-node flags on every host instead"
        )
    if not isinstance(max_nodes, int) or max_nodes < min_nodes:
        raise LaunchError(f"max_nodes must be an int >= min_nodes, got {max_nodes!r:.40}")
    if _field(config, "virtual_local_rank", False):
        raise LaunchError("virtual_local_rank is not supported: each worker has its LOCAL_RANK")
    backend = _field(config, "rdzv_backend", "")
    if backend not in _IGNORED_BACKENDS:
        raise LaunchError(f"rdzv_backend {backend!r:.40} is not one torch knows")
    run_id = str(_field(config, "run_id") or "") or f"launch-{uuid.uuid4().hex[:12]}"
    if len(run_id) > MAX_RUN_ID or not is_name(run_id):
        raise LaunchError(f"run_id must be a name (letters, digits, ._-), got {run_id!r:.80}")
    local_addr = _field(config, "local_addr") or ""
    if local_addr and not is_host(local_addr):
        raise LaunchError(f"local_addr is not a host name or address: {local_addr!r:.80}")
    master_addr, master_port = _static_master(config)
    shutdown = _field(config, "shutdown_timeout")
    common: dict[str, Any] = {
        "nproc_per_node": _field(config, "nproc_per_node"),
        "min_nodes": 1,
        "max_nodes": 1,
        "max_restarts": _field(config, "max_restarts", 3),
        "role": _field(config, "role", "default_role"),
        "name": run_id,
        # c10d's key, else the one torch's other backends (and rdzv_timeout) use.
        "join_timeout": _seconds(
            config, "join_timeout", _seconds(config, "timeout", DEFAULT_RDZV_TIMEOUT_S)
        ),
        "last_call_timeout": _seconds(config, "last_call_timeout", 30.0),
        "stop_grace": float(30 if shutdown is None else shutdown),
        "master_addr": master_addr or local_addr,
        "master_port": master_port,
        "tee": "3",
        "cwd": os.getcwd(),
    }
    if isinstance(entrypoint, str):
        # torch: a str entrypoint is a program, its arguments the args' strings.
        return JobSpec(entrypoint=[entrypoint], args=[str(a) for a in args], **common)
    return JobSpec(entrypoint=entrypoint, args=args, **common)


def child_failed_error(name: str, result: RunResult) -> Exception:
    """torch's `ChildFailedError(name, failures)` for a failed job, keyed by global rank.

    Each failure is torch's `ProcessFailure(local_rank, pid, exitcode, error_file)`, which reads
    the worker's error file as torch's agent does (the files are on this host); torch's classes
    when torch can be imported, else `client.errors`'. The root cause comes first, so that
    `get_first_failure()` (the smallest whole-second timestamp, ties to the first) names it.
    """
    error_cls, failure_cls = _torch_error_classes()
    root = result.root_cause
    ordered = sorted(result.failures.values(), key=lambda f: (f is not root, f.precise_timestamp))
    failures = {f.global_rank: _torch_failure(failure_cls, f) for f in ordered}
    return error_cls(name, failures)  # type: ignore[no-any-return]


def _torch_error_classes() -> tuple[Any, Any]:
    try:
        from torch.distributed.elastic.multiprocessing.errors import (
            ChildFailedError,
        )
        from torch.distributed.elastic.multiprocessing.errors import (
            ProcessFailure as TorchProcessFailure,
        )
    except ImportError:
        return gelastic_errors.ChildFailedError, gelastic_errors.ProcessFailure
    return ChildFailedError, TorchProcessFailure


def _torch_failure(failure_cls: Any, f: ProcessFailure) -> Any:
    path = f.error_file if f.error_file != gelastic_errors.NOT_AVAILABLE else ""
    try:
        return failure_cls(f.local_rank, f.pid, f.exitcode, path)
    except (OSError, ValueError, KeyError, TypeError):
        # A file torch could not read: the failure as gelastic read it.
        made = failure_cls(f.local_rank, f.pid, f.exitcode, "")
        made.message = f.report_text
        return made


def launch(
    config: Any, entrypoint: Callable[..., Any] | str, *, trust_pickles: bool = True
) -> Callable[..., dict[int, Any]]:
    """`elastic_launch(config, entrypoint)`: call the result with the entrypoint's arguments.

    Returns ``{global rank: return value}`` (None for each rank of a program entrypoint) or
    raises torch's `ChildFailedError`. `trust_pickles=False` leaves a value that is not JSON
    as a `client.results.PickledReturnValue` instead of loading it (see the module's notes).
    """

    def run(*args: Any) -> dict[int, Any]:
        spec = launch_spec(config, entrypoint, args)
        return _run(spec, entrypoint_name(entrypoint, args), trust_pickles)

    return run


def _run(spec: JobSpec, name: str, trust_pickles: bool) -> dict[int, Any]:
    log_dir = tempfile.mkdtemp(prefix="gelastic-launch-")
    state_dir = tempfile.mkdtemp(prefix="gelastic-launch-state-")
    cluster = EmbeddedCluster(
        slots=spec.nproc_per_node,
        log_dir=log_dir,
        state_dir=state_dir,
        addr=spec.master_addr or "127.0.0.1",
    )
    keep_logs = False
    try:
        address = cluster.start()
        with Client(address, token_file=cluster.token_file) as client:
            job = client.submit(spec)
            result = job.wait(trust_pickles=trust_pickles)
            if not result.is_failed():
                return _values(result, spec)
            result = settled(job, result, spec.stop_grace)
        # The failures' error files and logs stay: the error reads them, its report names them.
        keep_logs = True
        raise child_failed_error(name, result)
    finally:
        cluster.stop(spec.stop_grace)
        shutil.rmtree(state_dir, ignore_errors=True)
        if not keep_logs:
            shutil.rmtree(log_dir, ignore_errors=True)


def _values(result: RunResult, spec: JobSpec) -> dict[int, Any]:
    if not spec.is_function:
        return dict.fromkeys(range(spec.nproc_per_node))
    return dict(sorted(result.return_values.items()))


def entrypoint_name(entrypoint: Callable[..., Any] | str, args: tuple[Any, ...]) -> str:
    """The name torch's launcher gives the entrypoint in its `ChildFailedError`: a function's
    `__name__`; for the python interpreter, its script (the first argument not an option)."""
    if not isinstance(entrypoint, str):
        return str(getattr(entrypoint, "__name__", type(entrypoint).__name__))
    if entrypoint == sys.executable:
        return next((str(a) for a in args if not str(a).startswith("-")), "")
    return entrypoint
