"""Reading what a worker left behind: its error file and the tail of its stderr.

`read_error_file` understands torchelastic's error-file formats and never raises: a missing,
empty, truncated or malformed file becomes a `problem` string that says exactly what is wrong.
`build_failure` turns one worker's exit into a `client.model.ProcessFailure` with torchelastic's
wording (``Signal 9 (SIGKILL) received by PID 1234``).
"""

from __future__ import annotations

import dataclasses
import errno
import json
import math
import os
import stat
from dataclasses import dataclass
from typing import Any

from client.errors import NO_ERROR_FILE_MESSAGE
from client.model import FailureCategory, ProcessFailure, signal_message, signal_name

__all__ = [
    "MAX_ERROR_FILE_BYTES",
    "ErrorFileResult",
    "build_failure",
    "read_error_file",
    "read_stderr_tail",
]

MAX_ERROR_FILE_BYTES = 1024 * 1024
"""Error files above this size are not parsed (a runaway writer must not exhaust the agent)."""

_TAIL_MAX_BYTES = 64 * 1024

WHOLE_SECOND_S = 1.0
"""The resolution of a whole-second time: torch's own error file (`@record`) writes
`int(time.time())` as a string, so the failure was in the second after it."""
MTIME_RESOLUTION_S = 0.01
"""The resolution of a file's modification time: the kernel stamps it from its coarse clock,
one tick late at most (1 to 10 ms, by CONFIG_HZ)."""


@dataclass(frozen=True)
class ErrorFileResult:
    """What an error file said, or why it could not be used."""

    path: str
    found: bool = False
    """The file exists (whether or not it could be parsed)."""
    message: str = ""
    traceback: str = ""
    timestamp: float | None = None
    """Seconds since the epoch, from the file; None when the file has none."""
    error_code: int | None = None
    """torch's ``errorCode`` (set when a parent agent re-dumps a child's file)."""
    problem: str | None = None
    """Why the file could not be used; None when it was read cleanly (or is absent)."""
    written_at: float | None = None
    """The file's modification time: when the worker wrote it, to the nanosecond."""

    @property
    def usable(self) -> bool:
        return self.found and self.problem is None


def _timestamp(value: Any, path: str, where: str) -> tuple[float | None, str | None]:
    if value is None:
        return None, None
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        return (
            None,
            f"error file {path}: {where} must be a number or a string of digits, got {value!r}",
        )
    try:
        ts = float(value)
    except ValueError:
        return None, f"error file {path}: {where} is not a number: {value!r}"
    if not math.isfinite(ts) or ts < 0:
        return None, f"error file {path}: {where} is not a valid time: {value!r}"
    return ts, None


def _parse(data: Any, path: str) -> ErrorFileResult:
    if not isinstance(data, dict):
        return ErrorFileResult(
            path,
            True,
            problem=f"error file {path} must hold a JSON object, got {type(data).__name__}",
        )
    if "message" not in data:
        return ErrorFileResult(path, True, problem=f"error file {path} has no 'message' field")
    msg = data["message"]
    if isinstance(msg, str):
        # The flat format: {"message": "...", "timestamp": N}.
        ts, problem = _timestamp(data.get("timestamp"), path, "'timestamp'")
        if problem:
            return ErrorFileResult(path, True, problem=problem)
        tb = data.get("traceback", "")
        if not isinstance(tb, str):
            return ErrorFileResult(
                path, True, problem=f"error file {path}: 'traceback' must be a string"
            )
        return ErrorFileResult(path, True, message=msg, traceback=tb, timestamp=ts)
    if not isinstance(msg, dict):
        return ErrorFileResult(
            path,
            True,
            problem=f"error file {path}: 'message' must be a string or an object, "
            f"got {type(msg).__name__}",
        )
    # torch's nested format: {"message": {"message": ..., "extraInfo": {...}, "errorCode": N}}.
    inner = msg.get("message")
    if not isinstance(inner, str):
        what = "missing" if inner is None else f"of type {type(inner).__name__}, not a string"
        return ErrorFileResult(
            path, True, problem=f"error file {path}: 'message.message' is {what}"
        )
    extra = msg.get("extraInfo", {})
    if not isinstance(extra, dict):
        return ErrorFileResult(
            path, True, problem=f"error file {path}: 'message.extraInfo' must be an object"
        )
    tb = extra.get("py_callstack", "")
    if not isinstance(tb, str):
        return ErrorFileResult(
            path,
            True,
            problem=f"error file {path}: 'message.extraInfo.py_callstack' must be a string",
        )
    ts, problem = _timestamp(extra.get("timestamp"), path, "'message.extraInfo.timestamp'")
    if problem:
        return ErrorFileResult(path, True, problem=problem)
    ns = extra.get("timestamp_ns")
    # gelastic's writers add nanoseconds beside torch's whole seconds; prefer them when sane.
    if isinstance(ns, str) and ns.isdigit() and (ts is None or abs(int(ns) / 1e9 - ts) < 1.0):
        ts = int(ns) / 1e9
    code = msg.get("errorCode")
    error_code = code if isinstance(code, int) and not isinstance(code, bool) else None
    return ErrorFileResult(
        path, True, message=inner, traceback=tb, timestamp=ts, error_code=error_code
    )


