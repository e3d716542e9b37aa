"""The workers of one job round on this node: start them, watch them, report each exit, stop them.

`WorkerGroup` carries out a `RoundAssignment`: it prepares the log directories, spawns every
local worker from the launch plan, copies their stdout/stderr into the log files (and, per the
redirect/tee masks, onto the agent's console), serves the FileTimer watchdog, samples health,
and calls `on_exit` with a `WorkerExit` the moment each worker is gone. It makes no decisions
about the job: what to do after a failure is the coordinator's call, relayed by the session.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import enum
import errno
import logging
import os
import signal
import stat
import sys
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable, Coroutine, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import IO, Any

from client.assignment import RoundAssignment, WorkerRanks
from client.model import (
    MAX_RETURN_VALUE_BYTES,
    FailureCategory,
    ProcessFailure,
    WorkerState,
    signal_name,
)
from client.redaction import redact_argv
from nodeagent import _faults
from nodeagent._errorfile import (
    ErrorFileResult,
    build_failure,
    read_error_file,
    read_stderr_tail,
)
from nodeagent._health import HealthJudge, HealthSample, HealthSampler
from nodeagent._inotify import ErrorFileWatch
from nodeagent._launch import (
    ROUND_MARKER,
    STDERR,
    STDOUT,
    StandbyLaunch,
    StoreHostLaunch,
    WorkerLaunch,
    bounded,
    build_launch_plan,
    build_standby_launch,
    build_store_host_launch,
    describe_executable,
    entrypoint_name,
    resolve_attempt_dir,
    resolve_executable,
    watchdog_request,
)
from nodeagent._process import ProcessHandle, spawn
from nodeagent._reaper import PidRegistry
from nodeagent._store_host import StoreHost, StoreHostError, WarmStoreHost
from nodeagent._watchdog import FileTimerServer, TimerFileError, validate_timer_file

__all__ = ["ConsoleWriter", "WorkerExit", "WorkerGroup", "WorkerHealth", "agent_console"]

logger = logging.getLogger(__name__)

ConsoleWriter = Callable[[int, bytes], None]
"""console(stream, data): stream is 1 (stdout) or 2 (stderr)."""

_READ_CHUNK = 65536
_MAX_PARTIAL_LINE = 64 * 1024
_EXIT_NOT_FOUND = 127
_STOP_SIGNALS = frozenset({signal.SIGTERM, signal.SIGKILL})


def _stopped_by_us(handle: Any, rc: int) -> bool:
    """Whether a death by signal `-rc` is the agent's stop: one of its stop signals, and one it
    sent (a worker SIGKILLed by someone else while the stop began is a failure, not a stop)."""
    if -rc not in _STOP_SIGNALS:
        return False
    sent = getattr(handle, "signals_sent", None)
    return sent is None or -rc in sent


_EXIT_CANNOT_EXECUTE = 126
_STORE_STOP_GRACE = 2.0
MAX_UNKNOWN_REASON = 1000
"""Characters of an UNKNOWN group's reason kept (an exception's text is not ours to bound)."""
# errnos that mean the agent's host, not the worker's program, is at fault.
_PLATFORM_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.EAGAIN, errno.ENOSPC})


@dataclass(frozen=True)
class WorkerExit:
    """One worker is gone: how, and what it left."""

    local_rank: int
    global_rank: int
    pid: int
    """0 when the worker could not be started."""
    exitcode: int
    """Negative = killed by that signal; 126/127 = could not be started."""
    stopped_by_agent: bool
    """The exit was caused by `stop()`; it is neither a failure nor a result."""
    failure: ProcessFailure | None
    return_value: bytes | None
    """Pickled return value of a function entrypoint that succeeded (never unpickled here)."""
    timestamp: float
    """When the agent observed the exit (seconds since the epoch)."""

    @property
    def succeeded(self) -> bool:
        return self.failure is None and not self.stopped_by_agent


@dataclass(frozen=True)
class WorkerHealth:
    """The latest health sample of one worker."""

    local_rank: int
    global_rank: int
    pid: int
    status: str
    """psutil status: "running", "sleeping", "disk-sleep", "stopped", ..."""
    cpu_percent: float
    rss_bytes: int
    timestamp: float
    bad_since: float | None = None
    """Since when the worker has been in D or T state (None = it is not)."""


def agent_console(stream: int, data: bytes) -> None:
    """Default console writer: the agent's own stdout/stderr."""
    out = sys.stdout if stream == STDOUT else sys.stderr
    buffer = getattr(out, "buffer", None)
    if buffer is not None:
        out.flush()
        buffer.write(data)
        buffer.flush()
    else:
        out.write(data.decode("utf-8", errors="replace"))
        out.flush()


def _private_dirs(path: Path) -> None:
    """mkdir -p where every directory made is 0700: a job's logs and arguments are its own.

    (mkdir's `parents` ignores `mode`, so each missing level is made here.)
    """
    missing: list[Path] = []
    p = path
    while not p.exists():
        missing.append(p)
        p = p.parent
    for d in reversed(missing):
        with contextlib.suppress(FileExistsError):
            d.mkdir(mode=0o700)


