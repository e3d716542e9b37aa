"""Ranks' output for the CLI: `gelastic submit --watch --logs` and `gelastic logs --all`.

Each (rank, stream) is read through the coordinator's log relay (`Client.logs`) on a thread
of its own and written whole lines at a time, so ranks and progress lines never tear each
other's lines. With several ranks every line starts with ``[rank]:``, as torchrun's --tee
does. Worker output is whatever the program wrote: on a terminal it goes through
`TerminalFilter` (no escape sequence of a worker runs); into a pipe or a file it stays byte
for byte, as `gelastic logs` leaves it.

Bounded: at most MAX_FOLLOWS streams at once (the coordinator relays 8 per client), a partial
line is held back up to MAX_LINE_BYTES, and every thread ends with its stream or the channel.
"""

from __future__ import annotations

import re
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import BinaryIO

import grpc

from client._client import GelasticError, Job
from client._terminal import TerminalFilter
from client.model import JobState, JobStatus

__all__ = [
    "MAX_FOLLOWS",
    "LogRelay",
    "RankWriter",
    "follow_rank",
    "parse_logs_choice",
    "print_all_ranks",
    "wait_for_ranks",
]

MAX_FOLLOWS = 8
"""Streams followed at once: what the coordinator relays for one client."""
MAX_LINE_BYTES = 64 * 1024
"""Longest partial line held back waiting for its newline; past it, it is written as it is."""
FOLLOW_POLL_S = 0.5
"""`gelastic logs -f`: how often the job is asked whether the rank (re)started."""
_CHOICE = re.compile(r"rank0|all|none|[0-9]{1,7}")

Write = Callable[[BinaryIO, bytes], None]


def parse_logs_choice(value: str) -> str:
    """`--logs rank0|all|N|none`."""
    if not _CHOICE.fullmatch(value):
        raise ValueError(f"must be rank0, all, a rank number or none, got {value[:100]!r}")
    return "0" if value == "rank0" else value


def plain_write(stream: BinaryIO, data: bytes) -> None:
    stream.write(data)
    stream.flush()


class RankWriter:
    """One rank's stream: whole lines, optionally prefixed and filtered, through `write`."""

    def __init__(
        self, rank: int, dest: BinaryIO, write: Write, *, prefix: bool, screen: bool
    ) -> None:
        self._dest = dest
        self._write = write
        self._prefix = f"[{rank}]:".encode() if prefix else b""
        encoding = getattr(dest, "encoding", None) or "utf-8"
        self._screen = TerminalFilter(encoding) if screen else None
        self._partial = b""

    def feed(self, chunk: bytes) -> None:
        data = self._partial + (self._screen.feed(chunk) if self._screen is not None else chunk)
        cut = data.rfind(b"\n") + 1
        if cut == 0 and len(data) > MAX_LINE_BYTES:
            cut = len(data)
        self._partial = data[cut:]
        if cut:
            self._emit(data[:cut])

    def finish(self) -> None:
        data = self._partial + (self._screen.finish() if self._screen is not None else b"")
        self._partial = b""
        if data:
            self._emit(data if data.endswith(b"\n") else data + b"\n")

    def _emit(self, data: bytes) -> None:
        if self._prefix:
            lines = data.splitlines(keepends=True)
            data = b"".join(self._prefix + line for line in lines)
        self._write(self._dest, data)


def _dest(stream: str) -> BinaryIO:
    return sys.stdout.buffer if stream == "stdout" else sys.stderr.buffer


def _is_tty(stream: str) -> bool:
    return (sys.stdout if stream == "stdout" else sys.stderr).isatty()


class LogRelay:
    """Follows the chosen ranks of a watched job, each attempt afresh, as they start.

    `which` is a rank number as text or "all"; stdout goes to stdout, stderr to stderr.
    """

    def __init__(self, job: Job, which: str, write: Write = plain_write) -> None:
        self.job = job
        self.which = which
        self._write = write
        self._lock = threading.Lock()
        self._started: set[tuple[int, int, str]] = set()
        self._threads: list[threading.Thread] = []
        self._warned = False

    def update(self, status: JobStatus) -> None:
        """A new snapshot of the job: start following the ranks that now run."""
        if status.state != JobState.RUNNING:
            return
        running = sorted(w.global_rank for w in status.workers if w.pid)
        ranks = running if self.which == "all" else [r for r in running if r == int(self.which)]
        with self._lock:
            for rank in ranks:
                for stream in ("stdout", "stderr"):
                    key = (status.attempt, rank, stream)
                    if key in self._started:
                        continue
                    if sum(t.is_alive() for t in self._threads) >= MAX_FOLLOWS:
                        if not self._warned:
                            self._warned = True
                            self._note(
                                f"showing the output of the first ranks only: at most "
                                f"{MAX_FOLLOWS} streams are followed at once "
                                f"(gelastic logs {self.job.job_id} --rank N for the others)"
                            )
                        return
                    self._started.add(key)
                    t = threading.Thread(
                        target=self._follow,
                        args=(key,),
                        name=f"logs-{rank}-{stream}",
                        daemon=True,
                    )
                    self._threads.append(t)
                    t.start()

    def join(self, timeout: float) -> None:
        """Wait (bounded) for the followed streams to end: the job's last lines are printed."""
        deadline = time.monotonic() + timeout
        for t in list(self._threads):
            t.join(max(0.0, deadline - time.monotonic()))

    def _follow(self, key: tuple[int, int, str]) -> None:
        attempt, rank, stream = key
        writer = RankWriter(
            rank,
            _dest(stream),
            self._write,
            prefix=self.which == "all",
            screen=_is_tty(stream),
        )
        got = False
        try:
            for chunk in self.job.client.logs(self.job.job_id, rank, stream, attempt, follow=True):
                got = True
                writer.feed(chunk)
        except GelasticError as exc:
            if exc.code == grpc.StatusCode.NOT_FOUND and not got:
                with self._lock:
                    self._started.discard(key)  # not there yet: the next update tries again
            elif exc.code != grpc.StatusCode.CANCELLED:
                self._note(f"the output of rank {rank} ({stream}) ended early: {exc}")
        except Exception as exc:  # a thread must not die with a traceback over the output
            self._note(f"the output of rank {rank} ({stream}) stopped: {type(exc).__name__}")
        finally:
            writer.finish()

    def _note(self, text: str) -> None:
        self._write(sys.stderr.buffer, f"gelastic: {' '.join(text.split())}\n".encode())


