"""Plain-text tables and JSON views of the client's domain objects, for the `gelastic` CLI.

Pure functions: they take dataclasses and return strings or JSON-ready values, so the CLI's
output can be tested without a coordinator.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import math
import time
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

from client.model import (
    JobEvent,
    JobStatus,
    NodeInfo,
    RunResult,
    WorkerState,
    WorkerStatus,
    signal_name,
)
from client.results import PickledReturnValue

__all__ = [
    "ago",
    "clock",
    "event_line",
    "event_line_header",
    "events_table",
    "jobs_table",
    "nodes_table",
    "progress_lines",
    "result_text",
    "status_text",
    "table",
    "to_jsonable",
]

MAX_REPR_CHARS = 2000
"""Longest repr of a return value printed by `result_text` (the JSON view is not cut)."""


def table(headers: Sequence[str], rows: Sequence[Sequence[object]], right: str = "") -> str:
    """Columns padded to their widest cell; columns whose header is in `right` align right.

    The last column is never padded, so a long free-text column (a reason) does not push
    trailing spaces onto every line.
    """
    cells = [[str(h) for h in headers], *[[_cell(c) for c in row] for row in rows]]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    right_cols = {i for i, h in enumerate(headers) if h in right.split(",")}
    lines = []
    for r in cells:
        parts = []
        for i, c in enumerate(r):
            if i == len(r) - 1 and i not in right_cols:
                parts.append(c)
            elif i in right_cols:
                parts.append(c.rjust(widths[i]))
            else:
                parts.append(c.ljust(widths[i]))
        lines.append("  ".join(parts).rstrip())
    return "\n".join(lines)


def _cell(value: object) -> str:
    if value is None:
        return "-"
    if isinstance(value, enum.Enum):
        return str(value.value)
    # Free text from the coordinator must not break the table's rows.
    return " ".join(str(value).split()) if "\n" in str(value) else str(value)


def clock(timestamp: float) -> str:
    """Local wall-clock time with milliseconds, e.g. ``12:00:05.123``; ``-`` when unset."""
    if timestamp <= 0:
        return "-"
    return datetime.fromtimestamp(timestamp).strftime("%H:%M:%S.%f")[:-3]


def ago(timestamp: float, now: float | None = None) -> str:
    """How long ago `timestamp` was, in the largest sensible unit: ``3s``, ``5m``, ``2h``."""
    if timestamp <= 0:
        return "-"
    delta = max(0.0, (time.time() if now is None else now) - timestamp)
    if delta < 10:
        return f"{delta:.1f}s"
    if delta < 120:
        return f"{delta:.0f}s"
    if delta < 7200:
        return f"{delta / 60:.0f}m"
    if delta < 172800:
        return f"{delta / 3600:.0f}h"
    return f"{delta / 86400:.0f}d"


def jobs_table(jobs: Sequence[JobStatus], now: float | None = None) -> str:
    rows = [
        (
            j.job_id,
            j.name or "-",
            j.state,
            j.attempt,
            # A list's entries carry no members; `nodes_joined` counts them (before a round,
            # the nodes its rendezvous has).
            f"{len(j.members) or j.nodes_joined} ({j.min_nodes}:{j.max_nodes})",
            j.world_size or "-",
            ago(j.submitted_at, now),
            j.reason,
        )
        for j in jobs
    ]
    return table(
        ("JOB", "NAME", "STATE", "ATTEMPT", "NODES", "WORLD", "AGE", "REASON"),
        rows,
        right="ATTEMPT,WORLD,AGE",
    )


def nodes_table(nodes: Sequence[NodeInfo], now: float | None = None) -> str:
    rows = [
        (
            n.name,
            n.addr,
            n.state,
            f"{n.slots_used}/{n.slots}",
            ago(n.last_seen, now),
            _clock_cell(n),
            ",".join(n.jobs) or "-",
        )
        for n in nodes
    ]
    text = table(
        ("NODE", "ADDR", "STATE", "SLOTS", "SEEN", "CLOCK_MS", "JOBS"), rows, right="SLOTS,SEEN"
    )
    gpu_rows = [
        (
            n.name,
            g.index,
            _cell(g.name) or "-",
            "lost" if h is not None and h.lost else ("busy" if g.index in n.gpus_used else "free"),
            f"{h.utilization_percent:.0f}" if h is not None and not h.lost else "-",
            f"{(h.memory_used if h is not None else 0) / 2**20:.0f}/{g.memory_total / 2**20:.0f}",
            f"{h.temperature_c}" if h is not None and not h.lost else "-",
            f"{h.uncorrectable_ecc}" if h is not None else "-",
        )
        for n in nodes
        for g in n.gpus
        for h in [next((x for x in n.gpu_health if x.index == g.index), None)]
    ]
    if gpu_rows:
        text += "\n\ngpus:\n" + "\n".join(
            _indent(
                table(
                    ("NODE", "GPU", "NAME", "USE", "UTIL%", "MEM_MB", "TEMP_C", "ECC_UNCORR"),
                    gpu_rows,
                    right="GPU,UTIL%,MEM_MB,TEMP_C,ECC_UNCORR",
                )
            )
        )
    quarantined = [
        f"  {n.name}: {_cell(n.quarantine_reason)} (until {_datetime(n.quarantined_until)})"
        for n in nodes
        if n.quarantine_reason
    ]
    if quarantined:
        text += "\n\nquarantined (no new rounds; `gelastic nodes --clear-quarantine NAME`):\n"
        text += "\n".join(quarantined)
    drained = [
        f"  {n.name}: {_cell(n.drain_reason)} (since {_datetime(n.drained_since)}; workers "
        + (
            f"killed at {_datetime(n.drain_deadline)})"
            if n.drain_deadline
            else "get their job's stop_grace)"
        )
        for n in nodes
        if n.drain_reason
    ]
    if drained:
        text += "\n\ndrained (no new rounds; `gelastic nodes --undrain NAME`):\n"
        text += "\n".join(drained)
    return text


def _clock_cell(n: NodeInfo) -> str:
    """How far the node's clock is ahead of the coordinator's, +/- how sure, in milliseconds:
    "-" when not measured."""
    if not n.clock_uncertainty > 0:
        return "-"
    return f"{n.clock_offset * 1000:+.1f} +/-{n.clock_uncertainty * 1000:.1f}"


def status_text(s: JobStatus) -> str:
    """Everything `gelastic status` shows: the job, its members, and one row per rank."""
    lines = [
        f"job:       {s.job_id}" + (f" ({s.name})" if s.name else ""),
        f"state:     {s.state.value}",
        f"reason:    {_cell(s.reason) or '-'}",
        f"attempt:   {s.attempt} (round {s.round}); max_restarts {s.max_restarts}",
        f"nodes:     {_nodes_now(s)} (min {s.min_nodes}, max {s.max_nodes}); "
        f"world size {s.world_size or '-'}",
        f"submitted: {_datetime(s.submitted_at)}"
        + (f"; finished {_datetime(s.finished_at)}" if s.finished_at > 0 else ""),
    ]
    if s.members:
        lines += ["", "members:"]
        members = sorted(s.members, key=lambda m: m.group_rank)
        headers: tuple[str, ...] = ("GROUP", "NODE", "ADDR", "NPROC", "GROUP_STATE", "DONE")
        member_rows: list[tuple[object, ...]] = [
            (
                m.group_rank,
                m.node,
                m.addr,
                m.nproc,
                m.group_state.value if m.group_state is not None else "-",
                "yes" if m.done else "no",
            )
            for m in members
        ]
        if len({m.role for m in members}) > 1:  # a multi-role job: each node runs one role
            headers = ("GROUP", "NODE", "ROLE", "ADDR", "NPROC", "GROUP_STATE", "DONE")
            member_rows = [
                (*r[:2], m.role, *r[2:]) for r, m in zip(member_rows, members, strict=True)
            ]
        lines += _indent(table(headers, member_rows, right="GROUP,NPROC"))
    if s.workers:
        lines += ["", "ranks:"]
        # An exited rank shows how it ended, not its last CPU and memory sample.
        worker_rows = [
            (
                w.global_rank,
                w.local_rank,
                w.role or "-",
                w.role_rank,
                w.world_size or "-",
                w.role_world_size or "-",
                w.node,
                w.state,
                w.pid or "-",
                "-" if _exited(w) else f"{w.cpu_percent:.1f}",
                "-" if _exited(w) else f"{w.rss_bytes / (1024 * 1024):.1f}",
                "-" if _exited(w) else (w.proc_state or "-"),
                _exitcode(w),
            )
            for w in sorted(s.workers, key=lambda w: w.global_rank)
        ]
        lines += _indent(
            table(
                (
                    "RANK",
                    "LOCAL",
                    "ROLE",
                    "ROLE_RANK",
                    "WORLD",
                    "ROLE_WORLD",
                    "NODE",
                    "STATE",
                    "PID",
                    "CPU%",
                    "RSS_MB",
                    "PROC",
                    "EXIT",
                ),
                worker_rows,
                right="RANK,LOCAL,ROLE_RANK,WORLD,ROLE_WORLD,PID,CPU%,RSS_MB",
            )
        )
    if s.stalled or any(w.step is not None for w in s.workers):
        lines += ["", "progress:"]
        lines += _indent("\n".join(progress_lines(s)))
    gpu_rows = [
        (
            w.global_rank,
            w.node,
            w.gpu.index,
            _cell(w.gpu.uuid) or "-",
            f"{w.gpu.utilization_percent:.0f}",
            f"{w.gpu.memory_used / 2**20:.0f}/{w.gpu.memory_total / 2**20:.0f}",
            w.gpu.temperature_c,
        )
        for w in sorted(s.workers, key=lambda w: w.global_rank)
        if w.gpu is not None
    ]
    if gpu_rows:
        lines += ["", "gpus:"]
        lines += _indent(
            table(
                ("RANK", "NODE", "GPU", "UUID", "UTIL%", "MEM_MB", "TEMP_C"),
                gpu_rows,
                right="RANK,GPU,UTIL%,MEM_MB,TEMP_C",
            )
        )
    return "\n".join(lines)


MAX_METRICS_SHOWN = 4


def _flags(w: WorkerStatus) -> str:
    flags = [f for f, on in (("BEHIND", w.behind), ("STRAGGLER", w.straggler)) if on]
    return ",".join(flags) or "-"


def _metrics(w: WorkerStatus) -> str:
    shown = [f"{k}={v:.4g}" for k, v in sorted(w.metrics.items())[:MAX_METRICS_SHOWN]]
    more = len(w.metrics) - MAX_METRICS_SHOWN
    return _cell(" ".join(shown) + (f" +{more}" if more > 0 else "")) or "-"


def _gpu(w: WorkerStatus) -> str:
    if w.gpu is None:
        return "-"
    return f"{w.gpu.index}:{w.gpu.utilization_percent:.0f}%"


def progress_lines(s: JobStatus) -> list[str]:
    """The stall (if any) and the per-rank progress table, as lines."""
    lines = []
    if s.stalled:
        lines.append(f"STALLED: {_cell(s.stall_reason)}")
    rows = [
        (
            w.global_rank,
            w.node,
            w.state,
            "-" if w.step is None else w.step,
            "-" if w.step is None else f"{w.steps_per_s:.2f}",
            "-" if w.last_step_age is None else f"{w.last_step_age:.1f}",
            f"{w.cpu_percent:.0f}",
            f"{w.rss_bytes / 2**20:.0f}",
            _gpu(w),
            _flags(w),
            _metrics(w),
        )
        for w in sorted(s.workers, key=lambda w: w.global_rank)
    ]
    lines += table(
        (
            "RANK",
            "NODE",
            "STATE",
            "STEP",
            "STEPS/S",
            "LAST_STEP_S",
            "CPU%",
            "RSS_MB",
            "GPU",
            "FLAGS",
            "METRICS",
        ),
        rows,
        right="RANK,STEP,STEPS/S,LAST_STEP_S,CPU%,RSS_MB",
    ).splitlines()
    return lines


def events_table(events: Sequence[JobEvent], *, header: bool = True) -> str:
    rows = [
        (
            e.seq,
            clock(e.timestamp),
            e.kind,
            e.attempt,
            e.node or "-",
            "-" if e.rank < 0 else e.rank,
            e.reason,
        )
        for e in events
    ]
    text = table(
        ("SEQ", "TIME", "KIND", "ATTEMPT", "NODE", "RANK", "REASON"), rows, right="SEQ,ATTEMPT,RANK"
    )
    return text if header else "\n".join(text.splitlines()[1:])


def result_text(result: RunResult, state: str) -> str:
    """`gelastic result` for a finished job: the return values, or the failure report."""
    name = result.name or result.job_id
    lines = [f"{name} {state}" + (f": {result.reason}" if result.reason else "")]
    if result.return_values:
        lines.append("return values:")
        for rank in sorted(result.return_values):
            text = repr(result.return_values[rank])
            if len(text) > MAX_REPR_CHARS:
                text = text[:MAX_REPR_CHARS] + f"... ({len(text)} chars)"
            lines.append(f"  rank {rank}: {text}")
        if any(isinstance(v, PickledReturnValue) for v in result.return_values.values()):
            lines.append(
                "  pickles are not loaded: `gelastic result --trusted-load` unpickles and prints "
                "them, which runs code chosen by whoever wrote them"
            )
    elif result.return_value_sizes:
        lines.append("return values (not fetched):")
        for rank in sorted(result.return_value_sizes):
            lines.append(f"  rank {rank}: {result.return_value_sizes[rank]} bytes")
    if result.failures:
        lines.append(result.format_failures())
    return "\n".join(lines)


def _nodes_now(s: JobStatus) -> str:
    # Before a round forms, the members are none but the nodes that joined its rendezvous are.
    if s.members or s.state.is_terminal() or not s.nodes_joined:
        return str(len(s.members))
    return f"{s.nodes_joined} joined"


def _exited(w: WorkerStatus) -> bool:
    return w.exitcode is not None and w.state not in _NOT_EXITED


def _exitcode(w: WorkerStatus) -> str:
    """``exited 0``, ``signal SIGKILL``; ``-`` for a worker that has not exited, whatever the
    wire's default says."""
    if w.exitcode is None or not _exited(w):
        return "-"
    if w.exitcode < 0:
        return f"signal {signal_name(-w.exitcode)}"
    return f"exited {w.exitcode}"


