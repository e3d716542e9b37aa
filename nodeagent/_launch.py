"""The launch plan: what to run for each local worker of a round, as data.

`build_launch_plan` turns a `RoundAssignment` into one `WorkerLaunch` per local worker: argv,
the torchrun-compatible environment, cwd and the paths of its logs, error file and (for function
entrypoints) its argument and return-value files. It touches nothing; spawning the plan is
`nodeagent._process.spawn`, preparing the directories is `nodeagent._workers.WorkerGroup`.

Log layout (also read back by the log reader, through `attempt_dir`)::

    <log_root>/<job_id>/attempt_<attempt>/<global_rank>/{stdout.log,stderr.log,error.json}

The first round of an attempt owns ``attempt_<attempt>``. A membership change re-forms the round
without a new attempt; such a later round of the same attempt gets ``attempt_<attempt>.<round>``
so the logs of the earlier round are never overwritten. Which of the two names a round gets is
recorded in a ``round`` marker file inside the directory (see `resolve_attempt_dir`).

The workers' c10d store: for a python job (a function, or a command run by a python interpreter)
the workers get ``TORCHELASTIC_USE_AGENT_STORE=True`` and every rank is a TCPStore client of
MASTER_ADDR:MASTER_PORT, where group rank 0's agent runs a store host (`StoreHostLaunch`, the
script ``_c10d_store.py``) that outlives the round's workers. The choice is made from the spec
alone, so every node of a round makes the same one. Other commands keep ``False``: worker RANK 0
hosts the store, as before.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import stat
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from string import Template

from client.assignment import RoundAssignment, WorkerRanks
from client.model import JobSpec, parse_std_mapping
from client.progress import PROGRESS_FILE_ENV

__all__ = [
    "BOOTSTRAP_PATH",
    "PREEMPT_FILE_ENV",
    "PROGRESS_FILE_ENV",
    "STDERR",
    "STDOUT",
    "STORE_HOST_PATH",
    "StandbyLaunch",
    "StoreHostLaunch",
    "WorkerLaunch",
    "attempt_dir",
    "attempt_dir_name",
    "bounded",
    "build_launch_plan",
    "build_standby_launch",
    "build_store_host_launch",
    "check_main_script",
    "describe_executable",
    "entrypoint_name",
    "find_attempt_dir",
    "job_python",
    "parse_python_command",
    "preempt_file",
    "progress_file",
    "resolve_attempt_dir",
    "resolve_executable",
    "role_spec",
    "tee_prefix",
    "uses_agent_store",
    "watchdog_request",
]

STDOUT = 1
"""torchrun's Std.OUT bit in redirect/tee masks."""
STDERR = 2
"""torchrun's Std.ERR bit in redirect/tee masks."""

BOOTSTRAP_PATH = str(Path(__file__).with_name("_bootstrap_stub.py").resolve())
"""The standalone script every python worker runs under (executed by path): it runs
`_bootstrap.py` from its cached bytecode."""

STORE_HOST_PATH = str(Path(__file__).with_name("_c10d_store.py").resolve())
"""The standalone script that serves a round's c10d store (executed by path, imports torch)."""

STORE_HOST_LOG = "c10d_store.log"
"""The store host's stderr, in the round's attempt directory."""

USE_AGENT_STORE = "TORCHELASTIC_USE_AGENT_STORE"

ROUND_MARKER = "round"
"""File inside an attempt directory holding the round number that owns it."""

_PYTHON_NAME = re.compile(r"python(\d+(\.\d+)?)?")  # fullmatch: `$` accepts a trailing newline
# Interpreter options that take no value and do not change how the target is chosen.
_NOARG_FLAGS = frozenset("bBdEIOPqsSuvR")
# Options whose value is either glued on (-Wignore) or the next argument (-W ignore).
_VALUE_FLAGS = frozenset("WX")
_DEFAULT_PREFIX_TEMPLATE = "[${role_name}${local_rank}]:"


@dataclass(frozen=True)
class PythonCommand:
    """A `python ...` command split the way the interpreter reads it."""

    interpreter: str
    flags: tuple[str, ...]
    mode: str
    """"script", "module" or "code"."""
    target: str
    args: tuple[str, ...]


