"""The node agent's Prometheus metrics (served by `client.metrics_http.MetricsEndpoint`).

The agent's numbers come from the health samples its heartbeat already takes (one psutil walk
per heartbeat, nothing extra): how many workers run, and each worker's CPU and resident memory.
A scrape reads the latest snapshot, so it never touches the worker processes or the event loop.
The agent's own resident memory is read when scraped.

Every set of metrics lives on a registry of its own rather than prometheus_client's global one, so
several agents or coordinators in one process (tests, LocalCluster) never clash. prometheus_client
is imported only when metrics are served: an agent without `--metrics-port` does not pay for it.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from client.node_protocol import GroupHealth

if TYPE_CHECKING:
    import psutil
    from prometheus_client import CollectorRegistry
    from prometheus_client.core import Metric

    from client.metrics_http import MetricsEndpoint

__all__ = ["AgentMetrics", "WorkerSample"]


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

        from client.metrics_http import MetricsEndpoint

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

    def observe(self, groups: Iterable[GroupHealth]) -> None:
        """Take the groups of a heartbeat (`client.node_protocol.GroupHealth`)."""
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
        import psutil  # only when scraped: an agent without --metrics-port does without it

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
