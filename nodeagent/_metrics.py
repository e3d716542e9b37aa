"""The node agent's Prometheus metrics, and the HTTP endpoint both programs serve metrics on.

The agent's numbers come from the health samples its heartbeat already takes (one psutil walk
per heartbeat, nothing extra): how many workers run, and each worker's CPU and resident memory.
A scrape reads the latest snapshot, so it never touches the worker processes or the event loop.
The agent's own resident memory is read when scraped.

Every set of metrics lives on a registry of its own rather than prometheus_client's global one, so
several agents or coordinators in one process (tests, LocalCluster) never clash.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any
from wsgiref.simple_server import WSGIServer

import psutil
from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.process_collector import ProcessCollector
from prometheus_client.registry import Collector

__all__ = ["AgentMetrics", "MetricsEndpoint", "WorkerSample"]

logger = logging.getLogger(__name__)

STOP_JOIN_S = 5.0


class MetricsEndpoint:
    """`GET /metrics` for one registry, served by prometheus_client on a daemon thread.

    `start()` binds (an OSError names the address); `stop()` shuts the server down, closes its
    socket and joins its thread. Both are idempotent.
    """

    def __init__(self, registry: CollectorRegistry, host: str, port: int) -> None:
        self.registry = registry
        self.host = host
        self.port = port
        self._server: WSGIServer | None = None
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/metrics"

    def start(self) -> None:
        if self._server is not None:
            return
        try:
            server, thread = start_http_server(self.port, addr=self.host, registry=self.registry)
        except OSError as exc:
            raise OSError(
                f"cannot serve metrics on {self.host}:{self.port}: {exc.strerror or exc}"
            ) from exc
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
    """The agent's metrics: fed from each heartbeat, optionally served over HTTP."""

    def __init__(self, node: str, host: str = "127.0.0.1", port: int = 0) -> None:
        self.node = node
        self.registry = CollectorRegistry()
        self._samples: tuple[WorkerSample, ...] = ()
        self._self = psutil.Process()
        self.registry.register(_AgentCollector(self))
        ProcessCollector(registry=self.registry)
        self.endpoint = MetricsEndpoint(self.registry, host, port) if port else None

    def start(self) -> None:
        """Serve the metrics, when a port was given."""
        if self.endpoint is not None:
            self.endpoint.start()

    def stop(self) -> None:
        if self.endpoint is not None:
            self.endpoint.stop()

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
            return int(self._self.memory_info().rss)
        except psutil.Error:
            return 0


class _AgentCollector(Collector):
    def __init__(self, metrics: AgentMetrics) -> None:
        self._metrics = metrics

    def collect(self) -> Iterable[Metric]:
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
