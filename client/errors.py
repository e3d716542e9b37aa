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
import stat
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
    "NO_ERROR_FILE_MESSAGE",
    "ChildFailedError",
    "ErrorFileRecord",
    "ErrorHandler",
    "FailureLike",
    "ProcessFailure",
    "read_error_file",
    "record",
]

logger = logging.getLogger(__name__)

ERROR_FILE_ENV = "TORCHELASTIC_ERROR_FILE"
"""The variable the agent sets to the path each worker writes its error file to."""

NOT_AVAILABLE = "<N/A>"
NO_ERROR_FILE_MESSAGE = (
    "To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html"
)
"""torchelastic's message for a worker that exited non-zero without writing an error file."""
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
        """Write `e` and its traceback to the error file.

        When TORCHELASTIC_ERROR_FILE is unset, the JSON that would have been written is logged
        (at INFO) instead, which is what torch's ErrorHandler documents.
        """
        path = self.error_file_path()
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
        if not path:
            logger.info(
                "%s is not set; the error file would have held:\n%s",
                ERROR_FILE_ENV,
                json.dumps(data, indent=2),
            )
            return
        self._write(path, data)

    def dump_error_file(self, rootcause_error_file: str, error_code: int = 0) -> None:
        """Copy a child's error file to this process's error file, as torch's handler does.

        A non-zero `error_code` (the child's exit code) is stored as `message.errorCode` when
        `message` is a dict, because a child killed by a signal could not record it itself.
        An existing error file of this process is logged (WARNING) and replaced; without
        TORCHELASTIC_ERROR_FILE nothing is written and torch's error line is logged.
        """
        with open(rootcause_error_file, encoding="utf-8") as fp:
            data = json.load(fp)
        if error_code:
            _override_error_code(rootcause_error_file, data, error_code)
        logger.debug(
            "child error file (%s) contents:\n%s",
            rootcause_error_file,
            json.dumps(data, indent=2),
        )
        path = self.error_file_path()
        if not path:
            logger.error(
                "no error file defined for parent, to copy child error file (%s)",
                rootcause_error_file,
            )
            return
        warn_if_error_file_exists(path)
        if self._write(path, data):
            logger.info("dumped error file to parent's %s", path)

    def _write(self, path: str, data: Mapping[str, Any]) -> bool:
        # Write then rename, so a reader never sees half a file. Failing to write must not
        # replace the worker's own exception with an OSError.
        try:
            write_error_file_atomically(path, json.dumps(data))
        except OSError as e:
            logger.warning("cannot write error file %s: %s: %s", path, type(e).__name__, e)
            return False
        return True


def _override_error_code(path: str, data: Any, error_code: int) -> None:
    # torch's override_error_code_in_rootcause_data, with its warnings.
    if not isinstance(data, dict) or "message" not in data:
        logger.warning(
            "child error file (%s) does not have field `message`. \ncannot override error code: %s",
            path,
            error_code,
        )
    elif isinstance(data["message"], str):
        logger.warning(
            "child error file (%s) has a new message format. \nskipping error code override",
            path,
        )
    elif isinstance(data["message"], dict):
        data["message"]["errorCode"] = error_code
    else:
        logger.warning(
            "child error file (%s): `message` is neither a string nor an object; "
            "cannot override error code: %s",
            path,
            error_code,
        )


_MAX_LOGGED_ORIGINAL = 64 * 1024


def warn_if_error_file_exists(path: str) -> None:
    """Log (WARNING) that `path` will be overwritten, with what it holds, as torch does.

    torch pretty-prints the old JSON, or says it could not load it; at most the first 64 KiB
    are read, and a path that is not a regular file is named without being opened.
    """
    try:
        st = os.lstat(path)
    except OSError:
        return
    if not stat.S_ISREG(st.st_mode):
        logger.warning("%s already exists (not a regular file) and will be replaced.", path)
        return
    try:
        original = json.dumps(json.loads(_read_text(path, _MAX_LOGGED_ORIGINAL)), indent=2)
    except ValueError:
        logger.warning(
            "%s already exists and will be overwritten. Unable to load original contents:\n",
            path,
        )
        return
    logger.warning(
        "%s already exists and will be overwritten. Original contents:\n%s", path, original
    )


