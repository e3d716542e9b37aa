"""The outcome of a job: `RunResult`, its `ProcessFailure`s and `AttemptSummary`s, and the
failure table every report of a failed job prints (`format_failures`).
"""

from __future__ import annotations

import enum
import math
import re
import signal as _signal
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from client._failure_order import failure_time, order_note, root_cause, time_uncertainty
from client._status import WorkerState
from client.errors import (
    NOT_AVAILABLE,
    format_failure_block,
    format_failure_table,
    indent_continuation,
)
from client.results import PickledReturnValue


class FailureCategory(enum.Enum):
    """torchelastic's error categories: who is to blame for a failure."""

    USER = "USER"  # the worker failed
    PLATFORM = "PLATFORM"  # the agent failed
    INFRA = "INFRA"  # the host or the network failed
    INPUT = "INPUT"  # the spec was invalid
    HANG = "HANG"  # the rank stopped making progress (stall detection)


def signal_message(signum: int, pid: int) -> str:
    """torchelastic's wording for a death by signal: `Signal 9 (SIGKILL) received by PID 1234`."""
    return f"Signal {signum} ({signal_name(signum)}) received by PID {pid}"


def signal_name(signum: int) -> str:
    try:
        return _signal.Signals(signum).name
    except ValueError:
        return "<N/A>"


@dataclass(frozen=True)
class ProcessFailure:
    """One worker's failure, as torchelastic reports it, plus where and when."""

    global_rank: int
    local_rank: int
    pid: int
    exitcode: int
    message: str
    """torchelastic's message, exactly: the error file's message ("ValueError: boom"), torch's
    ``Signal 9 (SIGKILL) received by PID 1234``, or, without an error file, torch's "To enable
    traceback see: ..." hint (gelastic's own account of that exit is `detail`); or why the agent
    itself ended the worker (watchdog, health, a return value over the limit)."""
    timestamp: float
    """Whole seconds since the epoch, an `int` as torch's. A float given here is cut to whole
    seconds and kept exact in `precise_timestamp` (so `replace(f, timestamp=t)` with a float
    sets both); an int leaves a `precise_timestamp` given with it alone."""
    node: str = ""
    signal: str = ""
    error_file: str = "<N/A>"
    traceback: str = ""
    attempt: int = 0
    round: int = 0
    root_cause: bool = False
    category: FailureCategory = FailureCategory.USER
    stderr_tail: str = ""
    role: str = ""
    role_rank: int = -1
    clock_offset: float = 0.0
    """Seconds the node's clock was ahead of the coordinator's (negative: behind) when the
    coordinator recorded the failure; `timestamp` is already corrected by it (the node read
    `timestamp + clock_offset`). 0.0 for a time the coordinator took itself, or a node whose
    clock was not measured yet."""
    time_uncertainty: float = 0.0
    """+/- seconds of `timestamp`: the resolution of its source (1.0 for the whole seconds of
    torch's own error file; 0.01 for a file's modification time) plus the uncertainty of the
    node's clock offset. Failures closer than their uncertainties together are in no known
    order (see `first_failure`)."""
    precise_timestamp: float = 0.0
    """Seconds since the epoch, sub-second when gelastic's own writer or agent set it: what
    orders failures. On the coordinator's clock once the coordinator recorded it (see
    `clock_offset`). 0.0 (unset) takes `timestamp`."""
    executable: str = ""
    """Which executable the worker ran, as the agent resolved it (its PATH and cwd decide what
    a bare "python" is); "" when the agent did not say."""
    detail: str = ""
    """gelastic's own account of the exit where torch's `message` is only its generic hint
    ("Process exited with exit code 3 (pid 7); no error file was written"); "" otherwise."""

    def __post_init__(self) -> None:
        t = self.timestamp
        if isinstance(t, int) and not isinstance(t, bool):
            if not self.precise_timestamp:
                object.__setattr__(self, "precise_timestamp", float(t))
            return
        precise = float(t)
        object.__setattr__(self, "precise_timestamp", precise)
        object.__setattr__(self, "timestamp", int(precise) if math.isfinite(precise) else 0)

    @property
    def report_text(self) -> str:
        """What a report shows as this failure's text: `detail` where torch's message is only
        its hint, else `message`."""
        return self.detail or self.message

    def signal_name(self) -> str:
        return self.signal or "<N/A>"

    def timestamp_iso(self) -> str:
        return datetime.fromtimestamp(self.precise_timestamp).isoformat(sep="_", timespec="seconds")


