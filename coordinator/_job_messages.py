"""How big one job's message may grow: `_bounded_job` cuts a job whose failures make it too big
for one GetJob, WatchJob or CancelJob answer, keeping its most useful part.

The service shapes every job message with it; the client RPCs send what it leaves.
"""

from __future__ import annotations

from typing import TypeVar

from protos.gelastic.v1 import gelastic_pb2 as pb

JOB_MESSAGE_BYTES = 4 * 1024 * 1024
"""About the most one job's GetJob/WatchJob/CancelJob message holds; see `_bounded_job`."""
FAILURES_KEPT_IN_JOB = 1000
"""Failures a job message lists when it must be shortened (root cause first, then earliest)."""
SHORT_TEXT = 1024


def _shorten(f: pb.ProcessFailure) -> None:
    f.traceback = ""
    f.stderr_tail = ""
    if len(f.message) > SHORT_TEXT:
        f.message = f.message[:SHORT_TEXT] + " [...]"
    if len(f.detail) > SHORT_TEXT:
        f.detail = f.detail[:SHORT_TEXT] + " [...]"


def _bounded_job(msg: pb.Job) -> pb.Job:
    """`msg` cut down to about JOB_MESSAGE_BYTES when its failures make it bigger.

    Each step keeps the most useful part: first the attempts' failures lose their tracebacks
    and stderr tails, then the result's failures other than the root cause, then only the
    first and the latest attempts stay, then only the root cause and the earliest failures.
    """
    if msg.ByteSize() <= JOB_MESSAGE_BYTES:
        return msg
    r = msg.result
    for a in r.attempts:
        for f in a.failures:
            _shorten(f)
    if msg.ByteSize() <= JOB_MESSAGE_BYTES:
        return msg
    for f in r.failures.values():
        if not f.root_cause:
            _shorten(f)
    if msg.ByteSize() <= JOB_MESSAGE_BYTES:
        return msg
    if len(r.attempts) > 2:
        kept = [
            _copy(pb.AttemptSummary(), r.attempts[0]),
            _copy(pb.AttemptSummary(), r.attempts[-1]),
        ]
        del r.attempts[:]
        r.attempts.extend(kept)
    if msg.ByteSize() <= JOB_MESSAGE_BYTES or len(r.failures) <= FAILURES_KEPT_IN_JOB:
        return msg
    order = sorted(r.failures.items(), key=lambda kv: (not kv[1].root_cause, kv[1].timestamp))
    keep = {rank: _copy(pb.ProcessFailure(), f) for rank, f in order[:FAILURES_KEPT_IN_JOB]}
    r.ClearField("failures")
    for rank, f in keep.items():
        r.failures[rank].CopyFrom(f)
    return msg


M = TypeVar("M", pb.AttemptSummary, pb.ProcessFailure)


def _copy(into: M, source: M) -> M:
    into.CopyFrom(source)
    return into
