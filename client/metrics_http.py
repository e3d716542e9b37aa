"""The HTTP endpoint the coordinator and the node agent serve their Prometheus metrics on.

Every set of metrics lives on a registry of its own rather than prometheus_client's global one, so
several agents or coordinators in one process (tests, LocalCluster) never clash. prometheus_client
and the HTTP modules are imported only when an endpoint starts.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import selectors
import socket
import threading
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any
from urllib.parse import unquote

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

__all__ = ["LISTEN_BACKLOG", "MAX_CONNECTIONS", "MetricsEndpoint"]

logger = logging.getLogger(__name__)

STOP_JOIN_S = 5.0
CONNECTION_TIMEOUT_S = 10.0
"""Seconds a connection has, from its accept, to send its request and take the answer."""
MAX_CONNECTIONS = 64
"""Connections served at once. At the cap the one waiting longest for its request is closed to
make room; a new one is closed at once only when every open one is being answered."""
LISTEN_BACKLOG = 64
"""Connections the kernel queues before their accept."""
MAX_REQUEST_BYTES = 8 * 1024
"""The request line and headers; a scrape sends a few hundred bytes."""
ACCEPTS_PER_WAKE = 16
"""Connections accepted in a row before the loop serves the open ones again."""
ACCEPT_PAUSE_S = 1.0
"""Out of descriptors, the endpoint stops accepting this long, rather than spin on accept."""
LOG_INTERVAL_S = 60.0
"""At most one line per kind of trouble (failed accepts, connections closed at the cap) this
often; the next says how many were left out."""
_TICK_S = 0.5
_OUT_OF_RESOURCES = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})


class _Connection:
    def __init__(self, sock: socket.socket, deadline: float) -> None:
        self.sock = sock
        self.deadline = deadline
        self.inbox = bytearray()
        self.outbox = b""
        self.answered = False


class _SummaryLog:
    """One WARNING per kind per `interval` at most; the next says how many were left out."""

    def __init__(self, interval: float = LOG_INTERVAL_S) -> None:
        self._interval = interval
        self._last: dict[str, tuple[float, int]] = {}

    def note(self, kind: str, detail: str) -> None:
        now = time.monotonic()
        last = self._last.get(kind)
        if last is not None and now - last[0] < self._interval:
            self._last[kind] = (last[0], last[1] + 1)
            return
        more = f" ({last[1]} more since the last line)" if last is not None and last[1] else ""
        self._last[kind] = (now, 0)
        logger.warning("metrics endpoint: %s: %s%s", kind, detail, more)


class MetricsEndpoint:
    """`GET /metrics` for one registry: prometheus_client's WSGI app behind a small HTTP loop.

    One long-lived thread serves every connection with non-blocking sockets and a selector.
    prometheus_client's `start_http_server` starts a thread per request instead, and the agent
    forks workers: threads coming and going in the parent at that moment are what
    fork-with-threads handles worst. Connections are served side by side, so one that sends
    nothing does not hold up a scrape; each has CONNECTION_TIMEOUT_S in all, and at most
    MAX_CONNECTIONS are open: at the cap the one that has waited longest without a whole
    request is closed to make room, so connections that only wait cannot keep a scrape out.
    Out of descriptors (EMFILE), the endpoint stops accepting for ACCEPT_PAUSE_S instead of
    spinning on accept, and says so once a minute. The HTTP modules are imported only when
    metrics are on, to keep an idle agent small.

    `start()` binds (an OSError names the address); `stop()` ends the loop, closes every socket
    and joins its thread. Both are idempotent.
    """

    def __init__(
        self,
        registry: CollectorRegistry,
        host: str,
        port: int,
        *,
        connection_timeout: float = CONNECTION_TIMEOUT_S,
        max_connections: int = MAX_CONNECTIONS,
    ) -> None:
        self.registry = registry
        self.host = host
        self.port = port
        self.connection_timeout = connection_timeout
        self.max_connections = max_connections
        self._listener: socket.socket | None = None
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        self._wake: tuple[socket.socket, socket.socket] | None = None
        self._app: Callable[..., Iterable[bytes]] | None = None
        self._log = _SummaryLog()
        self._paused_until: float | None = None
        """While out of descriptors: when the listener is watched again."""
        self.evicted = 0
        """Connections closed to make room at the cap."""
        self.refused = 0
        """Connections closed at their accept: every open one was being answered."""
        self.failed_accepts = 0

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/metrics"

    def start(self) -> None:
        if self._listener is not None:
            return
        from prometheus_client import make_wsgi_app

        try:
            family, _, _, _, address = socket.getaddrinfo(
                self.host, self.port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
            )[0]
            listener = socket.socket(family, socket.SOCK_STREAM)
            try:
                listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                listener.bind(address)
                listener.listen(LISTEN_BACKLOG)
            except OSError:
                listener.close()
                raise
        except OSError as exc:
            raise OSError(
                f"cannot serve metrics on {self.host}:{self.port}: {exc.strerror or exc}"
            ) from exc
        listener.setblocking(False)
        self._app = make_wsgi_app(self.registry)
        self._wake = socket.socketpair()
        self._stopping.clear()
        thread = threading.Thread(
            target=self._serve, args=(listener, self._wake[0]), name="metrics-http", daemon=True
        )
        self._listener, self._thread = listener, thread
        self.port = listener.getsockname()[1]
        thread.start()
        logger.info("metrics on %s", self.url)

    def stop(self) -> None:
        listener, thread, wake = self._listener, self._thread, self._wake
        self._listener = self._thread = self._wake = None
        if listener is None:
            return
        self._stopping.set()
        if wake is not None:
            with contextlib.suppress(OSError):
                wake[1].send(b"x")
        if thread is not None:
            thread.join(STOP_JOIN_S)
        listener.close()
        if wake is not None:
            wake[0].close()
            wake[1].close()

    # ---- the loop (its own thread) ----------------------------------------------------------

    def _serve(self, listener: socket.socket, wake: socket.socket) -> None:
        sel = selectors.DefaultSelector()
        conns: dict[socket.socket, _Connection] = {}
        try:
            sel.register(listener, selectors.EVENT_READ)
            sel.register(wake, selectors.EVENT_READ)
            while not self._stopping.is_set():
                now = time.monotonic()
                if self._paused_until is not None and now >= self._paused_until:
                    self._paused_until = None
                    sel.register(listener, selectors.EVENT_READ)
                waits = [_TICK_S] + [c.deadline - now for c in conns.values()]
                if self._paused_until is not None:
                    waits.append(self._paused_until - now)
                for key, events in sel.select(max(0.0, min(waits))):
                    sock = key.fileobj
                    if sock is listener:
                        self._accept(listener, sel, conns)
                    elif sock is wake:
                        break
                    else:
                        assert isinstance(sock, socket.socket)
                        conn = conns.get(sock)
                        if conn is not None and not self._step(conn, events, sel):
                            self._drop(conn, sel, conns)
                now = time.monotonic()
                for conn in [c for c in conns.values() if now >= c.deadline]:
                    self._drop(conn, sel, conns)
        except Exception:
            logger.exception("the metrics endpoint failed; metrics are no longer served")
        finally:
            for conn in list(conns.values()):
                self._drop(conn, sel, conns)
            sel.close()

    def _accept(
        self,
        listener: socket.socket,
        sel: selectors.BaseSelector,
        conns: dict[socket.socket, _Connection],
    ) -> None:
        for _ in range(ACCEPTS_PER_WAKE):
            try:
                sock, _ = listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                self.failed_accepts += 1
                if exc.errno in _OUT_OF_RESOURCES:
                    # The connection stays queued; accepting again at once would only fail again.
                    sel.unregister(listener)
                    self._paused_until = time.monotonic() + ACCEPT_PAUSE_S
                    self._log.note(
                        "cannot accept connections",
                        f"{exc.strerror or exc}; retrying every {ACCEPT_PAUSE_S:g} s",
                    )
                    return
                self._log.note("accept failed", str(exc))
                continue
            if len(conns) >= self.max_connections and not self._make_room(sel, conns):
                self.refused += 1
                self._log.note("connection refused", "every open connection is being answered")
                sock.close()
                continue
            sock.setblocking(False)
            conn = _Connection(sock, time.monotonic() + self.connection_timeout)
            conns[sock] = conn
            sel.register(sock, selectors.EVENT_READ)

    def _make_room(
        self, sel: selectors.BaseSelector, conns: dict[socket.socket, _Connection]
    ) -> bool:
        """Close the connection that has waited longest for its request; False if none waits."""
        waiting = [c for c in conns.values() if not c.answered]
        if not waiting:
            return False
        self.evicted += 1
        self._log.note("connection closed to make room", "the one waiting longest for a request")
        self._drop(min(waiting, key=lambda c: c.deadline), sel, conns)
        return True

    def _drop(
        self,
        conn: _Connection,
        sel: selectors.BaseSelector,
        conns: dict[socket.socket, _Connection],
    ) -> None:
        conns.pop(conn.sock, None)
        with contextlib.suppress(KeyError, ValueError):
            sel.unregister(conn.sock)
        conn.sock.close()

    def _step(self, conn: _Connection, events: int, sel: selectors.BaseSelector) -> bool:
        """Read or write what the socket allows; False when the connection is done."""
        try:
            if not conn.answered and events & selectors.EVENT_READ:
                data = conn.sock.recv(4096)
                if not data:
                    return False
                conn.inbox += data
                head, sep, _ = bytes(conn.inbox).partition(b"\r\n\r\n")
                if not sep:
                    if len(conn.inbox) > MAX_REQUEST_BYTES:
                        conn.outbox = _status_only("431 Request Header Fields Too Large")
                    else:
                        return True
                else:
                    try:
                        conn.outbox = self._answer(head)
                    except Exception:
                        # A collector that fails must not end the endpoint for every scrape.
                        logger.exception("metrics endpoint: the scrape failed")
                        conn.outbox = _status_only("500 Internal Server Error")
                conn.answered = True
                sel.modify(conn.sock, selectors.EVENT_WRITE)
            if conn.answered:
                sent = conn.sock.send(conn.outbox)
                conn.outbox = conn.outbox[sent:]
                return bool(conn.outbox)
            return True
        except (BlockingIOError, InterruptedError):
            return True
        except OSError:
            return False

    def _answer(self, head: bytes) -> bytes:
        lines = head.decode("latin-1").split("\r\n")
        parts = lines[0].split(" ")
        if len(parts) != 3 or not parts[2].startswith("HTTP/"):
            return _status_only("400 Bad Request")
        method, target = parts[0], parts[1]
        if method not in ("GET", "HEAD"):
            return _status_only("405 Method Not Allowed")
        path, _, query = target.partition("?")
        environ: dict[str, Any] = {
            "REQUEST_METHOD": method,
            "PATH_INFO": unquote(path),
            "QUERY_STRING": query,
            "SERVER_PROTOCOL": "HTTP/1.0",
        }
        for line in lines[1:]:
            name, sep, value = line.partition(":")
            if sep:
                environ["HTTP_" + name.strip().upper().replace("-", "_")] = value.strip()
        status: list[str] = []
        headers: list[tuple[str, str]] = []

        def start_response(s: str, h: list[tuple[str, str]], exc_info: Any = None) -> None:
            status.append(s)
            headers.extend(h)

        assert self._app is not None
        body = b"".join(self._app(environ, start_response))
        if method == "HEAD":
            body = b""
        head_out = [f"HTTP/1.0 {status[0] if status else '500 Internal Server Error'}"]
        head_out += [f"{k}: {v}" for k, v in headers if k.lower() != "content-length"]
        head_out += [f"Content-Length: {len(body)}", "Connection: close", "", ""]
        return "\r\n".join(head_out).encode("latin-1") + body


def _status_only(status: str) -> bytes:
    return f"HTTP/1.0 {status}\r\nContent-Length: 0\r\nConnection: close\r\n\r\n".encode()
