"""How the `gelastic` CLI reports: its exit codes, the one-line error, text for people, JSON.

Text meant for people loses escape sequences on a terminal; JSON goes out as it is.
"""

from __future__ import annotations

import json
import sys
from typing import Any, TextIO

from client._tables import to_jsonable
from client._terminal import strip_terminal_controls
from client.model import JobState

EXIT_OK = 0
EXIT_FAILED = 1
"""The job failed or was cancelled."""
EXIT_USAGE = 2
"""Bad usage, an unreachable coordinator, or a request the coordinator refused."""
EXIT_INTERRUPTED = 130
"""Ctrl-C (a watched job goes on running)."""


class CliError(Exception):
    """A problem to report as one line on stderr, ending the command with `code`."""

    def __init__(self, message: str, code: int = EXIT_USAGE) -> None:
        super().__init__(one_line(message))
        self.code = code


def one_line(text: str) -> str:
    return " ".join(str(text).split())


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
