"""The nodes' sessions: one gRPC stream per node agent, and what the coordinator sends on it.

`_NodeSessionServicer.Session` takes a node's hello (`_check_hello` says what one may hold),
opens its session on the service, and then writes the session's outbox to the stream while
`_read` hands each message the node sends to the service; the session ends with either side.
`_Session` is the outbox, bounded: an agent that stops reading loses its session rather than
the coordinator its memory. `_command` is the message that carries an effect of the state
machine to its node.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import grpc

from client.assignment import RoundAssignment
from client.model import is_host, is_name
from client.node_codec import MessageError, decode_node
from client.node_protocol import (
    Assign,
    CoordinatorMsg,
    DrainAccepted,
    Heartbeat,
    Hello,
    Release,
    ReservePort,
    Stop,
)
from coordinator import _faults as faults
from coordinator._auth import RefusalLog, cert_node_name_refusal
from coordinator._cluster import (
    AssignRound,
    ClusterConfig,
    JobNotFound,
    NodeNameInUse,
    ReleaseRound,
    RequestPort,
    StopRound,
)
from coordinator._cluster import (
    DrainAccepted as DrainRecorded,
)
from coordinator._errors import RequestError
from coordinator._rpc import _abort_for
from protos.gelastic.v1 import gelastic_pb2 as pb
from protos.gelastic.v1 import gelastic_pb2_grpc as pb_grpc

logger = logging.getLogger(__name__)

MAX_SLOTS = 4096
MAX_NODE_MESSAGE_BYTES = 16 * 1024 * 1024
"""The largest message a node's stream carries: the server's send limit and the agent's receive
limit (coordinator/server.py, nodeagent/_agent_link.py). A bigger one fails the whole stream."""
OUTBOX_LIMIT = 10_000
HELLO_TIMEOUT_S = 10.0
"""How long an admitted session has to send its hello."""
OPENING_MAX = 32
"""Sessions whose hello is read and taken at once; the others wait for their turn, unread and
untimed (the admission queue: its length is bounded by the calls grpc admits, see
coordinator._connections). With 2,500 agents opening at once, every hello timed from its call's
start ran out on hundreds of agents that had sent it, while the coordinator took the others."""


@dataclass
class _Session:
    """One node's session: the messages waiting for its stream, and whether it has ended."""

    name: str
    incarnation: str
    outbox: asyncio.Queue[pb.CoordinatorMessage] = field(
        default_factory=lambda: asyncio.Queue(OUTBOX_LIMIT)
    )
    closed: bool = False
    last_beat: tuple[bytes, Heartbeat] | None = None
    """The last heartbeat taken from the session: its content (seq left out), and what it was
    decoded to (see coordinator._heartbeat_batch)."""
    ended: asyncio.Event = field(default_factory=asyncio.Event)
    """Set by close(). The stream loop waits on it beside every outbox get and every write: a
    sentinel in the outbox cannot carry the close when the outbox is full (an agent that stopped
    reading), and a write to such an agent never completes."""

    def send(self, msg: pb.CoordinatorMessage) -> None:
        if self.closed:
            return
        try:
            self.outbox.put_nowait(msg)
        except asyncio.QueueFull:
            logger.error("node %s: outbox full; dropping the session", self.name)
            self.close()

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.ended.set()


class NodeService(Protocol):
    """What a node's session asks of the coordinator's service (`CoordinatorService`)."""

    config: ClusterConfig
    refusals: RefusalLog
    require_cert_node_names: bool
    epoch: int
    may_send: Callable[[], bool]

    @property
    def reconnect_grace(self) -> float: ...

    def open_session(self, hello: Hello) -> _Session: ...

    def close_session(self, session: _Session) -> None: ...

    def on_node_message(self, session: _Session, msg: pb.NodeMessage) -> None: ...

    def on_heartbeat(self, session: _Session, msg: pb.NodeMessage) -> None: ...


