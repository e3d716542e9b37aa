"""An in-process coordinator's config and one node agent of it on 127.0.0.1, as the service
tests that run real workers start them (each test starts and stops them itself)."""

from __future__ import annotations

from pathlib import Path

from coordinator.server import CoordinatorConfig
from nodeagent.session import AgentConfig, NodeAgent


def coordinator_config(tmp_path: Path) -> CoordinatorConfig:
    """State under `tmp_path`, any free port, a lease that never runs out in a test, fast beats."""
    return CoordinatorConfig(
        state_dir=str(tmp_path / "state"), port=0, lease=30.0, heartbeat_interval=0.2
    )


def local_agent(address: str, tmp_path: Path, *, slots: int) -> NodeAgent:
    """Agent node-a of the coordinator at `address`, its logs under `tmp_path`."""
    return NodeAgent(
        AgentConfig(
            coordinator=address,
            name="node-a",
            slots=slots,
            addr="127.0.0.1",
            log_dir=str(tmp_path / "logs"),
        )
    )
