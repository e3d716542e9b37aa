"""`gelastic`: submit jobs to a coordinator and follow them; `gelastic run`: torchrun on one host.

A thin layer over the Python client: flags become a JobSpec, domain objects become aligned
tables or (with --json) JSON. Exit codes: 0 success, 1 the job failed or was cancelled, 2 a
usage or connection error, reported as one line on stderr.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import json
import os
import socket
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any, NoReturn, TextIO

import grpc

from client._client import DEFAULT_COORDINATOR, Client, GelasticError, Job, _Progress
from client._logrelay import (
    LogRelay,
    follow_rank,
    parse_logs_choice,
    print_all_ranks,
    wait_for_ranks,
)
from client._scheduler_error import write_scheduler_error_file
from client._tables import (
    event_line,
    event_line_header,
    events_table,
    jobs_table,
    nodes_table,
    result_text,
    status_text,
    to_jsonable,
)
from client._terminal import TerminalFilter, strip_terminal_controls
from client.coordinators import parse_coordinators
from client.model import (
    MAX_SPEC_BYTES,
    JobSpec,
    JobState,
    Role,
    RunResult,
    SpecError,
    is_function_reference,
    is_host,
    roles_from_json,
)
from client.results import trusted_load
from client.security import Security, describe_tls_failure
from client.version import VersionAction as _Version
from client.wire import job_status_from_pb

__all__ = ["EXIT_FAILED", "EXIT_OK", "EXIT_USAGE", "CliError", "main", "parse_nnodes"]

EXIT_OK = 0
EXIT_FAILED = 1
"""The job failed or was cancelled."""
EXIT_USAGE = 2
"""Bad usage, an unreachable coordinator, or a request the coordinator refused."""
EXIT_INTERRUPTED = 130
"""Ctrl-C (a watched job goes on running)."""
LOGS_DRAIN_S = 5.0
"""How long `submit --watch --logs` waits for the last output once the job has ended."""
MAX_FORGET = 1000
"""Most node names one `gelastic nodes --forget ...` takes."""

DEFAULT_CALL_TIMEOUT_S = 10.0
DEFAULT_CONNECT_TIMEOUT_S = 5.0
EVENTS_POLL_INTERVAL_S = 0.5

# Options of the top-level parser that take a value; `_run_argv` skips over them.
_GLOBAL_VALUE_OPTIONS = (
    "--coordinator",
    "--token-file",
    "--tls-ca",
    "--tls-cert",
    "--tls-key",
    "--tls-server-name",
    "--timeout",
    "--connect-timeout",
)


class CliError(Exception):
    """A problem to report as one line on stderr, ending the command with `code`."""

    def __init__(self, message: str, code: int = EXIT_USAGE) -> None:
        super().__init__(one_line(message))
        self.code = code


def one_line(text: str) -> str:
    return " ".join(str(text).split())


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (argparse prints the whole usage first)."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"{self.prog}: {one_line(message)} (see '{self.prog} --help')\n")


# ---- parsing --------------------------------------------------------------------------------


def parse_nnodes(value: str) -> tuple[int, int]:
    """torchrun's --nnodes: ``N`` or ``MIN:MAX`` with ``0 < MIN <= MAX``."""
    parts = value.split(":")
    try:
        if len(parts) == 1:
            low = high = int(parts[0])
        elif len(parts) == 2:
            low, high = int(parts[0]), int(parts[1])
        else:
            raise ValueError
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be N or MIN:MAX, got {value!r}") from None
    if not 0 < low <= high:
        raise argparse.ArgumentTypeError(f"must satisfy 0 < MIN <= MAX, got {value!r}")
    return low, high


def _env_pair(value: str) -> tuple[str, str]:
    key, sep, val = value.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"must be KEY=VALUE, got {value!r}")
    return key, val


def _positive_float(value: str) -> float:
    try:
        f = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number of seconds, got {value!r}") from None
    if not f > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {value!r}")
    return f


