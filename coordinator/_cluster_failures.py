"""Failures as the cluster keeps them: an agent's report bounded and stamped with where and
when, the root cause marked, the job's own failure when no worker's is there, and the
jittered wait before a restart.
"""

from __future__ import annotations

import hashlib
import logging
import math
import re
from dataclasses import replace

from client.model import (
    MAX_RESULT_BYTES_PER_JOB,
    MAX_RETURN_VALUE_BYTES,
    FailureCategory,
    ProcessFailure,
    first_failure,
    order_note,
)
from coordinator._clock_offset import ClockOffset
from coordinator._cluster_records import (
    WorkerExitReport,
    _Job,
    _Worker,
)
from coordinator._cluster_words import (
    _clip,
)

logger = logging.getLogger("coordinator._cluster")


def _sanitized(report: WorkerExitReport, now: float) -> WorkerExitReport:
    """An agent's report made safe to keep: bounded texts, finite times, bounded return value."""
    ts = report.timestamp if math.isfinite(report.timestamp) and report.timestamp > 0 else now
    f = report.failure
    if f is not None:
        f = replace(
            f,
            message=_clip(f.message),
            traceback=_clip(f.traceback),
            stderr_tail=_clip(f.stderr_tail),
            error_file=_clip(f.error_file, 4096),
            node=_clip(f.node, 256),
            signal=_clip(f.signal, 64),
            role=_clip(f.role, 256),
            executable=_clip(f.executable, 4096),
            detail=_clip(f.detail),
            timestamp=t if math.isfinite(t := f.precise_timestamp) and t > 0 else float(ts),
        )
    value = report.return_value
    if value is not None and len(value) > MAX_RETURN_VALUE_BYTES:
        f = ProcessFailure(
            global_rank=report.global_rank,
            local_rank=report.local_rank,
            pid=report.pid,
            exitcode=report.exitcode,
            message=(
                f"the return value is {len(value)} bytes pickled, over the limit of "
                f"{MAX_RETURN_VALUE_BYTES} bytes; return less, or write it to a file"
            ),
            timestamp=ts,
        )
        value = None
    return replace(report, failure=f, return_value=value, timestamp=ts)


def _within_result_budget(job: _Job, rank: int, report: WorkerExitReport) -> WorkerExitReport:
    """The report with its return value kept only where one belongs and the job can hold it.

    A command job has no return values, whatever an agent says; a function job's ranks together
    may keep at most MAX_RESULT_BYTES_PER_JOB, and the rank that goes over fails the job.
    """
    value = report.return_value
    if value is None or not job.spec.is_function:
        return replace(report, return_value=None)
    held = sum(len(v) for r, v in job.current.return_values.items() if r != rank)
    if held + len(value) <= MAX_RESULT_BYTES_PER_JOB:
        return report
    return replace(
        report,
        return_value=None,
        failure=report.failure
        or ProcessFailure(
            global_rank=report.global_rank,
            local_rank=report.local_rank,
            pid=report.pid,
            exitcode=report.exitcode,
            message=(
                f"the return values of the job's ranks add up to {held + len(value)} bytes "
                f"with this rank's {len(value)}, over the per-job limit of "
                f"{MAX_RESULT_BYTES_PER_JOB} bytes; return less, or write it to a file"
            ),
            timestamp=report.timestamp,
        ),
    )


def _stamp(f: ProcessFailure, node: str, w: _Worker, job: _Job) -> ProcessFailure:
    member = job.member(node)
    role_rank = member.ranks.role_rank(w.local_rank) if member is not None else f.role_rank
    return replace(
        f,
        role_rank=role_rank,
        node=f.node or node,
        global_rank=w.global_rank,
        local_rank=w.local_rank,
        attempt=job.attempt,
        round=job.round,
        role=member.ranks.role if member is not None else (f.role or job.spec.role),
    )


MAX_TIME_RESOLUTION_S = 60.0
"""The largest resolution an agent may claim for a failure's time."""


