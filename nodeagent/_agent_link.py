"""A node agent's session with its coordinator, kept up: dial, register, heartbeat, read.

`SessionLink` runs one bidirectional gRPC stream at a time (`run`). A session opens with the
agent's hello; once welcomed it replays what the hello left out, heartbeats, and hands every
message it reads to the agent, decoded (`client.node_codec`) and checked against the newest
leader epoch (`nodeagent._agent_core.EpochGuard`); the coordinator's clock probes it answers
itself, at once. What the agent says goes through two outboxes that one writer task drains,
control messages first: a log chunk never holds up a heartbeat or an exit, and a control
outbox that stops draining drops the session.

When the stream breaks it reconnects with backoff and jitter, rotating through the listed
replicas and going straight to the leader a standby names; the agent's workers keep running
meanwhile. A refusal no retry can fix (a wrong token, a name another live agent holds, a TLS
setting the coordinator does not accept) ends `run` instead, with the reason in `refusal`. A
name the coordinator keeps for this node's previous agent during its reconnect grace is no such
refusal: it is retried until the name is free.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections.abc import Callable
from typing import Any

import grpc

from client.coordinators import (
    UNREACHABLE_HEADER,
    is_standby_answer,
    leader_hint,
    next_coordinator,
    reconnect_pause,
)
from client.node_codec import MessageError, decode_coordinator, encode_node
from client.node_protocol import ClockProbe, ClockReply, CoordinatorMsg, Welcome
from client.security import Security
from nodeagent import _faults
from nodeagent._agent_core import EpochGuard, StaleEpoch, message_kind
from nodeagent._agent_logs import LOG_OUTBOX_CHUNKS, log_task_failure
from protos.gelastic.v1 import gelastic_pb2 as pb
from protos.gelastic.v1 import gelastic_pb2_grpc as pb_grpc

__all__ = [
    "CONTROL_OUTBOX_LIMIT",
    "WAKE",
    "LinkView",
    "Outbox",
    "SessionLink",
    "one_line",
]

logger = logging.getLogger(__name__)

CONTROL_OUTBOX_LIMIT = 10_000
"""Control messages (heartbeats, starts, exits) queued for a stream that is not draining; past
this the session is dropped and a new one re-reports everything the agent holds."""
REFUSED_RETRY_MAX_S = 1.0
"""Longest pause between tries while the coordinator still holds this node's previous session."""
NAME_HELD_HEADER = "gelastic-name-held-ms"
"""Trailing metadata of a name-in-use refusal: how long the name can stay held by an agent that
is in fact gone (its lease, or the reconnect grace after a restart)."""
NAME_GRACE_HEADER = "gelastic-name-grace-ms"
"""Trailing metadata of a temporary name-in-use refusal: the name is kept for this node's
previous agent (known only from the coordinator's state on disk) this much longer."""
NAME_HELD_DEFAULT_S = 60.0
"""How long refusals of a name in use are retried when the coordinator does not say."""
NAME_HELD_MARGIN_S = 3.0
PROBE_CONFIRM_S = 0.5
"""A TLS verdict ends the agent only when a second probe this much later agrees."""
RETRY_LOG_EVERY_S = 10.0
"""A retry with the same reason and pause is logged again after this long."""
_PROBE_HINTS = (
    "socket closed",
    "handshake",
    "ssl",
    "tls",
    "verification",
    "connection reset",
    "end of tcp",
)
"""An UNAVAILABLE whose details say one of these may be a TLS mismatch grpc does not name."""

Outbox = asyncio.Queue[pb.NodeMessage]

WAKE = pb.NodeMessage()
"""Put into the control outbox (by identity, never sent) when a log chunk waits to be sent."""