def _add_connection_options(p: argparse.ArgumentParser, *, suppress: bool) -> None:
    # The subcommands repeat these with SUPPRESS defaults, so `gelastic jobs --coordinator X`
    # works and a subcommand never overwrites a value given before it.
    def default(value: object) -> object:
        return argparse.SUPPRESS if suppress else value

    p.add_argument(
        "--coordinator",
        default=default(None),
        help="HOST:PORT of the coordinator, or of its replicas as a list A:PORT,B:PORT,... "
        f"(at most 16; default: $GELASTIC_COORDINATOR or {DEFAULT_COORDINATOR})",
    )
    p.add_argument(
        "--token-file",
        default=default(""),
        metavar="PATH",
        help="file holding the token that authenticates this client ($GELASTIC_TOKEN_FILE)",
    )
    p.add_argument(
        "--tls-ca",
        default=default(""),
        metavar="PATH",
        help="PEM CA of the coordinator's certificate: use TLS ($GELASTIC_TLS_CA)",
    )
    p.add_argument(
        "--tls",
        action="store_true",
        default=default(False),
        help="use TLS without --tls-ca: verify against the system trust store ($GELASTIC_TLS=1)",
    )
    p.add_argument(
        "--tls-cert",
        default=default(""),
        metavar="PATH",
        help="PEM client certificate to present (mTLS; $GELASTIC_TLS_CERT)",
    )
    p.add_argument(
        "--tls-key",
        default=default(""),
        metavar="PATH",
        help="PEM private key of --tls-cert ($GELASTIC_TLS_KEY)",
    )
    p.add_argument(
        "--tls-server-name",
        default=default(""),
        metavar="NAME",
        help="name to check in the coordinator's certificate, when it differs from the host "
        "($GELASTIC_TLS_SERVER_NAME)",
    )
    p.add_argument(
        "--insecure",
        action="store_true",
        default=default(False),
        help="allow sending the token in plain text to a coordinator off this host "
        "($GELASTIC_INSECURE=1)",
    )
    p.add_argument(
        "--timeout",
        type=_positive_float,
        default=default(DEFAULT_CALL_TIMEOUT_S),
        metavar="S",
        help=f"deadline of each call to the coordinator (default {DEFAULT_CALL_TIMEOUT_S:g} s)",
    )
    p.add_argument(
        "--connect-timeout",
        type=_positive_float,
        default=default(DEFAULT_CONNECT_TIMEOUT_S),
        metavar="S",
        help=f"how long to try to connect (default {DEFAULT_CONNECT_TIMEOUT_S:g} s)",
    )


