"""An agent can always re-register after a coordinator restart, however big the results it holds.

Its hello names the groups and pids only; every held exit follows the welcome in a message of
its own, so neither the hello nor any one message can outgrow the limit.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from client.assignment import RoundAssignment, WorkerRanks
from client.model import JobSpec, JobState
from client.wire import spec_from_pb
from coordinator.server import MAX_MESSAGE_BYTES, Coordinator, CoordinatorConfig
from nodeagent._workers import WorkerExit
from nodeagent.session import AgentConfig, NodeAgent, _Held
from protos.gelastic.v1 import gelastic_pb2 as pb
from tests.service._fakes import FakeNode

WORKERS = 6
VALUE = 3 * 1024 * 1024  # six of them: 18 MiB, over the 16 MiB message limit


async def test_held_exits_bigger_than_a_message_still_reach_a_restarted_coordinator(
    tmp_path: Path,
) -> None:
    config = CoordinatorConfig(
        state_dir=str(tmp_path / "state"), port=0, lease=30.0, heartbeat_interval=1.0
    )
    spec = JobSpec(entrypoint="pkg.mod:fn", nproc_per_node=WORKERS, min_nodes=1, max_nodes=1)
    async with Coordinator(config) as c:
        job_id = await c.service.submit(spec)
        node = FakeNode(c.address, "node-a", "127.0.0.1", slots=WORKERS)
        await node.connect()
        rp = (await node.expect("reserve_port")).reserve_port
        await node.send(port_reserved=pb.PortReserved(job_id=job_id, round=rp.round, port=40000))
        asg = (await node.expect("assign")).assign
        await node.send(
            workers_started=pb.WorkersStarted(
                job_id=job_id,
                round=asg.round,
                workers=[
                    pb.WorkerPid(local_rank=w.local_rank, pid=1000 + w.local_rank)
                    for w in asg.workers
                ],
            )
        )
        for _ in range(3000):
            if c.service.cluster.job_status(job_id).workers[0].pid == 1000:
                break
            await asyncio.sleep(0.01)
        assert c.service.cluster.job_status(job_id).workers[0].pid == 1000
    # The coordinator went down under an open stream (as in a crash): had the node closed first,
    # the coordinator could have seen it lost before it stopped.
    await node.close()

    # The coordinator is down; meanwhile every worker finished with a big return value.
    async with Coordinator(config.__class__(**{**config.__dict__, "port": c.port})) as c2:
        agent = NodeAgent(
            AgentConfig(
                coordinator=c2.address,
                name="node-a",
                slots=WORKERS,
                addr="127.0.0.1",
                log_dir=str(tmp_path / "logs"),
            )
        )
        agent.incarnation = node.incarnation
        assignment = RoundAssignment(
            job_id=job_id,
            round=asg.round,
            attempt=asg.attempt,
            spec=spec_from_pb(asg.spec),
            group_rank=0,
            group_world_size=1,
            master_addr="127.0.0.1",
            master_port=40000,
            workers=tuple(
                WorkerRanks(
                    w.local_rank, w.global_rank, w.role_rank, w.world_size, w.role_world_size
                )
                for w in asg.workers
            ),
            run_id=job_id,
        )
        held = _Held(assignment, pids={lr: 1000 + lr for lr in range(WORKERS)})
        held.exits = [
            WorkerExit(lr, lr, 1000 + lr, 0, False, None, bytes([lr]) * VALUE, 1.0)
            for lr in range(WORKERS)
        ]
        agent._held[(job_id, asg.round)] = held
        hello = agent._hello()
        assert hello.ByteSize() < 64 * 1024
        assert all(m.ByteSize() < MAX_MESSAGE_BYTES for m in agent._replay())
        async with agent:
            await asyncio.wait_for(agent.connected.wait(), 60)
            for _ in range(6000):
                if c2.service.cluster.job_state(job_id).is_terminal():
                    break
                await asyncio.sleep(0.01)
        assert c2.service.cluster.job_state(job_id) == JobState.SUCCEEDED
        result = c2.service.cluster.job_result(job_id)
        assert result is not None
        assert {r: len(v) for r, v in result.return_values.items()} == {
            r: VALUE for r in range(WORKERS)
        }