class _NodeSessionServicer(pb_grpc.NodeSessionServicer):
    """The node agents' streams, each on whichever service `current` returns at its start."""

    def __init__(self, current: Callable[[], NodeService]) -> None:
        self._current = current
        self._opening = asyncio.Semaphore(OPENING_MAX)

    @property
    def _svc(self) -> NodeService:
        return self._current()

    async def Session(
        self, request_iterator: AsyncIterator[pb.NodeMessage], context: grpc.aio.ServicerContext
    ) -> None:
        svc = self._svc
        # The admission queue: sessions opening wait their turn here, their hello unread and
        # its timer not started, however long the coordinator takes to get to them.
        async with self._opening:
            session = await self._open(svc, request_iterator, context)
        if session is None:
            return
        loop = asyncio.get_running_loop()
        reader = loop.create_task(self._read(svc, session, request_iterator))
        ended = loop.create_task(session.ended.wait())
        # One writer per session, not a task and a wait per message: `ended` ends the call
        # however the writer is stuck (on an empty outbox, or a write an agent never reads).
        writer = loop.create_task(self._write(svc, session, context))
        try:
            await asyncio.wait((writer, ended), return_when=asyncio.FIRST_COMPLETED)
            if writer.done():
                writer.result()
        finally:
            if not writer.done():
                # A write may still fail once the call goes: nobody waits for its outcome.
                writer.add_done_callback(_ignore_outcome)
                writer.cancel()
            ended.cancel()
            reader.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await reader
            svc.close_session(session)
        # Returning ends the call with OK, as any close by the coordinator does. The status
        # waits behind what is already written: it reaches an agent that reads again, and the
        # call goes with the connection if it never does.

    async def _open(
        self,
        svc: NodeService,
        request_iterator: AsyncIterator[pb.NodeMessage],
        context: grpc.aio.ServicerContext,
    ) -> _Session | None:
        """Read the hello and open the session; None when it was refused (the call aborted)."""
        try:
            first = await asyncio.wait_for(anext(request_iterator), HELLO_TIMEOUT_S)
        except (StopAsyncIteration, TimeoutError):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "a session must start with hello")
            return None
        if first.WhichOneof("kind") != "hello":
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "a session must start with hello")
            return None
        if svc.require_cert_node_names:
            refusal = cert_node_name_refusal(first.hello.name, context.auth_context())
            if refusal:
                svc.refusals.refused(context.peer() or "?", "a node session", refusal)
                await context.abort(grpc.StatusCode.PERMISSION_DENIED, refusal)
                return None
        try:
            hello = decode_node(first)
            assert isinstance(hello, Hello)
            session = svc.open_session(hello)
        except MessageError as exc:
            svc.refusals.refused(context.peer() or "?", "a node session", str(exc))
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
            return None
        except NodeNameInUse as exc:
            svc.refusals.refused(context.peer() or "?", "a node session", str(exc))
            await context.abort(
                grpc.StatusCode.ALREADY_EXISTS, str(exc), trailing_metadata=_name_held(svc, exc)
            )
            return None
        except RequestError as exc:
            svc.refusals.refused(context.peer() or "?", "a node session", str(exc))
            await _abort_for(context, exc)
            return None
        except Exception as exc:
            await _abort_for(context, exc)
            return None
        return session

    async def _write(
        self, svc: NodeService, session: _Session, context: grpc.aio.ServicerContext
    ) -> None:
        """Write the session's outbox to its stream until the session closes."""
        while not session.closed:
            msg = await session.outbox.get()
            if session.closed:
                return
            if not svc.may_send():
                session.close()  # no longer the leader: nothing more goes out
                return
            msg.epoch = svc.epoch
            # Written with context.write, not yielded: a write to an agent that does not read
            # never completes, and a close must still end the call.
            await context.write(msg)
            faults.after_send(msg)

    async def _read(
        self, svc: NodeService, session: _Session, it: AsyncIterator[pb.NodeMessage]
    ) -> None:
        try:
            async for msg in it:
                if session.closed:
                    return
                try:
                    if msg.WhichOneof("kind") == "heartbeat":
                        svc.on_heartbeat(session, msg)  # taken in a batch
                    else:
                        svc.on_node_message(session, msg)
                except RequestError as exc:
                    logger.warning("node %s sent a bad message: %s", session.name, exc.message)
                except JobNotFound as exc:
                    logger.warning("node %s named an unknown job %s", session.name, exc)
        except (grpc.aio.AioRpcError, asyncio.CancelledError):
            pass
        except Exception:
            logger.exception("node %s session reader failed", session.name)
        finally:
            session.close()


NAME_HELD_HEADER = "gelastic-name-held-ms"
"""How long a gone agent can keep the name: the refused agent retries that long, no longer."""
NAME_GRACE_HEADER = "gelastic-name-grace-ms"
"""Set when the name is kept only for a reconnect grace, this long still: the refusal is
temporary, and the refused agent retries until the name is free."""


