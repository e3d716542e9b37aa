"""An agent that cannot take an Assign says so to the coordinator instead of dropping it.

Before the fix `NodeAgent._assign` logged "ignoring a duplicate or invalid assignment" and
returned: the coordinator heard nothing, the round stayed assigned and its slots taken. Now each
rank of the refused assignment exits at once with a platform failure that names the reason.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from client.model import FailureCategory
from client.wire import failure_from_pb
from nodeagent.session import AgentConfig, NodeAgent
from protos.gelastic.v1 import gelastic_pb2 as pb


def _assign(job_id: str, spec: pb.JobSpec) -> pb.CoordinatorMessage:
    return pb.CoordinatorMessage(
        assign=pb.Assign(
            job_id=job_id,
            round=3,
            attempt=0,
            spec=spec,
            group_rank=0,
            group_world_size=1,
            master_addr="127.0.0.1",
            master_port=29500,
            workers=[
                pb.WorkerRanks(
                    local_rank=lr, global_rank=lr, role_rank=lr, world_size=2, role_world_size=2
                )
                for lr in range(2)
            ],
            run_id=job_id,
        )
    )


def _sent(outbox: asyncio.Queue[pb.NodeMessage]) -> list[pb.NodeMessage]:
    out = []
    while not outbox.empty():
        out.append(outbox.get_nowait())
    return out


@pytest.mark.parametrize(
    ("job_id", "spec", "why"),
    [
        ("x\n-0123456789", pb.JobSpec(entrypoint=["true"], nproc_per_node=2), "job id"),
        ("j-0123456789", pb.JobSpec(entrypoint=[], nproc_per_node=2), "entrypoint"),
    ],
)
async def test_a_refused_assignment_is_a_platform_failure_of_each_rank(
    tmp_path: Path, job_id: str, spec: pb.JobSpec, why: str
) -> None:
    agent = NodeAgent(
        AgentConfig(coordinator="127.0.0.1:1", name="n1", addr="127.0.0.1", log_dir=str(tmp_path))
    )
    outbox: asyncio.Queue[pb.NodeMessage] = asyncio.Queue()
    agent._outbox = outbox  # as while a session is up; nothing is started
    agent._dispatch(_assign(job_id, spec))
    sent = _sent(outbox)
    assert [m.WhichOneof("kind") for m in sent] == ["worker_exited", "worker_exited"]
    assert not agent._held  # nothing runs, nothing is held
    for lr, m in enumerate(sent):
        e = m.worker_exited
        assert (e.job_id, e.round) == (job_id, 3)
        assert e.exit.local_rank == lr and e.exit.has_failure and not e.exit.stopped_by_agent
        failure = failure_from_pb(e.exit.failure)
        assert failure.category == FailureCategory.PLATFORM
        assert "refused the assignment" in failure.message and why in failure.message