def _add_json(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print machine-readable JSON")


def _parser() -> argparse.ArgumentParser:
    d = JobSpec()
    p = _Parser(
        prog="gelastic",
        description="Run elastic distributed jobs on a gelastic coordinator.",
        epilog="Exit codes: 0 success, 1 the job failed or was cancelled, 2 usage or "
        "connection error.",
    )
    p.add_argument("--version", action=_Version)
    _add_connection_options(p, suppress=False)
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=_Parser)

    def command(name: str, help_text: str) -> argparse.ArgumentParser:
        s = sub.add_parser(name, help=help_text, description=help_text)
        _add_connection_options(s, suppress=True)
        return s

    sub.add_parser(
        "run",
        help="run a torchrun-style script on this host, no servers needed "
        "(see 'gelastic run --help')",
        add_help=False,
    )

    s = command("submit", "submit a job; print its id")
    s.add_argument(
        "--nnodes",
        type=parse_nnodes,
        default=(1, 1),
        metavar="N|MIN:MAX",
        help="number of nodes, or a range (default 1)",
    )
    s.add_argument(
        "--nproc-per-node",
        "--nproc_per_node",
        type=int,
        default=d.nproc_per_node,
        metavar="N",
        help="workers per node (default %(default)s)",
    )
    s.add_argument(
        "--max-restarts",
        "--max_restarts",
        type=int,
        default=d.max_restarts,
        metavar="N",
        help="failure restarts allowed (default %(default)s)",
    )
    s.add_argument("--role", default=d.role, help="ROLE_NAME of the workers (default %(default)s)")
    s.add_argument("--name", default=d.name, help="a label for people")
    s.add_argument(
        "--env",
        type=_env_pair,
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="extra environment for every worker (repeatable)",
    )
    s.add_argument(
        "-r",
        "--redirects",
        default=d.redirects,
        metavar="MASK",
        help="torchrun --redirects: 0-3 or 'local_rank:mask,...' (default 0)",
    )
    s.add_argument(
        "-t",
        "--tee",
        default=d.tee,
        metavar="MASK",
        help="torchrun --tee: 0-3 or 'local_rank:mask,...' (default 0)",
    )
    s.add_argument(
        "-m",
        "--module",
        action="store_true",
        help="the command is a module: run it as 'PYTHON -m MODULE ARGS'",
    )
    s.add_argument(
        "--python", default="python", help="interpreter on the nodes for -m (default %(default)s)"
    )
    s.add_argument("--cwd", default=d.cwd, help="working directory of the workers")
    s.add_argument(
        "--wait-for-nodes",
        action="store_true",
        help="wait (up to --join-timeout) for a node big enough to join, even when no node the "
        "coordinator knows could hold one group of the job (default: fail at once)",
    )
    s.add_argument(
        "--join-timeout",
        type=float,
        default=d.join_timeout,
        metavar="S",
        help="seconds to wait for the minimum of nodes (default %(default)g)",
    )
    s.add_argument(
        "--last-call-timeout",
        type=float,
        default=d.last_call_timeout,
        metavar="S",
        help="seconds a round waits for more nodes (default %(default)g)",
    )
    s.add_argument(
        "--exit-barrier-timeout",
        type=float,
        default=d.exit_barrier_timeout,
        metavar="S",
        help="seconds finished nodes wait for the others (default %(default)g)",
    )
    s.add_argument(
        "--stop-grace",
        type=float,
        default=d.stop_grace,
        metavar="S",
        help="seconds between SIGTERM and SIGKILL (default %(default)g)",
    )
    s.add_argument(
        "--restart-backoff",
        type=float,
        default=d.restart_backoff,
        metavar="S",
        help="seconds before a failure restart (default %(default)g)",
    )
    s.add_argument(
        "--restart-policy",
        default=d.restart_policy,
        metavar="POLICY",
        help="which failures restart the job: '' (default) all but input errors (a "
        "SyntaxError, a failed import of the entrypoint, a missing script, an argparse usage "
        "error), which fail at once; 'always'; or exit codes such as '2,127' that fail at once "
        "too",
    )
    s.add_argument(
        "--scale-up",
        choices=("restart", "never"),
        default=d.scale_up,
        help="re-form when a node joins below the maximum (default %(default)s)",
    )
    s.add_argument(
        "--watchdog", action="store_true", help="serve torch's FileTimer at TORCHELASTIC_TIMER_FILE"
    )
    s.add_argument(
        "--preload",
        action="append",
        default=[],
        metavar="MODULE",
        help="import MODULE (e.g. torch) in warm standby workers that take over on a restart "
        "(repeatable; see docs/python-api.md)",
    )
    s.add_argument(
        "--standby-linger",
        type=float,
        default=0.0,
        metavar="S",
        help="keep a succeeded job's standbys S seconds on each node for the next job of the "
        "same spec, e.g. a sweep (needs --preload; default 0: killed with the job)",
    )
    s.add_argument(
        "--watch",
        action="store_true",
        help="wait for the job with live progress; exit with its status",
    )
    s.add_argument(
        "--wait-timeout",
        type=_positive_float,
        default=None,
        metavar="S",
        help="with --watch: give up waiting after S seconds (exit 2)",
    )
    s.add_argument(
        "--logs",
        nargs="?",
        const="rank0",
        default=None,
        metavar="rank0|all|N|none",
        help="with --watch: print the workers' output as they run, stdout to stdout and "
        "stderr to stderr: rank 0's (the default, on when stdout is a terminal), every "
        "rank's with a [rank]: prefix, rank N's, or none",
    )
    s.add_argument(
        "--roles",
        metavar="FILE",
        default=None,
        help="a multi-role job (e.g. parameter servers and trainers in one world): a JSON list "
        'of roles, each {"name", "entrypoint": [argv], "args", "env", "nproc_per_node", '
        '"min_nodes", "max_nodes"}; instead of the command, --nnodes, --nproc-per-node and '
        "--role. Ranks follow group-rank order, role ranks count per role (docs/concepts.md)",
    )
    _add_json(s)
    s.add_argument(
        "entry",
        nargs=argparse.REMAINDER,
        metavar="-- COMMAND ...",
        help="the command (e.g. python train.py --lr 0.1), a module with -m, "
        "or a function 'pkg.module:fn' followed by its string arguments",
    )

    s = command("jobs", "list jobs")
    s.add_argument("--active", action="store_true", help="only jobs that have not finished")
    _add_json(s)

    s = command("nodes", "list nodes")
    s.add_argument(
        "--forget",
        action="append",
        default=[],
        metavar="NAME",
        help="drop lost node NAME from the list now (repeatable; a live node is refused)",
    )
    s.add_argument(
        "--clear-quarantine",
        action="append",
        default=[],
        metavar="NAME",
        help="let quarantined node NAME take new rounds again now (repeatable)",
    )
    _add_json(s)

    s = command("status", "show a job: state, reason, members, and every rank")
    s.add_argument("job_id", metavar="JOB", help="the job's id")
    _add_json(s)

    s = command("result", "show a finished job's return values or its failure report")
    s.add_argument("job_id", metavar="JOB", help="the job's id")
    s.add_argument(
        "--trusted-load",
        action="store_true",
        help="unpickle the return values and print them; this runs code chosen by whoever "
        "wrote them (the job's workers, or anyone who could change them on the way), so only "
        "for jobs whose nodes and channel you trust",
    )
    _add_json(s)

    s = command("logs", "print a rank's output (raw bytes)")
    s.add_argument("job_id", metavar="JOB", help="the job's id")
    s.add_argument("--rank", type=int, default=0, help="global rank (default %(default)s)")
    s.add_argument(
        "--stream", choices=("stdout", "stderr"), default="stdout", help="which output stream"
    )
    s.add_argument(
        "--attempt", type=int, default=None, metavar="N", help="which attempt (default: the latest)"
    )
    s.add_argument(
        "-f",
        "--follow",
        action="store_true",
        help="keep printing while the job runs: wait for the rank to start and follow it into "
        "each new attempt (with --attempt: that attempt only)",
    )
    s.add_argument(
        "--json",
        action="store_true",
        help="one JSON object per line: job, rank, stream, line (UTF-8, bad bytes replaced)",
    )
    s.add_argument(
        "--all",
        action="store_true",
        help="every rank, each line prefixed [rank]: (not --rank); with -f, wait for the ranks "
        "to start and follow each into each new attempt",
    )

    s = command("events", "print a job's timeline")
    s.add_argument("job_id", metavar="JOB", help="the job's id")
    s.add_argument(
        "--after", type=int, default=0, metavar="SEQ", help="only events after this sequence number"
    )
    s.add_argument(
        "-f",
        "--follow",
        action="store_true",
        help="keep printing new events until the job finishes (with --json: one object per line)",
    )
    s.add_argument(
        "--follow-timeout",
        type=_positive_float,
        default=None,
        metavar="S",
        help="with --follow: stop after S seconds",
    )
    _add_json(s)

    s = command("cancel", "stop every worker of a job; the job ends CANCELED")
    s.add_argument("job_id", metavar="JOB", help="the job's id")
    s.add_argument("--wait", action="store_true", help="return once the job has ended")
    s.add_argument(
        "--wait-timeout",
        type=_positive_float,
        default=60.0,
        metavar="S",
        help="with --wait: give up after S seconds (default %(default)g)",
    )
    _add_json(s)

    s = command(
        "dashboard", "print the URL of the coordinator's web dashboard; open it on a desktop"
    )
    s.add_argument("--no-browser", action="store_true", help="only print the URL")
    return p