def _on_coordinator_clock(
    f: ProcessFailure, clock: ClockOffset | None, now: float
) -> ProcessFailure:
    """A failure as its node reported it, its time put on the coordinator's clock.

    The node's time is corrected by the node clock's measured offset (kept in `clock_offset`),
    and `time_uncertainty` becomes the resolution the agent gave for its source (how precise
    each source is: `nodeagent._errorfile.build_failure`) plus the offset's uncertainty. A node
    whose clock is not measured yet (no probe answered) is taken at its word.
    """
    u = f.time_uncertainty
    resolution = min(u, MAX_TIME_RESOLUTION_S) if math.isfinite(u) and u > 0 else 0.0
    if clock is None or not clock.known:
        return replace(f, clock_offset=0.0, time_uncertainty=resolution)
    offset = clock.offset
    return replace(
        f,
        timestamp=f.precise_timestamp - offset,
        clock_offset=offset,
        time_uncertainty=resolution + clock.uncertainty_at(now),
    )


_ORDER_NOTE = "; root cause rank "
_WITH_ORDER_NOTE = re.compile(
    r"(?s)(?P<base>.*)" + re.escape(_ORDER_NOTE) + r"-?\d{1,10} on [^\n]{1,300}: order uncertain "
    r"within [^\n]{1,400}"
)


def _with_order_note(reason: str, failures: dict[int, ProcessFailure]) -> str:
    """A failed result's reason, and how uncertain the root cause's place in time was when it
    was (`client.model.order_note`); a note from before is replaced."""
    earlier = _WITH_ORDER_NOTE.fullmatch(reason)
    base = earlier.group("base") if earlier is not None else reason
    root = next((f for f in failures.values() if f.root_cause), None)
    note = order_note(failures.values(), root) if root is not None else ""
    if root is None or not note:
        return base
    return f"{base}{_ORDER_NOTE}{root.global_rank} on {root.node or '?'}: order {note}"


def _jittered(backoff: float, job_id: str, attempt: int) -> float:
    """`backoff` scaled by a factor in [0.5, 1.5) that the job and attempt fix (so a replay, a
    restored coordinator and a test see the same), and that differs between jobs: jobs that
    failed together do not all restart at once."""
    if backoff <= 0:
        return 0.0
    digest = hashlib.sha256(f"{job_id}/{attempt}".encode()).digest()
    return backoff * (0.5 + int.from_bytes(digest[:4], "big") / 2**32)


JOB_FAILURE_RANK = -1
"""The key, in a FAILED result's failures, of the job's own failure when no worker's is there
(a rendezvous that timed out, a job no node could hold): torchelastic's code reads
`result.failures` and `root_cause` of every failed run."""


def _job_failure(job: _Job, reason: str, category: FailureCategory, now: float) -> ProcessFailure:
    return ProcessFailure(
        global_rank=JOB_FAILURE_RANK,
        local_rank=JOB_FAILURE_RANK,
        pid=0,
        exitcode=1,
        message=reason,
        timestamp=now,
        attempt=job.attempt,
        round=job.round,
        root_cause=True,
        category=category,
    )


def _label_failures(failures: dict[int, ProcessFailure]) -> dict[int, ProcessFailure]:
    """Mark the root cause (first observed across all nodes); the rest are collateral."""
    root = first_failure(failures)
    return {
        rank: replace(f, root_cause=(root is not None and rank == root.global_rank))
        for rank, f in sorted(failures.items())
    }


def _exit_text(f: ProcessFailure) -> str:
    if f.signal:
        return f"signal {f.signal}"
    return f"exit {f.exitcode}"


_RAN_NOTE = re.compile(r" \(ran [^\n]{1,4200} on node [^\s()]{1,128}\)$")


_PID = re.compile(r"\b(?:pid|PID) \d{1,10}\b")


def _bare_message(message: str) -> str:
    """A failure's message without what differs from rank to rank for the same error: the
    agent's note of where it ran, and the pid."""
    return _PID.sub("pid", _RAN_NOTE.sub("", message.strip()))


def _last_line(text: str) -> str:
    """The last non-blank line, at most 300 characters: a traceback's exception line."""
    lines = [ln for ln in text.strip().splitlines() if ln.strip()]
    return lines[-1][:300] if lines else ""
