"""Agent plug-ins named module:object, in a real agent with real workers: a `before_round` veto
fails the round on that node with the reason shown, a failing `health_check` quarantines the
node (as `gelastic nodes` shows), and hooks that raise, hang or return nonsense leave the agent
running its jobs."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest

from client import cli
from client.model import FailureCategory, JobSpec, JobState
from coordinator.server import Coordinator, CoordinatorConfig
from nodeagent.session import AgentConfig, NodeAgent
from tests._helpers import wait_for
from tests.service import _site_plugins

WAIT_S = 60.0
VETO = "tests.service._site_plugins:Veto"


def _agent(c: Coordinator, tmp_path: Path, *plugins: str, **kw: float) -> NodeAgent:
    return NodeAgent(
        AgentConfig(
            coordinator=c.address,
            name="n1",
            addr="127.0.0.1",
            log_dir=str(tmp_path / "logs"),
            plugins=plugins,
            **kw,  # type: ignore[arg-type]
        )
    )


def _config(tmp_path: Path) -> CoordinatorConfig:
    return CoordinatorConfig(state_dir=str(tmp_path / "state"), port=0, heartbeat_interval=0.2)


def _spec(code: str = "pass", restarts: int = 0) -> JobSpec:
    return JobSpec(
        entrypoint=[sys.executable, "-c", code],
        nproc_per_node=2,
        min_nodes=1,
        max_nodes=1,
        last_call_timeout=0,
        max_restarts=restarts,
    )


async def test_a_before_round_veto_fails_the_round_with_its_reason(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    async with Coordinator(_config(tmp_path)) as c, _agent(c, tmp_path, VETO):
        job = await c.service.submit(_spec(f"open({str(marker)!r}, 'w')"))
        cluster = c.service.cluster
        await wait_for(lambda: cluster.job_state(job) == JobState.FAILED, WAIT_S, what="FAILED")
        result = cluster.job_result(job)
        events = [e.reason for e in cluster.job_events(job)]
    assert result is not None and result.failures and set(result.failures) <= {0, 1}
    for f in result.failures.values():
        assert f.category == FailureCategory.INFRA
        assert "plug-in tests.service._site_plugins:Veto: scratch disk full on n1" in f.message
    assert any("scratch disk full on n1" in r for r in events), events
    assert not marker.exists()  # no worker started


async def test_a_failing_health_check_quarantines_the_node(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    async with Coordinator(_config(tmp_path)) as c:
        agent = _agent(c, tmp_path, "tests.service._site_plugins:Sick", health_check_interval=0.1)
        async with agent:
            cluster = c.service.cluster
            await wait_for(
                lambda: [n.state for n in cluster.nodes()] == ["quarantined"],
                WAIT_S,
                what="the quarantine",
            )
            code = await asyncio.to_thread(cli.main, ["--coordinator", c.address, "nodes"])
    out = capsys.readouterr().out
    assert code == 0
    assert "quarantined" in out and "ECC errors on the NIC" in out, out


async def test_hooks_that_raise_hang_or_return_nonsense_do_not_break_the_agent(
    tmp_path: Path,
) -> None:
    broken = _site_plugins.Broken
    broken.exits.clear()
    broken.hang.clear()
    async with Coordinator(_config(tmp_path)) as c:
        agent = _agent(
            c,
            tmp_path,
            "tests.service._site_plugins:Broken",
            plugin_timeout=0.2,
            health_check_interval=0.1,
        )
        try:
            async with agent:
                cluster = c.service.cluster
                for _ in range(2):  # the second job's exits find the first's hooks still hung
                    job = await c.service.submit(_spec())
                    await wait_for(
                        lambda job=job: cluster.job_state(job) == JobState.SUCCEEDED,
                        WAIT_S,
                        what="the job to succeed",
                    )
                await wait_for(lambda: agent.plugins.errors >= 4, WAIT_S, what="hook errors")
                assert [n.state for n in cluster.nodes()] == ["live"]
                assert agent.connected.is_set()
        finally:
            broken.hang.set()
    assert {(i.global_rank, i.exitcode, i.signal) for i in broken.exits} == {(0, 0, 0), (1, 0, 0)}