@dataclass(frozen=True)
class WorkerLaunch:
    """Everything needed to start one worker process; pure data."""

    local_rank: int
    global_rank: int
    role_rank: int
    role: str
    argv: tuple[str, ...]
    env: dict[str, str]
    cwd: str
    log_dir: Path
    stdout_path: Path
    stderr_path: Path
    error_file: Path
    return_file: Path | None
    """Where a function entrypoint's pickled return value lands; None for commands."""
    args_file: Path | None
    """Where the pickled (args, kwargs) of a function entrypoint must be written first."""
    args_bytes: bytes | None = field(repr=False)
    """Content of `args_file` (`function_args_file`; holds the job's result key); written by
    the group before spawning."""
    redirect: int
    """torchrun Std mask: streams that go to the log file only."""
    tee: int
    """torchrun Std mask: streams that also go to the agent console, prefixed."""
    prefix: str
    """Line prefix for teed output, e.g. ``[default0]:``."""
    program: str
    """The program the user asked for (argv[0] of the command, or the function), for messages."""
    is_function: bool = False


@dataclass(frozen=True)
class StoreHostLaunch:
    """How group rank 0's agent starts the process that serves one round's c10d store."""

    argv: tuple[str, ...]
    """The job's interpreter and the store script; the agent appends its pid and the socket."""
    env: dict[str, str]
    """The workers' environment without their identity: the same torch is found."""
    cwd: str
    log_path: Path
    """Where the store host's stderr goes."""
    addr: str
    port: int


@dataclass(frozen=True)
class StandbyLaunch:
    """A warm standby of a job on this node: its interpreter, the job's env, no round yet."""

    prefix: tuple[str, ...]
    """Interpreter, its flags and the bootstrap: what every worker argv of the job starts with."""
    argv: tuple[str, ...]
    """`prefix` plus the standby options (the pipe descriptor is appended when spawned)."""
    env: dict[str, str]
    cwd: str
    preload: tuple[str, ...]


def attempt_dir_name(attempt: int, round_: int, *, first_round_of_attempt: bool) -> str:
    """``attempt_<a>`` for the first round of an attempt, ``attempt_<a>.<round>`` after."""
    if first_round_of_attempt:
        return f"attempt_{attempt}"
    return f"attempt_{attempt}.{round_}"


def attempt_dir(
    log_root: Path, job_id: str, attempt: int, round_: int, *, first_round_of_attempt: bool
) -> Path:
    """The directory of one round's logs (pure; see the module docstring for the rule)."""
    name = attempt_dir_name(attempt, round_, first_round_of_attempt=first_round_of_attempt)
    return Path(log_root) / job_id / name


def _marker_round(directory: Path) -> int | None:
    try:
        return int((directory / ROUND_MARKER).read_text().strip())
    except (OSError, ValueError):
        return None


def resolve_attempt_dir(log_root: Path, job_id: str, attempt: int, round_: int) -> Path:
    """The directory a round should write its logs to; never one an earlier round owns.

    Reads (does not write) the file system: ``attempt_<a>`` is used when it does not exist yet
    or its ``round`` marker names this round (several agents on one host share it). A directory
    without a marker is being created by a peer agent of this same round right now.
    """
    first = attempt_dir(log_root, job_id, attempt, round_, first_round_of_attempt=True)
    if not first.exists():
        return first
    owner = _marker_round(first)
    if owner is None or owner == round_:
        return first
    return attempt_dir(log_root, job_id, attempt, round_, first_round_of_attempt=False)


def find_attempt_dir(log_root: Path, job_id: str, attempt: int, round_: int) -> Path | None:
    """For readers: the existing log directory of (attempt, round), or None."""
    later = attempt_dir(log_root, job_id, attempt, round_, first_round_of_attempt=False)
    if later.is_dir():
        return later
    first = attempt_dir(log_root, job_id, attempt, round_, first_round_of_attempt=True)
    if first.is_dir() and _marker_round(first) in (None, round_):
        return first
    return None


def attempt_dirs(log_root: Path, job_id: str, attempt: int) -> list[Path]:
    """For readers: every existing log directory of one attempt, latest round first."""
    base = Path(log_root) / job_id
    dirs = [base / f"attempt_{attempt}", *base.glob(f"attempt_{attempt}.*")]
    return sorted((d for d in dirs if d.is_dir()), key=lambda d: d.stat().st_mtime, reverse=True)


