"""The coordinator's Prometheus metrics, derived from the effects of the state machine.

Every batch of effects the coordinator carries out passes `CoordinatorMetrics.observe`; the
numbers come from those effects (job events, job changes) plus cheap queries of the cluster, never
from the gRPC layer. Gauges are kept as snapshots the scrape thread only reads, so a scrape never
touches the cluster from outside the event loop.

- `gelastic_jobs{state}`: jobs the coordinator knows, by `JobState`.
- `gelastic_nodes{state}`: registered nodes, `live`, `quarantined` or `lost` (refreshed at most
  twice a second).
- `gelastic_restarts_total`: restarts that spent the restart budget.
- `gelastic_failures_total{category}`: worker failures by `FailureCategory`; a node lost under a
  job counts once per job as `INFRA`.
- `gelastic_rendezvous_duration_seconds`: from a job entering the queue (submitted, restarting or
  re-forming) to its round being assigned (the job becomes RUNNING).
- `gelastic_failure_to_restart_seconds`: from the first failure (or node loss) of a round to the
  moment every worker of a later round has started.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Iterable, Sequence

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.process_collector import ProcessCollector
from prometheus_client.registry import Collector

from client.model import FailureCategory, JobEvent, JobState
from client.node_protocol import Heartbeat
from coordinator._cluster import CloseSession, Cluster, Effect, EventRecorded, Forgotten, JobChanged

__all__ = ["CoordinatorMetrics"]

logger = logging.getLogger(__name__)

NODE_REFRESH_S = 0.5
_WAITING = frozenset({JobState.QUEUED, JobState.RENDEZVOUS})
_NODE_STATES = ("live", "quarantined", "lost")
RENDEZVOUS_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800, 3600)
MAX_TORCH_SERIES = 100
"""Distinct (group, name) series of torch metrics kept per job; more are dropped, counted."""
RECOVERY_BUCKETS = (0.1, 0.25, 0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300, 600, 1800)


class CoordinatorMetrics:
    """Metrics of one coordinator, on a registry of its own (`self.registry`)."""

    def __init__(self, cluster: Cluster, clock: Callable[[], float] = time.time) -> None:
        self._cluster = cluster
        self._clock = clock
        self.registry = CollectorRegistry()
        # Jobs restored from disk are counted, but their waits are not timed: when they began
        # is not known.
        self._job_states: dict[str, JobState] = {j: cluster.job_state(j) for j in cluster.job_ids()}
        # Every key exists from the start, so the scrape thread can copy it while it changes.
        self._job_counts: dict[str, int] = {s.value: 0 for s in JobState}
        for state in self._job_states.values():
            self._job_counts[state.value] += 1
        self._node_counts: dict[str, int] = dict.fromkeys(_NODE_STATES, 0)
        self._nodes_refreshed = -math.inf
        self._waiting_since: dict[str, float] = {}
        self._failed_at: dict[str, tuple[float, int]] = {}  # job -> (first failure, its round)

        self.restarts = Counter(
            "gelastic_restarts_total",
            "Restarts of a job that spent its restart budget",
            registry=self.registry,
        )
        self.failures = Counter(
            "gelastic_failures_total",
            "Worker failures by category (USER, PLATFORM, INFRA, INPUT); node losses are INFRA",
            ["category"],
            registry=self.registry,
        )
        for category in FailureCategory:
            self.failures.labels(category.value)
        self.rendezvous = Histogram(
            "gelastic_rendezvous_duration_seconds",
            "From a job entering the queue to its round being assigned (RUNNING)",
            buckets=RENDEZVOUS_BUCKETS,
            registry=self.registry,
        )
        self.failure_to_restart = Histogram(
            "gelastic_failure_to_restart_seconds",
            "From the first failure of a round to every worker of the next round started",
            buckets=RECOVERY_BUCKETS,
            registry=self.registry,
        )
        self.leading: Callable[[], bool] | None = None
        """With replicas: whether this one leads (`gelastic_coordinator_leader`, 1 or 0)."""
        self._torch: dict[str, dict[tuple[str, str], float]] = {}
        """Job -> (group, name) -> the latest value its workers put (torch_metrics jobs only).
        Replaced, never changed in place: the scrape thread reads it whole."""
        self.torch_dropped = 0
        """Torch metric samples refused: of a job without torch_metrics, or past its series cap."""
        self.sink_drops: Callable[[], dict[str, int]] | None = None
        """With event sinks: the events each lost (`gelastic_event_sink_dropped_events`)."""
        self.registry.register(_StateGauges(self))
        ProcessCollector(registry=self.registry)
        self._refresh_nodes()

    def adopt(self, cluster: Cluster) -> None:
        """Count from `cluster` from now on (a replica that took over, or stepped down)."""
        self._cluster = cluster
        self._job_states = {j: cluster.job_state(j) for j in cluster.job_ids()}
        counts = dict.fromkeys(self._job_counts, 0)
        for state in self._job_states.values():
            counts[state.value] += 1
        self._job_counts.update(counts)
        self._waiting_since = {}
        self._failed_at = {}
        self._refresh_nodes()

    # ---- snapshots read by the scrape thread -----------------------------------------------

    def job_counts(self) -> dict[str, int]:
        return dict(self._job_counts)

    def node_counts(self) -> dict[str, int]:
        return self._node_counts

    # ---- the hook --------------------------------------------------------------------------

    def observe(self, effects: Sequence[Effect]) -> None:
        """Account for one batch of effects. Never raises: metrics must not break the service."""
        try:
            self._observe(effects)
        except Exception:
            logger.exception("metrics: could not account for %d effects", len(effects))

    def _observe(self, effects: Sequence[Effect]) -> None:
        now = self._clock()
        started: set[str] = set()
        lost_session = False
        for eff in effects:
            if isinstance(eff, EventRecorded):
                if eff.event.kind == "workers_started":
                    started.add(eff.event.job_id)
                else:
                    self._on_event(eff.event, now)
            elif isinstance(eff, JobChanged):
                self._on_job_changed(eff.job_id, now)
            elif isinstance(eff, CloseSession):
                lost_session = True
            elif isinstance(eff, Forgotten) and eff.job_id:
                if eff.job_id in self._torch:
                    self._torch = {j: s for j, s in self._torch.items() if j != eff.job_id}
                gone = self._job_states.pop(eff.job_id, None)
                if gone is not None:
                    self._job_counts[gone.value] -= 1
                self._waiting_since.pop(eff.job_id, None)
                self._failed_at.pop(eff.job_id, None)
        for job_id in started:
            self._on_workers_started(job_id, now)
        if lost_session or time.monotonic() - self._nodes_refreshed >= NODE_REFRESH_S:
            self._refresh_nodes()

    def observe_heartbeat(self, beat: Heartbeat) -> None:
        """Keep the torch metrics a heartbeat carries, of jobs that asked for them."""
        if not beat.torch_metrics:
            return
        torch = dict(self._torch)
        for t in beat.torch_metrics:
            c = self._cluster
            if not c.has_job(t.job_id) or not c.job_spec(t.job_id).torch_metrics:
                self.torch_dropped += 1
                continue
            series = torch[t.job_id] = dict(torch.get(t.job_id, {}))
            if (t.group, t.name) not in series and len(series) >= MAX_TORCH_SERIES:
                self.torch_dropped += 1
                continue
            series[(t.group, t.name)] = t.value
        self._torch = torch

    def torch_series(self) -> dict[str, dict[tuple[str, str], float]]:
        return self._torch

    def _on_event(self, event: JobEvent, now: float) -> None:
        if event.kind == "restart":
            self.restarts.inc()
        elif event.kind in ("worker_failed", "node_lost"):
            category = (
                self._category(event)
                if event.kind == "worker_failed"
                else FailureCategory.INFRA.value
            )
            self.failures.labels(category).inc()
            if not self._cluster.job_state(event.job_id).is_terminal():
                self._failed_at.setdefault(event.job_id, (now, event.round))

    def _on_job_changed(self, job_id: str, now: float) -> None:
        if not self._cluster.has_job(job_id):
            return  # already past retention
        state = self._cluster.job_state(job_id)
        before = self._job_states.get(job_id)
        if state == before:
            return
        self._job_states[job_id] = state
        if before is not None:
            self._job_counts[before.value] -= 1
        self._job_counts[state.value] += 1
        # QUEUED <-> RENDEZVOUS is one wait; anything else entering them starts a new one.
        if state in _WAITING and before not in _WAITING:
            self._waiting_since[job_id] = now
        elif state == JobState.RUNNING:
            since = self._waiting_since.pop(job_id, None)
            if since is not None:
                self.rendezvous.observe(max(0.0, now - since))
        if state.is_terminal():
            self._waiting_since.pop(job_id, None)
            self._failed_at.pop(job_id, None)

    def _on_workers_started(self, job_id: str, now: float) -> None:
        if not self._cluster.has_job(job_id):
            return
        failed = self._failed_at.get(job_id)
        if failed is None:
            return
        at, failed_round = failed
        state, round_, all_started = self._cluster.round_progress(job_id)
        if state != JobState.RUNNING or round_ <= failed_round or not all_started:
            return
        del self._failed_at[job_id]
        self.failure_to_restart.observe(max(0.0, now - at))

    def _category(self, event: JobEvent) -> str:
        f = self._cluster.failure(event.job_id, event.rank, event.round)
        return (f.category if f is not None else FailureCategory.USER).value

    def _refresh_nodes(self) -> None:
        counts = dict.fromkeys(_NODE_STATES, 0)
        for node in self._cluster.nodes():
            counts[node.state] = counts.get(node.state, 0) + 1
        self._node_counts = counts  # one reference swap, read whole by the scrape thread
        self._nodes_refreshed = time.monotonic()


class _StateGauges(Collector):
    def __init__(self, metrics: CoordinatorMetrics) -> None:
        self._metrics = metrics

    def collect(self) -> Iterable[Metric]:
        jobs = GaugeMetricFamily(
            "gelastic_jobs", "Jobs the coordinator knows, by state", labels=["state"]
        )
        for state, n in self._metrics.job_counts().items():
            jobs.add_metric([state], n)
        nodes = GaugeMetricFamily(
            "gelastic_nodes", "Registered nodes, live or lost", labels=["state"]
        )
        for state, n in self._metrics.node_counts().items():
            nodes.add_metric([state], n)
        out: list[Metric] = [jobs, nodes]
        leading = self._metrics.leading
        if leading is not None:
            leader = GaugeMetricFamily(
                "gelastic_coordinator_leader", "1 while this replica leads, 0 while it stands by"
            )
            leader.add_metric([], 1 if leading() else 0)
            out.append(leader)
        torch = GaugeMetricFamily(
            "gelastic_torch_metric",
            "The latest value a job's workers put through torch.distributed.elastic.metrics "
            "(jobs with torch_metrics)",
            labels=["job", "group", "name"],
        )
        for job, series in self._metrics.torch_series().items():
            for (group, name), value in series.items():
                torch.add_metric([job, group, name], value)
        dropped_torch = GaugeMetricFamily(
            "gelastic_torch_metric_dropped",
            "Torch metric samples refused: of a job without torch_metrics, or past its cap",
        )
        dropped_torch.add_metric([], self._metrics.torch_dropped)
        out += [torch, dropped_torch]
        drops = self._metrics.sink_drops
        if drops is not None:
            dropped = GaugeMetricFamily(
                "gelastic_event_sink_dropped_events",
                "Job events an event sink lost (its queue full, or it raised)",
                labels=["sink"],
            )
            for sink, n in drops().items():
                dropped.add_metric([sink], n)
            out.append(dropped)
        return out