class SessionLink:
    """The agent's one session at a time with the coordinator, and the reconnects between."""

    def __init__(
        self,
        name: str,
        addr: str,
        coordinators: tuple[str, ...],
        security: Security,
        *,
        reconnect_max: float,
        hello: Callable[[], pb.NodeMessage],
        replay: Callable[[], list[pb.NodeMessage]],
        dispatch: Callable[[CoordinatorMsg], None],
        heartbeat: Callable[[Outbox, int], None],
        opened: Callable[[Outbox, Outbox], None],
        closed: Callable[[], None],
        closing: Callable[[], bool],
    ) -> None:
        self.name = name
        self.addr = addr
        self.coordinators = coordinators
        """Every listed replica, in the given order."""
        self.target = coordinators[0]
        """The replica the current (or next) session dials."""
        self.security = security
        self.reconnect_max = reconnect_max
        self._hello = hello
        """The first message of a session."""
        self._replay = replay
        """What follows the welcome."""
        self._dispatch = dispatch
        """Carry out a message of the coordinator's (the welcome aside)."""
        self._heartbeat = heartbeat
        """Queue heartbeat number `seq` on the outbox."""
        self._opened = opened
        """A session was welcomed: the control outbox and the log outbox to use."""
        self._closed = closed
        """The session ended: its outboxes (and its log requests) are gone."""
        self._closing = closing
        self.unreachable = ""
        """The listed replica the last session could not reach, until a session is welcomed:
        told to the others, so that a standby still naming it as the leader holds the session."""
        self.epochs = EpochGuard()
        self.heartbeat_interval = 1.0
        self._outbox_full = asyncio.Event()
        self.connected = asyncio.Event()
        self.refused = asyncio.Event()
        """Set when the coordinator refused this agent for good; `refusal` says why."""
        self.refusal = ""
        self._refused_since: float | None = None
        """When the coordinator first refused this agent's name since its last session."""

    @property
    def epoch(self) -> int:
        return self.epochs.newest

    async def run(self) -> None:
        """Keep a session up until the agent closes, or is refused for good."""
        delay = 0.05
        self._refused_since = None
        last_log: tuple[str, float, float] = ("", 0.0, 0.0)  # (reason, pause, when)
        probed: dict[str, str] = {}
        hops = 0  # hints followed since the last pause
        hunting = 0  # attempts since the last session that worked that found no leader
        while not self._closing():
            started = time.monotonic()
            reason = ""
            hunted = False
            target = self.target
            # Unless told otherwise below, the next session tries the next listed replica.
            after = next_coordinator(self.coordinators, target, {target}) or target
            follow = False
            try:
                await self._session()
                if not self._closing():
                    reason = f"session with {target} closed by the coordinator"
            except asyncio.CancelledError:
                raise
            except StaleEpoch:
                reason = ""  # _check_epoch logged it, rate-limited
            except grpc.aio.AioRpcError as exc:
                code, details = exc.code(), one_line(exc.details() or "")[:500]
                if code == grpc.StatusCode.ALREADY_EXISTS:
                    reason = self._name_refused(exc, target, details)
                    if self.refused.is_set():
                        return
                    delay = min(delay, REFUSED_RETRY_MAX_S / 2)
                    after = target  # that coordinator holds the name: only it can free it
                elif code in (
                    grpc.StatusCode.INVALID_ARGUMENT,
                    grpc.StatusCode.UNAUTHENTICATED,
                    grpc.StatusCode.PERMISSION_DENIED,
                ):
                    self._refuse_for_good(f"coordinator {target} refused this agent: {details}")
                    return
                else:
                    reason = f"session with {target} ended: {code.name}: {details}"
                    hint = leader_hint(exc.trailing_metadata(), self.coordinators)
                    # A standby that knows no leader yet, or a replica that does not answer.
                    hunted = code == grpc.StatusCode.UNAVAILABLE
                    listed = len(self.coordinators) > 1
                    if hunted and listed and not is_standby_answer(details, bool(hint)):
                        self.unreachable = target  # e.g. a leader that died
                    if code == grpc.StatusCode.UNAVAILABLE and hint and hint != target:
                        # A standby named the leader: straight there, a bounded number of times.
                        after, follow = hint, hops < len(self.coordinators)
                    elif code == grpc.StatusCode.UNAVAILABLE and any(
                        h in details.lower() for h in _PROBE_HINTS
                    ):
                        if details not in probed:
                            probed.clear()  # bounded: only the latest reason is remembered
                            probed[details] = await asyncio.to_thread(
                                _probe_tls, target, self.security
                            )
                        if probed[details]:
                            self._refuse_for_good(probed[details])
                            return
            except Exception as exc:
                logger.exception("session failed")
                reason = f"session failed: {type(exc).__name__}: {exc}"
            finally:
                if self.connected.is_set():
                    self._refused_since = None
                    probed.clear()
                    hunting = 0
                self.connected.clear()
                self._closed()
            if self._closing():
                return
            self.target = after
            if follow:
                hops += 1
                logger.info("%s; going to the leader it named, %s", reason, after)
                continue
            hops = 0
            if time.monotonic() - started > 10:
                delay = 0.05
            hunting = hunting + 1 if hunted else hunting
            low, high = reconnect_pause(delay, hunting if hunted else 0, len(self.coordinators))
            if reason:
                now = time.monotonic()
                said, was, when = last_log
                if reason != said or high != was or now - when > RETRY_LOG_EVERY_S:
                    where = f" at {after}" if len(self.coordinators) > 1 else ""
                    logger.warning("%s; retrying%s within %.2g s", reason, where, high)
                    last_log = (reason, high, now)
            # Jitter keeps a fleet of agents from reconnecting in lockstep; while hunting for
            # the leader over a list the pause stays short (bounded passes), else it doubles.
            await asyncio.sleep(random.uniform(low, high))
            if low == 0:
                delay = min(delay * 2, self.reconnect_max)

    def _name_refused(self, exc: grpc.aio.AioRpcError, target: str, details: str) -> str:
        """The coordinator refused this agent's name: why the next try waits, or (past the time
        the coordinator says a gone holder can keep it) refused for good."""
        if _name_grace_s(exc) is not None:
            # Kept for a previous agent during the reconnect grace after a coordinator restart:
            # temporary, whatever the time spent (a second restart begins the grace again).
            self._refused_since = None
            return f"coordinator keeps this node's name for its previous agent for now: {details}"
        # This node's previous session (or another live agent) holds the name. A dead holder's
        # session ends within the time the coordinator says; past it the holder is alive and
        # retrying cannot help.
        now = time.monotonic()
        since = self._refused_since if self._refused_since is not None else now
        self._refused_since = since
        if now - since > _name_held_s(exc) + NAME_HELD_MARGIN_S:
            self._refuse_for_good(
                f"node name {self.name!r} is in use by another live agent "
                f"(coordinator {target} refused this one for "
                f"{now - since:.0f} s: {details}); give this agent "
                "another --name"
            )
        return f"coordinator refused this agent for now: {details}"

    def _refuse_for_good(self, reason: str) -> None:
        logger.error("%s", reason)
        self.refusal = reason
        self.refused.set()

    async def _session(self) -> None:
        outbox: Outbox = asyncio.Queue(CONTROL_OUTBOX_LIMIT)
        logs: Outbox = asyncio.Queue(LOG_OUTBOX_CHUNKS)
        self._outbox_full.clear()
        outbox.put_nowait(self._hello())
        async with self.security.aio_channel(
            self.target,
            options=[
                ("grpc.keepalive_time_ms", 10_000),
                ("grpc.keepalive_timeout_ms", 5_000),
                ("grpc.max_receive_message_length", 16 * 1024 * 1024),
                # Its own subchannel: one shared with the channels of earlier tries would make
                # this one wait out grpc's connection backoff (1 s, growing 1.6 times a
                # refusal), however soon the coordinator is back: the pauses are ours to choose.
                ("grpc.use_local_subchannel_pool", 1),
            ],
        ) as channel:
            stub = pb_grpc.NodeSessionStub(channel)
            metadata = self.security.metadata
            if self.unreachable and self.unreachable != self.target:
                metadata += ((UNREACHABLE_HEADER, self.unreachable),)
            call = stub.Session(metadata=metadata)

            async def outgoing() -> None:
                # Our own task writing to the call (not a request iterator grpc would consume
                # in a task of its own): it ends with the session, however the session ends.
                while True:
                    # Control messages first: log chunks never hold up a heartbeat or an exit.
                    if outbox.empty() and not logs.empty():
                        await call.write(logs.get_nowait())
                        continue
                    msg = await outbox.get()
                    if msg is not WAKE:
                        await call.write(msg)

            loop = asyncio.get_running_loop()
            # A write fails only once the call has ended, which the read side reports.
            writer = loop.create_task(outgoing(), name="agent-session-writer")
            heartbeat: asyncio.Task[None] | None = None
            full = loop.create_task(self._outbox_full.wait())
            full.add_done_callback(lambda _t: call.cancel())
            try:
                async for raw in call:
                    read_at = time.time()
                    msg = self._read(raw)
                    if isinstance(msg, ClockProbe):
                        # Answered at once, ahead of anything queued but the control messages
                        # before it: the coordinator measures this node's clock with it.
                        reply = ClockReply(msg.sent_at, read_at, time.time())
                        self.put(outbox, encode_node(_faults.skewed(reply)))
                    elif isinstance(msg, Welcome):
                        self.unreachable = ""
                        self.heartbeat_interval = max(0.05, msg.heartbeat_interval)
                        self._opened(outbox, logs)
                        # What the hello left out (it must fit one message however big the
                        # results): every held exit, each in a message of its own.
                        for m in self._replay():
                            self.put(outbox, m)
                        self.connected.set()
                        logger.info(
                            "registered with %s as %s (%s)%s",
                            self.target,
                            self.name,
                            self.addr,
                            f", leader epoch {self.epoch}" if self.epoch else "",
                        )
                        if heartbeat is None:
                            heartbeat = asyncio.get_running_loop().create_task(
                                self._heartbeats(outbox), name="agent-heartbeats"
                            )
                            # Without heartbeats the session is dead in all but name: end it,
                            # and the next one starts them again.
                            heartbeat.add_done_callback(log_task_failure)
                            heartbeat.add_done_callback(
                                lambda t: t.cancelled() or t.exception() is None or call.cancel()
                            )
                    elif msg is not None:
                        self._dispatch(msg)
            except asyncio.CancelledError:
                task = asyncio.current_task()
                if self._outbox_full.is_set() and task is not None and not task.cancelling():
                    raise ConnectionError("the outbox to the coordinator is full") from None
                beat = heartbeat
                beat_failed = beat is not None and beat.done() and not beat.cancelled()
                beat_failed = beat_failed and beat is not None and beat.exception() is not None
                if beat_failed and task is not None and not task.cancelling():
                    raise ConnectionError("the heartbeats to the coordinator failed") from None
                raise
            finally:
                full.cancel()
                writer.cancel()
                if heartbeat is not None:
                    heartbeat.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await heartbeat
                call.cancel()
                # The writer's end (a write to a call that ended fails) is the session's end,
                # already reported by the read side.
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await writer
                with contextlib.suppress(asyncio.CancelledError):
                    await full

    def _read(self, raw: pb.CoordinatorMessage) -> CoordinatorMsg | None:
        """A message from the stream, decoded; StaleEpoch before anything of it is acted on
        (the welcome included) when it comes from an older leader; None for one this agent
        does not know."""
        msg: CoordinatorMsg | None = None
        error = ""
        try:
            msg = decode_coordinator(raw)
        except MessageError as exc:
            error = str(exc)
        self._check_epoch(raw.epoch, msg)
        if msg is None:
            logger.warning("ignoring an unknown message from the coordinator: %s", error)
        return msg

    def _check_epoch(self, epoch: int, msg: CoordinatorMsg | None) -> None:
        try:
            self.epochs.check(int(epoch), message_kind(msg), self.target, time.monotonic())
        except StaleEpoch as stale:
            if stale.report_args:
                logger.warning(StaleEpoch.REPORT, *stale.report_args)
            raise

    def put(self, outbox: Outbox, msg: pb.NodeMessage) -> None:
        """Queue a message; a full outbox drops the session."""
        try:
            outbox.put_nowait(msg)
        except asyncio.QueueFull:
            # The stream has not drained for ages: drop the session; the next one re-reports
            # every start and exit the agent holds.
            if not self._outbox_full.is_set():
                logger.error("the outbox to the coordinator is full; dropping the session")
            self._outbox_full.set()

    async def _heartbeats(self, outbox: Outbox) -> None:
        seq = 0
        while True:
            await asyncio.sleep(self.heartbeat_interval)
            seq += 1
            self._heartbeat(outbox, seq)