def build_spec(args: argparse.Namespace) -> JobSpec:
    """The JobSpec that `gelastic submit`'s flags describe."""
    entry = list(args.entry)
    if entry and entry[0] == "--":
        entry = entry[1:]
    roles = _read_roles(args, entry)
    if not entry and not roles:
        raise CliError("give the command to run after '--'")
    common: dict[str, Any] = dict(
        nproc_per_node=args.nproc_per_node,
        min_nodes=args.nnodes[0],
        max_nodes=args.nnodes[1],
        max_restarts=args.max_restarts,
        role=args.role,
        name=args.name,
        env=dict(args.env),
        redirects=args.redirects,
        tee=args.tee,
        join_timeout=args.join_timeout,
        last_call_timeout=args.last_call_timeout,
        exit_barrier_timeout=args.exit_barrier_timeout,
        stop_grace=args.stop_grace,
        restart_backoff=args.restart_backoff,
        restart_policy=args.restart_policy,
        scale_up=args.scale_up,
        watchdog=args.watchdog,
        cwd=args.cwd,
        preload=tuple(args.preload),
        standby_linger=args.standby_linger,
        wait_for_nodes=args.wait_for_nodes,
    )
    if roles:
        return JobSpec(roles=roles, **common)
    if args.module:
        return JobSpec(entrypoint=[args.python, "-m", entry[0]], args=entry[1:], **common)
    if is_function_reference(entry[0]):
        # A function entrypoint: its arguments are the remaining words, as strings.
        return JobSpec(entrypoint=entry[0], args=tuple(entry[1:]), **common)
    return JobSpec(entrypoint=entry, **common)


def _read_roles(args: argparse.Namespace, entry: Sequence[str]) -> tuple[Role, ...]:
    """The roles of `--roles FILE` (read once), or () without it."""
    if args.roles is None:
        return ()
    cached: tuple[Role, ...] | None = getattr(args, "_roles", None)
    if cached is not None:
        return cached
    if entry or args.module:
        raise CliError("--roles: each role gives its command in the file, not after '--'")
    d = JobSpec()
    if (args.nnodes, args.nproc_per_node, args.role) != ((1, 1), d.nproc_per_node, d.role):
        raise CliError(
            "--roles: give each role's nodes and workers in the file, not --nnodes, "
            "--nproc-per-node or --role"
        )
    try:
        with open(args.roles, "rb") as f:
            text = f.read(MAX_SPEC_BYTES + 1)
    except OSError as exc:
        raise CliError(f"--roles: cannot read {args.roles}: {exc.strerror or exc}") from None
    try:
        roles = roles_from_json(text)
    except SpecError as exc:
        raise CliError(f"invalid job: {exc}") from None
    args._roles = roles
    return roles


# ---- connection -----------------------------------------------------------------------------


def _host_port(address: str) -> tuple[str, int] | None:
    """(host, port) of a plain HOST:PORT or [V6]:PORT target; None for other gRPC targets."""
    if "://" in address or address.startswith(("unix:", "dns:", "ipv4:", "ipv6:")):
        return None
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        return None
    return host.strip("[]") or "127.0.0.1", int(port)


def check_reachable(address: str, timeout: float) -> None:
    """Fail fast, with the operating system's reason, when nothing listens at `address`.

    gRPC would instead retry until the call's deadline and then report only
    "failed to connect"; a plain TCP connect tells refused from unresolvable from silent.
    """
    target = _host_port(address)
    if target is not None:
        try:
            with socket.create_connection(target, timeout=timeout):
                return
        except socket.gaierror as exc:
            raise CliError(f"cannot reach the coordinator at {address}: {exc.strerror}") from None
        except TimeoutError:
            raise CliError(
                f"cannot reach the coordinator at {address}: no answer within {timeout:g} s"
            ) from None
        except OSError as exc:
            reason = exc.strerror or str(exc)
            raise CliError(f"cannot reach the coordinator at {address}: {reason}") from None
    with grpc.insecure_channel(address) as channel:
        try:
            grpc.channel_ready_future(channel).result(timeout=timeout)
        except grpc.FutureTimeoutError:
            raise CliError(
                f"cannot reach the coordinator at {address}: no connection within {timeout:g} s"
            ) from None