@dataclass(frozen=True)
class AttemptSummary:
    """One attempt (restart count) and why it ended."""

    attempt: int
    round: int
    nodes: tuple[str, ...]
    end_reason: str
    failures: tuple[ProcessFailure, ...] = ()
    started_at: float = 0.0
    ended_at: float = 0.0


@dataclass(frozen=True)
class RunResult:
    """The outcome of a job: torchelastic's RunResult, for every node of the job.

    `return_values` and `failures` are keyed by global rank and never share a key; workers
    that gelastic stopped on purpose are in neither.

    `return_values` holds data, never anything unpickled: a value the worker stored as JSON
    (one that JSON gives back exactly) is decoded; any other value (a tuple, an int-keyed
    dict, NaN, bytes, a tensor) is a `client.results.PickledReturnValue` holding the pickle,
    and `trusted_return_values()` (or ``Job.wait(trust_pickles=True)``) unpickles those, for
    a caller who trusts every node of the job; a value that cannot be read is a
    `client.results.UnreadableReturnValue` saying why. A `Job` holding the job's key (it
    submitted the job) checks each value's tag first (`return_values_verified`); a job looked
    up by id, or `gelastic result`, decodes without checking.
    """

    state: WorkerState
    return_values: dict[int, Any] = field(default_factory=dict)
    failures: dict[int, ProcessFailure] = field(default_factory=dict)
    attempts: tuple[AttemptSummary, ...] = ()
    reason: str = ""
    job_id: str = ""
    name: str = ""
    raw_return_values: dict[int, bytes] = field(default_factory=dict, repr=False)
    """The return values as the workers stored them (tagged bytes), by global rank."""
    return_value_sizes: dict[int, int] = field(default_factory=dict)
    """Size in bytes of each rank's return value, as jobs, lists and watches report it."""
    return_values_verified: bool = False
    """Every return value's tag matched the job's key: a process holding the key (a node of
    the job) wrote it for its rank. It says nothing about whether loading a pickle is safe."""

    def is_failed(self) -> bool:
        return self.state == WorkerState.FAILED

    def trusted_return_values(self) -> dict[int, Any]:
        """`return_values` with every `PickledReturnValue` UNPICKLED: this runs code chosen by
        whoever wrote them (see `PickledReturnValue.trusted_load`). Values that cannot be read
        stay `UnreadableReturnValue`s."""
        return {
            rank: v.trusted_load() if isinstance(v, PickledReturnValue) else v
            for rank, v in sorted(self.return_values.items())
        }

    @property
    def root_cause(self) -> ProcessFailure | None:
        """The failure the coordinator marked as the root cause; else `first_failure`."""
        marked = [f for f in self.failures.values() if f.root_cause]
        if marked:
            return marked[0]
        return first_failure(self.failures)

    def format_failures(self, name: str = "") -> str:
        """A report shaped like torchelastic's ChildFailedError table, root cause first."""
        return format_failures(self, name or self.name or self.job_id)


def first_failure(failures: Mapping[int, ProcessFailure]) -> ProcessFailure | None:
    """Root cause: smallest timestamp, ties to the smallest global rank; but a collective's
    communication error ("Connection reset by peer", a collective timeout) gives way to a
    failure that is not one when their times are closer than their uncertainties together
    (`client._failure_order`)."""
    return root_cause(failures)


# --- the failure table ---------------------------------------------------------------------
# The shape of torchelastic's ChildFailedError message (same frame, width rule, rows and
# indentation) with the root cause first, plus where (node, executable) and when (attempt,
# round) each failure happened, and how each other failure relates to the root cause in time.
# Every report of a failed job (`gelastic run`, `submit --watch`, `result`, `wait`) is this one.


def format_failures(result: RunResult, name: str) -> str:
    """The failure table of `result`: root cause first, then the other failures by time."""
    title = f"{_one_line(name or result.name or result.job_id or 'job')} FAILED"
    root = result.root_cause
    # The same failure order as first_failure: time, then global rank.
    ordered = sorted(result.failures.values(), key=lambda f: (_sort_time(f), f.global_rank))
    others = [f for f in ordered if f is not root]
    root_block = ""
    if root is not None:
        # Where the root cause's time was too close to another's to tell which came first.
        note = order_note(result.failures.values(), root)
        root_block = format_failure_block(0, _rows(root, None, note))
    other_blocks = [
        format_failure_block(idx, _rows(f, root))
        for idx, f in enumerate(others, start=1 if root is not None else 0)
    ]
    return format_failure_table(title, root_block, other_blocks)


