"""`gelastic run`: a drop-in for `torchrun` on one host, with no servers to start.

It runs a coordinator (loopback, any free port, behind a random token that only this process
holds: in a 0600 file of a private 0700 temp dir) and one node agent inside this process, on an
asyncio loop in a background thread, submits the script as a one-node job and waits for it with
the Python client, like any other job. Worker output is teed to this console with a `[rank]:`
prefix, a failure ends with the torchelastic-style failure report, and the exit code is
torchrun's: 0 when every rank succeeded, 1 otherwise. SIGINT, SIGTERM and SIGHUP cancel the job
and stop everything before the command exits.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import shutil
import signal
import socket
import sys
import tempfile
import threading
import types
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NoReturn

from client._client import Client, GelasticError, Job
from client._scheduler_error import write_scheduler_error_file
from client._terminal import strip_terminal_controls
from client.model import JobSpec, JobState, RunResult, SpecError, is_name
from client.security import new_token_file

__all__ = ["EmbeddedCluster", "RunPlan", "main", "plan_run", "run_parser"]

logger = logging.getLogger(__name__)

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

# torchrun flags that configure a rendezvous or launcher this command does not have. They are
# accepted, so a torchrun command line works unchanged, and named in a one-line note.
_IGNORED_WITH_VALUE: dict[str, str] = {
    "rdzv-backend": "the embedded coordinator is the rendezvous",
    "rdzv-endpoint": "the embedded coordinator is the rendezvous",
    "rdzv-id": "the run id is the job id the embedded coordinator makes",
    "rdzv-conf": "the embedded coordinator is the rendezvous",
    "master-addr": "MASTER_ADDR is this host's loopback address",
    "master-port": "MASTER_PORT is a free port the agent reserves",
    "node-rank": "this host is the only node",
    "monitor-interval": "workers' exits are reported the moment they happen",
    "start-method": "every worker is a fresh process",
    "local-addr": "this host is reached on loopback",
    "event-log-handler": "events are kept by the coordinator",
    "logs-specs": "logs go to --log-dir/<job>/attempt_<n>/<rank>/",
    "numa-binding": "NUMA binding is not supported",
    "signals-to-handle": "SIGINT, SIGTERM and SIGHUP always cancel the job",
    "duplicate-stdout-filters": "output filters are not supported",
    "duplicate-stderr-filters": "output filters are not supported",
}
_IGNORED_FLAGS: dict[str, str] = {
    "virtual-local-rank": "every worker sees its own LOCAL_RANK",
}


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
    # torchrun reads each option's default from PET_<DEST>.
    return os.environ.get(f"PET_{dest.upper()}", default)


def run_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="gelastic run",
        description="Run a torchrun-style training script on this host: an embedded "
        "coordinator and node agent start the workers with torchrun's environment.",
        epilog="Exit code: 0 when every rank succeeded, 1 otherwise (like torchrun); 2 for a "
        "command line that cannot run here.",
    )
    p.add_argument(
        *_names("nnodes"),
        dest="nnodes",
        metavar="N",
        default=_env_default("nnodes", "1"),
        help="must resolve to 1: this command runs on this host only (default 1)",
    )
    p.add_argument(
        *_names("nproc-per-node"),
        dest="nproc_per_node",
        metavar="N",
        default=_env_default("nproc_per_node", "1"),
        help="workers on this host: a number, or auto, cpu, gpu (default 1)",
    )
    p.add_argument(
        *_names("max-restarts"),
        dest="max_restarts",
        metavar="N",
        type=int,
        default=int(_env_default("max_restarts", "0") or 0),
        help="failure restarts before the job fails (default 0)",
    )
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
        default=None,
        help="torchrun --redirects: 0-3 or 'local_rank:mask,...' "
        "(default: none, output is teed with a [rank]: prefix)",
    )
    p.add_argument(
        "-t",
        *_names("tee"),
        dest="tee",
        metavar="MASK",
        default=None,
        help="torchrun --tee: 0-3 or 'local_rank:mask,...' (default 3)",
    )
    p.add_argument(
        *_names("local-ranks-filter"),
        dest="local_ranks_filter",
        metavar="RANKS",
        default="",
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
    p.add_argument(
        "-m", "--module", action="store_true", help="the script is a module: run it as 'python -m'"
    )
    p.add_argument(
        *_names("no-python"),
        dest="no_python",
        action="store_true",
        help="run the script as a program, without the Python interpreter",
    )
    # torchrun's flags that change nothing here: listed in a group of their own.
    compat = p.add_argument_group(
        "accepted for compatibility with torchrun",
        "these torchrun flags are accepted so a torchrun command line runs unchanged; "
        "they change nothing here",
    )
    compat.add_argument(
        *_names("run-path"),
        dest="run_path",
        action="store_true",
        help="the script always runs in its own interpreter",
    )
    compat.add_argument(
        "--standalone",
        action="store_true",
        help="every run is standalone",
    )
    p.add_argument(
        *_names("shutdown-timeout"),
        dest="shutdown_timeout",
        metavar="S",
        type=float,
        default=float(_env_default("shutdown_timeout", "30") or 30),
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
        compat.add_argument(
            *_names(name), dest=_ignored_dest(name), default=None, metavar="VALUE", help=why
        )
    for name, why in _IGNORED_FLAGS.items():
        compat.add_argument(
            *_names(name),
            dest=_ignored_dest(name),
            action="store_true",
            default=None,
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


def _parse_nnodes(value: str) -> None:
    parts = value.split(":")
    if len(parts) not in (1, 2) or not all(p.strip().isdigit() for p in parts):
        raise RunError(f"--nnodes must be N or MIN:MAX, got {value!r}")
    if any(int(p) != 1 for p in parts):
        raise RunError(
            f"--nnodes={value}: gelastic run runs on this host only, so it must be 1; "
            "for several nodes start a coordinator and node agents and use 'gelastic submit'"
        )


def _parse_nproc(value: str) -> int:
    if value.isdigit():
        n = int(value)
        if n < 1:
            raise RunError(f"--nproc-per-node must be at least 1, got {value}")
        return n
    if value == "cpu":
        return os.cpu_count() or 1
    if value in ("auto", "gpu"):
        gpus = _gpu_count()
        if gpus:
            return gpus
        if value == "gpu":
            raise RunError("--nproc-per-node=gpu: no GPU is visible to torch on this host")
        return os.cpu_count() or 1
    raise RunError(f"--nproc-per-node must be a number, auto, cpu or gpu, got {value!r}")


def _gpu_count() -> int:
    try:
        import torch
    except ImportError:
        return 0
    return int(torch.cuda.device_count()) if torch.cuda.is_available() else 0


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


def plan_run(args: argparse.Namespace, *, python: str = sys.executable) -> RunPlan:
    """Turn `gelastic run`'s parsed command line into a JobSpec; raise RunError if it cannot run."""
    notes = [
        f"ignoring --{name}: {why}"
        for name, why in {**_IGNORED_WITH_VALUE, **_IGNORED_FLAGS}.items()
        if getattr(args, _ignored_dest(name)) is not None
    ]
    _parse_nnodes(str(args.nnodes))
    nproc = _parse_nproc(str(args.nproc_per_node))
    log_level = str(args.log_level).upper()
    if not isinstance(logging.getLevelName(log_level), int):
        raise RunError(f"--log-level must be DEBUG, INFO, WARNING or ERROR, got {args.log_level!r}")
    if args.module and args.no_python:
        raise RunError("use either --module (-m) or --no-python, not both")
    script: str = args.training_script
    script_args = list(args.training_script_args)
    if args.no_python:
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
        role=args.role,
        redirects=redirects,
        tee=tee,
        # One node: the round can close as soon as the node is there.
        last_call_timeout=0.0,
        join_timeout=START_TIMEOUT_S,
        exit_barrier_timeout=START_TIMEOUT_S,
        stop_grace=args.shutdown_timeout,
        preload=tuple(args.preload),
    )
    try:
        spec.validate()
    except SpecError as exc:
        raise RunError(str(exc)) from None
    name = script if args.module else os.path.basename(script)
    dashboard_port = None
    if args.dashboard or args.dashboard_port is not None:
        dashboard_port = args.dashboard_port or 0
        if not 0 <= dashboard_port < 65536:
            raise RunError(f"--dashboard-port must be 0-65535, got {dashboard_port}")
    return RunPlan(
        spec=spec,
        report_name=name,
        log_dir=args.log_dir,
        notes=tuple(notes),
        prefix_template=os.environ.get(PREFIX_TEMPLATE_ENV, RANK_PREFIX_TEMPLATE),
        progress=not args.quiet,
        log_level=log_level,
        dashboard_port=dashboard_port,
    )