def check_any_reachable(addresses: Sequence[str], timeout: float) -> None:
    """`check_reachable` for a list of replicas: fine when any one of them is reachable."""
    if len(addresses) == 1:
        check_reachable(addresses[0], timeout)
        return
    reasons = []
    for address in addresses:
        try:
            check_reachable(address, timeout)
            return
        except CliError as exc:
            reasons.append(str(exc).removeprefix("cannot reach the coordinator at "))
    raise CliError(f"cannot reach any coordinator of the list: {'; '.join(reasons)}")


def _describe(exc: GelasticError, address: str, security: Security | None = None) -> str:
    details = one_line(str(exc))
    if exc.code == grpc.StatusCode.UNAVAILABLE and "," in address:
        return f"cannot reach the leader of the coordinators {address}: {details}"
    if exc.code == grpc.StatusCode.UNAVAILABLE:
        # grpc says "Socket closed" for most TLS mismatches: one handshake of our own names it.
        why = describe_tls_failure(address, security) if security is not None else ""
        return f"cannot reach the coordinator at {address}: {why or details}"
    if exc.code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return f"the coordinator at {address} did not answer in time: {details}"
    return details


def _connect(args: argparse.Namespace) -> Client:
    address = args.coordinator or os.environ.get("GELASTIC_COORDINATOR") or DEFAULT_COORDINATOR
    security = Security.from_env(
        args.token_file or None,
        getattr(args, "tls_ca", "") or None,
        tls=getattr(args, "tls", False) or None,
        insecure=getattr(args, "insecure", False) or None,
        tls_cert=getattr(args, "tls_cert", "") or None,
        tls_key=getattr(args, "tls_key", "") or None,
        tls_server_name=getattr(args, "tls_server_name", "") or None,
    )
    addresses = parse_coordinators(address)
    # Refused before any connection: the token must not go out in clear text.
    for one in addresses:
        security.check_target(one)
    check_any_reachable(addresses, args.connect_timeout)
    return Client(",".join(addresses), timeout=args.timeout, security=security)


# ---- output ---------------------------------------------------------------------------------


def _show(text: str, out: TextIO | None = None) -> None:
    """Print text meant for people. Names, reasons, failure messages and addresses in it come
    from the coordinator, and some from workers and agents: on a terminal, escape sequences
    and control characters in them are removed (a pipe or a file gets them as they are)."""
    stream = out or sys.stdout
    if stream.isatty():
        text = strip_terminal_controls(text)
    stream.write(text + "\n")
    stream.flush()


def _print_json(value: Any, out: TextIO | None = None, *, indent: int | None = 2) -> None:
    stream = out or sys.stdout
    stream.write(json.dumps(to_jsonable(value), indent=indent, allow_nan=False) + "\n")
    stream.flush()


def exit_code_of(state: JobState) -> int:
    return EXIT_OK if state == JobState.SUCCEEDED else EXIT_FAILED


def _result_json(job_id: str, state: JobState, result: RunResult | None) -> dict[str, Any]:
    out: dict[str, Any] = {"job_id": job_id, "state": state.value, "finished": result is not None}
    if result is not None:
        # The bytes themselves are not printed: `return_value_sizes` says what there is.
        out["result"] = to_jsonable(dataclasses.replace(result, raw_return_values={}))
        out["root_cause"] = to_jsonable(result.root_cause)
    return out


def _finished(job: Job) -> tuple[JobState, RunResult | None]:
    # The result first: once it exists, the state read after it is terminal too.
    result = job.poll()
    return job.status().state, result


# ---- commands -------------------------------------------------------------------------------


def _check_spec(spec: JobSpec) -> None:
    # A bad command line is reported before any connection attempt.
    try:
        spec.validate()
    except SpecError as exc:
        raise CliError(f"invalid job: {exc}") from None


def _check_submit_flags(args: argparse.Namespace) -> None:
    # Refused rather than ignored: each of these only means something while watching.
    if args.wait_timeout is not None and not args.watch:
        raise CliError("--wait-timeout needs --watch")
    if args.logs is not None:
        if not args.watch:
            raise CliError("--logs needs --watch")
        try:
            args.logs = parse_logs_choice(args.logs)
        except ValueError as exc:
            raise CliError(f"--logs: {exc}") from None
        if args.json and args.logs != "none":
            raise CliError("--logs writes the workers' output to stdout: not with --json")
    elif args.watch and not args.json and sys.stdout.isatty():
        args.logs = "0"


class _WatchProgress(_Progress):
    """The progress lines, and the ranks' output streamed above them."""

    def __init__(self, out: TextIO, job: Job, logs: str | None) -> None:
        super().__init__(out)
        self.relay = LogRelay(job, logs, self.write_above) if logs not in (None, "none") else None

    def show(self, update: Any) -> None:
        super().show(update)
        if self.relay is not None:
            self.relay.update(job_status_from_pb(update.job))


_STILL: dict[JobState | None, str] = {
    None: "queued",
    JobState.QUEUED: "queued",
    JobState.RENDEZVOUS: "in rendezvous",
    JobState.STOPPING: "stopping",
}
"""What a job goes on doing once `submit --watch` detaches; any other state: running."""


