"""The node agent's Prometheus metrics, and the HTTP endpoint both programs serve metrics on.

The agent's numbers come from the health samples its heartbeat already takes (one psutil walk
per heartbeat, nothing extra): how many workers run, and each worker's CPU and resident memory.
A scrape reads the latest snapshot, so it never touches the worker processes or the event loop.
The agent's own resident memory is read when scraped.

Every set of metrics lives on a registry of its own rather than prometheus_client's global one, so
several agents or coordinators in one process (tests, LocalCluster) never clash. prometheus_client
is imported only when metrics are served: an agent without `--metrics-port` does not pay for it.
"""

from __future__ import annotations

import logging
import socket
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import psutil

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry
    from prometheus_client.core import Metric

__all__ = ["AgentMetrics", "MetricsEndpoint", "WorkerSample"]

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


@dataclass(frozen=True)
class WorkerSample:
    """One running worker's latest health sample, as the metrics see it."""

    job_id: str
    global_rank: int
    cpu_percent: float
    rss_bytes: int


class AgentMetrics:
    """The agent's metrics: fed from each heartbeat, served over HTTP when a port is given."""

    def __init__(self, node: str, host: str = "127.0.0.1", port: int = 0) -> None:
        self.node = node
        self.host = host
        self.port = port
        self.registry: CollectorRegistry | None = None
        self.endpoint: MetricsEndpoint | None = None
        self._samples: tuple[WorkerSample, ...] = ()
        self._self: psutil.Process | None = None

    def start(self) -> None:
        """Serve the metrics, when a port was given (port 0: do nothing)."""
        if not self.port or self.endpoint is not None:
            return
        from prometheus_client import CollectorRegistry
        from prometheus_client.process_collector import ProcessCollector

        registry = CollectorRegistry()
        registry.register(_AgentCollector(self))
        ProcessCollector(registry=registry)
        endpoint = MetricsEndpoint(registry, self.host, self.port)
        endpoint.start()
        self.registry, self.endpoint = registry, endpoint

    def stop(self) -> None:
        endpoint, self.endpoint = self.endpoint, None
        if endpoint is not None:
            endpoint.stop()

    def observe(self, groups: Iterable[Any]) -> None:
        """Take the heartbeat's `GroupHealth` messages (job_id, workers with rank/cpu/rss)."""
        self.set_samples(
            WorkerSample(g.job_id, w.global_rank, w.cpu_percent, w.rss_bytes)
            for g in groups
            for w in g.workers
        )

    def set_samples(self, samples: Iterable[WorkerSample]) -> None:
        # One reference swap: a scrape on the HTTP thread sees either the old or the new snapshot.
        self._samples = tuple(samples)

    def samples(self) -> Sequence[WorkerSample]:
        return self._samples

    def own_rss_bytes(self) -> int:
        try:
            if self._self is None:
                self._self = psutil.Process()
            return int(self._self.memory_info().rss)
        except psutil.Error:
            return 0


class _AgentCollector:
    """A prometheus_client collector reading the latest snapshot."""

    def __init__(self, metrics: AgentMetrics) -> None:
        self._metrics = metrics

    def collect(self) -> Iterable[Metric]:
        from prometheus_client.core import GaugeMetricFamily

        samples = self._metrics.samples()
        workers = GaugeMetricFamily(
            "gelastic_agent_workers", "Worker processes this agent runs", labels=["node"]
        )
        workers.add_metric([self._metrics.node], len(samples))
        cpu = GaugeMetricFamily(
            "gelastic_agent_worker_cpu_percent",
            "CPU use of each running worker (100 = one core), at the last heartbeat",
            labels=["node", "job_id", "rank"],
        )
        rss = GaugeMetricFamily(
            "gelastic_agent_worker_rss_bytes",
            "Resident memory of each running worker, at the last heartbeat",
            labels=["node", "job_id", "rank"],
        )
        for s in samples:
            labels = [self._metrics.node, s.job_id, str(s.global_rank)]
            cpu.add_metric(labels, s.cpu_percent)
            rss.add_metric(labels, s.rss_bytes)
        own = GaugeMetricFamily(
            "gelastic_agent_rss_bytes", "Resident memory of the agent itself", labels=["node"]
        )
        own.add_metric([self._metrics.node], self._metrics.own_rss_bytes())
        return [workers, cpu, rss, own]
