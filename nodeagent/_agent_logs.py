"""The node agent serves its workers' log files over its session with the coordinator.

A `StartLogs` starts one task that reads the file a chunk at a time and queues each chunk for
the session's writer (`LogService.start`); it sends a chunk only against the credit the
coordinator granted (`LogCredit`), so a slow reader never grows the agent's memory. A followed
log goes on while its rank runs. A `CancelLogs`, or the end of the session the request came on,
ends the task.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from client.model import is_job_id
from client.node_codec import encode_node
from client.node_protocol import LogChunk, LogCredit, StartLogs
from nodeagent._launch import attempt_dirs
from protos.gelastic.v1 import gelastic_pb2 as pb

__all__ = [
    "LOG_CHUNK_BYTES",
    "LOG_CREDIT_MAX",
    "LOG_OUTBOX_CHUNKS",
    "LOG_REQUESTS_MAX",
    "LogRequest",
    "LogService",
    "log_task_failure",
]

logger = logging.getLogger(__name__)

LOG_CHUNK_BYTES = 64 * 1024
LOG_OUTBOX_CHUNKS = 8
"""Log chunks queued for the stream at once, all log requests together: a reader of a log file
waits for room here (and for the coordinator's credit), so logs never grow the outbox."""
LOG_REQUESTS_MAX = 64
"""Log requests served at once; more are answered with an error."""
LOG_CREDIT_MAX = 1024
"""Most chunks of credit one log request holds."""

Outbox = asyncio.Queue[pb.NodeMessage]


@dataclass
class LogRequest:
    """One log request being served: the session it belongs to and the credit it holds."""

    credit: int
    """Data chunks the coordinator will still take; -1 = no limit (a coordinator without
    credits)."""
    logs: Outbox
    outbox: Outbox
    more: asyncio.Event = field(default_factory=asyncio.Event)


class LogService:
    """The log requests of the current session, each served by a task of its own."""

    def __init__(
        self,
        node: str,
        log_root: Callable[[], Path],
        rank_running: Callable[[str, int], bool],
        put: Callable[[Outbox, pb.NodeMessage], None],
        wake: Callable[[Outbox], None],
        *,
        chunk_bytes: int = LOG_CHUNK_BYTES,
    ) -> None:
        self.node = node
        self._log_root = log_root
        self._rank_running = rank_running
        self._put = put
        """Queue a control message (the session's outbox, dropped when it is full)."""
        self._wake = wake
        """Tell the session's writer that a log chunk waits."""
        self.chunk_bytes = chunk_bytes
        self.requests: dict[int, LogRequest] = {}
        self.tasks: dict[int, asyncio.Task[None]] = {}

    def start(self, m: StartLogs, outbox: Outbox | None, logs: Outbox | None) -> None:
        if outbox is None or logs is None or m.request_id in self.tasks:
            return
        if len(self.tasks) >= LOG_REQUESTS_MAX:
            error = f"node {self.node} already serves {LOG_REQUESTS_MAX} logs"
            self._put(outbox, encode_node(LogChunk(m.request_id, eof=True, error=error)))
            return
        req = LogRequest(m.credit_chunks if m.credit_chunks > 0 else -1, logs, outbox)
        self.requests[m.request_id] = req
        task = asyncio.get_running_loop().create_task(
            self._serve(m, req), name=f"logs-{m.request_id}"
        )
        task.add_done_callback(log_task_failure)
        self.tasks[m.request_id] = task

        def done(t: asyncio.Task[None]) -> None:
            if self.tasks.get(m.request_id) is t:
                del self.tasks[m.request_id]
            if self.requests.get(m.request_id) is req:
                del self.requests[m.request_id]

        task.add_done_callback(done)

    def cancel(self, request_id: int) -> None:
        self.requests.pop(request_id, None)
        task = self.tasks.pop(request_id, None)
        if task is not None:
            task.cancel()

    def credit(self, m: LogCredit) -> None:
        req = self.requests.get(m.request_id)
        if req is not None and req.credit >= 0:
            req.credit = min(LOG_CREDIT_MAX, req.credit + max(0, m.chunks))
            req.more.set()

    def end_session(self) -> None:
        """Their request ids belong to the session that ended: every request goes."""
        for task in list(self.tasks.values()):
            task.cancel()
        self.requests.clear()

    async def _serve(self, m: StartLogs, req: LogRequest) -> None:
        """Send one log file, a chunk per credit the coordinator granted.

        The waits end with the request: a CancelLogs or the end of its session cancels it.
        """
        path = self._path(m.job_id, m.attempt, m.rank, m.stream)
        if path is None:
            error = (
                f"node {self.node} has no {m.stream} log for rank {m.rank} "
                f"of job {m.job_id} attempt {m.attempt}"
            )
            await self._emit(req, LogChunk(m.request_id, eof=True, error=error))
            return
        with open(path, "rb") as f:
            while True:
                while req.credit == 0:
                    req.more.clear()
                    await req.more.wait()
                data = f.read(self.chunk_bytes)
                if data:
                    await self._emit(req, LogChunk(m.request_id, data=data))
                    continue
                if not m.follow or not self._rank_running(m.job_id, m.rank):
                    break
                await asyncio.sleep(0.2)
        await self._emit(req, LogChunk(m.request_id, eof=True))

    async def _emit(self, req: LogRequest, chunk: LogChunk) -> None:
        if chunk.data and req.credit > 0:
            req.credit -= 1
        await req.logs.put(encode_node(chunk))
        self._wake(req.outbox)

    def _path(self, job_id: str, attempt: int, rank: int, stream: str) -> Path | None:
        if not is_job_id(job_id) or stream not in ("stdout", "stderr") or rank < 0 or attempt < 0:
            return None
        root = self._log_root()
        for d in attempt_dirs(root, job_id, attempt):
            p = (d / str(rank) / f"{stream}.log").resolve()
            if p.is_relative_to(root) and p.is_file():
                return p
        return None


def log_task_failure(task: asyncio.Task[Any]) -> None:
    """Done callback of every agent task: an exception is logged, never lost."""
    if not task.cancelled() and task.exception() is not None:
        logger.error("agent task %s failed", task.get_name(), exc_info=task.exception())