def _cmd_submit(client: Client, args: argparse.Namespace) -> int:
    job = client.submit(build_spec(args))
    if not args.watch:
        if args.json:
            _print_json({"job_id": job.job_id})
        else:
            print(job.job_id, flush=True)
        return EXIT_OK
    if not args.json:
        print(job.job_id, flush=True)
    printer = _WatchProgress(sys.stderr, job, args.logs)
    try:
        job.wait(args.wait_timeout, progress=printer)
    except TimeoutError as exc:
        raise CliError(str(exc)) from None
    except KeyboardInterrupt:
        # Ctrl-C stops the watching, not the job.
        printer.done()
        print(
            f"gelastic submit: detached; job {job.job_id} is still "
            f"{_STILL.get(printer.state, 'running')} (gelastic cancel {job.job_id})",
            file=sys.stderr,
            flush=True,
        )
        return EXIT_INTERRUPTED
    if printer.relay is not None:
        printer.relay.join(LOGS_DRAIN_S)
    state, result = _finished(job)
    if args.json:
        _print_json(_result_json(job.job_id, state, result))
    elif result is not None:
        _show(result_text(result, state.value))
    if result is not None:
        write_scheduler_error_file(result, result.name or job.job_id)
    return exit_code_of(state)


def _cmd_jobs(client: Client, args: argparse.Namespace) -> int:
    jobs = client.list_jobs(include_finished=not args.active)
    if args.json:
        _print_json(jobs)
    else:
        _show(jobs_table(jobs))
    return EXIT_OK


def _cmd_nodes(client: Client, args: argparse.Namespace) -> int:
    if len(args.forget) > MAX_FORGET:
        raise CliError(f"--forget: at most {MAX_FORGET} names at once")
    if len(args.clear_quarantine) > MAX_FORGET:
        raise CliError(f"--clear-quarantine: at most {MAX_FORGET} names at once")
    if args.clear_quarantine:
        cleared = {name: client.clear_quarantine(name) for name in args.clear_quarantine}
        if args.json:
            _print_json({"cleared": [n for n, done in cleared.items() if done]})
        else:
            for name, done in cleared.items():
                print(
                    f"{name}: quarantine cleared" if done else f"{name}: not quarantined",
                    flush=True,
                )
        if not args.forget:
            return EXIT_OK
    if args.forget:
        forgotten = {name: client.forget_node(name) for name in args.forget}
        if args.json:
            _print_json({"forgotten": [n for n, done in forgotten.items() if done]})
        else:
            for name, done in forgotten.items():
                print(f"{name} forgotten" if done else f"{name}: no such node", flush=True)
        return EXIT_OK
    nodes = client.list_nodes()
    if args.json:
        _print_json(nodes)
    else:
        _show(nodes_table(nodes))
    return EXIT_OK


def _cmd_status(client: Client, args: argparse.Namespace) -> int:
    status = client.job(args.job_id).status()
    if args.json:
        _print_json(status)
    else:
        _show(status_text(status))
    return EXIT_OK


def _cmd_result(client: Client, args: argparse.Namespace) -> int:
    job = client.job(args.job_id)
    state, result = _finished(job)
    if result is not None and args.trusted_load and result.raw_return_values:
        print(
            "gelastic: warning: --trusted-load unpickles return values nobody verified; "
            "this runs code chosen by whoever wrote them",
            file=sys.stderr,
        )
        try:
            loaded = {
                r: trusted_load(v, rank=r) for r, v in sorted(result.raw_return_values.items())
            }
        except Exception as exc:
            raise CliError(f"cannot load the return values: {type(exc).__name__}: {exc}") from None
        result = dataclasses.replace(result, return_values=loaded)
    if args.json:
        _print_json(_result_json(job.job_id, state, result))
    if result is None:
        if not args.json:
            _show(f"gelastic: job {job.job_id} is still {state.value}", sys.stderr)
        return EXIT_USAGE
    if not args.json:
        _show(result_text(result, state.value))
    write_scheduler_error_file(result, result.name or job.job_id)
    return exit_code_of(state)


_MAX_JSON_LOG_LINE = 64 * 1024
"""`logs --json`: a longer line is cut into objects of at most this many bytes."""


class _JsonLogLines:
    """`gelastic logs --json`: a rank's output as one JSON object per line."""

    def __init__(self, job_id: str, rank: int, stream: str) -> None:
        self._head = {"job": job_id, "rank": rank, "stream": stream}
        self._partial = b""

    def _line(self, data: bytes) -> bytes:
        line = data.decode("utf-8", errors="replace")
        return (json.dumps({**self._head, "line": line}) + "\n").encode()

    def feed(self, chunk: bytes) -> bytes:
        lines = (self._partial + chunk).split(b"\n")
        self._partial = lines.pop()
        while len(self._partial) > _MAX_JSON_LOG_LINE:
            lines.append(self._partial[:_MAX_JSON_LOG_LINE])
            self._partial = self._partial[_MAX_JSON_LOG_LINE:]
        return b"".join(self._line(line) for line in lines)

    def finish(self) -> bytes:
        rest, self._partial = self._partial, b""
        return self._line(rest) if rest else b""


