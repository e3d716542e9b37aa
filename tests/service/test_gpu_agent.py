"""A real node agent over a fake NVML: it offers its GPUs (one slot each), its real workers run
with CUDA_VISIBLE_DEVICES set to their own GPUs, and a GPU that falls off the bus reaches the
coordinator in a heartbeat and quarantines the node."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

from client.model import JobSpec, JobState
from coordinator.server import Coordinator, CoordinatorConfig
from nodeagent.session import AgentConfig, NodeAgent
from tests._fake_nvml import FakeNvml
from tests._helpers import wait_for

WAIT_S = 60.0

WORKER = """
import os, sys, time
out, go = sys.argv[1], sys.argv[2]
with open(os.path.join(out, os.environ["LOCAL_RANK"]), "w") as f:
    f.write(os.environ.get("CUDA_VISIBLE_DEVICES", "<unset>"))
deadline = time.monotonic() + 60
while not os.path.exists(go) and time.monotonic() < deadline:
    time.sleep(0.05)
"""


async def test_workers_see_their_own_gpus_and_a_lost_gpu_quarantines_the_node(
    tmp_path: Path,
) -> None:
    nvml = FakeNvml(count=4)
    config = CoordinatorConfig(
        state_dir=str(tmp_path / "state"), port=0, lease=30.0, heartbeat_interval=0.2
    )
    go = tmp_path / "go"
    async with Coordinator(config) as c:
        agent = NodeAgent(
            AgentConfig(
                coordinator=c.address,
                name="gpu-node",
                addr="127.0.0.1",
                log_dir=str(tmp_path / "logs"),
                gpus="auto",
            ),
            nvml=nvml,
        )
        async with agent:
            await asyncio.wait_for(agent.connected.wait(), WAIT_S)
            (node,) = c.service.cluster.nodes()
            assert node.slots == 4  # one per GPU: no --slots given
            assert [g.uuid for g in node.gpus] == [g.uuid for g in nvml.gpus]
            jobs = {}
            for name in ("a", "b"):
                out = tmp_path / name
                out.mkdir()
                spec = JobSpec(
                    entrypoint=[sys.executable, "-c", WORKER, str(out), str(go)],
                    nproc_per_node=2,
                    min_nodes=1,
                    max_nodes=1,
                    last_call_timeout=0,
                    # The user's value loses on a GPU node: the placement owns the devices.
                    env={"CUDA_VISIBLE_DEVICES": "0,1,2,3"},
                )
                jobs[name] = await c.service.submit(spec)
                await wait_for(  # both files written, not only made: open() comes first
                    lambda out=out: sum(bool(p.read_text()) for p in out.iterdir()) == 2,
                    WAIT_S,
                    what=f"job {name}'s workers",
                )
            seen = {
                name: [(tmp_path / name / str(lr)).read_text() for lr in (0, 1)] for name in jobs
            }
            uuids = [g.uuid for g in nvml.gpus]
            want = {"a": ",".join(uuids[:2]), "b": ",".join(uuids[2:])}
            assert seen == {name: [want[name]] * 2 for name in jobs}
            go.touch()
            cluster = c.service.cluster
            await wait_for(
                lambda: all(cluster.job_state(j) == JobState.SUCCEEDED for j in jobs.values()),
                WAIT_S,
                what="both jobs to succeed",
            )
            assert cluster.nodes()[0].gpus_used == ()

            nvml.gpus[3].lost = True
            await wait_for(
                lambda: cluster.nodes()[0].state == "quarantined", WAIT_S, what="the quarantine"
            )
            assert f"GPU 3 ({uuids[3]}) is lost" in cluster.nodes()[0].quarantine_reason