def tee_prefix(template: str | None, *, role: str, local_rank: int, rank: int) -> str:
    """torchrun's tee line prefix; TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE may override it."""
    return Template(template or _DEFAULT_PREFIX_TEMPLATE).safe_substitute(
        role_name=role, rank=str(rank), local_rank=str(local_rank)
    )


MAX_SHOWN_PATH = 300
"""How much of a PATH (or an executable's path) a failure message quotes."""


def bounded(text: str, limit: int = MAX_SHOWN_PATH) -> str:
    """`text`, cut to at most `limit` characters (with an ellipsis) for a message."""
    return text if len(text) <= limit else text[: limit - 3] + "..."


def resolve_executable(program: str, env: Mapping[str, str], cwd: str) -> str | None:
    """The file `program` (argv[0]) runs as: a path as given (relative to `cwd`), a bare name
    looked up in the worker's PATH as exec does; None when there is no such executable."""
    if os.sep in program:
        path = program if os.path.isabs(program) else os.path.join(cwd, program)
        return path if os.path.isfile(path) and os.access(path, os.X_OK) else None
    return shutil.which(program, path=env.get("PATH", os.defpath))


def describe_executable(launch: WorkerLaunch) -> str:
    """Which executable a worker ran, for its failure's `executable` (bounded)."""
    program = launch.argv[0]
    found = resolve_executable(program, launch.env, launch.cwd)
    return bounded(found) if found is not None else f"{bounded(program)!r}, not found"


def _is_python(program: str, python: str) -> bool:
    return (
        program == python
        or program == sys.executable
        or bool(_PYTHON_NAME.fullmatch(os.path.basename(program)))
    )


def parse_python_command(
    argv: Sequence[str], *, python: str = sys.executable
) -> PythonCommand | None:
    """Split ``python [flags] (script | -m mod | -c code) args...``; None if it is not one.

    Commands the bootstrap cannot host faithfully (no target, ``-`` for stdin, ``-i``, ``-x``,
    ``--help`` ...) return None and run as they are.
    """
    if not argv or not _is_python(argv[0], python):
        return None
    flags: list[str] = []
    i = 1
    while i < len(argv):
        arg = argv[i]
        if arg == "--":
            i += 1
            break
        if arg.startswith("--"):
            if arg == "--check-hash-based-pycs" and i + 1 < len(argv):
                flags += [arg, argv[i + 1]]
                i += 2
                continue
            if arg.startswith("--check-hash-based-pycs="):
                flags.append(arg)
                i += 1
                continue
            return None
        if not arg.startswith("-") or arg == "-":
            break
        j = 1
        while j < len(arg):
            ch = arg[j]
            if ch in _NOARG_FLAGS:
                flags.append("-" + ch)
                j += 1
                continue
            if ch in _VALUE_FLAGS or ch in "cm":
                value = arg[j + 1 :]
                if not value:
                    i += 1
                    if i >= len(argv):
                        return None
                    value = argv[i]
                if ch in _VALUE_FLAGS:
                    flags += ["-" + ch, value]
                    break
                mode = "code" if ch == "c" else "module"
                return PythonCommand(argv[0], tuple(flags), mode, value, tuple(argv[i + 1 :]))
            return None
        i += 1
    if i >= len(argv) or argv[i] == "-":
        return None
    return PythonCommand(argv[0], tuple(flags), "script", argv[i], tuple(argv[i + 1 :]))


PYTHON_EXEC = "PYTHON_EXEC"
"""torchrun's interpreter override: python entrypoints run under it when it is set."""


def job_python(spec: JobSpec, agent_env: Mapping[str, str], python: str = sys.executable) -> str:
    """The interpreter the agent gives a job's python processes (function workers, the store
    host, standbys): $PYTHON_EXEC of the spec's env, else of the agent's, as torchrun reads it
    (`os.getenv("PYTHON_EXEC", sys.executable)`); else `python`."""
    for env in (spec.env, agent_env):
        value = env.get(PYTHON_EXEC, "")
        if value and "\x00" not in value and len(value) <= 4096:
            return value
    return python


