"""`gelastic logs` and `gelastic events`: a job's output and its timeline, once or followed.

A rank's output goes out as raw bytes, without the worker's escape sequences on a terminal, or
as one JSON object per line; events as a table, or as lines while they come.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import grpc

from client._cli_output import EXIT_FAILED, EXIT_OK, CliError, _print_json, _show
from client._client import Client, GelasticError
from client._logrelay import follow_rank, print_all_ranks, wait_for_ranks
from client._tables import event_line, event_line_header, events_table
from client._terminal import TerminalFilter

EVENTS_POLL_INTERVAL_S = 0.5


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
