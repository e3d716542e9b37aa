"""`gelastic run`'s command line and the plan made of it, before anything starts.

torchrun's flags (and their PET_* defaults), the ones accepted for compatibility and the ones
refused, the multi-node rendezvous (`gelastic._rdzv`), the workers' count, the checks that the
script, module or program is there, and the JobSpec every node would submit.
"""

from __future__ import annotations

import argparse
import importlib.machinery
import logging
import os
import re
import shutil
import socket
import sys
from dataclasses import dataclass, replace
from typing import Any, NoReturn

from client.model import JobSpec, SpecError, is_host
from client.stall_flags import add_stall_options
from gelastic._rdzv import (
    BACKENDS,
    C10D_PORT,
    ETCD_PORT,
    STATIC_PORT,
    MultiNode,
    RdzvError,
    default_node_name,
    job_name_for,
    parse_endpoint,
    parse_rdzv_conf,
    token_file_from,
)

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2

PREFIX_TEMPLATE_ENV = "TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE"
RANK_PREFIX_TEMPLATE = "[${rank}]:"
"""Teed lines start with the global rank, e.g. ``[1]:``."""
START_TIMEOUT_S = 30.0
"""How long the embedded coordinator and agent may take to come up."""
CANCEL_SLACK_S = 15.0
"""Time on top of the job's stop grace for a cancelled job to end."""

# torchrun flags that change nothing on one host: accepted, so a torchrun command line works
# unchanged, listed in --help as such and named in a one-line note.
_IGNORED_WITH_VALUE: dict[str, str] = {
    "rdzv-backend": "on one host the embedded coordinator is the rendezvous (several nodes: "
    "c10d, static or etcd)",
    "rdzv-id": "on one host the run id is the job id the embedded coordinator makes (several "
    "nodes: one job per id)",
    "rdzv-conf": "on one host the embedded coordinator is the rendezvous (several nodes: "
    "is_host, token_file, join_timeout, last_call_timeout, close_timeout, leader_ttl, "
    "replica_port)",
    "monitor-interval": "workers' exits are reported the moment they happen",
    "start-method": "every worker is a fresh process",
}
# torchrun flags whose effect this command does not have: ignoring them would change what the
# job does, so they are refused unless they hold torchrun's default (the value that asks for
# nothing). Each reads PET_<DEST> as torchrun does.
_REFUSED: dict[str, str] = {
    "rdzv-endpoint": "with --nnodes 1 and the static backend this host is the only node; for "
    "several nodes give --nnodes MIN:MAX (and --rdzv-backend c10d or etcd)",
    "node-rank": "with --nnodes 1 this host is the only node, so its node rank is 0",
    "event-log-handler": "events are kept by the coordinator (see 'gelastic events'); only "
    "'null' is accepted",
    "logs-specs": "logs go to --log-dir/<job>/attempt_<n>/<rank>/ and cannot be replaced; "
    "only 'default' is accepted",
    "numa-binding": "NUMA binding is not available",
    "signals-to-handle": "SIGINT, SIGTERM, SIGHUP (and SIGQUIT) cancel the job; no other "
    "signal can be forwarded to the workers",
    "duplicate-stdout-filters": "output filters are not available",
    "duplicate-stderr-filters": "output filters are not available",
    "virtual-local-rank": "every worker sees its own LOCAL_RANK",
}
_DEFAULT_SIGNALS = frozenset({"SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT"})
_MULTINODE_FLAGS = frozenset({"rdzv-endpoint", "node-rank", "rdzv-backend", "rdzv-id", "rdzv-conf"})
"""Flags that a run of several nodes reads (refused or ignored when this host is the only node)."""
_NO_ENV = frozenset({"logs-specs", "numa-binding"})
"""Options torchrun does not read from PET_*."""