_NOT_EXITED = frozenset(
    {WorkerState.UNKNOWN, WorkerState.INIT, WorkerState.HEALTHY, WorkerState.UNHEALTHY}
)


def _indent(text: str) -> list[str]:
    return ["  " + line for line in text.splitlines()]


def _datetime(timestamp: float) -> str:
    if timestamp <= 0:
        return "-"
    return datetime.fromtimestamp(timestamp).isoformat(sep=" ", timespec="seconds")


def to_jsonable(value: Any) -> Any:
    """Dataclasses become dicts, enums their value, mappings get string keys; a value JSON
    cannot carry (a return value of any type) becomes its repr."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: to_jsonable(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, enum.Enum):
        return to_jsonable(value.value)
    if value is None or isinstance(value, bool | int | str):
        return value
    if isinstance(value, float):
        # JSON has no NaN or infinity; strict parsers reject them.
        return value if math.isfinite(value) else repr(value)
    if isinstance(value, Mapping):
        return {str(k): to_jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [to_jsonable(v) for v in value]
    if isinstance(value, bytes):
        return repr(value)
    try:
        json.dumps(value, allow_nan=False)
    except (TypeError, ValueError):
        return repr(value)
    return value


# Wide enough for every event kind ("assign_undeliverable"): a streamed row cannot widen its
# column afterwards, so a longer kind would shift the rest of its row off the header.
_EVENT_LINE = "{:>5}  {:<12}  {:<20}  {:>7}  {:<12}  {:>4}  {}"


def event_line_header() -> str:
    """Header of `event_line` rows: fixed widths, for output that grows as events arrive."""
    return _EVENT_LINE.format("SEQ", "TIME", "KIND", "ATTEMPT", "NODE", "RANK", "REASON").rstrip()


def event_line(e: JobEvent) -> str:
    return _EVENT_LINE.format(
        e.seq,
        clock(e.timestamp),
        e.kind,
        e.attempt,
        e.node or "-",
        "-" if e.rank < 0 else e.rank,
        _cell(e.reason),
    ).rstrip()