def read_error_file(path: str | os.PathLike[str]) -> ErrorFileResult:
    """Parse a torchelastic error file; never raises.

    Accepts torch's nested format (timestamp: seconds as a string, finer accepted; gelastic's
    ``timestamp_ns`` beside it wins) and the flat ``{"message": "...", "timestamp": N}`` format.
    """
    p = os.fspath(path)
    try:
        # O_NONBLOCK: a FIFO planted at the path must not hang the agent.
        fd = os.open(p, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return ErrorFileResult(p, False)
    except OSError as e:
        return ErrorFileResult(p, True, problem=f"error file {p} cannot be read: {e.strerror}")
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            return ErrorFileResult(p, True, problem=f"error file {p} is not a regular file")
        if st.st_size > MAX_ERROR_FILE_BYTES:
            return ErrorFileResult(
                p,
                True,
                problem=f"error file {p} is {st.st_size} bytes, over the limit of "
                f"{MAX_ERROR_FILE_BYTES} bytes",
            )
        chunks: list[bytes] = []
        total = 0
        while total <= MAX_ERROR_FILE_BYTES:
            chunk = os.read(fd, MAX_ERROR_FILE_BYTES + 1 - total)
            if not chunk:
                break
            chunks.append(chunk)
            total += len(chunk)
    except OSError as e:
        return ErrorFileResult(p, True, problem=f"error file {p} cannot be read: {e.strerror}")
    finally:
        os.close(fd)
    raw = b"".join(chunks)
    if len(raw) > MAX_ERROR_FILE_BYTES:
        return ErrorFileResult(
            p, True, problem=f"error file {p} grew over the limit of {MAX_ERROR_FILE_BYTES} bytes"
        )
    if not raw.strip():
        return ErrorFileResult(p, True, problem=f"error file {p} is empty")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        return ErrorFileResult(
            p, True, problem=f"error file {p} is not valid UTF-8: {e.reason} at byte {e.start}"
        )
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        return ErrorFileResult(
            p,
            True,
            problem=f"error file {p} is not valid JSON: "
            f"{e.msg} at line {e.lineno} column {e.colno}",
        )
    except RecursionError:
        return ErrorFileResult(
            p, True, problem=f"error file {p} is not valid JSON: nested too deeply"
        )
    return dataclasses.replace(_parse(data, p), written_at=st.st_mtime_ns / 1e9)


def read_stderr_tail(
    path: str | os.PathLike[str], lines: int, *, max_bytes: int = _TAIL_MAX_BYTES
) -> str:
    """The last `lines` lines of a log file, reading at most `max_bytes` from its end."""
    if lines <= 0:
        return ""
    try:
        with open(path, "rb") as f:
            size = f.seek(0, os.SEEK_END)
            start = max(0, size - max_bytes)
            f.seek(start)
            data = f.read(max_bytes)
    except OSError as e:
        if e.errno == errno.ENOENT:
            return ""
        return f"<stderr of this worker cannot be read: {e.strerror}>"
    text = data.decode("utf-8", errors="replace")
    parts = text.splitlines()
    if start > 0 and parts:
        # The first line was cut by the byte window.
        parts = parts[1:]
    return "\n".join(parts[-lines:])


def build_failure(
    *,
    exitcode: int,
    pid: int,
    error_file: ErrorFileResult | None,
    stderr_tail: str,
    observed_at: float,
    local_rank: int,
    global_rank: int,
    node: str,
    attempt: int,
    round_: int,
    role: str,
    role_rank: int = -1,
    message: str | None = None,
    category: FailureCategory = FailureCategory.USER,
) -> ProcessFailure:
    """One worker's failure with torchelastic's wording.

    `message`, when given, says why the agent itself ended the worker (watchdog, health, a
    return value over the limit); the error file's message then moves into the traceback.
    The timestamp is the error file's when it has one, else `observed_at` (the agent's clock).
    Its `time_uncertainty` is the resolution of that source: a fraction of a second from the
    file (gelastic's writers keep nanoseconds) or the agent's own clock is exact (0.0); torch's
    whole seconds are 1.0, or as precise as what refined them.
    """
    sig = -exitcode if exitcode < 0 else 0
    ef = error_file
    text = ""
    traceback = ""
    timestamp = observed_at
    resolution = 0.0
    detail = ""
    path_field = "<N/A>"
    if ef is not None and ef.found:
        path_field = ef.path
    if ef is not None and ef.usable:
        text = ef.message
        traceback = ef.traceback
        if ef.timestamp is not None:
            timestamp = ef.timestamp
            # torch's own writer keeps whole seconds: ranks that failed within one second would
            # tie. The file's modification time says when it was written, to a kernel tick.
            if timestamp == int(timestamp):
                resolution = WHOLE_SECOND_S
                if ef.written_at is not None and timestamp <= ef.written_at < timestamp + 2:
                    timestamp, resolution = ef.written_at, MTIME_RESOLUTION_S
                elif timestamp <= observed_at < timestamp + 2:
                    # The exit came after the record: the failure was between the two.
                    timestamp, resolution = observed_at, observed_at - timestamp
    elif sig:
        # torch's message; a malformed file's problem is gelastic's detail.
        text = signal_message(sig, pid)
        if ef is not None and ef.problem:
            detail = f"{text}; {ef.problem}"
    else:
        # torch says only where to read about @record; what gelastic knows goes in `detail`.
        text = NO_ERROR_FILE_MESSAGE
        problem = ef.problem if ef is not None and ef.problem else "no error file was written"
        detail = f"Process exited with exit code {exitcode} (pid {pid}); {problem}"
    if message is not None:
        if text and ef is not None and ef.usable and not traceback:
            traceback = text
        text, detail = message, ""
    return ProcessFailure(
        global_rank=global_rank,
        local_rank=local_rank,
        pid=pid,
        exitcode=exitcode,
        message=text,
        timestamp=timestamp,
        node=node,
        signal=signal_name(sig) if sig else "",
        error_file=path_field,
        traceback=traceback,
        attempt=attempt,
        round=round_,
        category=category,
        stderr_tail=stderr_tail,
        role=role,
        role_rank=role_rank,
        time_uncertainty=resolution,
        detail=detail,
    )