PET_NAMES: tuple[str, ...] = (
    "PET_NNODES",
    "PET_NPROC_PER_NODE",
    "PET_RDZV_BACKEND",
    "PET_RDZV_ENDPOINT",
    "PET_RDZV_ID",
    "PET_RDZV_CONF",
    "PET_STANDALONE",
    "PET_MAX_RESTARTS",
    "PET_MONITOR_INTERVAL",
    "PET_START_METHOD",
    "PET_EVENT_LOG_HANDLER",
    "PET_ROLE",
    "PET_MODULE",
    "PET_NO_PYTHON",
    "PET_RUN_PATH",
    "PET_LOG_DIR",
    "PET_REDIRECTS",
    "PET_TEE",
    "PET_LOCAL_RANKS_FILTER",
    "PET_DUPLICATE_STDOUT_FILTERS",
    "PET_DUPLICATE_STDERR_FILTERS",
    "PET_NODE_RANK",
    "PET_MASTER_ADDR",
    "PET_MASTER_PORT",
    "PET_LOCAL_ADDR",
    "PET_SIGNALS_TO_HANDLE",
    "PET_SHUTDOWN_TIMEOUT",
    "PET_VIRTUAL_LOCAL_RANK",
)
"""Every default torchrun 2.13 reads from the environment (its `env`/`check_env` options)."""

_TRUE = frozenset({"true", "yes", "on"})
_FALSE = frozenset({"false", "no", "off", ""})


