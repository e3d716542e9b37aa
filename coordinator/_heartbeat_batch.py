"""The heartbeats read from the nodes' streams and not taken yet: one batch, taken as one input.

A heartbeat waits at most `HEARTBEAT_BATCH_S` for the others read meanwhile; the batch keeps the
latest beat of each node (bounded by the nodes), which says all an earlier one did. The service
takes the batch early before any other message of a node it holds, and before each tick.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from coordinator._node_sessions import _Session
from protos.gelastic.v1 import gelastic_pb2 as pb

HEARTBEAT_BATCH_S = 0.05
"""A heartbeat waits at most this long to be taken with the others: far below any lease, and
one state-machine input instead of thousands a second."""

Beats = list[tuple[_Session, pb.NodeMessage]]


class HeartbeatBatch:
    """Heartbeats waiting to be taken; `take` hands them over, in one call, to `taker`."""

    def __init__(self, taker: Callable[[Beats], None]) -> None:
        self._taker = taker
        self._beats: dict[str, tuple[_Session, pb.NodeMessage]] = {}
        self._timer: asyncio.TimerHandle | None = None

    def add(self, session: _Session, msg: pb.NodeMessage) -> None:
        self._beats[session.name] = (session, msg)
        if self._timer is None:
            self._timer = asyncio.get_running_loop().call_later(HEARTBEAT_BATCH_S, self.take)

    def holds(self, name: str) -> bool:
        """Whether a beat of node `name` waits in the batch."""
        return name in self._beats

    def take(self) -> None:
        self._cancel_timer()
        if self._beats:
            beats, self._beats = list(self._beats.values()), {}
            self._taker(beats)

    def clear(self) -> None:
        self._cancel_timer()
        self._beats.clear()

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
