"""The HTTP endpoint the coordinator and the node agent serve their Prometheus metrics on.

Every set of metrics lives on a registry of its own rather than prometheus_client's global one, so
several agents or coordinators in one process (tests, LocalCluster) never clash. prometheus_client
and the HTTP modules are imported only when an endpoint starts.
"""

from __future__ import annotations

import logging
import socket
import threading
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

__all__ = ["MetricsEndpoint"]

logger = logging.getLogger(__name__)

STOP_JOIN_S = 5.0


class MetricsEndpoint:
    """`GET /metrics` for one registry: prometheus_client's WSGI app on one daemon thread.

    One long-lived thread serves every scrape in turn. prometheus_client's `start_http_server`
    starts a thread per request instead, and the agent forks workers: threads coming and going
    in the parent at that moment are what fork-with-threads handles worst. A scrape takes
    milliseconds, so serving them one at a time costs nothing. The HTTP modules are imported
    only when metrics are on, to keep an idle agent small.

    `start()` binds (an OSError names the address); `stop()` shuts the server down, closes its
    socket and joins its thread. Both are idempotent.
    """

    def __init__(self, registry: CollectorRegistry, host: str, port: int) -> None:
        self.registry = registry
        self.host = host
        self.port = port
        self._server: Any = None
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/metrics"

    def start(self) -> None:
        if self._server is not None:
            return
        from wsgiref.simple_server import WSGIRequestHandler, WSGIServer

        from prometheus_client import make_wsgi_app

        class _QuietHandler(WSGIRequestHandler):
            def log_message(self, format: str, *args: Any) -> None:
                pass  # a scrape every few seconds must not fill the agent's log

        try:
            family = socket.getaddrinfo(
                self.host, self.port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
            )[0][0]
            server_class = type("MetricsServer", (WSGIServer,), {"address_family": family})
            server = server_class((self.host, self.port), _QuietHandler)
        except OSError as exc:
            raise OSError(
                f"cannot serve metrics on {self.host}:{self.port}: {exc.strerror or exc}"
            ) from exc
        server.set_app(make_wsgi_app(self.registry))
        thread = threading.Thread(target=server.serve_forever, name="metrics-http", daemon=True)
        thread.start()
        self._server, self._thread = server, thread
        self.port = server.server_port
        logger.info("metrics on %s", self.url)

    def stop(self) -> None:
        server, thread = self._server, self._thread
        self._server = self._thread = None
        if server is None:
            return
        server.shutdown()
        server.server_close()
        if thread is not None:
            thread.join(STOP_JOIN_S)
