"""Coordinator replicas on etcd: the election, the leader's own step-down timer, and the gate
that keeps a standby (or a replica that just stepped down) from serving.

Every replica runs `Leadership.run`. A standby polls the leader key `PREFIX/leader` every
`POLL_S`; when there is none it grants itself a lease of `ttl` seconds and campaigns: a txn
that puts the key, on that lease, only if the key does not exist. The winner's epoch is the
key's creation revision (it only grows); the service then fences every state write on it
(see `Fence`), so a deposed leader's write fails at etcd (`StoreFenced`).

The leader refreshes its lease every `ttl / 4`, on a thread of its own (so that a busy event
loop cannot delay a keepalive or its answer), and trusts it for `ttl - margin` from the send
time of the last keepalive etcd confirmed, on the monotonic clock: etcd counts the TTL from when
it handled that keepalive, which is later, so the leader stops before etcd could have expired
the lease, even when etcd (or the way to it) stops answering. `leading()` is that check, cheap
enough to make before every message a node session writes.

`LeaderGate` is a server interceptor: while this replica does not lead, every gelastic call
(client API and node sessions) is answered UNAVAILABLE, "not the leader; the leader is at
HOST:PORT", with the trailing metadata `gelastic-leader`; the calls of a term still open when it
ends are ended the same way. Probes (health, reflection) stay open.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import json
import logging
import math
import re
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import grpc
import grpc.aio

from client.coordinators import UNREACHABLE_HEADER
from coordinator._store import StoreUnavailable
from coordinator._store_etcd import EtcdStore

__all__ = [
    "DEFAULT_TTL_S",
    "LEADER_METADATA",
    "LeaderGate",
    "Leadership",
    "Term",
    "parse_advertise",
]

logger = logging.getLogger(__name__)

DEFAULT_TTL_S = 3.0
MIN_TTL_S = 1.0
MAX_TTL_S = 60.0
LEADER_METADATA = "gelastic-leader"
MAX_LEADER_VALUE_BYTES = 4096
REVOKE_TIMEOUT_S = 1.0
POLL_S = 0.25
"""How often a standby reads the leader key (at most; a third of the TTL when that is less): a
lease that expired is taken over within this much. One small etcd read per standby each time."""
ELECTION_RPC_TIMEOUT_S = 1.0
"""Deadline of one etcd call of a campaign (at most; a third of the TTL when that is less)."""
_ADDR = re.compile(r"(?:[A-Za-z0-9.\-]{1,253}|\[[0-9A-Fa-f:.]{2,45}\]):[0-9]{1,5}")
_ID = re.compile(r"[0-9a-f]{1,64}")
_GELASTIC = ("/gelastic.v1.Coordinator/", "/gelastic.v1.NodeSession/")
_SESSION = "/gelastic.v1.NodeSession/Session"
MAX_HELD = 10_000
"""Most agent sessions a replica holds while no leader is known (see `LeaderGate`)."""

T = TypeVar("T")


def parse_advertise(addr: str) -> str:
    """`addr` when it is a valid HOST:PORT; ValueError otherwise."""
    if not _ADDR.fullmatch(addr) or not 0 < int(addr.rpartition(":")[2]) < 65536:
        raise ValueError(f"advertise: expected HOST:PORT, got {addr[:300]!r}")
    return addr


def margin_for(ttl: float) -> float:
    """How long before the TTL a leader stops trusting its lease."""
    return max(0.3, ttl / 4)


def _unreachable(metadata: Any) -> str:
    """The replica an agent says its last session could not reach ("" when none, or not a
    HOST:PORT)."""
    for key, value in metadata or ():
        if key == UNREACHABLE_HEADER and isinstance(value, str) and _ADDR.fullmatch(value):
            return value
    return ""


def _decode_leader(raw: bytes) -> tuple[str, str]:
    """(replica id, address) of a leader key's value; ("", "") when it is not one we wrote."""
    if len(raw) > MAX_LEADER_VALUE_BYTES:
        return "", ""
    try:
        doc = json.loads(raw)
    except (ValueError, RecursionError):
        return "", ""
    if not isinstance(doc, dict):
        return "", ""
    rid, addr = doc.get("id"), doc.get("addr")
    if not isinstance(rid, str) or not _ID.fullmatch(rid):
        return "", ""
    if not isinstance(addr, str) or not _ADDR.fullmatch(addr):
        return rid, ""
    return rid, addr


