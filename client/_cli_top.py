"""`gelastic top JOB`: the ranks' progress, live.

On a terminal it redraws every `--interval` seconds until `q` (or Ctrl-C), or the job ends; the
terminal is put back as it was however it ends. Not on a terminal (a pipe, a file) it prints one
frame and returns, so scripts can read it.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import select
import sys
import termios
import time
import tty
from collections.abc import Iterator
from typing import TextIO

from client._cli_output import EXIT_OK
from client._client import Client
from client._status import JobStatus
from client._tables import _cell, progress_lines
from client._terminal import strip_terminal_controls

__all__ = ["_cmd_top"]

CLEAR = "\x1b[H\x1b[2J"
MAX_FRAMES = 10_000_000
"""A bound on the redraw loop: at 1 s a frame, about four months."""


@contextlib.contextmanager
def _keys(fd: int) -> Iterator[None]:
    """The terminal in cbreak mode (one key at a time, no echo) while inside."""
    saved = termios.tcgetattr(fd)
    try:
        tty.setcbreak(fd)
        yield
    finally:
        termios.tcsetattr(fd, termios.TCSADRAIN, saved)


def _quit_pressed(fd: int, wait: float) -> bool:
    """Wait up to `wait` seconds for a key; True for q or Q."""
    end = time.monotonic() + wait
    while (left := end - time.monotonic()) > 0:
        ready, _, _ = select.select([fd], [], [], left)
        if not ready:
            return False
        key = os.read(fd, 1)
        if key in (b"q", b"Q", b"\x03", b""):
            return True
    return False


def top_text(s: JobStatus) -> str:
    """What one frame of `gelastic top` shows."""
    head = [
        f"job {s.job_id}" + (f" ({_cell(s.name)})" if s.name else "") + f"  {s.state.value}"
        f"  attempt {s.attempt} round {s.round}  world {s.world_size or '-'}",
        _cell(s.reason) or "-",
        "",
    ]
    return "\n".join(head + progress_lines(s))


def _frame(client: Client, job_id: str) -> tuple[str, bool]:
    status = client.job(job_id).status()
    return strip_terminal_controls(top_text(status)), status.state.is_terminal()


def _cmd_top(client: Client, args: argparse.Namespace, out: TextIO | None = None) -> int:
    out = out or sys.stdout
    stdin = sys.stdin
    if not (out.isatty() and stdin.isatty()):
        text, _ = _frame(client, args.job_id)
        print(text, file=out)
        return EXIT_OK
    fd = stdin.fileno()
    with _keys(fd), contextlib.suppress(KeyboardInterrupt):
        for _ in range(MAX_FRAMES):
            text, ended = _frame(client, args.job_id)
            out.write(CLEAR + text.replace("\n", "\r\n") + "\r\n\r\n(q to quit)\r\n")
            out.flush()
            if ended or _quit_pressed(fd, args.interval):
                break
    return EXIT_OK
