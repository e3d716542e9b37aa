"""ListJobs, a page at a time: a job's list entry, the page token, and one page.

A list entry is a job's summary, the same size whatever the job's width: no workers, no
members, no spec, its result reduced to state, reason and root cause (who and what, no
traceback), its texts cut.
`gelastic jobs` and `Client.list_jobs` show no more; GetJob has the rest.

Pages go in submit order (submit time, then job id). The token names the last job a page held,
not an offset: jobs submitted, finished or deleted between two pages make no job that was there
all along come twice or not at all. A page holds at most the page size asked for (a default,
and a cap) and stops early at `LIST_PAGE_BYTES`, so no page nears a message limit whatever the
jobs.
"""

from __future__ import annotations

import base64
import binascii
import bisect
import dataclasses
import math
import re
from collections.abc import Sequence

import grpc

from client.model import ProcessFailure, RunResult
from client.wire import job_to_pb, result_to_pb
from coordinator._cluster import Cluster
from coordinator._errors import RequestError
from protos.gelastic.v1 import gelastic_pb2 as pb

__all__ = [
    "LIST_PAGE_BYTES",
    "LIST_PAGE_DEFAULT",
    "LIST_PAGE_MAX",
    "LIST_TEXT_MAX",
    "PAGE_TOKEN_MAX",
    "decode_page_token",
    "encode_page_token",
    "list_entry",
    "list_page",
]

LIST_PAGE_DEFAULT = 100
"""Entries in a page when the request names no page size."""
LIST_PAGE_MAX = 1000
"""Most entries in a page, whatever the request asks."""
LIST_PAGE_BYTES = 1024 * 1024
"""About the most bytes of entries in one page (one entry always goes)."""
LIST_TEXT_MAX = 1024
"""A list entry's reasons are cut to this many characters (GetJob has them whole)."""
PAGE_TOKEN_MAX = 400
"""The longest page token this coordinator makes or reads."""

_TOKEN = re.compile(r"[A-Za-z0-9_-]{4,400}")
_TOKEN_VERSION = "j1"
_JOB_KEY_MAX = 256
"""Longest job id a token names (ids of today are 160 at most; older ones were names too)."""


def _cut(text: str) -> str:
    return text if len(text) <= LIST_TEXT_MAX else text[:LIST_TEXT_MAX] + " [...]"


def list_entry(cluster: Cluster, job_id: str) -> pb.Job:
    """The job as a list shows it, in time and size independent of its width."""
    summary = cluster.job_summary(job_id)
    msg = job_to_pb(summary, None)
    msg.reason = _cut(summary.reason)
    result = cluster.job_result(job_id)
    if result is not None:
        root = result.root_cause
        # A failed job's entry keeps its root cause, so that a result read from a list names one
        # as every FAILED result does; its report is cut to who and what (GetJob has it whole).
        failures = {} if root is None else {root.global_rank: _short_failure(root)}
        shown = RunResult(state=result.state, failures=failures, reason=_cut(result.reason))
        msg.result.CopyFrom(result_to_pb(shown))
        msg.result.root_cause_rank = root.global_rank if root is not None else -1
        msg.has_result = True
    return msg


def _short_failure(f: ProcessFailure) -> ProcessFailure:
    return dataclasses.replace(
        f,
        message=_cut(f.message),
        detail=_cut(f.detail),
        traceback="",
        stderr_tail="",
        error_file=_cut(f.error_file),
    )


def encode_page_token(submitted_at: float, job_id: str) -> str:
    """The token of a page that ended with this job."""
    raw = f"{_TOKEN_VERSION}|{submitted_at.hex()}|{job_id}".encode()
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def decode_page_token(token: str) -> tuple[float, str]:
    """(submitted_at, job_id) of the last job the page before held; RequestError
    (INVALID_ARGUMENT) for anything this coordinator did not make."""
    if not _TOKEN.fullmatch(token):
        raise _bad_token(token)
    try:
        raw = base64.urlsafe_b64decode(token + "=" * (-len(token) % 4)).decode()
        version, at, job_id = raw.split("|", 2)
        submitted_at = float.fromhex(at)
    except (binascii.Error, UnicodeDecodeError, ValueError):
        raise _bad_token(token) from None
    if (
        version != _TOKEN_VERSION
        or not math.isfinite(submitted_at)
        or not 0 < len(job_id) <= _JOB_KEY_MAX
    ):
        raise _bad_token(token)
    return submitted_at, job_id


def _bad_token(token: str) -> RequestError:
    return RequestError(
        grpc.StatusCode.INVALID_ARGUMENT,
        f"page_token: not a token this coordinator gave: {token[:60]!r}",
    )


def list_page(
    cluster: Cluster, job_ids: Sequence[str], page_size: int, page_token: str
) -> tuple[list[pb.Job], str]:
    """The page of `job_ids` (those still held) after `page_token`, and the next page's
    token ("" when this page is the last)."""
    if page_size < 0:
        raise RequestError(
            grpc.StatusCode.INVALID_ARGUMENT, f"page_size: must be >= 0, got {page_size}"
        )
    most = min(page_size or LIST_PAGE_DEFAULT, LIST_PAGE_MAX)
    order = sorted((cluster.job_submitted_at(j), j) for j in job_ids if cluster.has_job(j))
    start = bisect.bisect_right(order, decode_page_token(page_token)) if page_token else 0
    page: list[pb.Job] = []
    size = 0
    for key in order[start:]:
        if len(page) >= most:
            break
        entry = list_entry(cluster, key[1])
        size += entry.ByteSize()
        if page and size > LIST_PAGE_BYTES:
            break
        page.append(entry)
    else:
        return page, ""
    last = order[start + len(page) - 1]
    return page, encode_page_token(*last)