def entrypoint_name(spec: JobSpec) -> str:
    """What the job runs, named as torch's launcher names it (`_get_entrypoint_name`) for log
    lines: a function's name, a python command's script (basename) or module, else the
    program's basename. Bounded, and printable only: it goes into log lines."""
    if spec.is_function:
        name = spec.function.rpartition(":")[2].rpartition(".")[2]
    elif not spec.argv:
        return ""
    else:
        parsed = parse_python_command(spec.argv)
        if parsed is None:
            name = os.path.basename(spec.argv[0])
        elif parsed.mode == "script":
            name = os.path.basename(parsed.target)
        else:
            name = parsed.target if parsed.mode == "module" else "-c"
    return "".join(c if c.isprintable() else "?" for c in name[:128]) or "?"


def uses_agent_store(spec: JobSpec) -> bool:
    """Whether the workers of `spec` use a store hosted outside them (USE_AGENT_STORE=True).

    Decided from the spec alone, never from this node's interpreter, so that every node of a
    round gives its workers the same value: with the agent store every rank is a TCPStore
    client, without it rank 0 is the server, and a mix has two servers or none. A function, or a
    command whose program is named like a python interpreter, gets the agent store; a user who
    sets TORCHELASTIC_USE_AGENT_STORE to anything but "True" in the spec's env opts out.
    """
    if spec.env.get(USE_AGENT_STORE, "True") != "True":
        return False
    if spec.is_function:
        return True
    return bool(spec.argv) and bool(_PYTHON_NAME.fullmatch(os.path.basename(spec.argv[0])))


def role_spec(spec: JobSpec, role: str) -> JobSpec:
    """The one-role spec that a node whose group runs `role` launches (`JobSpec.for_role`).

    Where the round's store lives is the whole world's choice, not one role's: if any role's
    workers would not use the agent store (a binary, or an env that opts out), every role's
    workers get TORCHELASTIC_USE_AGENT_STORE=False and worker RANK 0 hosts the store.
    """
    mine = spec.for_role(role)
    if not spec.roles or not uses_agent_store(mine):
        return mine
    if all(uses_agent_store(spec.for_role(r.name)) for r in spec.roles):
        return mine
    return replace(mine, env={**mine.env, USE_AGENT_STORE: "False"})


ARGS_MAGIC = b"GELASTIC-ARGS/1\n"
"""First line of a function worker's args file; the bootstrap reads the format back."""


def function_args_file(spec: JobSpec, job_id: str, global_rank: int) -> bytes:
    """The args file of one function worker: a magic line, one JSON line, the pickled args.

    The JSON line carries what the worker's bootstrap tags the return value with: the job's
    result key (hex; "" when the submitter made none), the job id and the worker's global rank.
    The file is the only place the key is given to the worker (never env or argv), so it is
    written 0600 in the worker's 0700 directory.
    """
    header = {"job_id": job_id, "rank": int(global_rank), "result_key": spec.result_key.hex()}
    return ARGS_MAGIC + json.dumps(header).encode("utf-8") + b"\n" + spec.function_args


def _substitute(args: Sequence[str], local_rank: int) -> list[str]:
    # torchrun's macros.substitute: string.Template over each argument (not the program).
    return [Template(a).safe_substitute(local_rank=str(local_rank)) for a in args]


def _worker_argv(
    assignment: RoundAssignment, ranks: WorkerRanks, wdir: Path, error_file: Path, python: str
) -> tuple[tuple[str, ...], Path | None, Path | None, str]:
    spec = assignment.spec
    if spec.is_function:
        args_file = wdir / "args.pkl"
        return_file = wdir / "return.pkl"
        fn_argv: tuple[str, ...] = (
            python,
            BOOTSTRAP_PATH,
            "--error-file",
            str(error_file),
            "--function",
            spec.function,
            "--args-file",
            str(args_file),
            "--return-file",
            str(return_file),
            *(("--main-path", spec.main_path) if spec.main_path else ()),
            "--",
        )
        return fn_argv, args_file, return_file, spec.function
    command = list(spec.argv)
    command = [command[0], *_substitute(command[1:], ranks.local_rank)]
    parsed = parse_python_command(command, python=python)
    if parsed is None:
        return tuple(command), None, None, command[0]
    mode_flag = {"script": "--script", "module": "--module", "code": "--code"}[parsed.mode]
    argv: tuple[str, ...] = (
        parsed.interpreter,
        *parsed.flags,
        BOOTSTRAP_PATH,
        "--error-file",
        str(error_file),
        mode_flag,
        parsed.target,
        "--",
        *parsed.args,
    )
    program = parsed.target if parsed.mode != "code" else "-c"
    return argv, None, None, program