def _cmd_logs(client: Client, args: argparse.Namespace) -> int:
    if getattr(args, "all", False):
        if getattr(args, "json", False):
            raise CliError("logs: --all and --json cannot be combined; use --json per --rank")
        job = client.job(args.job_id)
        if args.follow:
            # As for one rank: wait for the ranks to start (a job in rendezvous has none yet).
            ranks = wait_for_ranks(job)
            if not ranks:
                raise CliError(f"job {args.job_id} ended before any rank started", EXIT_FAILED)
        else:
            ranks = sorted(w.global_rank for w in job.status().workers)
            if not ranks:
                raise CliError(
                    f"job {args.job_id} has no ranks yet (-f waits for them)", EXIT_FAILED
                )
        missing = print_all_ranks(
            job,
            ranks,
            args.stream,
            args.attempt,
            args.follow,
            lambda text: _show(f"gelastic logs: {text}", sys.stderr),
        )
        if missing:
            print(f"gelastic logs: {missing} of {len(ranks)} ranks had no log", file=sys.stderr)
        return EXIT_OK
    out = sys.stdout.buffer
    # Raw bytes into a pipe or a file; on a terminal, no escape sequence of the worker's runs.
    # With --json, one object per line (JSON escapes every control character).
    screen: TerminalFilter | _JsonLogLines | None = None
    if getattr(args, "json", False):
        screen = _JsonLogLines(args.job_id, args.rank, args.stream)
    elif sys.stdout.isatty():
        screen = TerminalFilter(sys.stdout.encoding or "utf-8")
    job = client.job(args.job_id)
    if args.follow and args.attempt is None:
        # As `tail -F`: wait for the rank to start, and follow it into each new attempt.
        chunks = follow_rank(
            job, args.rank, args.stream, lambda text: _show(f"gelastic logs: {text}", sys.stderr)
        )
    else:
        chunks = job.logs(args.rank, args.stream, args.attempt, args.follow)
    try:
        for chunk in chunks:
            out.write(screen.feed(chunk) if screen is not None else chunk)
            out.flush()
    except GelasticError as exc:
        # The node that holds the log went away (UNAVAILABLE) or part of it was lost
        # (DATA_LOSS): say so, not "cannot reach the coordinator".
        if exc.code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DATA_LOSS) and str(
            exc
        ).partition(": ")[2].startswith("node "):
            raise CliError(f"the log ended early: {exc}", EXIT_FAILED) from None
        raise
    finally:
        if screen is not None:
            out.write(screen.finish())
            out.flush()
    return EXIT_OK


def _cmd_events(client: Client, args: argparse.Namespace) -> int:
    job = client.job(args.job_id)
    if not args.follow:
        events = job.events(args.after)
        if args.json:
            _print_json(events)
        else:
            _show(events_table(events))
        return EXIT_OK
    deadline = None if args.follow_timeout is None else time.monotonic() + args.follow_timeout
    if not args.json:
        _show(event_line_header())
    last = args.after
    done = False
    while True:
        for e in job.events(last):
            if args.json:
                _print_json(e, indent=None)
            else:
                _show(event_line(e))
            last = e.seq
        if done:
            return EXIT_OK
        # The state is read after the events, and the events read once more after a terminal
        # state, so the events that finish the job are always printed.
        done = job.status().state.is_terminal() or (
            deadline is not None and time.monotonic() >= deadline
        )
        if not done:
            time.sleep(EVENTS_POLL_INTERVAL_S)


def _cmd_cancel(client: Client, args: argparse.Namespace) -> int:
    job = client.job(args.job_id)
    status = job.cancel()
    if args.wait and not status.state.is_terminal():
        try:
            job.wait(args.wait_timeout)
        except TimeoutError as exc:
            raise CliError(str(exc)) from None
        status = job.status()
    if args.json:
        _print_json(status)
    else:
        _show(f"{status.job_id} {status.state.value}")
    return EXIT_OK


def _cmd_dashboard(client: Client, args: argparse.Namespace) -> int:
    url = client.dashboard_url()
    if not url:
        raise CliError(
            "the coordinator serves no dashboard: start it with "
            "'coordinator serve --dashboard-port PORT'"
        )
    problem = _dashboard_url_problem(url)
    if problem:
        # The URL is the coordinator's word: a browser is handed only a web page of a host.
        raise CliError(f"the coordinator reported a dashboard URL that {problem}: {url!r:.200}")
    _show(url)
    # The login page asks for a token: say which one, on stderr (stdout is the URL alone).
    token_file = args.token_file or os.environ.get("GELASTIC_TOKEN_FILE", "")
    _show(
        f"gelastic dashboard: log in with the token in {token_file} (the client token this "
        "command sent)"
        if token_file
        else "gelastic dashboard: this command sent no token; if the page asks for one, log in "
        "with the coordinator's client token (the file of its --client-token-file, else of "
        "its --token-file)",
        sys.stderr,
    )
    if not args.no_browser and sys.stdout.isatty() and _desktop_browser():
        import webbrowser

        webbrowser.open(url)
    return EXIT_OK