def _rows(
    failure: ProcessFailure, root: ProcessFailure | None, note: str = ""
) -> list[tuple[str, str]]:
    rows = [("time", _time_row(failure))]
    if root is not None:
        rows.append(("order", _order(failure, root)))
    elif note:
        rows.append(("order", note))
    signame = _one_line(failure.signal) or (
        signal_name(-failure.exitcode) if failure.exitcode < 0 else ""
    )
    signame_part = f" ({signame})" if signame and signame != NOT_AVAILABLE else ""
    # Which executable ran: a row of its own, as the node has, never part of the message or
    # traceback shown (an older agent appended it to the message).
    message, executable = _split_executable_note(failure.report_text)
    executable = failure.executable or executable
    rows += [
        ("node", _one_line(failure.node) or NOT_AVAILABLE),
        ("attempt", f"{failure.attempt} (round: {failure.round})"),
        ("rank", f"{failure.global_rank} (local_rank: {failure.local_rank})"),
        # torchelastic's spacing, kept so the table reads the same: one space after the pid,
        # then " (SIGNAME)" only for a death by signal.
        ("exitcode", f"{failure.exitcode} (pid: {failure.pid}) {signame_part}"),
        ("error_file", _one_line(failure.error_file) or NOT_AVAILABLE),
    ]
    if executable:
        rows.append(("executable", _one_line(executable)))
    rows.append(("traceback", indent_continuation(failure.traceback or message or NOT_AVAILABLE)))
    tail = failure.stderr_tail.rstrip("\n")
    if tail.strip() and not failure.traceback:
        count = tail.count("\n") + 1
        noun = "line" if count == 1 else "lines"
        rows.append(("stderr", f"last {count} {noun}" + indent_continuation("\n" + tail, "    ")))
    return rows


def _time_row(failure: ProcessFailure) -> str:
    """The failure's time, how sure it is, and the node clock's offset it was corrected by."""
    text = _time(failure.precise_timestamp)
    u = time_uncertainty(failure)
    if u >= 0.0005:
        text += f" +/- {u:.3f} s"
    off = failure.clock_offset
    if math.isfinite(off) and abs(off) >= 0.0005:
        text += f" (corrected for the node's clock, {off:+.3f} s off)"
    return text


_RAN_NOTE = re.compile(
    r"(?s)(?P<message>.*) \(ran (?P<executable>[^\n]+) on node (?P<node>[^\s()]+)\)"
)


def executable_note(executable: str, node: str) -> str:
    """What an older agent appended to a worker's own failure message: which executable ran it
    on which node. Agents now send the executable in `ProcessFailure.executable`."""
    return f"(ran {executable} on node {node})"


def _split_executable_note(message: str) -> tuple[str, str]:
    """(the message without its `executable_note`, the executable); "" when it has none."""
    m = _RAN_NOTE.fullmatch(message)
    if m is None:
        return message, ""
    return m.group("message"), m.group("executable")


def _one_line(text: str) -> str:
    # A newline in a one-line field would start a line that reads as a new row or entry.
    return text.replace("\r", "\\r").replace("\n", "\\n")


def _order(failure: ProcessFailure, root: ProcessFailure) -> str:
    t, root_t = _sort_time(failure), _sort_time(root)
    both = time_uncertainty(failure) + time_uncertainty(root)
    # Their times too close to tell which came first (clock offsets, time resolution).
    unsure = (
        f", within the uncertainty of the times ({both:.3f} s)" if abs(t - root_t) <= both else ""
    )
    if t > root_t:
        later = f"{t - root_t:.3f} s after" if math.isfinite(t - root_t) else "after"
        if _same_error(failure, root):
            # The same error on its own (every rank ran the same bad line), not a consequence.
            return f"also failed, {later} the root cause{unsure}, with the same error"
        return f"failed {later} the root cause{unsure}, perhaps because of it"
    if t == root_t:
        return "failed at the same time as the root cause"
    if unsure:
        return (
            f"failed {root_t - t:.3f} s before the root cause{unsure}; taken as a consequence "
            "of it (a collective's communication error)"
        )
    # Possible when the coordinator chose the root cause and nodes' clocks disagree.
    return "failed before the root cause by its node's clock (the root cause was seen first)"


_sort_time = failure_time


def _same_error(a: ProcessFailure, b: ProcessFailure) -> bool:
    return _split_executable_note(a.report_text)[0] == _split_executable_note(b.report_text)[0]


def _time(timestamp: float) -> str:
    # Milliseconds, because the root cause is decided below one second.
    try:
        return datetime.fromtimestamp(timestamp).isoformat(sep="_", timespec="milliseconds")
    except (ValueError, OverflowError, OSError, TypeError):
        return repr(timestamp)
