"""A short, human-readable summary of a job's RunResult; the failure table is `client.model`'s."""

from __future__ import annotations

from client.errors import indent_continuation
from client.model import RunResult, WorkerState, format_failures

__all__ = ["format_result"]

MAX_REPR_CHARS = 200
"""Longest repr of a return value that `format_result` shows."""


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
    elif result.return_value_sizes:
        sizes = ", ".join(
            f"rank {r}: {result.return_value_sizes[r]} bytes"
            for r in sorted(result.return_value_sizes)
        )
        lines.append(f"return values (not fetched): {sizes}")
    if result.state == WorkerState.FAILED or result.failures:
        lines.append(format_failures(result, name))
    return "\n".join(lines)


def _short_repr(value: object) -> str:
    try:
        text = repr(value)
    except Exception as e:  # a user's return value may have a broken __repr__
        text = f"<repr failed: {type(e).__name__}>"
    if len(text) > MAX_REPR_CHARS:
        text = text[: MAX_REPR_CHARS - 3] + "..."
    return text
