"""The root cause of a FAILED job, written where the scheduler that ran the client reads it.

A scheduler (TorchX, Kubeflow's PyTorchJob, ...) that starts torchrun sets
TORCHELASTIC_ERROR_FILE for it, and torchrun's ``@record``-decorated main leaves the first
worker failure there. `gelastic run`, `gelastic submit --watch` and `gelastic result` do the same
through `write_scheduler_error_file`, in torch's error-file format:

- the root cause came from a worker's own error file: that file as torch's
  ``ErrorHandler.dump_error_file`` copies it (with ``message.errorCode`` = the exit code when
  non-zero). `gelastic run` copies the file itself (the workers ran on this host); the other
  commands rebuild it from the result (message, traceback, timestamp), as the worker's host
  may be another one;
- otherwise (no error file, or no failure at all: a rendezvous that timed out, an invalid
  spec): what ``ErrorHandler.record_exception`` writes, with the failure's message, its
  traceback or stderr tail as ``py_callstack`` and its time.

The file is written through a 0600 temporary file in the same directory and a rename, and is at
most `MAX_SCHEDULER_ERROR_FILE_BYTES`; an existing file is logged and replaced, as torch does.
"""

from __future__ import annotations

import json
import logging
import math
import os
import stat
import time
from collections.abc import Mapping
from typing import Any

from client.errors import (
    ERROR_FILE_ENV,
    NOT_AVAILABLE,
    warn_if_error_file_exists,
    write_error_file_atomically,
)
from client.model import ProcessFailure, RunResult

__all__ = [
    "MAX_SCHEDULER_ERROR_FILE_BYTES",
    "scheduler_error_data",
    "write_scheduler_error_file",
]

logger = logging.getLogger(__name__)

MAX_SCHEDULER_ERROR_FILE_BYTES = 64 * 1024
"""The most the file holds; a longer traceback keeps its end (where the exception is)."""

_MAX_MESSAGE_CHARS = 4096
_MAX_PATH_CHARS = 4096


def write_scheduler_error_file(
    result: RunResult,
    name: str,
    *,
    env: Mapping[str, str] | None = None,
    local_error_files: bool = False,
    now: float | None = None,
) -> str | None:
    """Write the root cause of a FAILED `result` to $TORCHELASTIC_ERROR_FILE.

    Does nothing when the variable is unset or empty, or the job did not fail. Returns the path
    written, or None; a path that cannot be written is logged (WARNING), never raised, so the
    command still reports the job and exits with its code. `local_error_files`: the workers ran
    on this host, so the root cause's error file may be copied as it is.
    """
    path = (os.environ if env is None else env).get(ERROR_FILE_ENV, "")
    if not path or not result.is_failed():
        return None
    if "\0" in path or len(path) > _MAX_PATH_CHARS:
        logger.warning("%s is not a usable path; not writing the root cause", ERROR_FILE_ENV)
        return None
    data = scheduler_error_data(
        result, name, local_error_files=local_error_files, now=time.time() if now is None else now
    )
    try:
        warn_if_error_file_exists(path)
        write_error_file_atomically(path, _encode(data))
    except OSError as e:
        logger.warning(
            "cannot write the root cause to %s=%s: %s: %s",
            ERROR_FILE_ENV,
            path,
            type(e).__name__,
            e,
        )
        return None
    return path


def scheduler_error_data(
    result: RunResult, name: str, *, local_error_files: bool = False, now: float
) -> dict[str, Any]:
    """The JSON `write_scheduler_error_file` writes for `result` (see the module docstring)."""
    root = result.root_cause
    if root is None:
        reason = " ".join(result.reason.split())
        return _recorded(f"{name} FAILED" + (f": {reason}" if reason else ""), "", now)
    has_file = bool(root.error_file) and root.error_file != NOT_AVAILABLE
    if has_file and local_error_files:
        copied = _copy_of(root)
        if copied is not None:
            return copied
    timestamp = root.timestamp if math.isfinite(root.timestamp) else now
    if has_file:
        data = _recorded(root.message, root.traceback, timestamp)
        if root.exitcode:
            data["message"]["errorCode"] = root.exitcode
        return data
    return _recorded(root.report_text, root.traceback or root.stderr_tail, timestamp)


def _recorded(message: str, callstack: str, timestamp: float) -> dict[str, Any]:
    # record_exception's shape: whole seconds, as a string.
    return {
        "message": {
            "message": message[:_MAX_MESSAGE_CHARS],
            "extraInfo": {"py_callstack": callstack, "timestamp": str(int(max(timestamp, 0)))},
        }
    }


def _copy_of(root: ProcessFailure) -> dict[str, Any] | None:
    """The worker's own file with dump_error_file's errorCode, or None if it cannot be used."""
    try:
        fd = os.open(root.error_file, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        raw = os.read(fd, MAX_SCHEDULER_ERROR_FILE_BYTES + 1)
    except OSError:
        return None
    finally:
        os.close(fd)
    if len(raw) > MAX_SCHEDULER_ERROR_FILE_BYTES:
        return None
    try:
        data = json.loads(raw)
    except ValueError:
        return None
    if not isinstance(data, dict) or not isinstance(data.get("message"), str | dict):
        return None
    if root.exitcode and isinstance(data["message"], dict):
        data["message"]["errorCode"] = root.exitcode
    if len(_encode(data)) > MAX_SCHEDULER_ERROR_FILE_BYTES:
        return None
    return data


def _encode(data: dict[str, Any]) -> str:
    """JSON of at most MAX_SCHEDULER_ERROR_FILE_BYTES: the traceback loses its beginning."""
    text = json.dumps(data)
    extra = data.get("message", {})
    extra = extra.get("extraInfo") if isinstance(extra, dict) else None
    for _ in range(64):  # each pass at least halves the traceback: bounded
        if len(text.encode()) <= MAX_SCHEDULER_ERROR_FILE_BYTES:
            return text
        callstack = extra.get("py_callstack", "") if isinstance(extra, dict) else ""
        if not isinstance(extra, dict) or not isinstance(callstack, str) or not callstack:
            break
        extra["py_callstack"] = "...\n" + callstack[len(callstack) // 2 + 1 :]
        if len(callstack) < 8:
            extra["py_callstack"] = ""
        text = json.dumps(data)
    if len(text.encode()) > MAX_SCHEDULER_ERROR_FILE_BYTES:
        text = json.dumps(_recorded("root cause too large to record", "", time.time()))
    return text