def _dashboard_url_problem(url: str) -> str:
    """Why `url` is not an http(s) URL of a host and port ("" when it is one)."""
    from urllib.parse import urlsplit

    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError:
        return "cannot be parsed"
    if parts.scheme not in ("http", "https"):
        return "is not http or https"
    if parts.username is not None or parts.password is not None:
        return "carries a user name"
    host = parts.hostname or ""
    if not is_host(host) or port is None:
        return "does not name a host and a port"
    if parts.path not in ("", "/") or parts.query or parts.fragment:
        return "is not the dashboard's own page"
    return ""


def _desktop_browser() -> bool:
    """A graphical browser could open here: a display on Linux, or macOS or Windows."""
    if sys.platform not in ("darwin", "win32") and not (
        os.environ.get("DISPLAY") or os.environ.get("WAYLAND_DISPLAY")
    ):
        return False
    import webbrowser

    try:
        webbrowser.get()
    except webbrowser.Error:
        return False
    return True


_COMMANDS: dict[str, Callable[[Client, argparse.Namespace], int]] = {
    "submit": _cmd_submit,
    "jobs": _cmd_jobs,
    "nodes": _cmd_nodes,
    "status": _cmd_status,
    "result": _cmd_result,
    "logs": _cmd_logs,
    "events": _cmd_events,
    "cancel": _cmd_cancel,
    "dashboard": _cmd_dashboard,
}


def _run_argv(argv: Sequence[str]) -> list[str] | None:
    """The arguments of `gelastic [connection options] run ...`, or None for other commands.

    `run` has torchrun's own parser: argparse cannot hand a subcommand everything after it
    when that starts with options.
    """
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg == "run":
            return list(argv[i + 1 :])
        if arg in _GLOBAL_VALUE_OPTIONS:
            i += 2
        elif arg.split("=", 1)[0] in _GLOBAL_VALUE_OPTIONS:
            i += 1
        else:
            return None
    return None


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def _did_you_mean(word: str, parser: argparse.ArgumentParser) -> str:
    """`; did you mean --nproc-per-node?` for a mistyped flag, or ""."""
    flag = word.split("=", 1)[0]
    if not flag.startswith("-"):
        return ""
    known = [o for a in parser._actions for o in a.option_strings if o.startswith("--")]
    close = difflib.get_close_matches(flag, known, n=1, cutoff=0.6)
    return f"; did you mean {close[0]}?" if close else ""


def _check_global_options(parser: argparse.ArgumentParser, argv: list[str]) -> list[str]:
    """`argv`, once every option before the command is known to the top-level parser.

    argparse would take the value of a mistyped `--coordnator ADDR` for the command and say
    "invalid choice: 'ADDR'"; this names the option instead.
    """
    commands = _subparsers(parser)
    known = {o for a in parser._actions for o in a.option_strings}
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg in commands or arg == "--" or not arg.startswith("-") or arg == "-":
            break
        name = arg.split("=", 1)[0]
        if name not in known:
            parser.exit(
                EXIT_USAGE,
                f"gelastic: unrecognized option {one_line(name)[:100]}"
                f"{_did_you_mean(name, parser)} (see 'gelastic --help')\n",
            )
        i += 2 if name in _GLOBAL_VALUE_OPTIONS and "=" not in arg else 1
    return argv


def _unrecognized(parser: argparse.ArgumentParser, command: str, extra: list[str]) -> NoReturn:
    """A subcommand's unknown arguments: name the subcommand, its help, the closest flag."""
    sub = _subparsers(parser).get(command, parser)
    flags = [w for w in extra if w.startswith("-")]
    hint = _did_you_mean(flags[0], sub) if flags else ""
    words = one_line(" ".join(extra))
    sub.exit(
        EXIT_USAGE,
        f"gelastic {command}: unrecognized arguments: {words[:200]}{hint} "
        f"(see 'gelastic {command} --help')\n",
    )


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    run_args = _run_argv(argv)
    if run_args is not None:
        from client._cli_run_nodes import main as run_main

        return run_main(run_args)
    parser = _parser()
    args, extra = parser.parse_known_args(_check_global_options(parser, argv))
    if extra:
        _unrecognized(parser, args.command, extra)
    address = args.coordinator or os.environ.get("GELASTIC_COORDINATOR") or DEFAULT_COORDINATOR
    client: Client | None = None
    try:
        if args.command == "submit":
            _check_submit_flags(args)
            _check_spec(build_spec(args))
        try:
            client = _connect(args)
        except ValueError as exc:  # an unreadable token file or TLS setting
            raise CliError(str(exc), EXIT_USAGE) from None
        return _COMMANDS[args.command](client, args)
    except CliError as exc:
        _show(f"gelastic {args.command}: {exc}", sys.stderr)
        return exc.code
    except GelasticError as exc:
        security = client.security if client is not None else None
        _show(f"gelastic {args.command}: {_describe(exc, address, security)}", sys.stderr)
        return EXIT_USAGE
    except grpc.RpcError as exc:
        _show(f"gelastic {args.command}: {one_line(str(exc))}", sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        # `gelastic logs JOB | head`: the reader is gone; say nothing more.
        _silence_stdout()
        return EXIT_OK
    finally:
        if client is not None:
            client.close()


def _silence_stdout() -> None:
    # Python would report the broken pipe again when it flushes stdout at exit.
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)


if __name__ == "__main__":
    sys.exit(main())
