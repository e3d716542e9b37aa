"""Many agents starting at once are admitted through a bounded queue, none turned away.

10,000 simulated nodes starting at once saw thousands of refused session attempts, each
retried after a backoff: grpc core refused calls past 1,000 pending (at random) or 3,000 (all),
and a session whose hello the busy coordinator had not read within the hello timeout, timed
from the call's start, was refused as one that sent none. Here 1,500 simulated nodes
(`bench._simnodes`: the real session protocol, 500 streams per connection) open their sessions
at once against an in-process coordinator, and every one is welcomed at its first attempt.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from bench._simnodes import SimFleet
from client.node_protocol import Hello
from coordinator import _node_sessions, _service
from coordinator.server import Coordinator, CoordinatorConfig

NODES = 1_500
HELLO_COST_S = 0.002
HELLO_TIMEOUT_S = 2.0
"""CPU each hello costs the coordinator here, and the time a session has to send its hello:
scaled down together, so that 1,500 sessions pile up as 10,000 did on a busy coordinator."""


async def test_thousands_of_sessions_opened_at_once_are_all_welcomed_at_the_first_try(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    open_session = _service.CoordinatorService.open_session

    def busy_open_session(self: _service.CoordinatorService, hello: Hello) -> object:
        until = time.monotonic() + HELLO_COST_S
        while time.monotonic() < until:  # busy, as a loaded coordinator is: bounded
            pass
        return open_session(self, hello)

    monkeypatch.setattr(_service.CoordinatorService, "open_session", busy_open_session)
    monkeypatch.setattr(_node_sessions, "HELLO_TIMEOUT_S", HELLO_TIMEOUT_S)
    config = CoordinatorConfig(
        state_dir=str(tmp_path / "state"), port=0, heartbeat_interval=30.0, lease=120.0
    )
    async with Coordinator(config) as c:
        fleet = SimFleet(c.address, NODES, processes=1)
        try:
            fleet.start()
            stats = await asyncio.to_thread(fleet.wait_welcomed, 60.0)
        finally:
            await asyncio.to_thread(fleet.stop)
    assert stats.welcomed == NODES
    assert stats.refused == 0, stats.refused_why
    assert stats.welcomes == NODES  # one session each: nobody had to come back