class RunError(Exception):
    """A command line that cannot run here; reported as one line, exit code 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        text = " ".join(message.split())
        self.exit(EXIT_USAGE, f"{self.prog}: {text} (see '{self.prog} --help')\n")


def _names(name: str) -> list[str]:
    # torchrun accepts every multi-word option with dashes or underscores.
    long = [f"--{name}"]
    if "-" in name:
        long.append(f"--{name.replace('-', '_')}")
    return long


def _env_default(dest: str, default: str | None) -> str | None:
    # torchrun's `env` action: the default comes from PET_<DEST> (converted by `type`).
    return os.environ.get(f"PET_{dest.upper()}", default)


@dataclass(frozen=True)
class _BadEnv:
    """A PET_* flag whose value is not a boolean; refused by `plan_run`."""

    name: str
    value: str


def _env_flag(dest: str) -> bool | _BadEnv:
    # torchrun's `check_env` action: bool(int(PET_<DEST>)); "true"/"false" are read too.
    name = f"PET_{dest.upper()}"
    raw = os.environ.get(name)
    if raw is None:
        return False
    value = raw.strip().lower()
    if value.lstrip("-").isdigit() and len(value) < 20:
        return int(value) != 0
    if value in _TRUE or value in _FALSE:
        return value in _TRUE
    return _BadEnv(name, raw[:40])


def _flag(group: Any, name: str, help_: str, *short: str) -> None:
    dest = name.replace("-", "_")
    group.add_argument(
        *short, *_names(name), dest=dest, action="store_true", default=_env_flag(dest), help=help_
    )


def run_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="gelastic run",
        description="Run a torchrun-style training script: on this host, or, with torchrun's "
        "multi-node flags run on every node, as one node of a job they form together (see "
        "docs/torchrun-migration.md, 'Several hosts'). An embedded coordinator and node agent "
        "start the workers with torchrun's environment. Every "
        "option reads its default from PET_<OPTION> as torchrun does (e.g. PET_NPROC_PER_NODE, "
        "PET_NO_PYTHON=1).",
        epilog="Exit code: 0 when every rank succeeded, 1 otherwise (like torchrun); 2 for a "
        "command line that cannot run here.",
    )
    p.add_argument(
        *_names("nnodes"),
        dest="nnodes",
        metavar="N",
        default=_env_default("nnodes", "1"),
        help="N or MIN:MAX nodes (default 1); above 1, run the same line on every node with "
        "--rdzv-endpoint (c10d, etcd) or --master-addr and --node-rank (static)",
    )
    p.add_argument(
        *_names("nproc-per-node"),
        dest="nproc_per_node",
        metavar="N",
        default=_env_default("nproc_per_node", "1"),
        help="workers on this host: a number, or auto, cpu, gpu, xpu or the name of torch's "
        "custom device (counted by torch, as torchrun does; default 1)",
    )
    p.add_argument(
        *_names("max-restarts"),
        dest="max_restarts",
        metavar="N",
        type=int,
        default=_env_default("max_restarts", "0"),
        help="failure restarts before the job fails (default 0)",
    )
    p.add_argument(
        "--restart-policy",
        dest="restart_policy",
        metavar="POLICY",
        default="",
        help="which failures restart: '' (default) all but input errors (a SyntaxError, a "
        "failed import of the script, a missing script, an argparse usage error), which fail at "
        "once; 'always'; or exit codes such as '2,127' that fail at once too",
    )
    add_stall_options(p, 0.0, "report")
    p.add_argument(
        *_names("role"),
        dest="role",
        metavar="ROLE",
        default=_env_default("role", "default"),
        help="ROLE_NAME of the workers (default: default)",
    )
    p.add_argument(
        "-r",
        *_names("redirects"),
        dest="redirects",
        metavar="MASK",
        default=_env_default("redirects", None),
        help="torchrun --redirects: 0-3 or 'local_rank:mask,...' "
        "(default: none, output is teed with a [rank]: prefix)",
    )
    p.add_argument(
        "-t",
        *_names("tee"),
        dest="tee",
        metavar="MASK",
        default=_env_default("tee", None),
        help="torchrun --tee: 0-3 or 'local_rank:mask,...' (default 3)",
    )
    p.add_argument(
        *_names("local-ranks-filter"),
        dest="local_ranks_filter",
        metavar="RANKS",
        default=_env_default("local_ranks_filter", ""),
        help="only show the output of these local ranks, e.g. 0,1 "
        "(the others go to the log files only)",
    )
    p.add_argument(
        *_names("log-dir"),
        dest="log_dir",
        metavar="DIR",
        default=_env_default("log_dir", None),
        help="where worker logs go (default: a temporary directory, removed when the job succeeds)",
    )
    _flag(p, "module", "the script is a module: run it as 'python -m'", "-m")
    _flag(p, "no-python", "run the script as a program, without the Python interpreter")
    p.add_argument(
        *_names("master-addr"),
        dest="master_addr",
        metavar="ADDR",
        default=_env_default("master_addr", None),
        help="MASTER_ADDR of the workers, where the round's c10d store listens "
        "(default: this host's loopback address)",
    )
    p.add_argument(
        *_names("master-port"),
        dest="master_port",
        metavar="PORT",
        type=int,
        default=_env_default("master_port", None),
        help="a fixed MASTER_PORT (default: a free port reserved for each round); if it is "
        "taken, the round fails naming it",
    )
    p.add_argument(
        *_names("local-addr"),
        dest="local_addr",
        metavar="ADDR",
        default=_env_default("local_addr", None),
        help="the address of this node (its MASTER_ADDR unless --master-addr is given; "
        "default 127.0.0.1)",
    )
    # torchrun's flags that change nothing here: listed in a group of their own.
    compat = p.add_argument_group(
        "accepted for compatibility with torchrun",
        "these torchrun flags are accepted so a torchrun command line runs unchanged; "
        "they change nothing here",
    )
    _flag(
        compat,
        "run-path",
        "the script always runs in its own interpreter (as a python script, even with "
        "--no-python, as torchrun does)",
    )
    _flag(compat, "standalone", "every run is standalone")
    _flag(compat, "use-env", "torch.distributed.launch's flag: LOCAL_RANK is in the environment")
    _flag(
        p,
        "no-use-env",
        "as 'python -m torch.distributed.launch' without --use-env: the script is also given "
        "--local-rank=N (its local rank) before its own arguments",
    )
    p.add_argument(
        *_names("shutdown-timeout"),
        dest="shutdown_timeout",
        metavar="S",
        type=float,
        default=_env_default("shutdown_timeout", "30"),
        help="seconds between SIGTERM and SIGKILL when workers are stopped (default 30)",
    )
    p.add_argument(
        "--preload",
        action="append",
        default=[],
        metavar="MODULE",
        help="import MODULE (e.g. torch) in warm standby workers that take over on a restart "
        "(repeatable; see docs/torchrun-migration.md)",
    )
    p.add_argument(
        "--dashboard",
        action="store_true",
        help="serve the coordinator's web dashboard on loopback for the life of the job and "
        "print its URL (log in with the token in the file it names)",
    )
    p.add_argument(
        "--dashboard-port",
        dest="dashboard_port",
        metavar="PORT",
        type=int,
        default=None,
        help="with --dashboard: the port (default: any free one)",
    )
    p.add_argument(
        "--quiet",
        "-q",
        action="store_true",
        help="no progress lines on stderr (worker output is still shown)",
    )
    p.add_argument(
        *_names("log-level"),
        dest="log_level",
        metavar="LEVEL",
        default="ERROR",
        help="log level of the embedded coordinator and agent (default ERROR: a worker's "
        "failure is in the report at the end)",
    )
    for name, why in _IGNORED_WITH_VALUE.items():
        dest = name.replace("-", "_")
        extra: dict[str, Any] = {}
        if name == "start-method":
            extra["choices"] = ["spawn", "fork", "forkserver"]
        compat.add_argument(
            *_names(name),
            dest=_ignored_dest(name),
            default=_env_default(dest, None),
            metavar="VALUE",
            help=why,
            **extra,
        )
    refused = p.add_argument_group(
        "torchrun flags refused",
        "this command has no such feature: given with anything but torchrun's default, "
        "these flags are refused (exit 2) rather than ignored",
    )
    for name, why in _REFUSED.items():
        dest = name.replace("-", "_")
        if name == "virtual-local-rank":
            _flag(refused, name, why)
            continue
        refused.add_argument(
            *_names(name),
            dest=dest,
            default=None if name in _NO_ENV else _env_default(dest, None),
            metavar="VALUE",
            help=why,
        )
    p.add_argument(
        "training_script",
        metavar="SCRIPT",
        help="the script (or module with -m, or program with --no-python)",
    )
    p.add_argument(
        "training_script_args",
        nargs=argparse.REMAINDER,
        metavar="ARGS",
        help="arguments of the script",
    )
    return p


def _ignored_dest(name: str) -> str:
    return "ignored_" + name.replace("-", "_")


@dataclass(frozen=True)
class RunPlan:
    """What `gelastic run` will do, decided from its command line before anything starts."""

    spec: JobSpec
    report_name: str
    """Title of the failure report: the script's basename or the module, as torchrun does."""
    log_dir: str | None
    notes: tuple[str, ...] = ()
    """One line per flag that was accepted but has no effect here."""
    prefix_template: str = RANK_PREFIX_TEMPLATE
    progress: bool = True
    log_level: str = "ERROR"
    dashboard_port: int | None = None
    """Serve the web dashboard on this port (0: any free one); None: no dashboard."""
    local_addr: str = "127.0.0.1"
    """The embedded node's address (torchrun's --local-addr)."""
    multinode: MultiNode | None = None
    """This node's part in a run of several nodes (None: this host is the only node)."""


