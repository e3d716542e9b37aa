"""A round of more simulated nodes than a job keeps events: every node's WorkersStarted reaches
the coordinator, and a reader that comes after the round still learns that all of them started.

The scale benchmark once reported "9,997 of 10,000 started" at N=10,000: the coordinator had
processed every WorkersStarted (its job said 10,000 workers running), but it keeps at most
10,000 events per job, and 10,000 `workers_started` events plus `submitted` and `round_formed`
cut three of them before the benchmark read them. Here the bound is 10 and the round 12 nodes
of `bench._simnodes` (the real session protocol, in a process of their own).
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from bench._simnodes import SimFleet, sim_job_spec, wait_round_started
from client import Client
from coordinator import _cluster_core
from coordinator.server import Coordinator, CoordinatorConfig
from tests._helpers import wait_for

NODES = 12


async def test_a_round_wider_than_the_event_log_is_seen_started_after_the_fact(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_cluster_core, "MAX_EVENTS_PER_JOB", 10)
    monkeypatch.setattr(_cluster_core, "EVENTS_HEAD", 2)
    config = CoordinatorConfig(
        state_dir=str(tmp_path / "state"), port=0, heartbeat_interval=5.0, lease=30.0
    )
    async with Coordinator(config) as c:
        fleet = SimFleet(c.address, NODES, processes=1)
        client = Client(c.address, timeout=10)
        try:
            fleet.start()
            await asyncio.to_thread(fleet.wait_welcomed, 30.0)
            job = await asyncio.to_thread(client.submit, sim_job_spec(NODES, name="wide"))
            cluster = c.service.cluster
            await wait_for(
                lambda: cluster.round_progress(job.job_id)[2], 20.0, what="every node started"
            )
            # Only now does the reader look: the cut has already happened.
            times = await asyncio.to_thread(wait_round_started, fleet, client, job.job_id, 10.0)
            events = cluster.job_events(job.job_id)  # before the fleet's going adds its own
        finally:
            client.close()
            await asyncio.to_thread(fleet.stop)
    kinds = [e.kind for e in events]
    assert "events_cut" in kinds, kinds  # the conditions of the lost count hold
    assert kinds.count("workers_started") < NODES, kinds
    assert times.assigned == NODES
    assert times.all_assigned is not None
    assert times.started == NODES
    (last,) = [e for e in events if e.kind == "round_started"]
    assert times.all_started == last.timestamp
    started = [e.timestamp for e in events if e.kind == "workers_started"]
    assert last.timestamp >= max(started)
