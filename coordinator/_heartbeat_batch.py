"""The heartbeats read from the nodes' streams and not taken yet: one batch, taken as one input.

A heartbeat waits at most `HEARTBEAT_BATCH_S` for the others read meanwhile; the batch keeps the
latest beat of each node (bounded by the nodes), which says all an earlier one did. The service
takes the batch early before any other message of a node it holds, and before each tick. A beat
that repeats its session's last one is not decoded again (`_decoded`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from client.node_codec import MessageError, decode_node
from client.node_protocol import Heartbeat
from coordinator._node_sessions import _Session
from protos.gelastic.v1 import gelastic_pb2 as pb

logger = logging.getLogger("coordinator._service")

HEARTBEAT_BATCH_S = 0.05
"""A heartbeat waits at most this long to be taken with the others: far below any lease, and
one state-machine input instead of thousands a second."""

Beats = list[tuple[_Session, pb.NodeMessage]]


class HeartbeatBatch:
    """Heartbeats waiting to be taken; `take` decodes them and hands the good ones over, in one
    call, to `taker` (node, incarnation, heartbeat each), then each to `after` (its clock probe,
    the observers), in the order they were read."""

    def __init__(
        self,
        taker: Callable[[list[tuple[str, str, Heartbeat]]], None],
        after: Callable[[_Session, Heartbeat], None],
    ) -> None:
        self._taker = taker
        self._after = after
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
        if not self._beats:
            return
        beats, self._beats = list(self._beats.values()), {}
        good: list[tuple[_Session, Heartbeat]] = []
        for session, msg in beats:
            if session.closed:
                continue
            try:
                beat = _decoded(session, msg)
            except MessageError as exc:
                logger.warning("node %s sent a bad message: %s", session.name, exc)
                continue
            good.append((session, beat))
        try:
            self._taker([(s.name, s.incarnation, b) for s, b in good])
        except Exception:
            logger.exception("taking %d heartbeats failed", len(good))
        for session, beat in good:
            if not session.closed:
                self._after(session, beat)

    def clear(self) -> None:
        self._cancel_timer()
        self._beats.clear()

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None


def _decoded(session: _Session, msg: pb.NodeMessage) -> Heartbeat:
    """The heartbeat `msg` holds. A beat that says what the session's last one said (only its
    seq differs: a node at rest) is that one's decoded form again, not new objects: comparing
    the bytes costs a twentieth of decoding them, and at rest every beat repeats the last."""
    h = msg.heartbeat
    seq, h.seq = h.seq, 0
    content = h.SerializeToString()
    h.seq = seq
    last = session.last_beat
    if last is not None and last[0] == content:
        return last[1]
    beat = decode_node(msg)
    if not isinstance(beat, Heartbeat):
        raise MessageError("expected a heartbeat")
    session.last_beat = (content, beat)
    return beat
