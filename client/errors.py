"""The worker-side error API: `record`, `ErrorHandler` and `ChildFailedError`.

A worker decorated with `@record` writes its uncaught exception to the file named by
TORCHELASTIC_ERROR_FILE, in the format torchelastic's agent reads; gelastic's node agent reads
the same file (see `read_error_file`). A nanny process that runs workers of its own raises
`ChildFailedError`, and `@record` then copies the root-cause child's file up to its own.

This module uses the standard library only and imports nothing else from gelastic, so a
bootstrap script can load it by file path under any python3 without gelastic installed.

Error file written by `ErrorHandler.record_exception`::

    {"message": {"message": "ValueError: boom",
                 "extraInfo": {"py_callstack": "Traceback (most recent call last):\\n...",
                               "timestamp": "1795998706",
                               "timestamp_ns": "1795998706123456789"}}}

`timestamp` is whole seconds as a string, exactly what torchelastic writes: torch's reader does
`int(extraInfo["timestamp"])`, which rejects "1795998706.123456". The same instant with
nanosecond precision goes in `timestamp_ns` (also a string), which torch ignores and gelastic
prefers, so that the first failure across ranks is found even within one second.
"""

from __future__ import annotations

import contextlib
import faulthandler
import functools
import json
import logging
import os
import signal
import socket
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol, overload

if TYPE_CHECKING:
    from typing import ParamSpec, TypeVar

    _P = ParamSpec("_P")
    _R = TypeVar("_R")

__all__ = [
    "ERROR_FILE_ENV",
    "ChildFailedError",
    "ErrorFileRecord",
    "ErrorHandler",
    "FailureLike",
    "read_error_file",
    "record",
]

logger = logging.getLogger(__name__)

ERROR_FILE_ENV = "TORCHELASTIC_ERROR_FILE"
"""The variable the agent sets to the path each worker writes its error file to."""

NOT_AVAILABLE = "<N/A>"
_MAX_WIDTH = 60


