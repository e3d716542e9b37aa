"""The `gelastic` argument parser, and the usage errors it reports in one line.

Owns every subcommand's flags, the connection options each subcommand repeats, and the checks
around argparse: the arguments of `gelastic ... run` (torchrun's own parser takes them), and a
mistyped option named with the closest known one ("did you mean").
"""

from __future__ import annotations

import argparse
import difflib
from collections.abc import Callable, Sequence
from typing import NoReturn

from client._cli_output import EXIT_USAGE, one_line
from client._cli_stacks import STACK_HELP, add_stack_arguments
from client._client import DEFAULT_COORDINATOR
from client.model import JobSpec
from client.stall_flags import add_stall_options
from client.version import VersionAction as _Version

DEFAULT_CALL_TIMEOUT_S = 10.0
DEFAULT_CONNECT_TIMEOUT_S = 5.0

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


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (argparse prints the whole usage first)."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"{self.prog}: {one_line(message)} (see '{self.prog} --help')\n")


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


def _add_status_and_top(command: Callable[[str, str], argparse.ArgumentParser]) -> None:
    s = command("status", "show a job: state, reason, members, and every rank")
    s.add_argument("job_id", metavar="JOB", help="the job's id")
    _add_json(s)
    s = command("top", "show a job's ranks' progress live (q or Ctrl-C quits)")
    s.add_argument("job_id", metavar="JOB", help="the job's id")
    s.add_argument(
        "--interval",
        type=_positive_float,
        default=1.0,
        metavar="S",
        help="seconds between refreshes (default %(default)g)",
    )


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
    add_stall_options(s, d.stall_timeout, d.stall_action)
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
        "--torch-metrics",
        action="store_true",
        help="what the workers put through torch.distributed.elastic.metrics reaches the "
        "coordinator's Prometheus metrics",
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
    s.add_argument(
        "--drain",
        action="append",
        default=[],
        metavar="NAME",
        help="drain node NAME (repeatable): no new round goes there, and the jobs running there "
        "re-form on the other nodes without spending a restart; their workers get a preemption "
        "notice at once, SIGTERM their job's stop_grace before the deadline, SIGKILL at it",
    )
    s.add_argument(
        "--deadline",
        type=float,
        default=None,
        metavar="S",
        help="with --drain: seconds until the drained workers are killed, e.g. a cloud's "
        "preemption notice (default: each job's stop_grace)",
    )
    s.add_argument(
        "--reason", default="", help="with --drain: why, shown with the node and in job events"
    )
    s.add_argument(
        "--undrain",
        action="append",
        default=[],
        metavar="NAME",
        help="let drained node NAME take new rounds again (repeatable)",
    )
    _add_json(s)

    _add_status_and_top(command)

    s = command("result", "show a finished job's return values or its failure report")
    s.add_argument("job_id", metavar="JOB", help="the job's id")
    s.add_argument(
        "--trusted-load",
        action="store_true",
        help="also unpickle the return values that are pickles (JSON values are printed "
        "without it); this runs code chosen by whoever wrote them (the job's workers, any node "
        "placed on the job, or anyone who could change them on the way), so only for jobs "
        "whose nodes and channel you trust",
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

    add_stack_arguments(command("stack", STACK_HELP))

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