def _job_env(spec: JobSpec, agent_env: Mapping[str, str]) -> dict[str, str]:
    """What every process of a job on this node starts from: the agent's env, the spec's."""
    env = dict(agent_env)
    # Defaults the user may override through spec.env (torchrun sets them the same way).
    env.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
    if spec.nproc_per_node > 1 and "OMP_NUM_THREADS" not in spec.env:
        env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONUNBUFFERED"] = "1"
    env.update(spec.env)
    return env


ENABLE_FILE_TIMER_ENV = "TORCHELASTIC_ENABLE_FILE_TIMER"
TIMER_FILE_ENV = "TORCHELASTIC_TIMER_FILE"
METRICS_CHANNEL_ENV = "GELASTIC_TORCH_METRICS"
"""Where a job with torch_metrics writes them (nodeagent._metric_channel, which loads alone)."""


def watchdog_request(spec: JobSpec, agent_env: Mapping[str, str]) -> tuple[bool, str | None]:
    """(serve the watchdog?, the FIFO path the job asks for, or None to make one).

    As torch's agent: TORCHELASTIC_ENABLE_FILE_TIMER=1 (the agent's env or the job's) or the
    spec's `watchdog` turns it on, and TORCHELASTIC_TIMER_FILE, when set, is where it is served
    (the agent checks it with `validate_timer_file` first).
    """
    env = _job_env(spec, agent_env)
    enabled = spec.watchdog or env.get(ENABLE_FILE_TIMER_ENV) == "1"
    return enabled, (env.get(TIMER_FILE_ENV) or None) if enabled else None


PREEMPT_FILE_ENV = "GELASTIC_PREEMPT_FILE"
"""Where a drain's preemption notice appears (`client.preempt`)."""


def progress_file(worker_dir: Path) -> Path:
    """Where a worker writes its progress: in its own log directory."""
    return Path(worker_dir) / "progress.json"


def preempt_file(round_dir: Path, node_name: str) -> Path:
    """The preemption notice of a worker group: in its round's directory, named for its node
    (agents of one host may share a round's directory)."""
    return Path(round_dir) / f"preempt-{node_name}.json"


def _worker_env(
    assignment: RoundAssignment,
    ranks: WorkerRanks,
    *,
    node_name: str,
    agent_env: Mapping[str, str],
    error_file: Path,
    timer_file: str | None,
    notice_file: Path,
    progress_file: Path | None = None,
) -> dict[str, str]:
    spec = assignment.spec
    env = _job_env(spec, agent_env)
    # The identity of the worker and the agent's wiring always win over the user's env:
    # a wrong RANK or error-file path breaks the whole job, not just this worker.
    env.update(
        {
            "RANK": str(ranks.global_rank),
            "LOCAL_RANK": str(ranks.local_rank),
            "GROUP_RANK": str(assignment.group_rank),
            "ROLE_RANK": str(ranks.role_rank),
            "ROLE_NAME": spec.role,
            "LOCAL_WORLD_SIZE": str(spec.nproc_per_node),
            "WORLD_SIZE": str(ranks.world_size),
            "GROUP_WORLD_SIZE": str(assignment.group_world_size),
            "ROLE_WORLD_SIZE": str(ranks.role_world_size),
            "MASTER_ADDR": assignment.master_addr,
            "MASTER_PORT": str(assignment.master_port),
            "TORCHELASTIC_RESTART_COUNT": str(assignment.attempt),
            "TORCHELASTIC_MAX_RESTARTS": str(spec.max_restarts),
            "TORCHELASTIC_RUN_ID": assignment.run_id,
            # True: group rank 0's store host serves MASTER_ADDR:PORT and outlives the workers;
            # False: worker RANK 0 hosts the store and takes it down when it exits.
            USE_AGENT_STORE: str(uses_agent_store(spec)),
            "TORCHELASTIC_ERROR_FILE": str(error_file),
            "GELASTIC_JOB_ID": assignment.job_id,
            "GELASTIC_ROUND": str(assignment.round),
            "GELASTIC_NODE": node_name,
            PREEMPT_FILE_ENV: str(notice_file),
        }
    )
    if progress_file is not None:
        env[PROGRESS_FILE_ENV] = str(progress_file)
    if timer_file is not None:
        env["TORCHELASTIC_TIMER_FILE"] = timer_file
    # The agent's metrics channel, for a job that asked for it; never a path a job names.
    env.pop(METRICS_CHANNEL_ENV, None)
    channel = agent_env.get(METRICS_CHANNEL_ENV, "")
    if spec.torch_metrics and channel:
        env[METRICS_CHANNEL_ENV] = channel
    if assignment.gpus:
        # The round's own GPUs, by uuid (immune to CUDA_DEVICE_ORDER), so device LOCAL_RANK is
        # the GPU placed for it; they win over the user's env. A node without GPUs leaves
        # whatever the user or the agent set.
        env["CUDA_VISIBLE_DEVICES"] = ",".join(
            u or str(i)
            for i, u in zip(
                assignment.gpus,
                assignment.gpu_uuids or ("",) * len(assignment.gpus),
                strict=True,
            )
        )
    return env