def _private_file(path: Path, flags: int) -> int:
    """Open (creating it 0600) a file of the agent's own, never through a symlink."""
    fd = os.open(path, flags | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        if os.fstat(fd).st_mode & 0o077:
            os.fchmod(fd, 0o600)  # a file left by an earlier agent with a looser mode
    except OSError:
        os.close(fd)
        raise
    return fd


def _write_private(path: Path, data: bytes) -> None:
    with os.fdopen(_private_file(path, os.O_WRONLY | os.O_TRUNC), "wb") as f:
        f.write(data)


class _StreamPump:
    """Copies one worker pipe into its log file and, per its mode, onto the console."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        fd: int,
        log_path: Path,
        stream: int,
        console: ConsoleWriter | None,
        prefix: bytes | None,
    ) -> None:
        self._loop = loop
        self._fd: int | None = fd
        self._stream = stream
        self._console = console
        self._prefix = prefix
        self._partial = b""
        self._log: IO[bytes] | None = None
        self.done: asyncio.Future[None] = loop.create_future()
        try:
            log_fd = _private_file(log_path, os.O_WRONLY | os.O_APPEND)
            self._log = os.fdopen(log_fd, "ab", buffering=0)  # closed in _finish
        except OSError:
            logger.exception("cannot open log file %s; output of this stream is dropped", log_path)
        os.set_blocking(fd, False)
        loop.add_reader(fd, self._on_readable)

    def _on_readable(self) -> None:
        if self._fd is None:
            return
        try:
            data = os.read(self._fd, _READ_CHUNK)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:
            self.finish()
            return
        if self._log is not None:
            try:
                self._log.write(data)
            except OSError:
                logger.exception("cannot write log file; dropping its output from now on")
                self._close_log()
        self._forward(data)

    def _emit(self, data: bytes) -> None:
        if self._console is None or not data:
            return
        try:
            self._console(self._stream, data)
        except Exception:
            logger.exception("console writer failed; worker output goes to the log file only")
            self._console = None

    def _forward(self, data: bytes) -> None:
        if self._console is None:
            return
        if self._prefix is None:
            self._emit(data)
            return
        lines = (self._partial + data).split(b"\n")
        self._partial = lines.pop()
        if len(self._partial) > _MAX_PARTIAL_LINE:
            lines.append(self._partial)
            self._partial = b""
        if lines:
            self._emit(b"".join(self._prefix + line + b"\n" for line in lines))

    def _close_log(self) -> None:
        if self._log is not None:
            with contextlib.suppress(OSError):
                self._log.close()
            self._log = None

    def finish(self) -> None:
        """Stop reading (EOF, or the drain deadline passed) and flush what is buffered."""
        if self._fd is not None:
            self._loop.remove_reader(self._fd)
            os.close(self._fd)
            self._fd = None
        if self._partial and self._prefix is not None:
            self._emit(self._prefix + self._partial + b"\n")
            self._partial = b""
        self._close_log()
        if not self.done.done():
            self.done.set_result(None)


class _Phase(enum.Enum):
    NEW = "NEW"
    STARTING = "STARTING"
    RUNNING = "RUNNING"
    STOPPING = "STOPPING"
    CLOSED = "CLOSED"


@dataclass
class _Worker:
    launch: WorkerLaunch
    handle: ProcessHandle | None = None
    pumps: list[_StreamPump] = field(default_factory=list)
    reported: bool = False
    exit: WorkerExit | None = None
    kill_reason: str | None = None
    """Why the agent itself killed this worker (watchdog, health); makes the exit a failure."""
    unhealthy: bool = False
    supervisor: asyncio.Task[Any] | None = None
    early: ErrorFileResult | None = None
    """The error file as first read complete while the worker still ran (reported at once)."""
    early_reading: bool = False
    early_recheck: bool = False

    @property
    def pid(self) -> int:
        return self.handle.pid if self.handle is not None else 0


class WorkerGroup:
    """The local workers of one job round (torchelastic's WorkerGroup on one node).

    `on_exit` is called once per worker, on the event loop, never before `start()` returned.
    Use `async with` or call `close()`: workers must never outlive the group.
    """

    def __init__(
        self,
        assignment: RoundAssignment,
        *,
        node_name: str,
        log_root: Path,
        on_exit: Callable[[WorkerExit], None],
        console: ConsoleWriter | None = agent_console,
        agent_env: Mapping[str, str] | None = None,
        run_dir: Path | None = None,
        pid_registry: PidRegistry | None = None,
        spawner: Callable[[WorkerLaunch], ProcessHandle] = spawn,
        python: str = sys.executable,
        agent_cwd: str | None = None,
        drain_timeout: float = 2.0,
        health_interval: float | None = None,
        on_failing: Callable[[ProcessFailure], None] | None = None,
        warm_store: Callable[[StoreHostLaunch], WarmStoreHost | None] | None = None,
        on_unknown: Callable[[str], None] | None = None,
        before_spawn: Callable[[], Awaitable[object]] | None = None,
    ) -> None:
        self.assignment = assignment
        self._on_unknown = on_unknown
        self._before_spawn = before_spawn
        """Awaited once the store host is started, before the workers are (the job's zygote)."""
        self._unknown: str | None = None
        self._warm_store = warm_store
        self.spec = assignment.spec
        self.node_name = node_name
        self.log_root = Path(log_root)
        self._on_exit = on_exit
        self._console = console
        self._agent_env = dict(os.environ if agent_env is None else agent_env)
        self._run_dir = Path(run_dir) if run_dir is not None else Path(tempfile.gettempdir())
        self._registry = pid_registry
        self._spawner = spawner
        self._python = python
        self._agent_cwd = agent_cwd
        self._drain_timeout = drain_timeout
        timeout = self.spec.unhealthy_timeout
        self._health_interval = (
            health_interval if health_interval is not None else min(5.0, max(0.2, timeout / 4))
        )
        self._judge = HealthJudge(timeout)
        self._sampler = HealthSampler()
        self._samples: dict[int, HealthSample] = {}
        self._workers: list[_Worker] = []
        self._by_pid: dict[int, _Worker] = {}
        self._tasks: set[asyncio.Task[Any]] = set()
        self._watchdog: FileTimerServer | None = None
        self._store_launch: StoreHostLaunch | None = None
        self._store: StoreHost | None = None
        self._store_stop: asyncio.Future[bool] | None = None
        self._phase = _Phase.NEW
        self._stop_task: asyncio.Task[list[int]] | None = None
        self._setup_failed = False
        self._on_failing = on_failing
        self._error_watch: ErrorFileWatch | None = None
        self._by_error_file: dict[Path, _Worker] = {}
        self.log_dir: Path | None = None
        self.plan: list[WorkerLaunch] = []

    # -- properties --------------------------------------------------------------------------

    @property
    def pids(self) -> dict[int, int]:
        """{local_rank: pid} of every worker that was started."""
        return {w.launch.local_rank: w.pid for w in self._workers if w.handle is not None}

    @property
    def running(self) -> int:
        """Workers started and not yet reported as exited."""
        return sum(1 for w in self._workers if w.handle is not None and not w.reported)

    @property
    def exits(self) -> dict[int, WorkerExit]:
        """{local_rank: WorkerExit} reported so far."""
        return {w.launch.local_rank: w.exit for w in self._workers if w.exit is not None}

    @property
    def state(self) -> WorkerState:
        """The group's torchelastic state, derived from its workers."""
        if self._unknown is not None:
            return WorkerState.UNKNOWN
        if self._phase in (_Phase.NEW, _Phase.STARTING):
            return WorkerState.INIT
        if self._phase in (_Phase.STOPPING, _Phase.CLOSED):
            return WorkerState.STOPPED
        exits = [w.exit for w in self._workers if w.exit is not None]
        if self._setup_failed or any(e.failure is not None for e in exits):
            return WorkerState.FAILED
        if self._workers and len(exits) == len(self._workers):
            return WorkerState.SUCCEEDED
        if any(w.unhealthy and not w.reported for w in self._workers):
            return WorkerState.UNHEALTHY
        return WorkerState.HEALTHY

    @property
    def unknown_reason(self) -> str | None:
        """Why the group is UNKNOWN (None: it is not)."""
        return self._unknown

    @property
    def state_reason(self) -> str:
        """Why the group is UNKNOWN or UNHEALTHY ("" otherwise)."""
        state = self.state
        if state is WorkerState.UNKNOWN:
            return self._unknown or ""
        if state is WorkerState.UNHEALTHY:
            for w in self._workers:
                if w.unhealthy and not w.reported and w.kill_reason:
                    return w.kill_reason[:MAX_UNKNOWN_REASON]
        return ""

    @property
    def timer_file(self) -> Path | None:
        return self._watchdog.path if self._watchdog is not None else None

    def samples(self) -> list[WorkerHealth]:
        """The latest health sample of each running worker, in local-rank order."""
        out = []
        for w in self._workers:
            s = self._samples.get(w.launch.local_rank)
            if s is None or w.reported:
                continue
            out.append(
                WorkerHealth(
                    local_rank=w.launch.local_rank,
                    global_rank=w.launch.global_rank,
                    pid=s.pid,
                    status=s.status,
                    cpu_percent=s.cpu_percent,
                    rss_bytes=s.rss_bytes,
                    timestamp=s.timestamp,
                    bad_since=self._judge.bad_since(s.pid),
                )
            )
        return out

    # -- start -------------------------------------------------------------------------------

    def _prepare(self) -> Path:
        a = self.assignment
        log_dir = resolve_attempt_dir(self.log_root, a.job_id, a.attempt, a.round)
        _private_dirs(log_dir)
        marker = log_dir / ROUND_MARKER
        if not marker.exists():
            _write_private(marker, f"{a.round}\n".encode())
        return log_dir

    def _prepare_workers(self, plan: list[WorkerLaunch]) -> None:
        for launch in plan:
            _private_dirs(launch.log_dir)
            # A stale file from an earlier run must not be taken for this run's.
            for stale in (launch.error_file, launch.return_file):
                if stale is not None:
                    with contextlib.suppress(FileNotFoundError):
                        stale.unlink()
            if launch.args_file is not None:
                _write_private(launch.args_file, launch.args_bytes or b"")

    def _ctx(self, launch: WorkerLaunch | None = None) -> str:
        a = self.assignment
        rank = f" rank {launch.global_rank} (local {launch.local_rank})" if launch else ""
        return (
            f"[job {a.job_id} ({entrypoint_name(a.spec)}) attempt {a.attempt} round {a.round} "
            f"node {self.node_name}{rank}]"
        )

    async def start(self) -> dict[int, int]:
        """Start every worker; returns {local_rank: pid} of those that started.

        Never raises for a worker that cannot start: that worker's failure goes to `on_exit`.
        Any other error half-way makes the group UNKNOWN: what started is killed (`go_unknown`).
        """
        if self._phase is not _Phase.NEW:
            return self.pids
        self._phase = _Phase.STARTING
        timer_file: str | None = None
        setup_error: str | None = None
        setup_category = FailureCategory.PLATFORM
        try:
            self.log_dir = await asyncio.to_thread(self._prepare)
            wanted, given = watchdog_request(self.spec, self._agent_env)
            if wanted:
                timer_file = given or str(self._run_dir / f"gelastic_timer_{uuid.uuid4().hex}")
                if given:
                    validate_timer_file(given)
            self.plan = build_launch_plan(
                self.assignment,
                log_root=self.log_root,
                node_name=self.node_name,
                agent_env=self._agent_env,
                python=self._python,
                timer_file=timer_file,
                log_dir=self.log_dir,
                agent_cwd=self._agent_cwd,
            )
            self._store_launch = build_store_host_launch(
                self.assignment,
                log_dir=self.log_dir,
                node_name=self.node_name,
                agent_env=self._agent_env,
                python=self._python,
                agent_cwd=self._agent_cwd,
            )
            await asyncio.to_thread(self._prepare_workers, self.plan)
        except TimerFileError as e:
            setup_error, setup_category = str(e), FailureCategory.INPUT
        except OSError as e:
            setup_error = f"cannot prepare the log directory under {self.log_root}: {e}"
        except Exception as e:  # a bad spec that slipped through validation
            setup_error = f"cannot build the launch plan: {type(e).__name__}: {e}"
            setup_category = FailureCategory.INPUT
        self._workers = [_Worker(launch) for launch in self.plan]
        if setup_error is None and timer_file is not None:
            self._watchdog = FileTimerServer(
                timer_file, allowed_pids=self._is_worker_pid, on_expired=self._on_timer_expired
            )
            try:
                self._watchdog.start()
            except TimerFileError as e:
                setup_error, setup_category = str(e), FailureCategory.INPUT
                self._watchdog.close()
                self._watchdog = None
            except OSError as e:
                setup_error = f"cannot serve the watchdog timer file {timer_file}: {e}"
                self._watchdog.close()
                self._watchdog = None
        if self._phase is not _Phase.STARTING:  # stop() or close() came in meanwhile
            return {}
        if setup_error is not None:
            logger.error("%s %s", self._ctx(), setup_error)
            self._workers = []
            self._setup_failed = True
            for ranks in self.assignment.workers:
                self._own(
                    self._report_setup_failure(ranks, setup_error, setup_category),
                    "report-not-started",
                )
            self._phase = _Phase.RUNNING
            return {}
        self._watch_error_files()
        loop = asyncio.get_running_loop()
        not_started: list[tuple[_Worker, int, str, FailureCategory]] = []
        try:
            store_error = self._start_store_host()
            if self._before_spawn is not None and store_error is None:
                # The store host imports meanwhile; a stop that comes in finds no worker yet.
                await self._before_spawn()
                if self._phase is not _Phase.STARTING:
                    return {}
            for w in self._workers:
                if store_error is not None:
                    not_started.append((w, *store_error))
                    continue
                try:
                    handle = self._spawner(w.launch)
                except OSError as e:
                    not_started.append((w, *self._describe_spawn_error(w.launch, e)))
                    continue
                except Exception as e:  # e.g. SubprocessError from the child setup
                    message = f"cannot start worker: {type(e).__name__}: {e}"
                    not_started.append((w, _EXIT_CANNOT_EXECUTE, message, FailureCategory.PLATFORM))
                    continue
                w.handle = handle
                self._by_pid[handle.pid] = w
                if self._registry is not None:
                    self._registry.add(
                        handle.pid, job_id=self.assignment.job_id, global_rank=w.launch.global_rank
                    )
                out_fd, err_fd = handle.take_pipes()
                for fd, stream, path in (
                    (out_fd, STDOUT, w.launch.stdout_path),
                    (err_fd, STDERR, w.launch.stderr_path),
                ):
                    if fd is not None:
                        w.pumps.append(self._make_pump(loop, fd, path, stream, w.launch))
                logger.info(
                    "%s started pid %d: %s",
                    self._ctx(w.launch),
                    handle.pid,
                    " ".join(redact_argv(w.launch.argv)),  # an option's secret stays out of the log
                )
                w.supervisor = self._own(self._supervise(w), f"supervise-{handle.pid}")
                _faults.started(sum(1 for x in self._workers if x.handle is not None))
        except Exception as e:
            # Half-way: what started must not run unsupervised, nor what is left start later.
            n = sum(1 for w in self._workers if w.handle is not None)
            self.go_unknown(
                f"the start failed after {n} of {len(self._workers)} worker(s): "
                f"{type(e).__name__}: {e}"
            )
            return self.pids
        # From here on nothing awaits, so on_exit runs only after start() has returned.
        for w, code, message, category in not_started:
            self._own(self._report_later(w, code, message, category), "report-not-started")
        self._phase = _Phase.RUNNING
        if any(w.handle is not None for w in self._workers):
            self._own(self._health_loop(), "health")
        return self.pids

    @property
    def store_launch(self) -> StoreHostLaunch | None:
        """The round's c10d store host launch on this node (None: this node serves none)."""
        return self._store_launch

    def standby_launch(self) -> StandbyLaunch | None:
        """How a standby of this group's job starts on this node (None: the job has none)."""
        return build_standby_launch(
            self.spec, agent_env=self._agent_env, python=self._python, agent_cwd=self._agent_cwd
        )

    def _start_store_host(self) -> tuple[int, str, FailureCategory] | None:
        """Start the round's c10d store host, before the workers; why not, if it cannot start.

        Workers told to use the agent's store would wait for one that never comes, so a host
        that cannot start fails the round's workers before they start.
        """
        if self._store_launch is None or not self.plan:
            return None
        try:
            warm = self._warm_store(self._store_launch) if self._warm_store is not None else None
            self._store = StoreHost.start(
                self._store_launch, ctx=self._ctx(), registry=self._registry, warm=warm
            )
        except StoreHostError as e:
            logger.error("%s %s", self._ctx(), e)
            return _EXIT_CANNOT_EXECUTE, f"cannot start worker: {e}", FailureCategory.PLATFORM
        except OSError as e:
            # The host runs the workers' interpreter in their cwd: say it as for a worker.
            return self._describe_spawn_error(self.plan[0], e)
        except Exception as e:
            message = f"cannot start the c10d store host: {type(e).__name__}: {e}"
            return _EXIT_CANNOT_EXECUTE, message, FailureCategory.PLATFORM
        self._own(self._store.watch(), f"store-host-{self._store.pid}")
        return None

    def _make_pump(
        self,
        loop: asyncio.AbstractEventLoop,
        fd: int,
        path: Path,
        stream: int,
        launch: WorkerLaunch,
    ) -> _StreamPump:
        console: ConsoleWriter | None = self._console
        # A stream that is neither teed nor redirected is echoed too: every job on this agent
        # shares its console, so each line names its job and rank.
        prefix: bytes | None = f"[{self.assignment.job_id}/{launch.global_rank}]:".encode()
        if launch.tee & stream:
            prefix = launch.prefix.encode()
        elif launch.redirect & stream:
            console = None
        return _StreamPump(loop, fd, path, stream, console, prefix)

    def _describe_spawn_error(
        self, launch: WorkerLaunch, e: OSError
    ) -> tuple[int, str, FailureCategory]:
        program = launch.argv[0]
        shown = bounded(program)
        node = self.node_name
        reason = e.strerror or str(e)
        if e.filename is not None and os.fspath(e.filename) == launch.cwd:
            return (
                _EXIT_CANNOT_EXECUTE,
                f"cannot start worker: working directory {launch.cwd!r} cannot be used ({reason})",
                FailureCategory.USER,
            )
        if isinstance(e, FileNotFoundError):
            if os.path.isabs(program):
                where = f"no such file ({reason})"
            elif os.sep in program:
                # Not where the submitter ran: a job without a cwd runs in its agent's.
                where = (
                    f"no such file in the worker's directory {bounded(launch.cwd)!r} ({reason}); "
                    "give the job its directory (gelastic submit --cwd DIR, cwd= in the API) "
                    "or the program's absolute path"
                )
            else:
                path = bounded(launch.env.get("PATH", os.defpath))
                where = f"not found in PATH={path}"
            return (
                _EXIT_NOT_FOUND,
                f"cannot start worker: cannot run {shown!r} on node {node}: {where}",
                FailureCategory.USER,
            )
        found = resolve_executable(program, launch.env, launch.cwd) or program
        if isinstance(e, PermissionError):
            return (
                _EXIT_CANNOT_EXECUTE,
                f"cannot start worker: cannot run {shown!r} on node {node}: permission denied "
                f"executing {bounded(found)!r} ({reason})",
                FailureCategory.USER,
            )
        category = FailureCategory.PLATFORM if e.errno in _PLATFORM_ERRNOS else FailureCategory.USER
        return (
            _EXIT_CANNOT_EXECUTE,
            f"cannot start worker: cannot run {shown!r} on node {node}: executing "
            f"{bounded(found)!r} failed ({reason})",
            category,
        )

    # -- exits -------------------------------------------------------------------------------

    def _own(self, coro: Coroutine[Any, Any, Any], name: str) -> asyncio.Task[Any]:
        task = asyncio.ensure_future(coro)
        task.set_name(f"{name} {self.assignment.job_id}/{self.assignment.round}")
        self._tasks.add(task)
        task.add_done_callback(self._task_done)
        return task

    def _task_done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        exc = None if task.cancelled() else task.exception()
        if exc is not None:
            logger.error("%s task %s failed", self._ctx(), task.get_name(), exc_info=exc)
            # A task of the group's supervision is gone: what it watched is unwatched now.
            what = task.get_name().split(" ", 1)[0]
            self.go_unknown(f"{what} failed: {type(exc).__name__}: {exc}")

    def go_unknown(self, reason: str) -> None:
        """The group can no longer be supervised: it is UNKNOWN. Every worker it started is
        killed now (its process group), the rest of the stop follows, then `on_unknown` says why:
        the agent never runs workers it cannot supervise. Once only."""
        if self._unknown is not None or self._phase is _Phase.CLOSED:
            return
        reason = " ".join(reason.split())[:MAX_UNKNOWN_REASON]
        self._unknown = reason
        logger.error("%s worker group UNKNOWN: %s; killing its workers", self._ctx(), reason)
        self._phase = _Phase.STOPPING  # their exits are the agent's stop, not failures
        for w in self._workers:
            if w.handle is not None and not w.reported:
                try:
                    w.handle.send_signal_group(signal.SIGKILL)
                except Exception:
                    logger.exception("%s cannot kill pid %d", self._ctx(w.launch), w.pid)
        if self._stop_task is None:
            self._stop_task = asyncio.ensure_future(self._stop(0.0))
            self._stop_task.add_done_callback(self._stop_done)
        if self._on_unknown is not None:
            try:
                self._on_unknown(reason)
            except Exception:
                logger.exception("%s on_unknown callback failed", self._ctx())

    def _stop_done(self, task: asyncio.Task[list[int]]) -> None:
        if not task.cancelled() and task.exception() is not None:
            logger.error("%s stop failed", self._ctx(), exc_info=task.exception())

    def _emit(self, w: _Worker, ex: WorkerExit) -> None:
        if w.reported:
            return
        w.reported = True
        w.exit = ex
        if w.handle is not None:
            if self._watchdog is not None:
                self._watchdog.forget_pid(w.handle.pid)
            if self._registry is not None:
                self._registry.remove(w.handle.pid)
            self._judge.forget(w.handle.pid)
        if ex.failure is not None:
            logger.warning(
                "%s exited with %d: %s", self._ctx(w.launch), ex.exitcode, ex.failure.message
            )
        else:
            logger.info(
                "%s exited with %d%s",
                self._ctx(w.launch),
                ex.exitcode,
                " (stopped by the agent)" if ex.stopped_by_agent else "",
            )
        try:
            self._on_exit(ex)
        except Exception as e:
            logger.exception("%s on_exit callback failed", self._ctx(w.launch))
            self.go_unknown(
                f"the exit of rank {w.launch.global_rank} could not be reported: "
                f"{type(e).__name__}: {e}"
            )

    def _failure(
        self,
        w: _Worker,
        *,
        exitcode: int,
        observed: float,
        error_file: ErrorFileResult | None,
        stderr_tail: str,
        message: str | None = None,
        category: FailureCategory = FailureCategory.USER,
    ) -> ProcessFailure:
        a = self.assignment
        failure = build_failure(
            exitcode=exitcode,
            pid=w.pid,
            error_file=error_file,
            stderr_tail=stderr_tail,
            observed_at=observed,
            local_rank=w.launch.local_rank,
            global_rank=w.launch.global_rank,
            role_rank=w.launch.role_rank,
            node=self.node_name,
            attempt=a.attempt,
            round_=a.round,
            role=w.launch.role,
            message=message,
            category=category,
        )
        if message is None:
            # The worker's own failure: say which executable ran (the agent's PATH and cwd
            # decide what a bare "python" is), e.g. a python without the job's packages.
            ran = describe_executable(w.launch, self.node_name)
            failure = dataclasses.replace(failure, message=f"{failure.message} {ran}")
        return failure

    def _report_not_started(
        self, w: _Worker, code: int, message: str, category: FailureCategory
    ) -> None:
        now = time.time()
        failure = self._failure(
            w,
            exitcode=code,
            observed=now,
            error_file=None,
            stderr_tail="",
            message=message,
            category=category,
        )
        self._emit(
            w,
            WorkerExit(
                w.launch.local_rank, w.launch.global_rank, 0, code, False, failure, None, now
            ),
        )

    async def _report_setup_failure(
        self, ranks: WorkerRanks, message: str, category: FailureCategory
    ) -> None:
        a = self.assignment
        now = time.time()
        failure = build_failure(
            exitcode=_EXIT_CANNOT_EXECUTE,
            pid=0,
            error_file=None,
            stderr_tail="",
            observed_at=now,
            local_rank=ranks.local_rank,
            global_rank=ranks.global_rank,
            role_rank=ranks.role_rank,
            node=self.node_name,
            attempt=a.attempt,
            round_=a.round,
            role=self.spec.role,
            message=message,
            category=category,
        )
        ex = WorkerExit(
            ranks.local_rank, ranks.global_rank, 0, _EXIT_CANNOT_EXECUTE, False, failure, None, now
        )
        try:
            self._on_exit(ex)
        except Exception:
            logger.exception("%s on_exit callback failed", self._ctx())

    async def _report_later(
        self, w: _Worker, code: int, message: str, category: FailureCategory
    ) -> None:
        logger.error("%s %s", self._ctx(w.launch), message)
        self._report_not_started(w, code, message, category)

    async def _drain(self, w: _Worker) -> None:
        pending = [p.done for p in w.pumps if not p.done.done()]
        if pending:
            # Bounded: a grandchild that left the group may hold the pipe open forever.
            await asyncio.wait(pending, timeout=self._drain_timeout)
        for p in w.pumps:
            p.finish()

    def _read_return_value(self, launch: WorkerLaunch) -> tuple[bytes | None, str | None]:
        # Opaque tagged bytes (the client checks the tag); a command job has none to read.
        path = launch.return_file
        if path is None or not launch.is_function:
            return None, None
        try:
            # O_NONBLOCK: a FIFO the worker planted at the path must not hang this thread.
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        except FileNotFoundError:
            return None, None
        with os.fdopen(fd, "rb") as f:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                return None, f"the return file {path} is not a regular file"
            size = st.st_size
            data = f.read(MAX_RETURN_VALUE_BYTES + 1) if size <= MAX_RETURN_VALUE_BYTES else b""
        size = max(size, len(data))
        if size > MAX_RETURN_VALUE_BYTES:
            return None, (
                f"the return value is {size} bytes, {size - MAX_RETURN_VALUE_BYTES} bytes over "
                f"the limit of {MAX_RETURN_VALUE_BYTES} bytes"
            )
        return data, None

    def _read_failure_files(self, launch: WorkerLaunch) -> tuple[ErrorFileResult, str]:
        ef = read_error_file(launch.error_file)
        tail = read_stderr_tail(launch.stderr_path, self.spec.stderr_tail_lines)
        return ef, tail

    async def _supervise(self, w: _Worker) -> None:
        assert w.handle is not None
        _faults.observe()
        rc = await w.handle.wait()
        observed = time.time()
        # Whether the agent was stopping when the exit was seen, not when it is reported.
        stopping = self._phase is not _Phase.RUNNING
        try:
            await self._drain(w)
            if w.reported:
                return
            launch = w.launch
            # During a stop, only a death by the agent's own signals (or a clean exit) is "stopped
            # on purpose". A worker that fails by itself meanwhile, e.g. on the collective its
            # crashed peer broke, is a real (collateral) failure and must be reported as one.
            stopped = (
                stopping and w.kill_reason is None and (rc == 0 or _stopped_by_us(w.handle, rc))
            )
            # A worker that recorded its failure is a failure however it ends (the stop that its
            # own early report caused usually cuts its teardown short).
            stopped = stopped and w.early is None
            failure: ProcessFailure | None = None
            value: bytes | None = None
            if stopped:
                pass
            elif rc == 0 and w.kill_reason is None and w.early is None:
                try:
                    value, problem = await asyncio.to_thread(self._read_return_value, launch)
                except OSError as e:
                    value, problem = None, f"the return value cannot be read: {e}"
                if problem is not None:
                    tail = await asyncio.to_thread(
                        read_stderr_tail, launch.stderr_path, self.spec.stderr_tail_lines
                    )
                    failure = self._failure(
                        w,
                        exitcode=rc,
                        observed=observed,
                        error_file=None,
                        stderr_tail=tail,
                        message=f"Process exited with exit code 0 (pid {w.pid}), but {problem}",
                    )
            else:
                ef, tail = await asyncio.to_thread(self._read_failure_files, launch)
                if w.early is not None:
                    ef = w.early  # the first complete record wins; the exit adds its code
                failure = self._failure(
                    w,
                    exitcode=rc,
                    observed=observed,
                    error_file=ef,
                    stderr_tail=tail,
                    message=w.kill_reason,
                )
        except Exception as e:
            logger.exception("%s cannot report the exit of pid %d", self._ctx(w.launch), w.pid)
            stopped, value = False, None
            failure = self._failure(
                w,
                exitcode=rc,
                observed=observed,
                error_file=None,
                stderr_tail="",
                message=f"the agent could not read the outcome of PID {w.pid} "
                f"(exit code {rc}): {type(e).__name__}: {e}",
                category=FailureCategory.PLATFORM,
            )
        self._emit(
            w,
            WorkerExit(
                local_rank=w.launch.local_rank,
                global_rank=w.launch.global_rank,
                pid=w.pid,
                exitcode=rc,
                stopped_by_agent=stopped,
                failure=failure,
                return_value=value,
                timestamp=observed,
            ),
        )

    # -- first error at record time ---------------------------------------------------------

    def _watch_error_files(self) -> None:
        """Watch each worker's error file, so a recorded failure is reported before the exit.

        Without inotify (or a callback) nothing is watched: the failure is known at the exit.
        """
        if self._on_failing is None or not self._workers:
            return
        watch = ErrorFileWatch(self._on_error_file)
        try:
            if not watch.start():
                return
        except Exception:
            logger.exception("%s cannot watch the error files", self._ctx())
            return
        self._error_watch = watch
        for w in self._workers:
            if watch.watch(w.launch.error_file):
                self._by_error_file[w.launch.error_file] = w

    def _on_error_file(self, path: Path) -> None:
        w = self._by_error_file.get(path)
        if w is None or w.handle is None or w.reported or w.early is not None:
            return
        if w.early_reading:
            w.early_recheck = True  # written again while being read: read once more if need be
            return
        w.early_reading = True
        self._own(self._read_early(w), f"error-file-{w.pid}")

    async def _read_early(self, w: _Worker) -> None:
        try:
            for _ in range(2):
                w.early_recheck = False
                # The same bounded reader as at the exit.
                ef = await asyncio.to_thread(read_error_file, w.launch.error_file)
                if ef.usable or not w.early_recheck:
                    break
        finally:
            w.early_reading = False
        if not ef.usable or w.reported or w.early is not None or self._on_failing is None:
            return  # an incomplete or malformed file: the exit reports what it holds
        w.early = ef
        # The exit code is not known yet: 1, an uncaught exception's, until the exit says.
        failure = self._failure(w, exitcode=1, observed=time.time(), error_file=ef, stderr_tail="")
        logger.warning(
            "%s recorded its failure (pid %d still running): %s",
            self._ctx(w.launch),
            w.pid,
            failure.message,
        )
        try:
            self._on_failing(failure)
        except Exception as e:
            logger.exception("%s on_failing callback failed", self._ctx(w.launch))
            self.go_unknown(
                f"the failure of rank {w.launch.global_rank} could not be reported: "
                f"{type(e).__name__}: {e}"
            )

    # -- watchdog and health -----------------------------------------------------------------

    def _is_worker_pid(self, pid: int) -> bool:
        w = self._by_pid.get(pid)
        return w is not None and not w.reported

    def _on_timer_expired(self, pid: int, scope_id: str, sig: int, expiration: float) -> None:
        w = self._by_pid.get(pid)
        if w is None or w.kill_reason is not None:
            return
        when = datetime.fromtimestamp(expiration).isoformat(sep=" ", timespec="milliseconds")
        w.kill_reason = (
            f"watchdog timer '{scope_id}' expired at {when}; killed PID {pid} with "
            f"{signal_name(sig)}"
        )

    async def _health_loop(self) -> None:
        while self._phase is _Phase.RUNNING:
            _faults.monitor()
            live = {
                w.handle.pid: w
                for w in self._workers
                if w.handle is not None and not w.reported and w.handle.is_alive()
            }
            if not live:
                return
            samples = await self._sampler.sample(live, time.time())
            now = time.time()
            for pid, sample in samples.items():
                w = live[pid]
                self._samples[w.launch.local_rank] = sample
                if w.reported or self._phase is not _Phase.RUNNING:
                    continue
                verdict = self._judge.observe(sample, now)
                if verdict is not None and w.kill_reason is None:
                    w.unhealthy = True
                    w.kill_reason = (
                        f"worker is unhealthy: {verdict.reason}, longer than "
                        f"unhealthy_timeout={self.spec.unhealthy_timeout:g} s; "
                        f"killed PID {pid} with SIGKILL"
                    )
                    self._own(self._kill_unhealthy(w), f"kill-unhealthy-{pid}")
            await asyncio.sleep(self._health_interval)

    async def _kill_unhealthy(self, w: _Worker) -> None:
        assert w.handle is not None
        logger.error("%s %s", self._ctx(w.launch), w.kill_reason)
        if await w.handle.terminate(0.0):
            return  # _supervise reports it
        now = time.time()
        tail = await asyncio.to_thread(
            read_stderr_tail, w.launch.stderr_path, self.spec.stderr_tail_lines
        )
        failure = self._failure(
            w,
            exitcode=-signal.SIGKILL,
            observed=now,
            error_file=None,
            stderr_tail=tail,
            message=f"{w.kill_reason}; it did not exit (unkillable)",
        )
        self._emit(
            w,
            WorkerExit(
                w.launch.local_rank,
                w.launch.global_rank,
                w.pid,
                -signal.SIGKILL,
                False,
                failure,
                None,
                now,
            ),
        )

    # -- stop --------------------------------------------------------------------------------

    async def stop(self, grace: float | None = None) -> list[int]:
        """Stop every remaining worker (SIGTERM, `grace` s, SIGKILL); idempotent.

        Returns the pids that would not die (uninterruptible sleep); their exit is never
        reported. `grace` defaults to the spec's stop_grace.
        """
        if self._stop_task is None:
            self._stop_task = asyncio.ensure_future(
                self._stop(self.spec.stop_grace if grace is None else grace)
            )
        return list(await asyncio.shield(self._stop_task))

    async def _stop(self, grace: float) -> list[int]:
        if self._phase in (_Phase.NEW, _Phase.STARTING, _Phase.RUNNING):
            self._phase = _Phase.STOPPING
        live = [w for w in self._workers if w.handle is not None and not w.reported]
        if live:
            logger.info("%s stopping %d worker(s), grace %.1f s", self._ctx(), len(live), grace)
        # A worker that already recorded its failure is ending on its own: it is not signalled,
        # so its exit code is its own (the root cause's), for up to the job's stop_grace.
        own_end = max(grace, self.spec.stop_grace)
        results = await asyncio.gather(
            *(
                self._let_end(w.handle, own_end)
                if w.early is not None and grace > 0
                else w.handle.terminate(grace)
                for w in live
                if w.handle
            )
        )
        unkillable = [w.pid for w, ok in zip(live, results, strict=True) if not ok]
        # Let the exits of the workers that died be reported before returning.
        reporting = [
            w.supervisor
            for w in live
            if w.supervisor is not None and not w.supervisor.done() and w.pid not in unkillable
        ]
        if reporting:
            await asyncio.wait(reporting, timeout=self._drain_timeout + 5.0)
        if self._store is not None and self._store_stop is None:
            # Only after the workers: none of them may lose the store while it still runs. The
            # group counts as stopped without waiting for the host's own teardown (it serves no
            # one now, and a torch interpreter takes a while to end): `close` waits for it.
            self._store_stop = asyncio.ensure_future(self._store.stop(_STORE_STOP_GRACE))
        if self._watchdog is not None:
            self._watchdog.close()
        return unkillable

    @staticmethod
    async def _let_end(handle: Any, bound: float) -> bool:
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(bound):
                await handle.wait()
                return True
        return bool(await handle.terminate(0.0))

    async def close(self, grace: float = 0.0) -> None:
        """Stop what still runs (SIGKILL after `grace`), cancel every task, remove the FIFO."""
        if self._phase is _Phase.CLOSED:
            return
        await self.stop(grace)
        if self._store_stop is not None:
            await asyncio.shield(self._store_stop)
        self._phase = _Phase.CLOSED
        if self._error_watch is not None:
            self._error_watch.close()
        tasks = list(self._tasks)
        for t in tasks:
            t.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
        for w in self._workers:
            for p in w.pumps:
                p.finish()
            close = getattr(w.handle, "close", None)
            if close is not None:
                close()
        if self._store is not None:
            self._store.close()
        if self._watchdog is not None:
            self._watchdog.close()

    async def __aenter__(self) -> WorkerGroup:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
