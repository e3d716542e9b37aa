"""What a worker of the group ended as: its `WorkerExit`, with its failure or its return value.

`Results` turns what a worker left (its exit code, error file, stderr tail, return file) into a
`ProcessFailure` in torchelastic's wording, or into the pickled return value of a function
entrypoint (never unpickled here). `EarlyFailures` watches the error files, so that a failure a
worker records is reported before the worker exits. `spawn_failure` says why a worker could not
be started. Nothing here starts, signals or waits for a process.
"""

from __future__ import annotations

import asyncio
import dataclasses
import errno
import logging
import os
import signal
import stat
import time
from collections.abc import Callable, Coroutine, Sequence
from pathlib import Path
from typing import Any

from client.assignment import RoundAssignment, WorkerRanks
from client.model import MAX_RETURN_VALUE_BYTES, FailureCategory, ProcessFailure
from client.node_protocol import WorkerExit
from nodeagent._errorfile import (
    ErrorFileResult,
    build_failure,
    read_error_file,
    read_stderr_tail,
)
from nodeagent._inotify import ErrorFileWatch
from nodeagent._launch import WorkerLaunch, bounded, describe_executable, resolve_executable

__all__ = [
    "EXIT_CANNOT_EXECUTE",
    "EarlyFailures",
    "NotStarted",
    "Results",
    "WorkerExit",
    "read_return_value",
    "spawn_failure",
]

logger = logging.getLogger("nodeagent._workers")

EXIT_NOT_FOUND = 127
EXIT_CANNOT_EXECUTE = 126
# errnos that mean the agent's host, not the worker's program, is at fault.
_PLATFORM_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.EAGAIN, errno.ENOSPC})

NotStarted = tuple[int, str, FailureCategory]
"""Why a worker could not be started: (exit code 126/127, message, category)."""


def spawn_failure(launch: WorkerLaunch, e: OSError, node: str) -> NotStarted:
    """Why `launch` could not be started on `node`, from the error its spawn raised."""
    program = launch.argv[0]
    shown = bounded(program)
    reason = e.strerror or str(e)
    if e.filename is not None and os.fspath(e.filename) == launch.cwd:
        return (
            EXIT_CANNOT_EXECUTE,
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
            EXIT_NOT_FOUND,
            f"cannot start worker: cannot run {shown!r} on node {node}: {where}",
            FailureCategory.USER,
        )
    found = resolve_executable(program, launch.env, launch.cwd) or program
    if isinstance(e, PermissionError):
        return (
            EXIT_CANNOT_EXECUTE,
            f"cannot start worker: cannot run {shown!r} on node {node}: permission denied "
            f"executing {bounded(found)!r} ({reason})",
            FailureCategory.USER,
        )
    category = FailureCategory.PLATFORM if e.errno in _PLATFORM_ERRNOS else FailureCategory.USER
    return (
        EXIT_CANNOT_EXECUTE,
        f"cannot start worker: cannot run {shown!r} on node {node}: executing "
        f"{bounded(found)!r} failed ({reason})",
        category,
    )


def read_return_value(launch: WorkerLaunch) -> tuple[bytes | None, str | None]:
    """(value, None), or (None, why the value cannot be had); (None, None) when there is none.

    Blocking. Opaque tagged bytes (the client checks the tag); a command job has none to read.
    """
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