def check_main_script(main_path: str, cwd: str) -> None:
    """ValueError naming `main_path` (relative to `cwd`) unless it is a regular .py file here.

    A function of the submitter's main script needs that script at the same path on every node;
    refusing it before any worker starts makes that an input failure of the job, not a crash.
    """
    path = os.path.join(cwd, main_path)
    shown = bounded(main_path)
    if not main_path.endswith(".py"):
        raise ValueError(f"main_path {shown!r} is not a .py file")
    try:
        st = os.stat(path)
    except OSError as e:
        raise ValueError(
            f"main_path {shown!r} cannot be used on this node: {e.strerror or e} (a function "
            "of a main script needs that script at the same path on every node)"
        ) from None
    if not stat.S_ISREG(st.st_mode):
        raise ValueError(f"main_path {shown!r} is not a regular file on this node")


def _cwd(spec: JobSpec, agent_cwd: str | None) -> str:
    here = agent_cwd if agent_cwd is not None else os.getcwd()
    return os.path.join(here, spec.cwd) if spec.cwd else here


def build_store_host_launch(
    assignment: RoundAssignment,
    *,
    log_dir: Path,
    node_name: str,
    agent_env: Mapping[str, str],
    python: str = sys.executable,
    agent_cwd: str | None = None,
) -> StoreHostLaunch | None:
    """The round's c10d store host on this node, or None when this node serves no store.

    Only group rank 0 serves one, and only when `uses_agent_store`. It runs under the workers'
    interpreter (with their interpreter flags), env and cwd, so it imports the torch they import.
    `log_dir` is the round's attempt directory.
    """
    spec = assignment.spec
    if assignment.group_rank != 0 or not uses_agent_store(spec):
        return None
    python = job_python(spec, agent_env, python)
    interpreter: tuple[str, ...] = (python,)
    if not spec.is_function:
        parsed = parse_python_command(spec.argv, python=python)
        interpreter = (parsed.interpreter, *parsed.flags) if parsed is not None else (spec.argv[0],)
    env = _job_env(spec, agent_env)
    env.update(
        {
            "MASTER_ADDR": assignment.master_addr,
            "MASTER_PORT": str(assignment.master_port),
            "TORCHELASTIC_RUN_ID": assignment.run_id,
            "GELASTIC_JOB_ID": assignment.job_id,
            "GELASTIC_ROUND": str(assignment.round),
            "GELASTIC_NODE": node_name,
        }
    )
    # The host starts without `site` (the .pth files, an editable install's hooks: most of an
    # interpreter's start here) and runs it in its low-priority import thread (`--site`), so
    # what it does at normal priority beside the starting workers is small. A job whose own
    # flags say -S keeps its python's view: no site at all.
    site_later = ("-S", STORE_HOST_PATH, "--site") if "-S" not in interpreter[1:] else None
    return StoreHostLaunch(
        argv=(*interpreter, *(site_later or (STORE_HOST_PATH,))),
        env=env,
        cwd=_cwd(spec, agent_cwd),
        log_path=Path(log_dir) / STORE_HOST_LOG,
        addr=assignment.master_addr,
        port=assignment.master_port,
    )


