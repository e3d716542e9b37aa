"""Metrics of the real programs: `coordinator serve --metrics-port` and `nodeagent --metrics-port`,
scraped over HTTP while real workers run, and gone once the cluster stops."""

from __future__ import annotations

import urllib.error
import urllib.request
from collections.abc import Callable

from prometheus_client.parser import text_string_to_metric_families

from client import JobSpec, JobState, WorkerState
from gelastic.local import LocalCluster, poll_until
from tests._helpers import free_port
from tests.e2e.conftest import PY

TIMEOUT = 60

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def _scrape(port: int) -> Samples:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def _value(samples: Samples, name: str, **labels: str) -> float | None:
    return samples.get((name, frozenset(labels.items())))


def _wait_for(port: int, pred: Callable[[Samples], bool], what: str) -> Samples:
    seen: list[Samples] = [{}]

    def check() -> bool:
        seen[0] = _scrape(port)
        return pred(seen[0])

    poll_until(check, TIMEOUT, interval=0.1, what=what)
    return seen[0]


def _refused(port: int) -> bool:
    try:
        _scrape(port)
    except (urllib.error.URLError, ConnectionError):
        return True
    return False


def test_coordinator_and_agent_metrics_while_workers_run(
    make_cluster: Callable[..., LocalCluster],
) -> None:
    coord_port, agent_port = free_port(), free_port()
    cluster = make_cluster(
        nodes=1,
        slots=2,
        coordinator_args=["--metrics-port", str(coord_port)],
        agent_args=["--metrics-port", str(agent_port)],
    )
    _wait_for(coord_port, lambda s: _value(s, "gelastic_nodes", state="live") == 1, "1 live node")
    job = cluster.client.submit(
        JobSpec(entrypoint=[PY, "-c", "import time; time.sleep(60)"], nproc_per_node=2)
    )
    node = "node-0"
    samples = _wait_for(
        agent_port,
        lambda s: _value(s, "gelastic_agent_workers", node=node) == 2,
        "the agent to report 2 workers",
    )
    for rank in ("0", "1"):
        labels = {"node": node, "job_id": job.job_id, "rank": rank}
        assert (_value(samples, "gelastic_agent_worker_rss_bytes", **labels) or 0) > 0
        assert _value(samples, "gelastic_agent_worker_cpu_percent", **labels) is not None
    assert (_value(samples, "gelastic_agent_rss_bytes", node=node) or 0) > 0
    assert job.status().state == JobState.RUNNING
    samples = _scrape(coord_port)
    assert _value(samples, "gelastic_jobs", state="RUNNING") == 1
    assert _value(samples, "gelastic_rendezvous_duration_seconds_count") == 1

    job.cancel()
    assert job.wait(TIMEOUT).state == WorkerState.STOPPED
    _wait_for(
        agent_port,
        lambda s: _value(s, "gelastic_agent_workers", node=node) == 0,
        "the agent to report no workers",
    )
    _wait_for(
        coord_port, lambda s: _value(s, "gelastic_jobs", state="CANCELED") == 1, "1 canceled job"
    )
    cluster.stop()
    assert _refused(coord_port), "the coordinator's metrics outlived it"
    assert _refused(agent_port), "the agent's metrics outlived it"