class Results:
    """The failures and results of one round's workers on this node."""

    def __init__(self, assignment: RoundAssignment, node_name: str) -> None:
        self.assignment = assignment
        self.node_name = node_name
        self._tail_lines = assignment.spec.stderr_tail_lines

    def failure(
        self,
        launch: WorkerLaunch,
        pid: int,
        *,
        exitcode: int,
        observed: float,
        error_file: ErrorFileResult | None,
        stderr_tail: str,
        message: str | None = None,
        category: FailureCategory = FailureCategory.USER,
    ) -> ProcessFailure:
        """The failure of the worker `launch` started as `pid` (0: it never started).

        `message`, when given, says why the agent ended the worker (or could not start it).
        """
        a = self.assignment
        failure = build_failure(
            exitcode=exitcode,
            pid=pid,
            error_file=error_file,
            stderr_tail=stderr_tail,
            observed_at=observed,
            local_rank=launch.local_rank,
            global_rank=launch.global_rank,
            role_rank=launch.role_rank,
            node=self.node_name,
            attempt=a.attempt,
            round_=a.round,
            role=launch.role,
            message=message,
            category=category,
        )
        if message is None:
            # The worker's own failure: say which executable ran (the agent's PATH and cwd
            # decide what a bare "python" is), e.g. a python without the job's packages.
            failure = dataclasses.replace(failure, executable=describe_executable(launch))
        return failure

    def not_started(self, launch: WorkerLaunch, why: NotStarted) -> WorkerExit:
        """The exit of a worker of the plan that could not be started."""
        code, message, category = why
        now = time.time()
        failure = self.failure(
            launch,
            0,
            exitcode=code,
            observed=now,
            error_file=None,
            stderr_tail="",
            message=message,
            category=category,
        )
        return WorkerExit(launch.local_rank, launch.global_rank, 0, code, False, failure, None, now)

    def setup_failed(
        self, ranks: WorkerRanks, message: str, category: FailureCategory
    ) -> WorkerExit:
        """The exit of a worker whose round could not even be planned (it has no launch)."""
        a = self.assignment
        now = time.time()
        failure = build_failure(
            exitcode=EXIT_CANNOT_EXECUTE,
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
            role=a.spec.role,
            message=message,
            category=category,
        )
        return WorkerExit(
            ranks.local_rank, ranks.global_rank, 0, EXIT_CANNOT_EXECUTE, False, failure, None, now
        )

    async def outcome(
        self,
        launch: WorkerLaunch,
        pid: int,
        rc: int,
        observed: float,
        *,
        kill_reason: str | None,
        early: ErrorFileResult | None,
    ) -> tuple[ProcessFailure | None, bytes | None]:
        """(failure, return value) of a worker that exited with `rc` (not stopped by the agent).

        `kill_reason`: why the agent killed it; `early`: the error file it recorded while it ran.
        """
        if rc == 0 and kill_reason is None and early is None:
            try:
                value, problem = await asyncio.to_thread(read_return_value, launch)
            except OSError as e:
                value, problem = None, f"the return value cannot be read: {e}"
            if problem is None:
                return None, value
            tail = await asyncio.to_thread(read_stderr_tail, launch.stderr_path, self._tail_lines)
            failure = self.failure(
                launch,
                pid,
                exitcode=rc,
                observed=observed,
                error_file=None,
                stderr_tail=tail,
                message=f"Process exited with exit code 0 (pid {pid}), but {problem}",
            )
            return failure, value
        ef, tail = await asyncio.to_thread(self._read_failure_files, launch)
        if early is not None:
            ef = early  # the first complete record wins; the exit adds its code
        failure = self.failure(
            launch,
            pid,
            exitcode=rc,
            observed=observed,
            error_file=ef,
            stderr_tail=tail,
            message=kill_reason,
        )
        return failure, None

    def _read_failure_files(self, launch: WorkerLaunch) -> tuple[ErrorFileResult, str]:
        ef = read_error_file(launch.error_file)
        tail = read_stderr_tail(launch.stderr_path, self._tail_lines)
        return ef, tail

    def unobserved(
        self, launch: WorkerLaunch, pid: int, rc: int, observed: float, e: Exception
    ) -> ProcessFailure:
        """The failure of a worker whose outcome the agent could not read (a PLATFORM fault)."""
        return self.failure(
            launch,
            pid,
            exitcode=rc,
            observed=observed,
            error_file=None,
            stderr_tail="",
            message=f"the agent could not read the outcome of PID {pid} "
            f"(exit code {rc}): {type(e).__name__}: {e}",
            category=FailureCategory.PLATFORM,
        )

    async def unkillable(self, launch: WorkerLaunch, pid: int, kill_reason: str) -> WorkerExit:
        """The exit reported for a worker killed with SIGKILL that does not die."""
        now = time.time()
        tail = await asyncio.to_thread(read_stderr_tail, launch.stderr_path, self._tail_lines)
        failure = self.failure(
            launch,
            pid,
            exitcode=-signal.SIGKILL,
            observed=now,
            error_file=None,
            stderr_tail=tail,
            message=f"{kill_reason}; it did not exit (unkillable)",
        )
        return WorkerExit(
            launch.local_rank, launch.global_rank, pid, -signal.SIGKILL, False, failure, None, now
        )


