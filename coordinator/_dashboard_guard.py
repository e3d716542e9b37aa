"""What reaches the web dashboard at all, before any page or login.

`HostCheck`: the Host a request names (pure checks on strings). `ConnectionGuard`: how many
connections are open and for how long one may sit idle, below aiohttp, at the transport. And
`AcceptErrorLog`, which keeps a listener out of file descriptors from flooding the log.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import socket
import time
from collections.abc import Callable, Iterable
from typing import Any, cast

__all__ = [
    "DEFAULT_IDLE_TIMEOUT_S",
    "DEFAULT_MAX_CONNECTIONS",
    "LISTEN_BACKLOG",
    "WILDCARDS",
    "AcceptErrorLog",
    "ConnectionGuard",
    "HostCheck",
    "wildcard_names",
]

logger = logging.getLogger(__name__)

DEFAULT_MAX_CONNECTIONS = 256
"""Connections open at once (browsers keep about 6 per site, each event stream holds one)."""
DEFAULT_IDLE_TIMEOUT_S = 15.0
"""How long a connection may stay without a request being handled: from its accept or from
the end of its last request until its next request has been read whole."""
LISTEN_BACKLOG = 64
"""Connections the kernel queues before accept. asyncio accepts up to this many at once
before the guard sees any: descriptors held are at most the cap plus this."""
CONNECTION_LOG_INTERVAL_S = 60.0
ACCEPT_ERROR_LOG_INTERVAL_S = 60.0

WILDCARDS = frozenset({"", "0.0.0.0", "::"})


def _host_key(host: str) -> str:
    """One spelling per host: IP literals compressed, names lower case without a final dot."""
    try:
        return ipaddress.ip_address(host).compressed
    except ValueError:
        return host.lower().removesuffix(".")


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


class HostCheck:
    """Which `Host` headers the dashboard answers: its own names, with its port.

    A page of another site whose name an attacker points at this address (DNS rebinding) sends
    that site's name as its Host, so it is refused, and a browser never lets that site read
    the dashboard. Served: the bound address; `localhost`, 127.0.0.1 and [::1] when that is a
    loopback address; the names given (the advertised name). On a wildcard address, also the
    host's own name and any IP literal (an IP in the Host is the dashboard's own origin).
    """

    def __init__(self, bound: str, port: int, default_port: int, names: Iterable[str] = ()) -> None:
        bound = bound.strip("[]")
        self.port = port
        self._default_port = default_port
        self.wildcard = bound in WILDCARDS
        hosts = {_host_key(n.strip("[]")) for n in names if n}
        if not self.wildcard:
            hosts.add(_host_key(bound))
        loopback = bound == "localhost" or (
            _is_ip(bound) and ipaddress.ip_address(bound).is_loopback
        )
        if loopback:
            hosts |= {"localhost", "127.0.0.1", "::1"}
        self.hosts = frozenset(hosts)

    def allows(self, header: str | None) -> bool:
        if not header or len(header) > 300:
            return False
        if header.startswith("["):
            host, bracket, rest = header[1:].partition("]")
            if not bracket or not _is_ip(host):
                return False
        else:
            host, colon, port_text = header.rpartition(":")
            rest = colon + port_text
            if not colon:
                host, rest = header, ""
            if ":" in host:
                return False  # an IPv6 literal needs its brackets
        if rest:
            digits = rest[1:]
            if not rest.startswith(":") or not digits.isdigit() or len(digits) > 5:
                return False
            port = int(digits)
        else:
            port = self._default_port
        if port != self.port:
            return False
        key = _host_key(host)
        return key in self.hosts or (self.wildcard and _is_ip(host))


def wildcard_names() -> list[str]:
    """This host's own names, for a dashboard bound on every address."""
    return [socket.gethostname(), socket.getfqdn()]


# ---- connections -------------------------------------------------------------------------------


class _Connection:
    __slots__ = ("busy", "idle_since", "timer", "transport")

    def __init__(self, transport: asyncio.Transport, now: float) -> None:
        self.transport = transport
        self.busy = 0
        """Requests of this connection being handled now (an event stream is one, for its life)."""
        self.idle_since = now
        self.timer: asyncio.TimerHandle | None = None


