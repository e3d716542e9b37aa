"""An agent is back within its own reconnect pause of the coordinator serving again.

Before the fix each session's channel shared grpc's subchannel with the channels of the tries
before it, so after a few refused connections a new try failed at once, without dialling, until
grpc's own backoff (1 s, growing 1.6 times a try) let it: the agent came back seconds after the
coordinator, whatever its `reconnect_max`. Now each session dials on a subchannel of its own.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from coordinator.server import Coordinator, CoordinatorConfig
from nodeagent.session import AgentConfig, NodeAgent
from tests._helpers import free_port

DOWN_S = 6.0
"""Long enough for grpc's backoff to grow past several seconds."""
PAUSE_S = 0.2


async def test_the_agent_is_back_within_its_pause_of_the_coordinator(tmp_path: Path) -> None:
    port = free_port()
    agent = NodeAgent(
        AgentConfig(
            coordinator=f"127.0.0.1:{port}",
            name="n1",
            addr="127.0.0.1",
            slots=1,
            gpus="none",
            log_dir=str(tmp_path / "logs"),
            reconnect_max=PAUSE_S,
        )
    )
    async with agent:
        await asyncio.sleep(DOWN_S)  # the coordinator is down this long: tries are refused
        assert not agent.connected.is_set()
        config = CoordinatorConfig(state_dir=":memory:", port=port, lease=30.0)
        async with Coordinator(config):
            serving = time.monotonic()
            await asyncio.wait_for(agent.connected.wait(), 30)
            back = time.monotonic() - serving
    # Its pause and a dial; grpc's own backoff would be seconds by now.
    assert back < 1.0, f"the agent was back {back:.2f} s after the coordinator served"