class ErrorHandler:
    """Writes a worker's uncaught exception to TORCHELASTIC_ERROR_FILE as torchelastic does.

    Subclass and override `initialize` / `record_exception` to handle errors differently.
    """

    def error_file_path(self) -> str | None:
        """Where this process writes its error file; None when the variable is unset."""
        return os.environ.get(ERROR_FILE_ENV) or None

    def initialize(self) -> None:
        """Dump every thread's stack on a fatal signal (SIGSEGV, SIGABRT, ...) to stderr."""
        try:
            faulthandler.enable(all_threads=True)
        except Exception as e:  # e.g. sys.stderr replaced by an object without fileno()
            logger.warning("cannot enable faulthandler: %s: %s", type(e).__name__, e)

    def record_exception(self, e: BaseException) -> None:
        """Write `e` and its traceback to the error file; does nothing if the variable is unset."""
        path = self.error_file_path()
        if not path:
            return
        now_ns = time.time_ns()
        data = {
            "message": {
                "message": _exception_summary(e),
                "extraInfo": {
                    # Formatted from `e` itself rather than traceback.format_exc(): the text is
                    # the same inside an except block, and still right when called outside one.
                    "py_callstack": "".join(
                        traceback.format_exception(type(e), e, e.__traceback__)
                    ),
                    "timestamp": str(now_ns // 1_000_000_000),
                    "timestamp_ns": str(now_ns),
                },
            }
        }
        self._write(path, data)

    def dump_error_file(self, rootcause_error_file: str, error_code: int = 0) -> None:
        """Copy a child's error file to this process's error file.

        A non-zero `error_code` (the child's exit code) is stored as `message.errorCode` when
        `message` is a dict, because a child killed by a signal could not record it itself.
        """
        with open(rootcause_error_file, encoding="utf-8") as fp:
            data = json.load(fp)
        if error_code:
            message = data.get("message") if isinstance(data, dict) else None
            if isinstance(message, dict):
                message["errorCode"] = error_code
            else:
                logger.warning(
                    "child error file %s has no dict `message`; not adding errorCode %s",
                    rootcause_error_file,
                    error_code,
                )
        path = self.error_file_path()
        if not path:
            logger.error(
                "%s is not set; cannot copy child error file %s",
                ERROR_FILE_ENV,
                rootcause_error_file,
            )
            return
        if os.path.isfile(path):
            # A child that inherited our environment may have written to our file before it
            # was given its own; keep its text in the log, then replace it.
            logger.warning(
                "error file %s already exists and will be overwritten; it held:\n%s",
                path,
                _read_text(path),
            )
        self._write(path, data)

    def _write(self, path: str, data: Mapping[str, Any]) -> None:
        # Write then rename, so a reader never sees half a file. Failing to write must not
        # replace the worker's own exception with an OSError.
        tmp = f"{path}.{os.getpid()}.tmp"
        try:
            with open(tmp, "w", encoding="utf-8") as fp:
                json.dump(data, fp)
            os.replace(tmp, path)
        except OSError as e:
            logger.warning("cannot write error file %s: %s: %s", path, type(e).__name__, e)
            with contextlib.suppress(OSError):
                os.remove(tmp)


def _exception_summary(e: BaseException) -> str:
    try:
        text = str(e)
    except Exception:  # a broken __str__ must not hide the original error
        text = "<exception str() failed>"
    return f"{type(e).__name__}: {text}"


def _read_text(path: str) -> str:
    try:
        with open(path, encoding="utf-8", errors="replace") as fp:
            return fp.read()
    except OSError as e:
        return f"<unreadable: {e}>"


class ErrorFileRecord(NamedTuple):
    """What a worker's error file says, in either format torchelastic accepts."""

    # A NamedTuple rather than a dataclass: dataclasses look the defining module up in
    # sys.modules, which a script loading this file by path need not have filled in.

    message: str
    """"ValueError: boom"; the whole message for the flat format."""
    traceback: str
    """`extraInfo.py_callstack`, or "" when the file has none."""
    timestamp: float
    """Seconds since the epoch; sub-second when the writer recorded `timestamp_ns`."""
    data: Mapping[str, Any]
    """The parsed JSON, unchanged."""
    error_code: int | None = None
    """`message.errorCode`, set when a parent copied a child's file."""


def read_error_file(path: str) -> ErrorFileRecord:
    """Parse an error file written by `record`, by torch's `@record`, or in the flat format.

    Accepts ``{"message": {"message": ..., "extraInfo": {...}}}`` and
    ``{"message": "<str>", "timestamp": <int|str>}``. Raises OSError if the file cannot be
    read and ValueError if it is not one of these shapes (torch's reader raises too).
    """
    with open(path, encoding="utf-8") as fp:
        data = json.load(fp)
    if not isinstance(data, dict) or "message" not in data:
        raise ValueError(f"error file {path} has no `message` field")
    message = data["message"]
    if isinstance(message, str):
        return ErrorFileRecord(
            message=message, traceback="", timestamp=_seconds(data, "timestamp"), data=data
        )
    if not isinstance(message, dict):
        raise ValueError(f"error file {path}: `message` is neither a string nor an object")
    extra = message.get("extraInfo")
    extra = extra if isinstance(extra, dict) else {}
    timestamp = _seconds(extra, "timestamp")
    # A malformed timestamp_ns leaves the whole seconds in place.
    with contextlib.suppress(KeyError, TypeError, ValueError):
        timestamp = int(extra["timestamp_ns"]) / 1e9
    error_code = message.get("errorCode")
    callstack = extra.get("py_callstack", "")
    return ErrorFileRecord(
        message=str(message.get("message", NOT_AVAILABLE)),
        traceback=callstack if isinstance(callstack, str) else "",
        timestamp=timestamp,
        error_code=error_code if isinstance(error_code, int) else None,
        data=data,
    )


def _seconds(container: Mapping[str, Any], key: str) -> float:
    try:
        return float(container.get(key, 0))
    except (TypeError, ValueError):
        return 0.0


class FailureLike(Protocol):
    """The fields of a failed child that `ChildFailedError` needs.

    Both gelastic's `client.ProcessFailure` and torchelastic's `ProcessFailure` have them.
    `message` may be a dict: torch keeps the nested error-file message that way.
    """

    @property
    def local_rank(self) -> int: ...

    @property
    def pid(self) -> int: ...

    @property
    def exitcode(self) -> int: ...

    @property
    def error_file(self) -> str: ...

    @property
    def message(self) -> Any: ...

    @property
    def timestamp(self) -> float: ...


class ChildFailedError(Exception):
    """Raised by a nanny process whose children failed, keyed by the children's global ranks.

    Under `@record`, the root-cause child's error file (the first failure by timestamp) becomes
    this process's error file, so the child's traceback, not the nanny's, reaches the report.
    """

    def __init__(self, name: str, failures: Mapping[int, FailureLike]) -> None:
        if not failures:
            raise ValueError("ChildFailedError needs at least one failure")
        self.name = name
        self.failures: dict[int, FailureLike] = dict(failures)
        super().__init__("\n" + self.format_msg())

    def __reduce__(self) -> tuple[type[ChildFailedError], tuple[str, dict[int, FailureLike]]]:
        # Exception pickles its args (the message), which __init__ does not take; a process
        # pool sending this error to its parent needs the name and failures instead.
        return (type(self), (self.name, self.failures))

    def get_first_failure(self) -> tuple[int, FailureLike]:
        """(rank, failure) with the smallest timestamp; ties go to the first one given."""
        rank = min(self.failures, key=lambda r: self.failures[r].timestamp)
        return rank, self.failures[rank]

    def format_msg(self) -> str:
        """The failure table, root cause first."""
        root_rank, _ = self.get_first_failure()
        root = ""
        others: list[str] = []
        for idx, (rank, failure) in enumerate(self.failures.items()):
            block = format_failure_block(idx, _child_failure_rows(rank, failure))
            if rank == root_rank:
                root = block
            else:
                others.append(block)
        return format_failure_table(f"{self.name} FAILED", root, others)


def _child_failure_rows(rank: int, failure: FailureLike) -> list[tuple[str, str]]:
    signame = _signal_name(failure.exitcode)
    signame_part = f" ({signame})" if signame != NOT_AVAILABLE else ""
    return [
        ("time", _iso_time(failure.timestamp)),
        ("host", str(getattr(failure, "node", "") or socket.getfqdn())),
        ("rank", f"{rank} (local_rank: {failure.local_rank})"),
        ("exitcode", f"{failure.exitcode} (pid: {failure.pid}) {signame_part}"),
        ("error_file", str(failure.error_file)),
        ("traceback", indent_continuation(_failure_text(failure))),
    ]


def _failure_text(failure: FailureLike) -> str:
    message = failure.message
    if isinstance(message, dict):
        extra = message.get("extraInfo")
        callstack = extra.get("py_callstack") if isinstance(extra, dict) else None
        return str(callstack if callstack is not None else message.get("message", NOT_AVAILABLE))
    callstack = getattr(failure, "traceback", "")
    return callstack if isinstance(callstack, str) and callstack else str(message)


def _signal_name(exitcode: int) -> str:
    if exitcode >= 0:
        return NOT_AVAILABLE
    try:
        return signal.Signals(-exitcode).name
    except ValueError:
        return NOT_AVAILABLE


def _iso_time(timestamp: float) -> str:
    try:
        return datetime.fromtimestamp(timestamp).isoformat(sep="_", timespec="seconds")
    except (ValueError, OverflowError, OSError, TypeError):
        return repr(timestamp)


def indent_continuation(text: str, indent: str = "  ") -> str:
    """Indent every line but the first, as torchelastic lays out a traceback in its table."""
    return text.replace("\n", "\n" + indent)


def format_failure_block(idx: int, rows: Sequence[tuple[str, str]]) -> str:
    """One ``[idx]:`` entry of the failure table; labels are padded to torchelastic's width."""
    return "\n".join([f"[{idx}]:", *(f"  {label:<10}: {value}" for label, value in rows)])


def format_failure_table(title: str, root: str, others: Sequence[str]) -> str:
    """torchelastic's ChildFailedError frame, with the root cause before the other failures.

    The rules are torchelastic's: borders as wide as the longest line (title included) but at
    most 60 characters, and ``<NO_OTHER_FAILURES>`` when there is only the root cause.
    """
    width = len(title)
    for block in (root, *others):
        for line in block.split("\n"):
            width = max(width, len(line))
    width = min(width, _MAX_WIDTH)
    border, section = "=" * width, "-" * width
    return "\n".join(
        [
            border,
            title,
            section,
            "Root Cause (first observed failure):",
            root or "  <NO_ROOT_CAUSE>",
            section,
            "Other Failures:",
            "\n".join(others) if others else "  <NO_OTHER_FAILURES>",
            border,
        ]
    )


@overload
def record(
    fn: Callable[_P, _R], error_handler: ErrorHandler | None = None
) -> Callable[_P, _R | None]: ...


@overload
def record(
    fn: None = None, error_handler: ErrorHandler | None = None
) -> Callable[[Callable[_P, _R]], Callable[_P, _R | None]]: ...


def record(
    fn: Callable[_P, _R] | None = None, error_handler: ErrorHandler | None = None
) -> Callable[_P, _R | None] | Callable[[Callable[_P, _R]], Callable[_P, _R | None]]:
    """Record the uncaught exception of `fn` in the error file, then re-raise it.

    Use it once per process, on the entrypoint: ``@record`` or ``@record()``. A
    `SystemExit` with code 0 or None makes the call return None (a script run through runpy
    must not turn a clean exit into a failure); any other `SystemExit` is re-raised without
    writing a file. A `ChildFailedError` copies the root-cause child's error file, with
    `errorCode` set to its exit code, when that child wrote one.
    """
    handler = error_handler if error_handler is not None else ErrorHandler()

    def wrap(f: Callable[_P, _R]) -> Callable[_P, _R | None]:
        @functools.wraps(f)
        def wrapper(*args: _P.args, **kwargs: _P.kwargs) -> _R | None:
            handler.initialize()
            try:
                return f(*args, **kwargs)
            except SystemExit as se:
                if se.code is None or se.code == 0:
                    return None
                raise
            except ChildFailedError as e:
                rank, failure = e.get_first_failure()
                child_file = failure.error_file
                if child_file and child_file != NOT_AVAILABLE and os.path.isfile(child_file):
                    try:
                        handler.dump_error_file(child_file, failure.exitcode)
                    except (OSError, ValueError) as copy_error:
                        # An unreadable child file must not hide the ChildFailedError itself.
                        logger.warning(
                            "cannot copy error file %s of rank %s: %s",
                            child_file,
                            rank,
                            copy_error,
                        )
                        handler.record_exception(e)
                else:
                    logger.info(
                        "rank %s failed without an error file; decorate its entrypoint with "
                        "@record to see its traceback",
                        rank,
                    )
                    handler.record_exception(e)
                raise
            except Exception as e:
                handler.record_exception(e)
                raise

        return wrapper

    if fn is None:
        return wrap
    return wrap(fn)
