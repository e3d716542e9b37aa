"""Fault injection for tests: make the agent's supervision fail at a chosen point. Off unless asked for.

`GELASTIC_AGENT_FAULTS` names one fault:

- `monitor-raise`: the health monitor of a worker group raises on its first pass.
- `observe-fail`: the agent cannot observe a worker (waiting for its exit raises).
- `start-fail-after:N`: a group's start raises after its N-th worker was spawned (a start that
  fails half-way).

Each makes the group UNKNOWN, the way a real fault at that point would. The variable is read
once, at import; a value that does not parse is ignored with a warning, never fatal. Tests in
the agent's own process use `configure` instead.
"""

from __future__ import annotations

import logging
import os
import re

__all__ = ["ENV", "InjectedFault", "configure", "monitor", "observe", "started"]

logger = logging.getLogger(__name__)

ENV = "GELASTIC_AGENT_FAULTS"
_PATTERN = re.compile(r"(monitor-raise|observe-fail)|start-fail-after:([1-9][0-9]{0,3})")


class InjectedFault(RuntimeError):
    """Raised where a fault was asked for."""


def _parse(text: str) -> tuple[str, int] | None:
    if not text:
        return None
    m = _PATTERN.fullmatch(text.strip())
    if m is None:
        logger.warning("%s=%r is not understood; no fault is injected", ENV, text[:200])
        return None
    if m.group(1):
        return m.group(1), 0
    return "start-fail-after", int(m.group(2))


_armed = _parse(os.environ.get(ENV, ""))


def configure(text: str) -> None:
    """Arm the fault `text` names ("" = none), as the variable would at import."""
    global _armed
    _armed = _parse(text)


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