def _parse_nnodes(value: str) -> tuple[int, int]:
    parts = value.split(":")
    if len(parts) not in (1, 2) or not all(p.strip().isdigit() and len(p) < 7 for p in parts):
        raise RunError(f"--nnodes must be N or MIN:MAX, got {value[:40]!r}")
    low, high = int(parts[0]), int(parts[-1])
    if not 0 < low <= high:
        raise RunError(f"--nnodes={value}: needs 0 < MIN <= MAX")
    return low, high


def _multinode(args: argparse.Namespace, low: int, high: int) -> MultiNode | None:
    """This node's part in a run of several nodes, or None when this host is the only node.

    As torchrun: --standalone is one host; c10d and etcd meet at --rdzv-endpoint; static (the
    default backend) at --master-addr:--master-port, node rank 0 hosting.
    """
    if args.standalone:
        return None
    backend = str(args.ignored_rdzv_backend or "static").strip()
    if backend not in BACKENDS:
        raise RunError(
            f"--rdzv-backend must be c10d, static or etcd (etcd-v2), got {backend[:40]!r}"
        )
    backend = "etcd" if backend == "etcd-v2" else backend
    endpoint = str(args.rdzv_endpoint or "").strip()
    node_rank = str(args.node_rank).strip() if args.node_rank is not None else ""
    try:
        if backend == "static":
            given = bool(endpoint or args.master_addr or args.master_port is not None or node_rank)
            if high == 1 or not given:
                return None
            if endpoint:
                host, port = parse_endpoint(endpoint, STATIC_PORT)
            else:
                host = args.master_addr or "127.0.0.1"
                port = args.master_port or STATIC_PORT
                if not is_host(host):
                    raise RunError(
                        f"--master-addr must be a host name or IP address, got {host!r:.80}"
                    )
        else:
            if not endpoint or (high == 1 and _loopback_endpoint(endpoint)):
                return None
            host, port = parse_endpoint(endpoint, ETCD_PORT if backend == "etcd" else C10D_PORT)
        conf = parse_rdzv_conf(args.ignored_rdzv_conf)
        token_file = token_file_from(conf, os.environ)
    except RdzvError as exc:
        raise RunError(str(exc)) from None
    rank: int | None = None
    if node_rank:
        if not node_rank.isdigit() or int(node_rank) >= high:
            raise RunError(
                f"--node-rank must be 0-{high - 1} (below --nnodes' MAX), got {node_rank[:20]!r}"
            )
        rank = int(node_rank)
    run_id = str(args.ignored_rdzv_id or "none").strip()
    if not run_id or len(run_id) > 256 or any(ord(c) < 32 for c in run_id):
        raise RunError("--rdzv-id must be 1-256 printable characters")
    if backend == "etcd" and run_id == "none":
        raise RunError(
            "--rdzv-backend etcd needs --rdzv-id: the job is kept in etcd under it, and a run "
            "that reuses an id gets that run's job (e.g. --rdzv-id $SLURM_JOB_ID)"
        )
    if args.local_addr is not None and not is_host(args.local_addr):
        raise RunError(
            f"--local-addr must be a host name or IP address, got {args.local_addr!r:.80}"
        )
    return MultiNode(
        backend=backend,
        host=host,
        port=port,
        run_id=run_id,
        conf=conf,
        node_name=default_node_name(os.environ, socket.gethostname(), os.getpid()),
        token_file=token_file,
        node_rank=rank,
        local_addr=args.local_addr or "",
    )