class Term:
    """One term of leadership: `ended` is set when it ends."""

    def __init__(self, epoch: int) -> None:
        self.epoch = epoch
        self.ended = asyncio.Event()


class Leadership:
    """The election for one replica (see the module docstring)."""

    def __init__(
        self,
        store: EtcdStore,
        replica_id: str,
        advertise: str,
        ttl: float = DEFAULT_TTL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not MIN_TTL_S <= ttl <= MAX_TTL_S:
            raise ValueError(f"leader_ttl: must be {MIN_TTL_S:g}-{MAX_TTL_S:g} s, got {ttl}")
        if not _ID.fullmatch(replica_id):
            raise ValueError("replica id: 1-64 lowercase hex digits")
        self._store = store
        self.replica_id = replica_id
        self.advertise = parse_advertise(advertise)
        self.ttl = ttl
        self._clock = clock
        self._key = store.leader_key()
        self._lease = 0
        self._trust = 0.0
        """Seconds from a confirmed keepalive's send time that the lease is trusted."""
        self._confirmed = -math.inf
        """Monotonic send time of the last keepalive (or grant) etcd confirmed."""
        self._leading = False
        self._fresh = True
        """No leader key was read yet by this process."""
        self._depose = asyncio.Event()
        self._depose_reason = ""
        self.epoch = 0
        self._leader_addr = ""
        self.on_change: Callable[[], None] | None = None
        """Called (on the event loop) whenever `leader_addr` changes."""
        self.eager: Callable[[], bool] = lambda: True
        """Whether to campaign as soon as the leader key is gone (see `_try_once`)."""
        self._deferred = False
        self.first_round = asyncio.Event()
        """Set once the first campaign had its answer (won, lost, or etcd did not answer)."""
        self.terms = 0
        self.last_step_down: tuple[float, float] | None = None
        """(when, monotonic; the send time of the last keepalive etcd confirmed before it) of
        the last step-down: what the step-down timer is measured by."""
        # Threads of its own: a store write stuck on an etcd that does not answer (the service's
        # writes use the default executor) must never delay a keepalive.
        self._threads = ThreadPoolExecutor(2, thread_name_prefix="leader")

    @property
    def leader_addr(self) -> str:
        """Address of the replica known to lead ("" = none known); this one's while it leads."""
        return self._leader_addr

    @leader_addr.setter
    def leader_addr(self, addr: str) -> None:
        changed, self._leader_addr = addr != self._leader_addr, addr
        if changed and self.on_change is not None:
            self.on_change()

    async def _in_thread(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._threads, fn, *args)

    def close(self) -> None:
        self._threads.shutdown(wait=False)

    @property
    def poll_interval(self) -> float:
        return min(POLL_S, self.ttl / 3)

    @property
    def rpc_timeout(self) -> float:
        return min(ELECTION_RPC_TIMEOUT_S, self.ttl / 3)

    @property
    def keepalive_interval(self) -> float:
        return self.ttl / 4

    def leading(self) -> bool:
        """True while this replica leads and its lease is trusted (monotonic clock)."""
        return self._leading and self._clock() < self._confirmed + self._trust

    def depose(self, reason: str) -> None:
        """Step down at once (e.g. a write was fenced: another replica leads)."""
        if self._leading and not self._depose.is_set():
            self._depose_reason = reason
            self._depose.set()

    async def run(
        self,
        elected: Callable[[int], Coroutine[Any, Any, None]],
        deposed: Callable[[str], Awaitable[None]],
    ) -> None:
        """Campaign, lead, step down, campaign again... until cancelled."""
        while True:
            epoch = await self._campaign()
            self._depose.clear()
            self._depose_reason = ""
            self._leading = True
            self.epoch = epoch
            self.leader_addr = self.advertise
            self.terms += 1
            logger.info("this replica (%s) leads, epoch %d", self.advertise, epoch)
            lead = asyncio.get_running_loop().create_task(self._keep_leading(), name="lease")
            reason = ""
            take_over = asyncio.get_running_loop().create_task(elected(epoch))
            try:
                await asyncio.wait((lead, take_over), return_when=asyncio.FIRST_COMPLETED)
                if not take_over.done():
                    take_over.cancel()
                    with contextlib.suppress(asyncio.CancelledError, Exception):
                        await take_over
                elif take_over.exception() is not None:
                    exc = take_over.exception()
                    logger.error("taking over as leader failed: %s", exc, exc_info=exc)
                    self.depose(f"taking over failed: {exc}")
                try:
                    reason = await lead
                except Exception as exc:  # a bug: never lead on without the lease checked
                    logger.exception("the leader lease check failed")
                    reason = f"the leader lease check failed: {exc}"
            finally:
                self._leading = False
                self.last_step_down = (self._clock(), self._confirmed)
                if not take_over.done():  # cancelled itself (the replica stops)
                    take_over.cancel()
                if not lead.done():
                    lead.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await lead
            logger.warning("this replica stops leading (epoch %d): %s", epoch, reason)
            self.leader_addr = ""
            try:
                await deposed(reason)
            except Exception:
                logger.exception("stepping down failed")
            await self._revoke()
            await asyncio.sleep(self.poll_interval)

    async def resign(self) -> None:
        """Give the leadership up at once (clean shutdown): the lease is revoked, so a standby
        takes over at its next poll, not after the TTL."""
        self._leading = False
        await self._revoke()

    async def _revoke(self) -> None:
        lease, self._lease = self._lease, 0
        if lease:
            try:
                await self._in_thread(self._store.revoke_lease, lease, REVOKE_TIMEOUT_S)
            except StoreUnavailable as exc:
                logger.info("could not revoke the leader lease (it expires by itself): %s", exc)

    # ---- standby -------------------------------------------------------------------------

    async def _campaign(self) -> int:
        """Return the epoch once this replica won; meanwhile keep `leader_addr` current."""
        while True:
            try:
                epoch = await self._try_once()
            except StoreUnavailable as exc:
                logger.warning("campaign: etcd did not answer: %s", exc)
                self.leader_addr = ""
                epoch = 0
            except Exception:
                logger.exception("campaign failed")
                self.leader_addr = ""
                epoch = 0
            self.first_round.set()
            if epoch:
                return epoch
            await asyncio.sleep(self.poll_interval)

    async def _try_once(self) -> int:
        t = self.rpc_timeout
        kv = await self._in_thread(self._store.read_key, self._key, t)
        fresh, self._fresh = self._fresh, False
        if kv is None and not fresh and not self._deferred and not self.eager():
            # The leader is gone and no agent waits on this replica: one that holds agents'
            # sessions gets one poll's head start, so that they go straight into its service
            # rather than all reconnecting to this one. Once per vacancy; never at start.
            self._deferred = True
            self.leader_addr = ""
            return 0
        self._deferred = False
        if kv is not None:
            rid, addr = _decode_leader(kv.value)
            if rid != self.replica_id and not (fresh and addr == self.advertise):
                self.leader_addr = addr
                return 0
            if rid != self.replica_id:
                # This process listens at the address the key names: the process that wrote it
                # (a coordinator here that crashed and is being restarted) is gone. Taken over
                # at once, not after the TTL; only at start, so that two replicas configured
                # with one address cannot take it from each other in turn.
                logger.warning(
                    "the leader key names this replica's address %s: the coordinator that "
                    "held it is gone; taking over",
                    addr,
                )
            else:
                # This replica's own key from a term it already gave up.
                logger.info("revoking the leader lease of an earlier term of this replica")
            await self._in_thread(self._store.revoke_lease, kv.lease, t)
            self.leader_addr = ""
            # The key went with its lease: the campaign below is open to every replica.
        sent = self._clock()
        lease, granted = await self._in_thread(
            self._store.grant_lease, math.ceil(self.ttl), self.ttl
        )
        value = json.dumps({"id": self.replica_id, "addr": self.advertise}).encode()
        try:
            epoch, holder = await self._in_thread(
                self._store.create_with_lease, self._key, value, lease, self.ttl
            )
        except BaseException:
            self._lease = lease
            await self._revoke()
            raise
        if not epoch:
            self._lease = lease
            await self._revoke()
            self.leader_addr = _decode_leader(holder.value)[1] if holder is not None else ""
            return 0
        self._lease = lease
        trust = min(self.ttl, float(granted) if granted > 0 else self.ttl)
        self._trust = trust - margin_for(trust)
        self._confirmed = sent
        return epoch

    # ---- leader --------------------------------------------------------------------------

    async def _keep_leading(self) -> str:
        """Refresh the lease until it can no longer be trusted; return why this term ends.

        The refreshing runs on a thread of its own, which also records each confirmation: a
        leader whose event loop is busy (a thousand agents reconnecting at once) must not lose
        its lease because the answer to a keepalive waited behind them. `leading()` reads that
        record, so it turns false on time however late the loop comes to this coroutine."""
        loop = asyncio.get_running_loop()
        ended: asyncio.Future[str] = loop.create_future()

        def end(reason: str) -> None:
            if not ended.done():
                ended.set_result(reason)

        stop = threading.Event()
        lease = threading.Thread(
            target=self._lease_thread,
            args=(stop, lambda reason: loop.call_soon_threadsafe(end, reason)),
            name="leader-lease",
            daemon=True,
        )
        depose = loop.create_task(self._depose.wait())
        lease.start()
        try:
            await asyncio.wait((ended, depose), return_when=asyncio.FIRST_COMPLETED)
            if self._depose.is_set():
                return self._depose_reason
            return ended.result()
        finally:
            stop.set()
            depose.cancel()

    def _lease_thread(self, stop: threading.Event, end: Callable[[str], None]) -> None:
        """Keep the lease alive every `keepalive_interval` until `stop`, or until it can no
        longer be trusted (then `end(why)`). A keepalive that etcd does not answer ends by its
        own deadline, never later than the trust it could still extend."""
        last_sent, lease_id = self._confirmed, self._lease
        try:
            while not stop.is_set():
                now = self._clock()
                deadline = self._confirmed + self._trust
                if now >= deadline:
                    end(
                        f"no keepalive of the leader lease was confirmed for "
                        f"{now - self._confirmed:.1f} s (stepping down before its TTL of "
                        f"{self.ttl:g} s)"
                    )
                    return
                next_at = last_sent + self.keepalive_interval
                if now < next_at:
                    stop.wait(min(next_at, deadline) - now)
                    continue
                sent = last_sent = self._clock()
                try:
                    ttl_left = self._store.keep_alive(lease_id, max(0.05, deadline - sent))
                except StoreUnavailable as exc:
                    logger.warning("keepalive of the leader lease failed: %s", exc)
                    continue
                if ttl_left <= 0:
                    end("the leader lease is gone (expired or revoked in etcd)")
                    return
                if not stop.is_set():
                    self._confirmed = max(self._confirmed, sent)
        except Exception as exc:  # a bug: never lead on without the lease checked
            logger.exception("the leader lease check failed")
            end(f"the leader lease check failed: {exc}")


class LeaderGate(grpc.aio.ServerInterceptor):
    """Answers every gelastic call UNAVAILABLE unless this replica leads (module docstring).

    An agent's session is held for up to `hold_s` rather than refused while no leader is
    known (a campaign is under way), while the leader known is the one the agent says it could
    not reach (`UNREACHABLE_HEADER`: a leader that died, whose key stays until its lease runs
    out), and while this replica has won and is loading the state. It goes on into this
    replica's service the moment this replica leads, or is answered with the leader's address
    the moment another is known. A fleet of agents then neither polls the standbys while the
    lease runs out nor waits out its pause once a leader serves. At most `MAX_HELD` sessions
    are held; past that, and for every other call, the answer is at once.
    """

    def __init__(self, leader_addr: Callable[[], str]) -> None:
        self._leader_addr = leader_addr
        self._own_addr = ""
        self.hold_s = 0.0
        """How long an agent's session is held while no leader is known (0: not at all)."""
        self.held = 0
        """Sessions held now."""
        self._term: Term | None = None
        self._changed = asyncio.Event()

    def configure_hold(self, own_addr: str, hold_s: float) -> None:
        """Hold agents' sessions up to `hold_s` while no leader is known; `own_addr` is the
        address this replica advertises (known to lead, it is not yet serving)."""
        self._own_addr, self.hold_s = own_addr, max(0.0, hold_s)

    @property
    def term(self) -> Term | None:
        """The current term (None: this replica does not lead)."""
        return self._term

    @term.setter
    def term(self, term: Term | None) -> None:
        self._term = term
        self.changed()

    def changed(self) -> None:
        """Who leads may have changed: held sessions look again."""
        event, self._changed = self._changed, asyncio.Event()
        event.set()

    def refusal(self) -> tuple[str, tuple[tuple[str, str], ...]]:
        """(details, trailing metadata) of the answer of a replica that does not lead."""
        addr = self._leader_addr()
        if addr:
            return f"not the leader; the leader is at {addr}", ((LEADER_METADATA, addr),)
        return "no leader elected yet", ()

    async def _abort(self, context: grpc.aio.ServicerContext) -> None:
        details, metadata = self.refusal()
        await context.abort(grpc.StatusCode.UNAVAILABLE, details, trailing_metadata=metadata)

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        method: str = details.method
        if not method.startswith(_GELASTIC):
            return await continuation(details)
        term = self.term
        if term is None or term.ended.is_set():
            gone = _unreachable(details.invocation_metadata) if method == _SESSION else ""
            if method == _SESSION and self._may_hold(gone):
                handler = await continuation(details)
                behavior = handler.stream_stream if handler is not None else None
                if behavior is not None and inspect.iscoroutinefunction(behavior):
                    session: Any = handler  # a namedtuple; grpc's stubs do not say so
                    return session._replace(stream_stream=self._held(behavior, gone))

            async def refuse(requests: Any, context: grpc.aio.ServicerContext) -> Any:
                await self._abort(context)
                yield  # pragma: no cover - makes this an async generator

            # Streaming both ways fits every method shape; the body is never parsed.
            return grpc.stream_stream_rpc_method_handler(refuse)
        handler = await continuation(details)
        if handler is None:
            return handler
        for kind in ("unary_unary", "unary_stream", "stream_unary", "stream_stream"):
            behavior = getattr(handler, kind)
            if behavior is not None:
                bound: Any = handler  # a namedtuple; grpc's stubs do not say so
                return bound._replace(**{kind: self._bound(term, behavior)})
        return handler

    def _may_hold(self, gone: str = "") -> bool:
        """Whether to hold a session whose agent could not reach `gone` ("": none named)."""
        addr = self._leader_addr()
        # Its own address: this replica won and is loading the state; it serves in a moment.
        waiting = not addr or addr in (gone, self._own_addr)
        return self.hold_s > 0 and self.held < MAX_HELD and waiting

    def _held(self, behavior: Callable[..., Any], gone: str = "") -> Callable[..., Any]:
        """`behavior` once this replica leads, or the refusal once another does (or `hold_s`
        passed first)."""
        gate = self

        async def held(requests: Any, context: grpc.aio.ServicerContext) -> Any:
            gate.held += 1
            try:
                term = await gate._leads_within(gate.hold_s, gone)
            finally:
                gate.held -= 1
            if term is None:
                await gate._abort(context)
                return None
            return await gate._bound(term, behavior)(requests, context)

        return held

    async def _leads_within(self, timeout: float, gone: str = "") -> Term | None:
        """This replica's term if it leads within `timeout`; None once another replica than
        `gone` is known to lead, or when the time is up."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            term = self._term
            if term is not None and not term.ended.is_set():
                return term
            addr = self._leader_addr()
            left = deadline - loop.time()
            if (addr and addr not in (self._own_addr, gone)) or left <= 0:
                return None
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), left)

    def _bound(self, term: Term, behavior: Callable[..., Any]) -> Callable[..., Any]:
        """`behavior`, ended with the refusal once `term` ends."""
        gate = self

        if inspect.isasyncgenfunction(behavior):

            async def stream(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
                items = behavior(request, context)
                ended = asyncio.ensure_future(term.ended.wait())
                item: asyncio.Future[Any] | None = None
                try:
                    while True:
                        item = asyncio.ensure_future(anext(items))
                        await asyncio.wait((item, ended), return_when=asyncio.FIRST_COMPLETED)
                        if not item.done():
                            item.cancel()
                            with contextlib.suppress(asyncio.CancelledError, Exception):
                                await item
                            await gate._abort(context)
                        try:
                            value = item.result()
                        except StopAsyncIteration:
                            return
                        yield value
                finally:
                    ended.cancel()
                    if item is not None and not item.done():
                        item.cancel()
                        with contextlib.suppress(asyncio.CancelledError, Exception):
                            await item
                    elif item is not None and not item.cancelled():
                        # A stream that ended (StopAsyncIteration) as the call was cancelled:
                        # its outcome is taken here, not reported as never retrieved.
                        item.exception()
                    with contextlib.suppress(Exception):
                        await items.aclose()

            return stream

        async def call(request: Any, context: grpc.aio.ServicerContext) -> Any:
            task = asyncio.ensure_future(behavior(request, context))
            ended = asyncio.ensure_future(term.ended.wait())
            try:
                await asyncio.wait((task, ended), return_when=asyncio.FIRST_COMPLETED)
            except asyncio.CancelledError:
                task.cancel()  # the call went (the peer cancelled it, or the server stops)
                raise
            finally:
                ended.cancel()
            if not task.done():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
                await gate._abort(context)
            return task.result()

        return call