def write_error_file_atomically(path: str, text: str) -> None:
    """Write `text` to `path` through a 0600 temporary file in the same directory and a rename.

    A reader sees the old file or the whole new one, never a part; a symlink at `path` is
    replaced, not followed. Raises OSError (the temporary file is removed).
    """
    directory = os.path.dirname(os.path.abspath(path))
    tmp = os.path.join(directory, f".{os.path.basename(path)}.{os.getpid()}.{time.time_ns()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fp:
            fp.write(text)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise


def _exception_summary(e: BaseException) -> str:
    try:
        text = str(e)
    except Exception:  # a broken __str__ must not hide the original error
        text = "<exception str() failed>"
    return f"{type(e).__name__}: {text}"


def _read_text(path: str, limit: int = -1) -> str:
    try:
        with open(path, encoding="utf-8", errors="replace") as fp:
            return fp.read(limit)
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


_EMPTY_ERROR_DATA_MESSAGE = "<NONE>"
MAX_CHILD_ERROR_FILE_BYTES = 1024 * 1024
"""A child error file larger than this is refused by `ProcessFailure` (ValueError)."""


class ProcessFailure:
    """torch's ``ProcessFailure(local_rank, pid, exitcode, error_file)``, for nanny parents.

    Built the way torch builds it: the constructor reads `error_file` when it exists and takes
    `message` (a dict for torch's nested format, a string for the flat one) and `timestamp`
    (whole seconds) from it, raising (ValueError, OSError) for a file that is not an error
    file, as torch's does. Without a file, `error_file` becomes ``"<N/A>"``, `timestamp` is
    now, and `message` is torch's ``Signal 9 (SIGKILL) received by PID 1234`` or its "To
    enable traceback" hint. Pass a dict of these to `ChildFailedError` and raise it under
    `@record`. (gelastic's result record, with global rank, node and attempt, is
    `client.ProcessFailure`.)
    """

    # A plain class rather than a dataclass: see ErrorFileRecord.

    def __init__(self, local_rank: int, pid: int, exitcode: int, error_file: str) -> None:
        self.local_rank = local_rank
        self.pid = pid
        self.exitcode = exitcode
        self.error_file = error_file
        self.error_file_data: dict[str, Any] = {"message": _EMPTY_ERROR_DATA_MESSAGE}
        self.message: Any = ""
        self.timestamp: int = 0
        if os.path.isfile(error_file):
            self.error_file_data = _load_child_error_file(error_file)
            self.message, self.timestamp = _error_data(error_file, self.error_file_data)
        else:
            self.error_file = NOT_AVAILABLE
            self.timestamp = int(time.time())
        if not self.message:
            if exitcode < 0:
                self.message = f"Signal {-exitcode} ({self.signal_name()}) received by PID {pid}"
            else:
                self.error_file_data["errorTraits"] = {
                    "category": "system_terminated_error",
                    "retryability": "False",
                }
                self.message = NO_ERROR_FILE_MESSAGE

    def signal_name(self) -> str:
        return _signal_name(self.exitcode)

    def timestamp_isoformat(self) -> str:
        """The time in torch's format, YYYY-MM-DD_HH:MM:SS."""
        return _iso_time(self.timestamp)

    def __repr__(self) -> str:
        return (
            f"ProcessFailure(local_rank={self.local_rank!r}, pid={self.pid!r}, "
            f"exitcode={self.exitcode!r}, error_file={self.error_file!r}, "
            f"error_file_data={self.error_file_data!r}, message={self.message!r}, "
            f"timestamp={self.timestamp!r})"
        )

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, ProcessFailure):
            return NotImplemented
        return vars(self) == vars(other)

    __hash__ = None  # type: ignore[assignment]