def one_line(text: str) -> str:
    return " ".join(str(text).split())


def _name_held_s(exc: grpc.aio.AioRpcError) -> float:
    """How long the coordinator says a name can stay held by an agent that is gone."""
    metadata: Any = exc.trailing_metadata() or ()
    for key, value in metadata:
        if key == NAME_HELD_HEADER and isinstance(value, str) and value.isdigit():
            return min(int(value[:9]) / 1000, 24 * 3600.0)
    return NAME_HELD_DEFAULT_S


def _name_grace_s(exc: grpc.aio.AioRpcError) -> float | None:
    """How much longer the coordinator keeps the name for a previous agent during its
    reconnect grace; None when the refusal is not such a temporary one."""
    metadata: Any = exc.trailing_metadata() or ()
    for key, value in metadata:
        if key == NAME_GRACE_HEADER and isinstance(value, str) and value.isdigit():
            return min(int(value[:9]) / 1000, 24 * 3600.0)
    return None


def _probe_tls(target: str, security: Security) -> str:
    """Why TLS fails between this agent and the coordinator ("" = TLS is not the problem)."""
    import sys

    from client.security import describe_tls_failure

    if sys.modules.get("ssl", False) is None:
        # The agent keeps ssl out of its memory (see nodeagent.cli); a failed connection that
        # may be a TLS mismatch is worth loading it for, once.
        del sys.modules["ssl"]
    verdict = describe_tls_failure(target, security)
    if not verdict:
        return ""
    # It ends the agent: a coordinator caught mid-restart must not pass for a wrong setting.
    time.sleep(PROBE_CONFIRM_S)
    return verdict if describe_tls_failure(target, security) == verdict else ""


class LinkView:
    """What an agent shows of its session link (`_link`): the replicas, the epoch, a refusal."""

    _link: SessionLink

    @property
    def coordinators(self) -> tuple[str, ...]:
        """Every listed replica, in the given order; set it to follow other replicas."""
        return self._link.coordinators

    @coordinators.setter
    def coordinators(self, listed: tuple[str, ...]) -> None:
        # The link reads the list at each dial: the next reconnect goes to the new replicas.
        self._link.coordinators = listed

    @property
    def target(self) -> str:
        """The replica the current (or next) session dials."""
        return self._link.target

    @property
    def _unreachable(self) -> str:
        return self._link.unreachable

    @property
    def epoch(self) -> int:
        """The newest leader epoch any coordinator message carried, for the life of the agent;
        a message with an older one is refused."""
        return self._link.epoch

    @property
    def refusal(self) -> str:
        return self._link.refusal
