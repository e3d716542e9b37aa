"""A worker group's output: its round's directories and files, and its workers' streams.

The round's log directory and each worker's are made 0700 and its files 0600 (a job's logs and
arguments are its own). A `StreamPump` copies one worker pipe into its log file and, per the
redirect/tee masks, onto the agent's console; `open_pumps` gives a worker its two, `drain`
waits (bounded) for them to reach EOF. Nothing here knows of processes or exits.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import sys
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import IO

from client.assignment import RoundAssignment
from nodeagent._launch import ROUND_MARKER, STDERR, STDOUT, WorkerLaunch, resolve_attempt_dir

__all__ = [
    "ConsoleWriter",
    "StreamPump",
    "agent_console",
    "drain",
    "open_pumps",
    "prepare_round_dir",
    "prepare_worker_dirs",
    "write_notice",
]

logger = logging.getLogger("nodeagent._workers")

ConsoleWriter = Callable[[int, bytes], None]
"""console(stream, data): stream is 1 (stdout) or 2 (stderr)."""

_READ_CHUNK = 65536
_MAX_PARTIAL_LINE = 64 * 1024


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


def prepare_round_dir(log_root: Path, assignment: RoundAssignment) -> Path:
    """Make the round's log directory (marked with its round); returns it. Blocking."""
    a = assignment
    log_dir = resolve_attempt_dir(log_root, a.job_id, a.attempt, a.round)
    _private_dirs(log_dir)
    marker = log_dir / ROUND_MARKER
    if not marker.exists():
        _write_private(marker, f"{a.round}\n".encode())
    return log_dir


def write_notice(path: Path, data: bytes) -> None:
    """Write a preemption notice whole (0600, a temporary file renamed over it): a worker that
    polls the file never reads half of one. Blocking."""
    tmp = path.with_name(f".{path.name}.tmp")
    _write_private(tmp, data)
    os.replace(tmp, path)


def prepare_worker_dirs(plan: Sequence[WorkerLaunch]) -> None:
    """Make each worker's log directory, clear its stale files, write its arguments. Blocking."""
    for launch in plan:
        _private_dirs(launch.log_dir)
        # A stale file from an earlier run must not be taken for this run's.
        for stale in (launch.error_file, launch.return_file):
            if stale is not None:
                with contextlib.suppress(FileNotFoundError):
                    stale.unlink()
        if launch.args_file is not None:
            _write_private(launch.args_file, launch.args_bytes or b"")


class StreamPump:
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
            self._log = os.fdopen(log_fd, "ab", buffering=0)  # closed in finish
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


def open_pumps(
    loop: asyncio.AbstractEventLoop,
    pipes: tuple[int | None, int | None],
    launch: WorkerLaunch,
    *,
    job_id: str,
    console: ConsoleWriter | None,
) -> list[StreamPump]:
    """A pump for each of a worker's (stdout, stderr) pipes that it has."""
    pumps: list[StreamPump] = []
    try:
        for fd, stream, path in (
            (pipes[0], STDOUT, launch.stdout_path),
            (pipes[1], STDERR, launch.stderr_path),
        ):
            if fd is None:
                continue
            shown: ConsoleWriter | None = console
            # A stream that is neither teed nor redirected is echoed too: every job on this
            # agent shares its console, so each line names its job and rank.
            prefix: bytes | None = f"[{job_id}/{launch.global_rank}]:".encode()
            if launch.tee & stream:
                prefix = launch.prefix.encode()
            elif launch.redirect & stream:
                shown = None
            pumps.append(StreamPump(loop, fd, path, stream, shown, prefix))
    except BaseException:
        for p in pumps:  # no one else holds them to finish them
            p.finish()
        raise
    return pumps


async def drain(pumps: Iterable[StreamPump], timeout: float) -> None:
    """Let the pumps reach EOF, for up to `timeout` s, then finish them all."""
    pumps = list(pumps)
    pending = [p.done for p in pumps if not p.done.done()]
    if pending:
        # Bounded: a grandchild that left the group may hold the pipe open forever.
        await asyncio.wait(pending, timeout=timeout)
    for p in pumps:
        p.finish()