def _load_child_error_file(path: str) -> dict[str, Any]:
    with open(path, "rb") as fp:
        raw = fp.read(MAX_CHILD_ERROR_FILE_BYTES + 1)
    if len(raw) > MAX_CHILD_ERROR_FILE_BYTES:
        raise ValueError(f"error file {path} is over {MAX_CHILD_ERROR_FILE_BYTES} bytes")
    data = json.loads(raw)
    if not isinstance(data, dict):
        raise ValueError(f"error file {path} does not hold a JSON object")
    return data


def _error_data(path: str, data: Mapping[str, Any]) -> tuple[Any, int]:
    # torch's ProcessFailure._get_error_data: the same keys, the same int() of the timestamp.
    if "message" not in data:
        raise ValueError(f"error file {path} has no `message` field")
    message = data["message"]
    try:
        if isinstance(message, str):
            return message, int(data.get("timestamp", 0))
        return message, int(message["extraInfo"]["timestamp"])
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(
            f"error file {path}: no usable timestamp ({type(e).__name__}: {e})"
        ) from None


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
        super().__init__(self.format_msg())

    def __reduce__(self) -> tuple[type[ChildFailedError], tuple[str, dict[int, FailureLike]]]:
        # Exception pickles its args (the message), which __init__ does not take; a process
        # pool sending this error to its parent needs the name and failures instead.
        return (type(self), (self.name, self.failures))

    def get_first_failure(self) -> tuple[int, FailureLike]:
        """(rank, failure) with the smallest timestamp; ties go to the first one given."""
        rank = min(self.failures, key=lambda r: self.failures[r].timestamp)
        return rank, self.failures[rank]

    def format_msg(self, boarder_delim: str = "=", section_delim: str = "-") -> str:
        """torch's ChildFailedError text, character for character: a leading newline, then
        "Failures:" (the other failures) before "Root Cause (first observed failure):".

        Tools parse this text, so the order is torch's; gelastic's own reports
        (`RunResult.format_failures`) put the root cause first instead.
        """
        root_rank, _ = self.get_first_failure()
        root = ""
        others: list[str] = []
        for idx, (rank, failure) in enumerate(self.failures.items()):
            block = format_failure_block(idx, _child_failure_rows(rank, failure))
            if rank == root_rank:
                root = block
            else:
                others.append(block)
        title = f"{self.name} FAILED"
        width = min(_table_width(title, [root, *others]), _MAX_WIDTH)
        return "\n".join(
            [
                "",
                boarder_delim * width,
                title,
                section_delim * width,
                "Failures:",
                "\n".join(others) if others else "  <NO_OTHER_FAILURES>",
                section_delim * width,
                "Root Cause (first observed failure):",
                root,
                boarder_delim * width,
            ]
        )


def _table_width(title: str, blocks: Sequence[str]) -> int:
    width = len(title)
    for block in blocks:
        for line in block.split("\n"):
            width = max(width, len(line))
    return width


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
    width = min(_table_width(title, [root, *others]), _MAX_WIDTH)
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
    `errorCode` set to its exit code, when that child wrote one; when it wrote none, nothing is
    written (as torch). A child file that cannot be read or parsed (torch would raise while
    handling the error) records the `ChildFailedError` itself instead.
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
                    # As torch: the child left nothing to copy, so this process writes nothing.
                    logger.info(
                        "local_rank %s FAILED with no error file. Decorate your entrypoint fn "
                        "with @record for traceback info. "
                        "See: https://pytorch.org/docs/stable/elastic/errors.html",
                        rank,
                    )
                raise
            except Exception as e:
                handler.record_exception(e)
                raise

        return wrapper

    if fn is None:
        return wrap
    return wrap(fn)
