"""torch's elastic metrics from a real torch worker to the coordinator's /metrics: a job with
torch_metrics shows what its worker put; a job without it shows nothing."""

from __future__ import annotations

import asyncio
import sys
import urllib.request
from dataclasses import replace
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from client.model import JobSpec, JobState
from client.node_protocol import Heartbeat, TorchMetric
from coordinator._metrics import MAX_TORCH_SERIES
from coordinator.server import Coordinator, CoordinatorConfig
from nodeagent.session import AgentConfig, NodeAgent
from tests._helpers import free_port, wait_for

WAIT_S = 90.0  # a first `import torch` can be slow on a busy machine
WORKER = """
import sys
from torch.distributed.elastic import metrics
metrics.put_metric("my.metric", 3)
metrics.put_metric("my.other", 7, "mygroup")
@metrics.prof
def step():
    return 1
step()
"""


def _series(port: int) -> dict[tuple[str, str, str], float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    return {
        (s.labels["job"], s.labels["group"], s.labels["name"]): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == "gelastic_torch_metric"
    }


async def test_a_workers_put_metric_reaches_metrics_only_when_its_job_opts_in(
    tmp_path: Path,
) -> None:
    pytest.importorskip("torch", reason="the worker puts its metric through torch")
    port = free_port()
    config = CoordinatorConfig(
        state_dir=str(tmp_path / "state"), port=0, heartbeat_interval=0.2, metrics_port=port
    )
    async with Coordinator(config) as c:
        agent = NodeAgent(
            AgentConfig(
                coordinator=c.address, name="n1", addr="127.0.0.1", log_dir=str(tmp_path / "logs")
            )
        )
        async with agent:
            cluster = c.service.cluster
            jobs = {}
            for opted in (False, True):  # the one without first: its metric had every chance
                spec = JobSpec(
                    entrypoint=[sys.executable, "-c", WORKER],
                    min_nodes=1,
                    max_nodes=1,
                    last_call_timeout=0,
                    torch_metrics=opted,
                    # No store host: these workers never rendezvous (and none outlives the test).
                    env={"TORCHELASTIC_USE_AGENT_STORE": "False"},
                )
                job = jobs[opted] = await c.service.submit(spec)
                await wait_for(
                    lambda job=job: cluster.job_state(job).is_terminal(), WAIT_S, what="the job"
                )
                assert cluster.job_state(job) == JobState.SUCCEEDED

            async def shown() -> dict[tuple[str, str, str], float]:
                return await asyncio.to_thread(_series, port)

            seen: dict[tuple[str, str, str], float] = {}

            async def has_it() -> bool:
                seen.update(await shown())
                return (jobs[True], "torchelastic", "my.metric") in seen

            deadline = asyncio.get_running_loop().time() + WAIT_S
            while not await has_it():
                assert asyncio.get_running_loop().time() < deadline, seen
                await asyncio.sleep(0.1)
    on = jobs[True]
    assert seen[(on, "torchelastic", "my.metric")] == 3
    assert seen[(on, "mygroup", "my.other")] == 7
    assert (on, "torchelastic", "__main__.step.success") in seen
    assert not [key for key in seen if key[0] == jobs[False]]


async def test_the_coordinator_keeps_a_bounded_set_of_series_of_opted_in_jobs_only() -> None:
    port = free_port()
    config = CoordinatorConfig(state_dir=":memory:", port=0, metrics_port=port)
    async with Coordinator(config) as c:
        assert c.metrics is not None
        spec = JobSpec(entrypoint=["/bin/true"], min_nodes=1, max_nodes=1)
        on = await c.service.submit(replace(spec, torch_metrics=True))
        off = await c.service.submit(spec)
        samples = [TorchMetric(on, "g", f"s{i}", i) for i in range(MAX_TORCH_SERIES + 10)]
        samples += [TorchMetric(off, "g", "s", 1.0), TorchMetric("job-gone", "g", "s", 1.0)]
        c.metrics.observe_heartbeat(Heartbeat(torch_metrics=tuple(samples)))
        c.metrics.observe_heartbeat(Heartbeat(torch_metrics=(TorchMetric(on, "g", "s0", -5),)))
        seen = await asyncio.to_thread(_series, port)
    assert len(seen) == MAX_TORCH_SERIES
    assert {job for job, _, _ in seen} == {on}
    assert seen[(on, "g", "s0")] == -5
    assert c.metrics.torch_dropped == 10 + 2