# ---- the embedded cluster -------------------------------------------------------------------


class EmbeddedCluster:
    """A coordinator and one node agent on a private asyncio loop in a background thread.

    The loop thread lives until `stop()`: the agent forks workers from it, and they are set to
    die with the thread that forked them, so no worker outlives this object, or this process.
    """

    def __init__(
        self, *, slots: int, log_dir: str, state_dir: str, dashboard_port: int | None = None
    ) -> None:
        self.slots = slots
        self.dashboard_port = dashboard_port
        self.dashboard_url = ""
        """Where the web dashboard serves (with `dashboard_port`), once started."""
        self.log_dir = log_dir
        self.state_dir = state_dir
        self.address = ""
        self.token_file = ""
        """The token the coordinator requires, in a private dir; made by `start()`."""
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._coordinator: Any = None
        self._agent: Any = None
        self._start_task: asyncio.Task[Any] | None = None

    def start(self) -> str:
        """Start both servers; return the coordinator's address once the node has joined."""
        # Loopback is open to every user of this host: the coordinator takes only this token.
        self.token_file = str(new_token_file("gelastic-run-token-"))
        loop = asyncio.new_event_loop()
        self._loop = loop
        self._thread = threading.Thread(target=self._serve, name="gelastic-run", daemon=True)
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), loop).result(START_TIMEOUT_S)
        return self.address

    def _serve(self) -> None:
        assert self._loop is not None
        asyncio.set_event_loop(self._loop)
        self._loop.run_forever()

    async def _start(self) -> None:
        # Imported here: the rest of the CLI needs neither the server nor the agent.
        from coordinator.server import Coordinator, CoordinatorConfig
        from nodeagent.session import AgentConfig, NodeAgent

        self._start_task = asyncio.current_task()
        self._coordinator = Coordinator(
            CoordinatorConfig(
                host="127.0.0.1",
                port=0,
                heartbeat_interval=0.5,
                lease=5.0,
                state_dir=":memory:",
                token_file=self.token_file,
            )
        )
        await self._coordinator.start()
        self.address = self._coordinator.address
        if self.dashboard_port is not None:
            self.dashboard_url = await self._coordinator.start_dashboard(self.dashboard_port)
        self._agent = NodeAgent(
            AgentConfig(
                coordinator=self.address,
                slots=self.slots,
                name=_node_name(),
                addr="127.0.0.1",
                log_dir=self.log_dir,
                state_dir=self.state_dir,
                token_file=self.token_file,
            )
        )
        await self._agent.start()
        await asyncio.wait_for(self._agent.connected.wait(), START_TIMEOUT_S)

    async def _stop(self, grace: float) -> None:
        start = self._start_task
        if start is not None and not start.done():
            # Interrupted while starting: the start must end before its parts are stopped.
            start.cancel()
            with contextlib.suppress(BaseException):
                await start
        # The node leaving is expected now; the coordinator need not warn about it.
        logging.getLogger("coordinator").setLevel(logging.ERROR)
        if self._agent is not None:
            await self._agent.stop(grace)
        if self._coordinator is not None:
            await self._coordinator.stop(grace=0.5)
        # The server's own RPC tasks end by themselves once it has stopped; anything still
        # pending after that must not run against a closed loop.
        me = asyncio.current_task()
        pending = [t for t in asyncio.all_tasks() if t is not me]
        if pending:
            _, left = await asyncio.wait(pending, timeout=2.0)
            for t in left:
                t.cancel()
            await asyncio.gather(*left, return_exceptions=True)

    def stop(self, grace: float) -> None:
        """Stop the workers (SIGTERM, `grace`, SIGKILL), the agent, the coordinator; idempotent."""
        loop, thread = self._loop, self._thread
        self._loop = self._thread = None
        if loop is None or thread is None:
            self._remove_token()
            return
        try:
            if thread.is_alive():
                asyncio.run_coroutine_threadsafe(self._stop(grace), loop).result(grace + 30)
        except Exception:
            logger.exception("stopping the embedded coordinator and agent failed")
        finally:
            loop.call_soon_threadsafe(loop.stop)
            thread.join(30)
            if not thread.is_alive():
                loop.close()
            self._remove_token()

    def _remove_token(self) -> None:
        if self.token_file:
            shutil.rmtree(os.path.dirname(self.token_file), ignore_errors=True)
            self.token_file = ""


