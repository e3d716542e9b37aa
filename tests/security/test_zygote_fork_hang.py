"""A zygote that does not answer a fork request does not stop its agent's heartbeats.

The zygote runs the job's own code: its preload, and whatever that registered to run at a fork.
Before the fix the agent waited for the zygote's answer on its event loop, up to 10 s, longer
than a node's lease: a preload whose fork hook took its time made the coordinator count the node
lost and re-form the job. Now the answer is awaited and the agent's session goes on meanwhile.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from client.model import JobSpec, JobState
from coordinator.server import Coordinator, CoordinatorConfig
from tests._helpers import wait_for

REPO = Path(__file__).resolve().parents[2]
PY = sys.executable
LEASE_S = 2.0
HOLD_S = 3 * LEASE_S
"""How long the zygote's fork hook holds a fork while the test watches the node (less than the
10 s after which the agent gives a fork up)."""
STEP = 60.0
WORKER = """
import os, pathlib
pathlib.Path(os.environ["OUT"]).write_text(os.environ["RANK"])
"""


@pytest.fixture
async def coordinator() -> AsyncIterator[Coordinator]:
    config = CoordinatorConfig(state_dir=":memory:", port=0, lease=LEASE_S, heartbeat_interval=0.25)
    async with Coordinator(config) as c:
        yield c


async def test_a_fork_the_zygote_does_not_answer_leaves_the_node_live(
    coordinator: Coordinator, tmp_path: Path
) -> None:
    c = coordinator
    log = (tmp_path / "agent.log").open("w")
    agent = subprocess.Popen(
        [
            *(PY, "-m", "nodeagent.cli", "--coordinator", c.address, "--name", "node-a"),
            *("--slots", "1", "--addr", "127.0.0.1", "--log-dir", str(tmp_path / "logs")),
            *("--state-dir", str(tmp_path / "state")),
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    try:
        cl = c.service.cluster
        await wait_for(
            lambda: [n.state for n in cl.nodes()] == ["live"], STEP, what="the agent to join"
        )
        script = tmp_path / "worker.py"
        script.write_text(WORKER)
        mark, until = tmp_path / "fork-asked", tmp_path / "fork-go"
        spec = JobSpec(
            entrypoint=[PY, str(script)],
            preload=("tests.workloads.preload_fork_hangs",),
            env={
                "PYTHONPATH": str(REPO),
                "HANG_MARK": str(mark),
                "HANG_UNTIL": str(until),
                "OUT": str(tmp_path / "out"),
            },
        )
        job_id = await c.service.submit(spec)
        # The round's worker is asked of the zygote, whose fork hook now holds it.
        await wait_for(mark.exists, STEP, what="the zygote to be asked for a fork")
        held_since = time.monotonic()
        gaps: list[float] = []

        def watched() -> bool:
            (node,) = cl.nodes()
            assert node.state == "live", f"node {node.state} while the fork was held"
            gaps.append(c.service.now() - node.last_seen)
            return time.monotonic() - held_since > HOLD_S

        await wait_for(watched, HOLD_S * 2, interval=0.1, what="the fork to be held long enough")
        assert max(gaps) < LEASE_S, max(gaps)
        assert not until.exists() and cl.job_state(job_id) != JobState.SUCCEEDED
        until.touch()  # the hook lets the fork be made: the worker runs as a fork
        await wait_for(lambda: cl.job_state(job_id).is_terminal(), STEP, what="the job to finish")
        assert cl.job_state(job_id) == JobState.SUCCEEDED
        assert (tmp_path / "out").read_text() == "0"
        kinds = [e.kind for e in cl.job_events(job_id)]
        assert "node_lost" not in kinds and "reform" not in kinds, kinds
        assert cl.job_status(job_id).attempt == 0
    finally:
        agent.terminate()
        try:
            agent.wait(STEP)
        except subprocess.TimeoutExpired:
            agent.kill()
            agent.wait(STEP)
        log.close()
