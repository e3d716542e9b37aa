"""The logs the coordinator relays: each ReadLogs call is one stream, from the node that holds the
log to one reader, paced by credit.

`LogRelay` keeps the open streams, caps them (per client and in all), and takes the chunks the
nodes send for them. A node gets LOG_WINDOW_CHUNKS chunks of credit per stream and more as the
reader takes them, so what one stream holds in the coordinator's memory stays bounded.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field

import grpc

from client.node_codec import encode_coordinator
from client.node_protocol import CancelLogs, LogChunk, LogCredit, StartLogs
from coordinator._cluster import Cluster
from coordinator._errors import RequestError
from coordinator._node_sessions import _Session
from protos.gelastic.v1 import gelastic_pb2 as pb

logger = logging.getLogger(__name__)

LOG_WINDOW_CHUNKS = 16
"""Log chunks an agent may send for one request before the coordinator grants more (each chunk
at most LOG_CHUNK_MAX_BYTES): what one log stream can hold in the coordinator's memory."""
LOG_CHUNK_MAX_BYTES = 64 * 1024
LOG_STREAMS_PER_CLIENT = 8
"""Log streams one client (one peer address) may have open at once."""
LOG_STREAMS_MAX = 64
"""Log streams the coordinator relays at once, all clients together."""
LOG_FIRST_WAIT_S = 30.0
"""How long a read of a whole log waits for the next chunk from the node."""


@dataclass
class _LogStream:
    """One ReadLogs call: the chunks the node sent for it and the room it still has."""

    node: str
    session: _Session
    client: str
    queue: asyncio.Queue[LogChunk] = field(
        default_factory=lambda: asyncio.Queue(LOG_WINDOW_CHUNKS + 1)
    )
    window: int = LOG_WINDOW_CHUNKS
    """Data chunks the node may still send before it is granted more."""
    lost: str = ""
    """Why data of this stream was dropped; the call then ends with DATA_LOSS."""
    wake: asyncio.Event = field(default_factory=asyncio.Event)


class LogRelay:
    """The log streams open now, each from a node's session to one reader."""

    def __init__(self, cluster: Cluster, sessions: Mapping[str, _Session]) -> None:
        self._cluster = cluster
        self._sessions = sessions
        """The service's node sessions, by node name (the service's own dict)."""
        self.streams: dict[int, _LogStream] = {}
        """The open streams, by the request id the node was given."""
        self.stray_chunks = 0
        """Log chunks dropped because their node was not asked for that request."""

    def on_chunk(self, session: _Session, chunk: LogChunk) -> None:
        """Take a log chunk a node sent for one of the streams."""
        ls = self.streams.get(chunk.request_id)
        if ls is None or ls.session is not session:
            # Not a request this node was asked (another node's, or one that ended): dropped.
            self.stray_chunks += 1
            n = self.stray_chunks
            if n <= 10 or n % 1000 == 0:
                logger.warning(
                    "node %s sent a log chunk for a request it was not asked; dropped (%d so far)",
                    session.name,
                    n,
                )
            return
        if ls.lost:
            return
        size = len(chunk.data)
        if size > LOG_CHUNK_MAX_BYTES:
            ls.lost = (
                f"node {ls.node} sent a log chunk of {size} bytes (at most {LOG_CHUNK_MAX_BYTES})"
            )
        elif (size and ls.window <= 0) or ls.queue.full():
            ls.lost = f"node {ls.node} sent more log data than it was granted room for"
        else:
            if size:
                ls.window -= 1
            ls.queue.put_nowait(chunk)
        if ls.lost:
            logger.warning("log stream dropped data: %s", ls.lost)
        ls.wake.set()

    async def read_logs(self, req: pb.ReadLogsRequest, client: str = "") -> AsyncIterator[bytes]:
        """Relay one rank's log from the node that holds it, paced by what the client takes.

        The node gets LOG_WINDOW_CHUNKS chunks of credit and more as the client consumes, so a
        slow reader slows the node's reading of the file instead of losing data. Data that is
        lost anyway ends the call with DATA_LOSS; a node that goes away ends it with UNAVAILABLE.
        """
        if req.stream not in ("stdout", "stderr"):
            raise RequestError(
                grpc.StatusCode.INVALID_ARGUMENT, "stream: must be 'stdout' or 'stderr'"
            )
        attempt = None if req.attempt < 0 else req.attempt
        where = self._cluster.log_location(req.job_id, req.rank, attempt)
        if where is None:
            raise RequestError(
                grpc.StatusCode.NOT_FOUND,
                f"no logs for rank {req.rank} of job {req.job_id}"
                + (f" in attempt {attempt}" if attempt is not None else ""),
            )
        node, found_attempt = where
        session = self._sessions.get(node)
        if session is None or session.closed:
            raise RequestError(
                grpc.StatusCode.UNAVAILABLE,
                f"node {node}, which holds these logs, is not connected",
            )
        if len(self.streams) >= LOG_STREAMS_MAX:
            raise RequestError(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"the coordinator already relays {LOG_STREAMS_MAX} log streams; try again later",
            )
        mine = sum(1 for ls in self.streams.values() if ls.client == client)
        if mine >= LOG_STREAMS_PER_CLIENT:
            raise RequestError(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"at most {LOG_STREAMS_PER_CLIENT} log streams per client at once; "
                "end one before starting another",
            )
        # Random, not sequential: a request id names nothing another node could guess.
        request_id = secrets.randbits(63)
        while request_id == 0 or request_id in self.streams:
            request_id = secrets.randbits(63)
        ls = _LogStream(node, session, client)
        self.streams[request_id] = ls
        gone = asyncio.get_running_loop().create_task(session.ended.wait())
        gone.add_done_callback(lambda _t: ls.wake.set())
        session.send(
            encode_coordinator(
                StartLogs(
                    request_id,
                    req.job_id,
                    found_attempt,
                    req.rank,
                    req.stream,
                    req.follow,
                    credit_chunks=LOG_WINDOW_CHUNKS,
                )
            )
        )
        consumed = 0
        try:
            while True:
                while ls.queue.empty():
                    if ls.lost:
                        raise RequestError(
                            grpc.StatusCode.DATA_LOSS, f"{ls.lost}; the log is incomplete"
                        )
                    if session.closed:
                        raise RequestError(
                            grpc.StatusCode.UNAVAILABLE
                            if req.follow
                            else grpc.StatusCode.DATA_LOSS,
                            f"node {node} disconnected before the end of the log"
                            + ("" if req.follow else "; the log is incomplete"),
                        )
                    ls.wake.clear()
                    try:
                        async with asyncio.timeout(None if req.follow else LOG_FIRST_WAIT_S):
                            await ls.wake.wait()
                    except TimeoutError:
                        raise RequestError(
                            grpc.StatusCode.DEADLINE_EXCEEDED,
                            f"node {node} did not send the logs",
                        ) from None
                chunk = ls.queue.get_nowait()
                if chunk.error:
                    raise RequestError(grpc.StatusCode.NOT_FOUND, chunk.error)
                if chunk.data:
                    yield chunk.data
                    # The client took it: room for one more chunk, granted a few at a time.
                    consumed += 1
                    if consumed >= LOG_WINDOW_CHUNKS // 4 and not session.closed:
                        ls.window += consumed
                        session.send(encode_coordinator(LogCredit(request_id, consumed)))
                        consumed = 0
                if chunk.eof:
                    return
        finally:
            gone.cancel()
            del self.streams[request_id]
            if not session.closed:
                session.send(encode_coordinator(CancelLogs(request_id)))
