"""Which worker failures no restart can mend: input errors, and the exit codes a job names.

Pure functions of the job's spec and one failure as the agent reported it (its message, the
traceback of its error file, the tail of its stderr, its exit code). Retrying an input error
only repeats it, after every restart's startup, so by default such a failure fails the job at
once; `JobSpec.restart_policy` "always" keeps retrying everything.
"""

from __future__ import annotations

import re

from client.model import JobSpec, ProcessFailure, parse_restart_policy

__all__ = ["input_error", "no_restart_reason"]

_SYNTAX = ("SyntaxError", "IndentationError", "TabError")
_IMPORT = ("ModuleNotFoundError", "ImportError")
_FRAME = re.compile(r'  File "(?P<file>[^"\n]{1,4096})", line \d{1,9}, in (?P<name>[^\n]{1,300})')
_USAGE_ERROR = re.compile(r"\S{1,300}: error: .{1,2000}")
MAX_TAIL_LINES = 200


def _import_time(traceback: str) -> bool:
    """The traceback ran module code only: the error came while the entrypoint was imported,
    not from a function it called (an import inside a loop may well be a transient one)."""
    frames = [m.group("name") for m in _FRAME.finditer(traceback)]
    return bool(frames) and all(name == "<module>" or name.startswith("_") for name in frames)


def _usage_error(stderr_tail: str) -> bool:
    """argparse's exit: a `usage:` line, then `prog: error: ...` last."""
    lines = [ln for ln in stderr_tail.splitlines()[-MAX_TAIL_LINES:] if ln.strip()]
    return (
        bool(lines)
        and bool(_USAGE_ERROR.fullmatch(lines[-1].strip()))
        and any(ln.startswith("usage:") for ln in lines[:-1])
    )


def input_error(failure: ProcessFailure) -> str:
    """Why `failure` is an input error no restart can mend ("" when it is none)."""
    message = failure.message.strip()
    kind = message.split(":", 1)[0]
    if kind in _SYNTAX:
        return f"the code does not compile ({kind})"
    if kind in _IMPORT and _import_time(failure.traceback):
        return f"an import of the entrypoint failed ({kind})"
    if message.startswith("can't open file "):
        return "the script does not exist"
    if message.startswith("cannot start worker: ") and "no such file" in message.lower():
        return "the program does not exist"
    if failure.exitcode == 2 and _usage_error(failure.stderr_tail):
        return "the command line was refused (exit 2 with a usage error)"
    return ""


def no_restart_reason(spec: JobSpec, failure: ProcessFailure) -> str:
    """Why `failure` must not restart the job under its restart policy ("" = it may)."""
    codes = parse_restart_policy(spec.restart_policy)
    if codes is None:
        return ""  # "always"
    if failure.exitcode in codes:
        return f"exit code {failure.exitcode} is one that never restarts (restart_policy)"
    why = input_error(failure)
    return f"{why}; a restart would repeat it" if why else ""
