"""Fault injection for tests: kill the coordinator at the worst moment. Off unless asked for.

`GELASTIC_FAULTS=kill-after-send:release` makes the coordinator SIGKILL itself right after it hands
the first Release message to a node's stream (also `assign`, `stop`, `reserve_port`); `:N`
after the kind waits for the N-th such message (`kill-after-send:assign:2`). The variable is
read once, at import; a value that does not parse is ignored with a warning, never fatal.
"""

from __future__ import annotations

import logging
import os
import re
import signal

from protos.gelastic.v1 import gelastic_pb2 as pb

__all__ = ["after_send"]

logger = logging.getLogger(__name__)

ENV = "GELASTIC_FAULTS"
_KINDS = ("assign", "release", "stop", "reserve_port")
_PATTERN = re.compile(r"kill-after-send:(" + "|".join(_KINDS) + r")(?::([1-9][0-9]{0,5}))?")


def _parse(text: str) -> tuple[str, int] | None:
    if not text:
        return None
    m = _PATTERN.fullmatch(text.strip())
    if m is None:
        logger.warning("%s=%r is not understood; no fault is injected", ENV, text[:200])
        return None
    return m.group(1), int(m.group(2) or 1)


_armed = _parse(os.environ.get(ENV, ""))
_seen = 0


def after_send(msg: pb.CoordinatorMessage) -> None:
    """Called right after a message is handed to a node's stream."""
    global _seen
    if _armed is None or msg.WhichOneof("kind") != _armed[0]:
        return
    _seen += 1
    if _seen >= _armed[1]:
        logger.error("fault injection: killing the coordinator after sending %s", _armed[0])
        logging.shutdown()
        os.kill(os.getpid(), signal.SIGKILL)