class ConnectionGuard:
    """At most `max_connections` open at once, and none idle for more than `idle_timeout`.

    A connection is idle from its accept, and from the end of each request, until the next
    request is read whole (a client that sends half a request, or nothing, stays idle); an
    event stream is busy for as long as it lasts. At the cap, the connection idle the longest
    is closed to make room, so connections that only wait cannot keep a request out; a new one
    is closed at once only when every open connection is busy.
    """

    def __init__(
        self, max_connections: int, idle_timeout: float, loop: asyncio.AbstractEventLoop
    ) -> None:
        self.max_connections = max_connections
        self.idle_timeout = idle_timeout
        self._loop = loop
        self._open: dict[asyncio.Transport, _Connection] = {}
        self._idle: dict[asyncio.Transport, None] = {}
        """The idle connections, the longest idle first."""
        self._log = _SummaryLog(logger, CONNECTION_LOG_INTERVAL_S, loop.time)
        self.closed_idle = 0
        self.evicted = 0
        self.refused = 0

    @property
    def open(self) -> int:
        return len(self._open)

    def protocol_factory(
        self, inner: Callable[[], asyncio.Protocol]
    ) -> Callable[[], asyncio.Protocol]:
        """A factory for `loop.create_server`: `inner`'s protocols, behind this guard."""
        return lambda: _GuardedProtocol(self, inner())

    def admit(self, transport: asyncio.Transport) -> bool:
        if len(self._open) >= self.max_connections:
            if not self._idle:
                self.refused += 1
                self._log.note("refused", "every connection is busy")
                return False
            oldest = next(iter(self._idle))
            self.evicted += 1
            self._log.note("closed to make room", "the connection idle the longest")
            self._drop(oldest)
            oldest.abort()
        conn = _Connection(transport, self._loop.time())
        self._open[transport] = conn
        self._set_idle(conn)
        return True

    def release(self, transport: asyncio.Transport) -> None:
        self._drop(transport)

    def request_started(self, transport: asyncio.Transport | None) -> None:
        conn = self._open.get(transport) if transport is not None else None
        if conn is None:
            return
        conn.busy += 1
        self._idle.pop(conn.transport, None)
        if conn.timer is not None:
            conn.timer.cancel()
            conn.timer = None

    def request_ended(self, transport: asyncio.Transport | None) -> None:
        conn = self._open.get(transport) if transport is not None else None
        if conn is None:
            return
        conn.busy -= 1
        if conn.busy == 0:
            self._set_idle(conn)

    def close(self) -> None:
        """Close every connection still open (the dashboard stops)."""
        for transport in list(self._open):
            self._drop(transport)
            transport.abort()

    def _set_idle(self, conn: _Connection) -> None:
        conn.idle_since = self._loop.time()
        self._idle[conn.transport] = None
        self._schedule(conn, self.idle_timeout)

    def _schedule(self, conn: _Connection, delay: float) -> None:
        if conn.timer is not None:
            conn.timer.cancel()
        conn.timer = self._loop.call_later(delay, self._check_idle, conn)

    def _check_idle(self, conn: _Connection) -> None:
        conn.timer = None
        if self._open.get(conn.transport) is not conn or conn.busy:
            return
        write_buffer = getattr(conn.transport, "get_write_buffer_size", lambda: 0)()
        if write_buffer:  # an answer still on its way out: not idle yet
            self._schedule(conn, self.idle_timeout)
            return
        left = conn.idle_since + self.idle_timeout - self._loop.time()
        if left > 0:
            self._schedule(conn, left)
            return
        self.closed_idle += 1
        self._drop(conn.transport)
        conn.transport.close()

    def _drop(self, transport: asyncio.Transport) -> None:
        conn = self._open.pop(transport, None)
        self._idle.pop(transport, None)
        if conn is not None and conn.timer is not None:
            conn.timer.cancel()
            conn.timer = None


class _GuardedProtocol(asyncio.Protocol):
    """Hands everything to `inner`, once the guard has let the connection in."""

    def __init__(self, guard: ConnectionGuard, inner: asyncio.Protocol) -> None:
        self._guard = guard
        self._inner = inner
        self._admitted = False

    def connection_made(self, base: asyncio.BaseTransport) -> None:
        transport = cast(asyncio.Transport, base)  # a stream server's transports are
        if not self._guard.admit(transport):
            transport.abort()
            return
        self._admitted = True
        self._transport = transport
        self._inner.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        if self._admitted:
            self._inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self._inner.eof_received() if self._admitted else None

    def pause_writing(self) -> None:
        if self._admitted:
            self._inner.pause_writing()

    def resume_writing(self) -> None:
        if self._admitted:
            self._inner.resume_writing()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._admitted:
            self._guard.release(self._transport)
            self._inner.connection_lost(exc)


# ---- log lines that could flood ----------------------------------------------------------------


class _SummaryLog:
    """At most one WARNING per kind per `interval`; the next says how many were left out."""

    def __init__(self, log: logging.Logger, interval: float, clock: Callable[[], float]) -> None:
        self._logger = log
        self._interval = interval
        self._clock = clock
        self._last: dict[str, tuple[float, int]] = {}

    def note(self, kind: str, detail: str) -> bool:
        """Log this one unless one of its kind was logged less than `interval` ago."""
        now = self._clock()
        last = self._last.get(kind)
        if last is not None and now - last[0] < self._interval:
            self._last[kind] = (last[0], last[1] + 1)
            return False
        left_out = last[1] if last is not None else 0
        self._last[kind] = (now, 0)
        more = f" ({left_out} more like it since the last line)" if left_out else ""
        self._logger.warning("dashboard connection %s: %s%s", kind, detail, more)
        return True


class AcceptErrorLog:
    """An event loop exception handler: "socket.accept() out of system resource" (EMFILE and
    the like, which asyncio reports once a second per listening socket for as long as it
    lasts) at most once per `interval`, with how many were left out; everything else goes to
    the loop's default handler."""

    MESSAGE = "socket.accept() out of system resource"

    def __init__(
        self,
        interval: float = ACCEPT_ERROR_LOG_INTERVAL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._interval = interval
        self._clock = clock
        self._last: float | None = None
        self._left_out = 0

    def __call__(self, loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        if context.get("message") != self.MESSAGE:
            loop.default_exception_handler(context)
            return
        now = self._clock()
        if self._last is not None and now - self._last < self._interval:
            self._left_out += 1
            return
        more = f" ({self._left_out} more since the last line)" if self._left_out else ""
        self._last, self._left_out = now, 0
        exc = context.get("exception")
        logger.error(
            "cannot accept connections: %s; retrying every second%s",
            exc if exc is not None else "out of system resources",
            more,
        )
