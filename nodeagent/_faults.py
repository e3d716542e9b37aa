"""Fault injection for tests: make the agent's supervision fail at a chosen point, or its host's
clock read wrong. Off unless asked for.

`GELASTIC_AGENT_FAULTS` names one fault:

- `monitor-raise`: the health monitor of a worker group raises on its first pass.
- `observe-fail`: the agent cannot observe a worker (waiting for its exit raises).
- `start-fail-after:N`: a group's start raises after its N-th worker was spawned (a start that
  fails half-way).
- `clock-skew:S`: the host's wall clock reads S seconds ahead (negative: behind), S a decimal
  of at most 3600 (`clock-skew:+0.5`, `clock-skew:-0.25`).

The first three make the group UNKNOWN, the way a real fault at that point would.

The clock skew models a host whose clock is off, as every process on it sees it: each wall time
the agent reports is shifted by S (`skewed`), whoever took it: the exits and failures the agent
stamps itself, the failure times it read from its workers' error files (which the workers wrote
with their own `time.time()`, and the kernel stamped with the file's modification time), and its
answers to the coordinator's clock probes. What the agent compares within the host stays
consistent, as on a real skewed host: its timers run on the monotonic clock, a worker's
watchdog expiry is on the worker's clock and the agent's alike. (Times are shifted on the way
out, so a whole-second time of torch's error file is the unskewed second plus S, where a real
skewed host would write the skewed second.)

The variable is read once, at import; a value that does not parse is ignored with a warning,
never fatal. Tests in the agent's own process use `configure` instead (it is process-wide).
"""

from __future__ import annotations

import logging
import os
import re
from dataclasses import replace

from client.node_protocol import ClockReply, Hello, NodeMsg, WorkerExit, WorkerExited, WorkerFailing

__all__ = [
    "ENV",
    "InjectedFault",
    "clock_skew",
    "configure",
    "monitor",
    "observe",
    "skewed",
    "started",
]

logger = logging.getLogger(__name__)

ENV = "GELASTIC_AGENT_FAULTS"
_PATTERN = re.compile(r"(monitor-raise|observe-fail)|start-fail-after:([1-9][0-9]{0,3})")
_SKEW = re.compile(r"clock-skew:([+-]?[0-9]{1,4}(?:\.[0-9]{1,6})?)")
MAX_SKEW_S = 3600.0


class InjectedFault(RuntimeError):
    """Raised where a fault was asked for."""


def _parse(text: str) -> tuple[str, int] | None:
    if not text:
        return None
    m = _PATTERN.fullmatch(text.strip())
    if m is None:
        if _parse_skew(text) is None:
            logger.warning("%s=%r is not understood; no fault is injected", ENV, text[:200])
        return None
    if m.group(1):
        return m.group(1), 0
    return "start-fail-after", int(m.group(2))


def _parse_skew(text: str) -> float | None:
    m = _SKEW.fullmatch(text.strip())
    if m is None:
        return None
    skew = float(m.group(1))
    return skew if abs(skew) <= MAX_SKEW_S else None


_armed = _parse(os.environ.get(ENV, ""))
_skew = _parse_skew(os.environ.get(ENV, "")) or 0.0


def configure(text: str) -> None:
    """Arm the fault `text` names ("" = none), as the variable would at import."""
    global _armed, _skew
    _armed = _parse(text)
    _skew = _parse_skew(text) or 0.0


def clock_skew() -> float:
    """Seconds this host's clock is made to read ahead (0.0 unless `clock-skew` is armed)."""
    return _skew


def skewed(msg: NodeMsg) -> NodeMsg:
    """`msg` with every wall time in it read on the skewed clock (itself when none is armed)."""
    s = _skew
    if not s:
        return msg
    if isinstance(msg, WorkerExited):
        return replace(msg, exit=_skewed_exit(msg.exit, s))
    if isinstance(msg, WorkerFailing):
        return replace(
            msg, failure=replace(msg.failure, timestamp=msg.failure.precise_timestamp + s)
        )
    if isinstance(msg, ClockReply):
        return replace(msg, received_at=msg.received_at + s, sent_at=msg.sent_at + s)
    if isinstance(msg, Hello):
        running = tuple(
            replace(g, exits=tuple(_skewed_exit(e, s) for e in g.exits)) for g in msg.running
        )
        return replace(msg, running=running)
    return msg


def _skewed_exit(e: WorkerExit, s: float) -> WorkerExit:
    failure = e.failure
    if failure is not None:
        failure = replace(failure, timestamp=failure.precise_timestamp + s)
    return replace(e, timestamp=e.timestamp + s, failure=failure)


def monitor() -> None:
    """Called on every pass of a group's health monitor."""
    if _armed is not None and _armed[0] == "monitor-raise":
        raise InjectedFault("fault injection: the health monitor raised")


def observe() -> None:
    """Called before the agent waits for a worker's exit."""
    if _armed is not None and _armed[0] == "observe-fail":
        raise InjectedFault("fault injection: the worker cannot be observed")


def started(count: int) -> None:
    """Called after a group's start spawned its `count`-th worker."""
    if _armed is not None and _armed[0] == "start-fail-after" and count >= _armed[1]:
        raise InjectedFault(f"fault injection: the start failed after {count} worker(s)")