class EarlyFailures:
    """The first error at record time: a failure reported when the worker writes it, before
    its exit (then its exit code, when known, completes it).

    Each worker's error file is watched with inotify; the first complete record read while the
    worker still runs goes to `on_failing` at once, and is that worker's error file at its exit.
    Without inotify (or a callback) nothing is watched: the failure is known at the exit.
    """

    def __init__(
        self,
        results: Results,
        on_failing: Callable[[ProcessFailure], None] | None,
        *,
        running_pid: Callable[[WorkerLaunch], int | None],
        own: Callable[[Coroutine[Any, Any, Any], str], object],
        go_unknown: Callable[[str], None],
        ctx: Callable[[WorkerLaunch | None], str],
    ) -> None:
        self._results = results
        self._on_failing = on_failing
        self._running_pid = running_pid
        """The pid of the worker `launch` started while it runs, unreported (else None)."""
        self._own = own
        self._go_unknown = go_unknown
        self._ctx = ctx
        self.watch: ErrorFileWatch | None = None
        self._launches: dict[Path, WorkerLaunch] = {}
        self._recorded: dict[Path, ErrorFileResult] = {}
        self._reading: set[Path] = set()
        self._recheck: set[Path] = set()
        """Written again while being read: read once more if need be."""

    def recorded(self, launch: WorkerLaunch) -> ErrorFileResult | None:
        """The error file the worker recorded (complete) while it still ran, if it did."""
        return self._recorded.get(launch.error_file)

    def start(self, plan: Sequence[WorkerLaunch]) -> None:
        """Watch the error file of each worker of `plan` (before they start)."""
        if self._on_failing is None or not plan:
            return
        watch = ErrorFileWatch(self._on_written)
        try:
            if not watch.start():
                return
        except Exception:
            logger.exception("%s cannot watch the error files", self._ctx(None))
            return
        self.watch = watch
        for launch in plan:
            if watch.watch(launch.error_file):
                self._launches[launch.error_file] = launch

    async def close(self) -> None:
        if self.watch is not None:
            await self.watch.aclose()

    def _on_written(self, path: Path) -> None:
        launch = self._launches.get(path)
        if launch is None or path in self._recorded:
            return
        pid = self._running_pid(launch)
        if pid is None:
            return
        if path in self._reading:
            self._recheck.add(path)
            return
        self._reading.add(path)
        self._own(self._read(launch), f"error-file-{pid}")

    async def _read(self, launch: WorkerLaunch) -> None:
        path = launch.error_file
        try:
            for _ in range(2):
                self._recheck.discard(path)
                # The same bounded reader as at the exit.
                ef = await asyncio.to_thread(read_error_file, path)
                if ef.usable or path not in self._recheck:
                    break
        finally:
            self._reading.discard(path)
        pid = self._running_pid(launch)
        if not ef.usable or pid is None or path in self._recorded or self._on_failing is None:
            return  # an incomplete or malformed file: the exit reports what it holds
        self._recorded[path] = ef
        # The exit code is not known yet: 1, an uncaught exception's, until the exit says.
        failure = self._results.failure(
            launch, pid, exitcode=1, observed=time.time(), error_file=ef, stderr_tail=""
        )
        logger.warning(
            "%s recorded its failure (pid %d still running): %s",
            self._ctx(launch),
            pid,
            failure.message,
        )
        try:
            self._on_failing(failure)
        except Exception as e:
            logger.exception("%s on_failing callback failed", self._ctx(launch))
            self._go_unknown(
                f"the failure of rank {launch.global_rank} could not be reported: "
                f"{type(e).__name__}: {e}"
            )