def _node_name() -> str:
    name = socket.gethostname().split(".")[0]
    return name if is_name(name) else "localhost"


# ---- signals --------------------------------------------------------------------------------


class Interrupted(BaseException):
    """SIGINT, SIGTERM or SIGHUP arrived: cancel the job and stop."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


_HANDLED_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class _SignalGuard:
    """Turns the first stop signal into `Interrupted`; a second one during clean-up forces exit.

    Forcing exit is safe: the workers die with the loop thread that forked them.
    """

    def __init__(self) -> None:
        self.received: int | None = None
        self.cleaning = False
        """Set once clean-up has begun: a first signal then no longer interrupts it."""
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> _SignalGuard:
        if threading.current_thread() is threading.main_thread():
            for sig in _HANDLED_SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum: int, frame: types.FrameType | None) -> None:
        if self.received is None:
            self.received = signum
            if self.cleaning:
                return
            raise Interrupted(signum)
        sys.stderr.write(f"gelastic run: {signal.Signals(signum).name} again; exiting now\n")
        sys.stderr.flush()
        os._exit(EXIT_FAILED)

    def __exit__(self, *exc: object) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)


# ---- running --------------------------------------------------------------------------------


def _say(text: str) -> None:
    sys.stderr.write(f"gelastic run: {text}\n")
    sys.stderr.flush()


def execute(plan: RunPlan) -> int:
    """Run the plan's job on an embedded cluster; return torchrun's exit code."""
    os.environ.setdefault(PREFIX_TEMPLATE_ENV, plan.prefix_template)
    own_log_dir = plan.log_dir is None
    log_dir = plan.log_dir or tempfile.mkdtemp(prefix="gelastic-run-")
    state_dir = tempfile.mkdtemp(prefix="gelastic-run-state-")
    cluster = EmbeddedCluster(
        slots=plan.spec.nproc_per_node,
        log_dir=log_dir,
        state_dir=state_dir,
        dashboard_port=plan.dashboard_port,
    )
    client: Client | None = None
    job: Job | None = None
    code = EXIT_FAILED
    keep_logs = True
    with _SignalGuard() as guard:
        try:
            address = cluster.start()
            if cluster.dashboard_url:
                _say(
                    f"dashboard: {cluster.dashboard_url} (log in with the token in "
                    f"{cluster.token_file}; it lasts as long as this run)"
                )
            client = Client(address, token_file=cluster.token_file)
            job = client.submit(plan.spec)
            result = job.wait(progress=plan.progress, out=sys.stderr)
            state = job.status().state
            code = EXIT_OK if state == JobState.SUCCEEDED else EXIT_FAILED
            keep_logs = code != EXIT_OK
            _report(plan, state, result)
        except Interrupted as exc:
            _say(f"{signal.Signals(exc.signum).name}: cancelling the job")
            if job is not None:
                _cancel(job, plan.spec.stop_grace + CANCEL_SLACK_S)
        except (GelasticError, TimeoutError, OSError) as exc:
            _say(" ".join(str(exc).split()) or type(exc).__name__)
        finally:
            guard.cleaning = True
            if client is not None:
                client.close()
            cluster.stop(plan.spec.stop_grace)
            shutil.rmtree(state_dir, ignore_errors=True)
            if own_log_dir:
                if keep_logs:
                    _say(f"worker logs are in {log_dir}")
                else:
                    shutil.rmtree(log_dir, ignore_errors=True)
        if guard.received is not None:
            return EXIT_FAILED
    return code


def _cancel(job: Job, timeout: float) -> None:
    try:
        job.cancel()
        job.wait(timeout)
    except (GelasticError, TimeoutError) as exc:
        _say(f"the job did not end cleanly ({' '.join(str(exc).split())}); stopping the workers")


def _report(plan: RunPlan, state: JobState, result: RunResult) -> None:
    if state == JobState.SUCCEEDED:
        return
    # The workers ran on this host: the root cause's own error file is copied as it is.
    write_scheduler_error_file(result, plan.report_name, local_error_files=True)
    if result.failures:
        table = result.format_failures(plan.report_name).rstrip("\n") + "\n"
        # The table quotes the workers (tracebacks, stderr): on a terminal none of it runs.
        sys.stderr.write(strip_terminal_controls(table) if sys.stderr.isatty() else table)
    else:
        reason = " ".join(result.reason.split())
        _say(
            f"{plan.report_name} {state.value}: "
            + (strip_terminal_controls(reason) if sys.stderr.isatty() else reason)
        )
    sys.stderr.flush()


def main(argv: Sequence[str]) -> int:
    args = run_parser().parse_args(list(argv))
    try:
        plan = plan_run(args)
    except RunError as exc:
        _say(str(exc))
        return EXIT_USAGE
    for note in plan.notes:
        _say(note)
    logging.basicConfig(
        level=plan.log_level,
        format="gelastic run: %(levelname)s %(name)s: %(message)s",
    )
    try:
        return execute(plan)
    except Interrupted:
        # The signal arrived as the run was ending; everything has been stopped already.
        return EXIT_FAILED
