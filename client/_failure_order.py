"""Which failure of a failed round is its root cause, when the failures' times are uncertain.

Every failure's `precise_timestamp` is on the coordinator's clock (a node's own time, corrected
by that node's measured clock offset) and `time_uncertainty` says how far off it may be: the offset's
uncertainty plus the resolution of the time's source. The root cause is the earliest failure;
but where another failure is closer to it than their two uncertainties together, which came
first is not known, and then a failure that is not a collective's communication error (a peer
hung up, a collective timed out: what the ranks of a job report when another rank died) is
preferred over one that is. `order_note` says so in the reports.

Pure; the texts classified are bounded, whatever a worker wrote.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping
from typing import Protocol, TypeVar

__all__ = [
    "MAX_CLASSIFIED_CHARS",
    "MAX_TIME_UNCERTAINTY_S",
    "Failure",
    "failure_time",
    "is_collective_error",
    "order_note",
    "root_cause",
    "time_uncertainty",
]

MAX_CLASSIFIED_CHARS = 4096
"""Characters of a failure's message that are classified (and of its stderr's tail)."""
MAX_TIME_UNCERTAINTY_S = 60.0
"""Largest uncertainty of a failure's time taken into account."""

# What torch's backends and its store say on the ranks whose peer is gone or stuck: gloo's
# "Connection reset by peer" / "Connection closed by peer", NCCL's aborted communicator and
# remote errors, the distributed exception types, the watchdog's collective timeout, the
# store's lost connections. Literal alternatives only: linear in the bounded text.
_COLLECTIVE = re.compile(
    r"connection (?:reset|closed) by peer"
    r"|broken pipe"
    r"|connection was likely closed"
    r"|nccl communicator was aborted"
    r"|\bnccl(?:remote|system|internal|unhandledcuda|invalidusage)error\b"
    r"|remote process exited or there was a network error"
    r"|\bdist(?:backend|network|store)error\b"
    r"|collective operation timeout"
    r"|\bmonitoredbarrier\b"
    r"|\bconnectfullmesh\b"
    r"|\bsocket timeout\b"
    r"|watchdog thread terminated",
    re.IGNORECASE,
)
# A timeout or a refused connection is a collective's only where the text is about one.
_TIMED_OUT = re.compile(r"\btim(?:ed|ing) ?out\b|\btimeout\b|\bconnection refused\b", re.IGNORECASE)
_DISTRIBUTED = re.compile(
    r"\b(?:gloo|nccl|c10d|tcpstore|processgroup\w{0,16}|collective|all_?reduce|all_?gather"
    r"|reduce_scatter|broadcast|barrier|rendezvous)\b",
    re.IGNORECASE,
)


class Failure(Protocol):
    """What the order needs of a failure (`client.model.ProcessFailure` has it)."""

    @property
    def global_rank(self) -> int: ...
    @property
    def message(self) -> str: ...
    @property
    def traceback(self) -> str: ...
    @property
    def stderr_tail(self) -> str: ...
    @property
    def precise_timestamp(self) -> float: ...
    @property
    def time_uncertainty(self) -> float: ...


F = TypeVar("F", bound=Failure)


def _classified_text(f: Failure) -> str:
    """What a failure says about itself, bounded: its message, its traceback's last line (the
    exception), and without a traceback the end of its stderr."""
    message = f.message[:MAX_CLASSIFIED_CHARS]
    tb = f.traceback[-MAX_CLASSIFIED_CHARS:].rstrip().rsplit("\n", 1)[-1]
    tail = "" if f.traceback else f.stderr_tail[-MAX_CLASSIFIED_CHARS:]
    return f"{message}\n{tb}\n{tail}"


def is_collective_error(f: Failure) -> bool:
    """Whether `f` is a communication error of a collective (or of torch's store): what a rank
    reports when another rank died or hung, rarely a root cause of its own."""
    text = _classified_text(f)
    if _COLLECTIVE.search(text):
        return True
    return bool(_TIMED_OUT.search(text) and _DISTRIBUTED.search(text))


def failure_time(f: Failure) -> float:
    """The failure's time for ordering (NaN, which would make every comparison false and the
    order depend on the input's, sorts last)."""
    t = f.precise_timestamp
    return t if t == t else math.inf


def time_uncertainty(f: Failure) -> float:
    """+/- seconds of the failure's time, brought into range."""
    u = f.time_uncertainty
    return min(u, MAX_TIME_UNCERTAINTY_S) if math.isfinite(u) and u > 0 else 0.0


def _key(f: Failure) -> tuple[float, int]:
    return failure_time(f), f.global_rank


def _near(a: Failure, b: Failure) -> bool:
    """Their order is not known: closer than their uncertainties together."""
    return abs(failure_time(a) - failure_time(b)) <= time_uncertainty(a) + time_uncertainty(b)


def root_cause(failures: Mapping[int, F]) -> F | None:
    """The earliest failure (ties to the smallest global rank); but when it is a collective's
    communication error, the earliest failure near enough to it that their order is unknown and
    that is not one."""
    if not failures:
        return None
    first = min(failures.values(), key=_key)
    if not is_collective_error(first):
        return first
    near = [f for f in failures.values() if f is not first and _near(f, first)]
    for f in sorted(near, key=_key):
        if not is_collective_error(f):
            return f
    return first


def order_note(failures: Iterable[Failure], root: Failure) -> str:
    """What a report says of the root cause's place in time: "" when it is clear of every other
    failure; else how uncertain the order was, and why this one was chosen."""
    rivals = [f for f in failures if f is not root and _near(f, root)]
    if not rivals:
        return ""
    within = max(time_uncertainty(root) + time_uncertainty(f) for f in rivals)
    note = f"uncertain within {within:.3f} s (clock offsets, time resolution)"
    earlier = [f for f in rivals if _key(f) < _key(root)]
    if earlier:
        return note + "; chosen because the failures before it are collective errors"
    if not is_collective_error(root) and all(is_collective_error(f) for f in rivals):
        return note + "; chosen because the others are collective errors"
    return note + "; chosen as the earliest"