def wait_for_ranks(job: Job, *, poll_s: float = FOLLOW_POLL_S) -> list[int]:
    """`gelastic logs JOB --all -f` right after submit: the job's global ranks once it has some
    (a job in rendezvous has none yet); [] when it ended before any rank started."""
    while True:
        status = job.status()
        ranks = sorted(w.global_rank for w in status.workers)
        if ranks or status.state.is_terminal():
            return ranks
        time.sleep(poll_s)


def print_all_ranks(
    job: Job,
    ranks: Sequence[int],
    stream: str,
    attempt: int | None,
    follow: bool,
    note: Callable[[str], None] | None = None,
) -> int:
    """`gelastic logs JOB --all`: every rank's stream, each line prefixed ``[rank]:``.

    Without follow the ranks are read one after the other; with it, at once (MAX_FOLLOWS at
    most), and without `attempt` each rank is followed as `follow_rank` does, into each new
    attempt, saying so through `note`. Returns how many ranks had no log to read.
    """
    screen = sys.stdout.isatty()
    missing = 0
    lock = threading.Lock()

    def write(dest: BinaryIO, data: bytes) -> None:
        with lock:
            plain_write(dest, data)

    def say(text: str) -> None:
        if note is not None:
            with lock:
                note(text)

    def read(rank: int) -> None:
        nonlocal missing
        writer = RankWriter(rank, sys.stdout.buffer, write, prefix=True, screen=screen)
        chunks = (
            follow_rank(job, rank, stream, say)
            if follow and attempt is None
            else job.logs(rank, stream, attempt, follow)
        )
        try:
            for chunk in chunks:
                writer.feed(chunk)
        except GelasticError as exc:
            if exc.code != grpc.StatusCode.NOT_FOUND:
                raise
            with lock:
                missing += 1
        finally:
            writer.finish()

    if not follow:
        for rank in ranks:
            read(rank)
        return missing
    errors: list[BaseException] = []

    def guarded(rank: int) -> None:
        try:
            read(rank)
        except BaseException as exc:
            errors.append(exc)

    threads = [
        threading.Thread(target=guarded, args=(r,), daemon=True) for r in ranks[:MAX_FOLLOWS]
    ]
    if len(ranks) > MAX_FOLLOWS:
        print(
            f"gelastic logs: following the first {MAX_FOLLOWS} of {len(ranks)} ranks",
            file=sys.stderr,
        )
    for t in threads:
        t.start()
    for t in threads:
        while t.is_alive():
            t.join(0.5)
    if errors:
        raise errors[0]
    return missing


def follow_rank(
    job: Job,
    rank: int,
    stream: str,
    note: Callable[[str], None],
    *,
    poll_s: float = FOLLOW_POLL_S,
) -> Iterator[bytes]:
    """`gelastic logs JOB -f`: one rank's output, as `tail -F` follows a file.

    Waits for the rank to start (a job in rendezvous has no log yet), follows it, and when that
    attempt's log ends while the job goes on, follows the rank into its next attempt or round,
    saying so through `note`; an attempt that came and went between two looks is read whole.
    Ends when the job has ended and the last log it had was read. Raises NOT_FOUND
    (GelasticError) when the job ended before the rank ever started.
    """
    followed: tuple[int, int] | None = None
    unread: int | None = None  # the first attempt whose log was not read yet
    shown = False

    def read(attempt: int | None, follow: bool) -> Iterator[bytes]:
        nonlocal shown
        for chunk in job.logs(rank, stream, attempt, follow):
            shown = True
            yield chunk

    while True:
        status = job.status()
        at = (status.attempt, status.round)
        ended = status.state.is_terminal()
        if unread is None:
            unread = status.attempt
        # Attempts that ended before the rank was seen running in them: their logs, whole.
        while unread < status.attempt:
            try:
                if shown:
                    note(f"rank {rank} ran in attempt {unread} meanwhile; its log follows")
                yield from read(unread, False)
            except GelasticError as exc:
                if exc.code != grpc.StatusCode.NOT_FOUND:
                    raise
            unread += 1
        running = status.state == JobState.RUNNING and any(
            w.global_rank == rank and w.pid for w in status.workers
        )
        if at != followed and (running or ended):
            if shown:
                note(
                    f"rank {rank} runs again in attempt {status.attempt} "
                    f"(round {status.round}); following it"
                )
            got = shown
            shown = False
            try:
                # Once the job has ended: its last attempt's log, whole.
                yield from read(None if ended else status.attempt, True)
            except GelasticError as exc:
                if exc.code != grpc.StatusCode.NOT_FOUND or shown:
                    raise
                shown = got
                if ended:
                    if not shown:
                        raise  # the job ended before the rank ever started
                    return
                # Started, but its file is not there yet: asked again at the next poll.
            else:
                shown = True
                followed = at
                unread = status.attempt + 1
                if ended:
                    return
        elif ended:
            return
        time.sleep(poll_s)