def _name_held(svc: NodeService, exc: NodeNameInUse) -> tuple[tuple[str, str], ...]:
    """The trailing metadata of a name-in-use refusal."""
    if exc.grace_left is not None:
        grace_ms = str(round(exc.grace_left * 1000))
        return ((NAME_HELD_HEADER, grace_ms), (NAME_GRACE_HEADER, grace_ms))
    # A live session under the name: a dead process's stream is gone within the lease.
    return ((NAME_HELD_HEADER, str(round(svc.config.lease * 1000))),)


def _check_hello(hello: Hello) -> None:
    """Refuse a hello whose name, slots, address or incarnation no session can take."""
    if not is_name(hello.name):
        raise RequestError(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"hello.name: must be 1-128 of [A-Za-z0-9_.-], got {hello.name!r}",
        )
    if not 1 <= hello.slots <= MAX_SLOTS:
        raise RequestError(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"hello.slots: must be 1-{MAX_SLOTS}, got {hello.slots}",
        )
    # Shown in tables and given to workers as MASTER_ADDR: a host name or an IP, nothing else.
    if not is_host(hello.addr):
        raise RequestError(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"hello.addr: must be a host name or an IP address, got {hello.addr[:256]!r}",
        )
    if not hello.incarnation or len(hello.incarnation) > 128:
        raise RequestError(grpc.StatusCode.INVALID_ARGUMENT, "hello.incarnation: must be set")


def _command(
    eff: RequestPort | AssignRound | StopRound | ReleaseRound | DrainRecorded,
) -> CoordinatorMsg:
    """The message that carries an effect to its node."""
    if isinstance(eff, RequestPort):
        return ReservePort(eff.job_id, eff.round)
    if isinstance(eff, AssignRound):
        return Assign(eff.assignment)
    if isinstance(eff, StopRound):
        return Stop(
            eff.job_id,
            eff.round,
            eff.grace,
            eff.reason,
            eff.replaced,
            notice=eff.notice,
            term_after=eff.term_after,
            drain_node=eff.drain_node,
        )
    if isinstance(eff, DrainRecorded):
        return DrainAccepted(eff.deadline)
    return Release(eff.job_id, eff.round)


def _undeliverable(eff: AssignRound, msg: pb.CoordinatorMessage) -> str:
    """Why the assignment `msg` (encoded `eff`) cannot go to its node, logged; "" if it can."""
    if (
        _assign_size_bound(eff.assignment) <= MAX_NODE_MESSAGE_BYTES
        or msg.ByteSize() <= MAX_NODE_MESSAGE_BYTES
    ):
        return ""
    # Writing it would end the node's stream and lose the node, and the job would then re-form
    # on the next one: the job fails instead, and the node stays.
    why = (
        f"the assignment is {msg.ByteSize():,} bytes, over the node message limit of "
        f"{MAX_NODE_MESSAGE_BYTES:,}"
    )
    logger.error(
        "job %s round %d: not sending the assignment to node %s: %s",
        eff.assignment.job_id,
        eff.assignment.round,
        eff.node,
        why,
    )
    return why


def _assign_size_bound(a: RoundAssignment) -> int:
    """More than the encoded Assign can be, from lengths alone: measuring the message itself
    costs as much as encoding it, once per node of a round.

    A character is at most 4 bytes, an item's tags and lengths at most 16, a worker's ranks 64.
    """
    spec = a.spec
    items = [*spec.command, *([] if spec.function else [str(x) for x in spec.args])]
    items += [spec.function, spec.name, spec.role, spec.cwd, spec.redirects, spec.tee]
    items += [spec.scale_up, a.job_id, a.master_addr, a.run_id]
    chars = sum(map(len, items)) + sum(len(k) + len(v) for k, v in spec.env.items())
    count = len(items) + 2 * len(spec.env)
    for r in spec.roles:
        role_items = [r.name, *r.entrypoint, *r.args]
        chars += sum(map(len, role_items)) + sum(len(k) + len(v) for k, v in r.env.items())
        count += len(role_items) + 2 * len(r.env) + 8
    return 4 * chars + 16 * count + len(spec.function_args) + 64 * len(a.workers) + 1024


def _ignore_outcome(task: asyncio.Task[Any]) -> None:
    if not task.cancelled():
        task.exception()