def _loopback_endpoint(endpoint: str) -> bool:
    text = endpoint.strip()
    host = text.rsplit(":", 1)[0] if text.count(":") <= 1 or text.startswith("[") else text
    return host.lower() in _LOOPBACK or host.startswith("127.")


def cpu_count() -> int:
    """The CPUs this process may run on, as torch counts them (`torch._utils.cpu_count`)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def _parse_nproc(value: str) -> int:
    # torchrun's determine_local_world_size: int() first, then the device names.
    try:
        n = int(value)
    except ValueError:
        pass
    else:
        if n < 1:
            raise RunError(f"--nproc-per-node must be at least 1, got {value}")
        return n
    if value == "cpu":
        return cpu_count()
    if not _DEVICE_NAME.fullmatch(value):
        raise RunError(
            f"--nproc-per-node must be a number, auto, cpu, gpu, xpu or a device name, "
            f"got {value[:40]!r}"
        )
    n = _device_count(value)
    if n < 1:
        raise RunError(f"--nproc-per-node={value}: no {value} device is visible on this host")
    return n


_DEVICE_NAME = re.compile(r"[a-z][a-z0-9_]{0,31}")


def _device_count(value: str) -> int:
    """Workers for a device name, counted by torch (imported here only) as torchrun does."""
    try:
        import torch
    except ImportError:
        if value == "auto":
            return cpu_count()
        raise RunError(f"--nproc-per-node={value} needs torch, which is not importable") from None
    if value == "gpu":
        if not torch.cuda.is_available():
            raise RunError("--nproc-per-node=gpu: CUDA is not available")
        return int(torch.cuda.device_count())
    if value == "xpu":
        if not torch.xpu.is_available():
            raise RunError("--nproc-per-node=xpu: XPU is not available")
        return int(torch.xpu.device_count())
    if value == torch._C._get_privateuse1_backend_name():
        from torch.utils.backend_registration import _get_custom_mod_func

        if not _get_custom_mod_func("is_available")():
            raise RunError(f"--nproc-per-node={value}: {value} is not available")
        return int(_get_custom_mod_func("device_count")())
    if value == "auto":
        if torch.accelerator.is_available():
            return int(torch.accelerator.device_count())
        return cpu_count()
    raise RunError(f"--nproc-per-node: unsupported value {value!r}")


_LOOPBACK = frozenset({"", "localhost", "127.0.0.1", "::1", "[::1]", "0.0.0.0"})


def _refusal(name: str, value: Any) -> bool:
    """Whether `value` of the refused flag `name` asks for something this command lacks."""
    if value is None or value is False:
        return False
    text = str(value).strip()
    if name == "rdzv-endpoint":
        host = text.rsplit(":", 1)[0] if text.count(":") <= 1 or text.startswith("[") else text
        return host.lower() not in _LOOPBACK and not host.startswith("127.")
    if name == "node-rank":
        return text != "0"
    if name == "event-log-handler":
        return text != "null"
    if name == "logs-specs":
        # torchrun's name for its own default (the "torchrun.logs_specs" entry point).
        return text != "default"
    if name == "signals-to-handle":
        names = {s.strip() for s in text.split(",") if s.strip()}
        return not names <= _DEFAULT_SIGNALS
    if name in ("duplicate-stdout-filters", "duplicate-stderr-filters"):
        return text != ""
    return True


def _legacy_local_rank(args: argparse.Namespace, script_args: list[str]) -> list[str]:
    """torch.distributed.launch without --use-env: `--local-rank=N` comes first (the agent puts
    each worker's local rank for `${local_rank}`, as torch's launcher does)."""
    if not args.no_use_env:
        return script_args
    if args.use_env:
        raise RunError("use either --use-env or --no-use-env, not both")
    if args.no_python:
        # torch.distributed.launch's own rule: a program cannot be handed a python flag.
        raise RunError("with --no-python the script cannot take --local-rank: drop --no-use-env")
    return ["--local-rank=${local_rank}", *script_args]


def _ranks_filter(value: str, nproc: int) -> set[int]:
    ranks: set[int] = set()
    for part in value.split(","):
        part = part.strip()
        if not part:
            continue
        if not part.isdigit() or int(part) >= nproc:
            raise RunError(f"--local-ranks-filter: {part!r} is not a local rank below {nproc}")
        ranks.add(int(part))
    return ranks


# Checked before anything starts: otherwise every worker starts only to fail the same way. The
# workers run in this directory (a one-node job's cwd is its agent's, and the agent is ours).


def _check_script(script: str) -> None:
    here = os.getcwd()
    path = os.path.join(here, script)
    runnable = os.path.isfile(path) or os.path.isfile(os.path.join(path, "__main__.py"))
    if not runnable:
        where = "" if os.path.isabs(script) else f" in {here}"
        raise RunError(f"cannot run {script}: no such file{where}")


def _check_program(program: str) -> None:
    if os.sep in program:
        path = os.path.normpath(os.path.join(os.getcwd(), program))
        if not (os.path.isfile(path) and os.access(path, os.X_OK)):
            raise RunError(f"cannot run {program} (--no-python): no executable file at {path}")
    elif shutil.which(program) is None:
        # As exec does: a bare name is looked up in PATH only, never in the cwd.
        here = f"; ./{program} runs the one in this directory" if os.path.isfile(program) else ""
        raise RunError(f"cannot run {program} (--no-python): not found in PATH{here}")


def _check_module(module: str) -> None:
    # As `python -m` looks: the cwd first, then the interpreter's path. Parent packages are
    # looked up, never imported, so none of the job's code runs here.
    search: list[str] | None = [os.getcwd(), *sys.path[1:]]
    found = None
    parts = module.split(".")
    for part in parts:
        if not part.isidentifier():
            found = None
            break
        found = importlib.machinery.PathFinder.find_spec(part, search)
        if found is None:
            if part == parts[0] and part in sys.builtin_module_names:
                return
            break
        search = list(found.submodule_search_locations or [])
    if found is None:
        raise RunError(
            f"cannot run -m {module}: no module named {module!r} in {os.getcwd()} "
            "or the interpreter's path"
        )


def plan_run(args: argparse.Namespace, *, python: str = sys.executable) -> RunPlan:
    """Turn `gelastic run`'s parsed command line into a JobSpec; raise RunError if it cannot run."""
    for value in vars(args).values():
        if isinstance(value, _BadEnv):
            raise RunError(f"{value.name} must be 0, 1, true or false, got {value.value!r}")
    low, high = _parse_nnodes(str(args.nnodes))
    multi = _multinode(args, low, high)
    for name, why in _REFUSED.items():
        if name in _MULTINODE_FLAGS and (multi is not None or args.standalone):
            continue  # read by the run of several nodes; --standalone: torchrun ignores them
        if _refusal(name, getattr(args, name.replace("-", "_"))):
            raise RunError(f"--{name} is not supported: {why}")
    notes = [
        f"ignoring --{name}: {why}"
        for name, why in _IGNORED_WITH_VALUE.items()
        if getattr(args, _ignored_dest(name)) is not None
        and not (multi is not None and name in _MULTINODE_FLAGS)
    ]
    if multi is not None:
        notes.extend(
            f"ignoring --rdzv-conf {key}: torch's own rendezvous setting"
            for key in multi.conf.ignored
        )
    elif low != 1:
        raise RunError(
            f"--nnodes={args.nnodes}: at least {low} nodes must join, so run the same line on "
            "every node with --rdzv-endpoint HOST:PORT (c10d, the node owning HOST hosts the "
            "rendezvous) or --master-addr and --node-rank (static)"
        )
    nproc = _parse_nproc(str(args.nproc_per_node))
    log_level = str(args.log_level).upper()
    if not isinstance(logging.getLevelName(log_level), int):
        raise RunError(f"--log-level must be DEBUG, INFO, WARNING or ERROR, got {args.log_level!r}")
    if args.module and args.no_python and not args.run_path:
        raise RunError("use either --module (-m) or --no-python, not both")
    script: str = args.training_script
    script_args = _legacy_local_rank(args, list(args.training_script_args))
    # torchrun: python entrypoints run under $PYTHON_EXEC when it is set.
    python = os.environ.get("PYTHON_EXEC") or python
    if args.run_path:
        # torchrun's --run-path runs the script as a python script, before --no-python/-m.
        entry = [python, "-u", script]
    elif args.no_python:
        entry = [script]
    elif args.module:
        # `-u`: unbuffered, as torchrun runs its workers, so teed lines arrive as printed.
        entry = [python, "-u", "-m", script]
    else:
        entry = [python, "-u", script]
    redirects = args.redirects if args.redirects is not None else "0"
    tee = args.tee if args.tee is not None else ("3" if args.redirects is None else "0")
    if args.local_ranks_filter:
        shown = _ranks_filter(args.local_ranks_filter, nproc)
        # Ranks filtered out write to their log files only.
        tee = ",".join(f"{lr}:{3 if lr in shown else 0}" for lr in range(nproc))
        redirects = ",".join(f"{lr}:{0 if lr in shown else 3}" for lr in range(nproc))
    spec = JobSpec(
        entrypoint=entry,
        args=script_args,
        nproc_per_node=nproc,
        min_nodes=1,
        max_nodes=1,
        max_restarts=args.max_restarts,
        restart_policy=args.restart_policy,
        stall_timeout=args.stall_timeout,
        stall_action=args.stall_action,
        role=args.role,
        redirects=redirects,
        tee=tee,
        # One node: the round can close as soon as the node is there.
        last_call_timeout=0.0,
        join_timeout=START_TIMEOUT_S,
        exit_barrier_timeout=START_TIMEOUT_S,
        stop_grace=args.shutdown_timeout,
        preload=tuple(args.preload),
        master_addr=args.master_addr or args.local_addr or "",
        master_port=args.master_port or 0,
    )
    if multi is not None:
        # Every node submits this spec: it holds nothing of one node's (its address, ports).
        # The workers' c10d store is on group rank 0's node, at a port it reserves per round.
        spec = replace(
            spec,
            name=job_name_for(multi.run_id),
            min_nodes=low,
            max_nodes=high,
            last_call_timeout=multi.conf.last_call_timeout,
            join_timeout=multi.conf.join_timeout,
            exit_barrier_timeout=JobSpec.exit_barrier_timeout,
            master_addr="",
            master_port=0,
            # The other nodes' launchers are still coming: a round waits its last call for them.
            wait_for_nodes=True,
        )
    if args.local_addr is not None and not is_host(args.local_addr):
        raise RunError(
            f"--local-addr must be a host name or IP address, got {args.local_addr!r:.80}"
        )
    if args.master_port is not None and not 0 < args.master_port < 65536:
        raise RunError(f"--master-port must be 1-65535, got {args.master_port}")
    try:
        spec.validate()
    except SpecError as exc:
        raise RunError(str(exc)) from None
    if args.run_path or not (args.no_python or args.module):
        _check_script(script)
    elif args.no_python:
        _check_program(script)
    elif python == sys.executable:  # another interpreter has a path of its own
        _check_module(script)
    name = script if args.module and not args.run_path else os.path.basename(script)
    dashboard_port = None
    if args.dashboard or args.dashboard_port is not None:
        dashboard_port = args.dashboard_port or 0
        if not 0 <= dashboard_port < 65536:
            raise RunError(f"--dashboard-port must be 0-65535, got {dashboard_port}")
        if multi is not None and not multi.token_file:
            # One node runs with a token of its own; several share the one they are given.
            raise RunError(
                "--dashboard needs a token on several nodes (--rdzv-conf token_file=PATH or "
                "$GELASTIC_TOKEN_FILE): without one, anyone who reaches its port could read "
                "every job, its spec and its logs"
            )
    return RunPlan(
        spec=spec,
        report_name=name,
        log_dir=args.log_dir,
        notes=tuple(notes),
        prefix_template=os.environ.get(PREFIX_TEMPLATE_ENV, RANK_PREFIX_TEMPLATE),
        progress=not args.quiet,
        log_level=log_level,
        dashboard_port=dashboard_port,
        local_addr=args.local_addr or "127.0.0.1",
        multinode=multi,
    )
