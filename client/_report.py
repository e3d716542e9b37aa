"""Human-readable reports of a job's RunResult: the failure table and a short summary.

The failure table has the shape of torchelastic's ChildFailedError message (same frame, width
rule, rows and indentation) with the root cause first, and adds where (node) and when
(attempt, round) each failure happened, and whether it was collateral damage of the root cause.
"""

from __future__ import annotations

from datetime import datetime

from client.errors import (
    NOT_AVAILABLE,
    format_failure_block,
    format_failure_table,
    indent_continuation,
)
from client.model import ProcessFailure, RunResult, WorkerState, signal_name

__all__ = ["format_failures", "format_result"]

MAX_REPR_CHARS = 200
"""Longest repr of a return value that `format_result` shows."""

_COLLATERAL_AFTER = "failed after the root cause"
_COLLATERAL_SAME_TIME = "no (failed at the same time as the root cause)"
_COLLATERAL_BEFORE = "no (its node's clock puts it before the root cause)"


def format_failures(result: RunResult, name: str) -> str:
    """The failure table of `result`: root cause first, then the other failures by time."""
    title = f"{_one_line(name or result.name or result.job_id or 'job')} FAILED"
    root = result.root_cause
    # The same failure order as first_failure: time, then global rank.
    ordered = sorted(result.failures.values(), key=lambda f: (_sort_time(f), f.global_rank))
    others = [f for f in ordered if f is not root]
    root_block = format_failure_block(0, _rows(root, None)) if root is not None else ""
    other_blocks = [
        format_failure_block(idx, _rows(f, root))
        for idx, f in enumerate(others, start=1 if root is not None else 0)
    ]
    return format_failure_table(title, root_block, other_blocks)


def format_result(result: RunResult) -> str:
    """A short summary: state, reason, return values by rank; the failure table if it failed."""
    name = result.name or result.job_id or "job"
    lines = [f"{name} {result.state.value}" + (f": {result.reason}" if result.reason else "")]
    if result.attempts:
        lines.append(f"attempts: {len(result.attempts)}")
    if result.return_values:
        lines.append("return values:")
        for rank in sorted(result.return_values):
            text = indent_continuation(_short_repr(result.return_values[rank]), "    ")
            lines.append(f"  rank {rank}: {text}")
    if result.state == WorkerState.FAILED or result.failures:
        lines.append(format_failures(result, name))
    return "\n".join(lines)


def _rows(failure: ProcessFailure, root: ProcessFailure | None) -> list[tuple[str, str]]:
    rows = [("time", _time(failure.timestamp))]
    if root is not None:
        rows.append(("collateral", _collateral(failure, root)))
    signame = _one_line(failure.signal) or (
        signal_name(-failure.exitcode) if failure.exitcode < 0 else ""
    )
    signame_part = f" ({signame})" if signame and signame != NOT_AVAILABLE else ""
    rows += [
        ("node", _one_line(failure.node) or NOT_AVAILABLE),
        ("attempt", f"{failure.attempt} (round: {failure.round})"),
        ("rank", f"{failure.global_rank} (local_rank: {failure.local_rank})"),
        # torchelastic's spacing, kept so the table reads the same: one space after the pid,
        # then " (SIGNAME)" only for a death by signal.
        ("exitcode", f"{failure.exitcode} (pid: {failure.pid}) {signame_part}"),
        ("error_file", _one_line(failure.error_file) or NOT_AVAILABLE),
        ("traceback", indent_continuation(failure.traceback or failure.message or NOT_AVAILABLE)),
    ]
    tail = failure.stderr_tail.rstrip("\n")
    if tail.strip() and not failure.traceback:
        count = tail.count("\n") + 1
        noun = "line" if count == 1 else "lines"
        rows.append(("stderr", f"last {count} {noun}" + indent_continuation("\n" + tail, "    ")))
    return rows


def _one_line(text: str) -> str:
    # A newline in a one-line field would start a line that reads as a new row or entry.
    return text.replace("\r", "\\r").replace("\n", "\\n")


def _collateral(failure: ProcessFailure, root: ProcessFailure) -> str:
    t, root_t = _sort_time(failure), _sort_time(root)
    if t > root_t:
        return _COLLATERAL_AFTER
    if t == root_t:
        return _COLLATERAL_SAME_TIME
    # Possible when the coordinator chose the root cause and nodes' clocks disagree.
    return _COLLATERAL_BEFORE


def _sort_time(failure: ProcessFailure) -> float:
    # NaN would make every comparison false and the order depend on the input order.
    t = failure.timestamp
    return t if t == t else float("inf")


def _time(timestamp: float) -> str:
    # Milliseconds, because the root cause is decided below one second.
    try:
        return datetime.fromtimestamp(timestamp).isoformat(sep="_", timespec="milliseconds")
    except (ValueError, OverflowError, OSError, TypeError):
        return repr(timestamp)


def _short_repr(value: object) -> str:
    try:
        text = repr(value)
    except Exception as e:  # a user's return value may have a broken __repr__
        text = f"<repr failed: {type(e).__name__}>"
    if len(text) > MAX_REPR_CHARS:
        text = text[: MAX_REPR_CHARS - 3] + "..."
    return text