def build_standby_launch(
    spec: JobSpec,
    *,
    agent_env: Mapping[str, str],
    python: str = sys.executable,
    agent_cwd: str | None = None,
) -> StandbyLaunch | None:
    """How to start a standby of `spec` (its preload may be empty), or None when it is not
    python.

    The env is the job's (`_job_env`): what every worker gets before its per-round variables.
    """
    python = job_python(spec, agent_env, python)
    if spec.is_function:
        interpreter: tuple[str, ...] = (python,)
    else:
        parsed = parse_python_command(spec.argv, python=python)
        if parsed is None:
            return None
        interpreter = (parsed.interpreter, *parsed.flags)
    prefix = (*interpreter, BOOTSTRAP_PATH)
    options: list[str] = []
    for name in spec.preload:
        options += ["--preload", name]
    return StandbyLaunch(
        prefix=prefix,
        argv=(*prefix, *options),
        env=_job_env(spec, agent_env),
        cwd=_cwd(spec, agent_cwd),
        preload=tuple(spec.preload),
    )


def build_launch_plan(
    assignment: RoundAssignment,
    *,
    log_root: Path,
    node_name: str,
    agent_env: Mapping[str, str],
    python: str = sys.executable,
    timer_file: str | None = None,
    log_dir: Path | None = None,
    agent_cwd: str | None = None,
) -> list[WorkerLaunch]:
    """One `WorkerLaunch` per local worker of `assignment`, in local-rank order.

    `log_dir` is this round's attempt directory (from `resolve_attempt_dir`); by default the
    first-round name ``<log_root>/<job_id>/attempt_<attempt>``. `agent_cwd` is where a spec
    without `cwd` runs (default: the agent's current directory).
    """
    spec = assignment.spec
    python = job_python(spec, agent_env, python)
    base_dir = log_dir or attempt_dir(
        log_root,
        assignment.job_id,
        assignment.attempt,
        assignment.round,
        first_round_of_attempt=True,
    )
    cwd = _cwd(spec, agent_cwd)
    if spec.main_path:
        check_main_script(spec.main_path, cwd)
    redirects = parse_std_mapping("redirects", spec.redirects, spec.nproc_per_node)
    tees = parse_std_mapping("tee", spec.tee, spec.nproc_per_node)
    template = agent_env.get("TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE")
    plan: list[WorkerLaunch] = []
    for ranks in sorted(assignment.workers, key=lambda w: w.local_rank):
        wdir = base_dir / str(ranks.global_rank)
        error_file = wdir / "error.json"
        argv, args_file, return_file, program = _worker_argv(
            assignment, ranks, wdir, error_file, python
        )
        env = _worker_env(
            assignment,
            ranks,
            node_name=node_name,
            agent_env=agent_env,
            error_file=error_file,
            timer_file=timer_file,
            notice_file=preempt_file(base_dir, node_name),
            progress_file=progress_file(wdir),
        )
        plan.append(
            WorkerLaunch(
                local_rank=ranks.local_rank,
                global_rank=ranks.global_rank,
                role_rank=ranks.role_rank,
                role=spec.role,
                argv=argv,
                env=env,
                cwd=cwd,
                log_dir=wdir,
                stdout_path=wdir / "stdout.log",
                stderr_path=wdir / "stderr.log",
                error_file=error_file,
                return_file=return_file,
                args_file=args_file,
                args_bytes=(
                    function_args_file(spec, assignment.job_id, ranks.global_rank)
                    if args_file is not None
                    else None
                ),
                redirect=redirects.get(ranks.local_rank, 0),
                tee=tees.get(ranks.local_rank, 0),
                prefix=tee_prefix(
                    template, role=spec.role, local_rank=ranks.local_rank, rank=ranks.global_rank
                ),
                program=program,
                is_function=spec.is_function,
            )
        )
    return plan


AGENT_SECRET_ENV = frozenset(
    {"GELASTIC_TOKEN", "GELASTIC_TOKEN_FILE", "GELASTIC_AGENT_TOKEN", "GELASTIC_AGENT_TOKEN_FILE"}
)
"""Variables that name a token or its file: never handed on to a worker, whatever they hold."""


def without_agent_secrets(env: Mapping[str, str], secrets: Sequence[str]) -> dict[str, str]:
    """`env` without `AGENT_SECRET_ENV` and without any variable whose value holds one of
    `secrets` (the agent's token, its file's path) (pure).

    Workers start from the agent's environment and run as its user: what is left there, they
    can read (and print into their logs).
    """
    needles = [s for s in secrets if s]
    return {
        k: v
        for k, v in env.items()
        if k not in AGENT_SECRET_ENV and not any(s in v for s in needles)
    }
