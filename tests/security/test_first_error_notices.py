"""Early failure notices are hostile input like any other node message or worker file.

The coordinator takes a WorkerFailing only for a worker of the sender's own current round and
only for the process it started there; its texts are clipped; repeats change nothing. The agent
reads an error file announced by inotify with the same bounded, non-blocking reader as at the
exit: a FIFO planted at the path or a flood of rewrites never hangs it and gives one notice.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from client import Client, JobSpec, JobState
from client.model import ProcessFailure
from client.wire import failure_to_pb
from coordinator._cluster import MAX_FAILURE_TEXT
from coordinator.server import Coordinator, CoordinatorConfig
from protos.gelastic.v1 import gelastic_pb2 as pb
from tests._helpers import wait_for
from tests.service._fakes import FakeNode, run_round
from tests.service.test_workers import DEADLINE, PY, Harness, h

__all__ = ["h"]

WAIT_S = 20.0


@pytest.fixture
async def coordinator() -> AsyncIterator[Coordinator]:
    cfg = CoordinatorConfig(state_dir=":memory:", port=0, lease=600.0, heartbeat_interval=1.0)
    async with Coordinator(cfg) as c:
        yield c


def notice(asg: pb.Assign, local_rank: int, pid: int, message: str) -> pb.WorkerFailing:
    g = asg.workers[local_rank].global_rank
    f = ProcessFailure(
        global_rank=g, local_rank=local_rank, pid=pid, exitcode=1, message=message, timestamp=1.0
    )
    return pb.WorkerFailing(
        job_id=asg.job_id,
        round=asg.round,
        local_rank=local_rank,
        global_rank=g,
        pid=pid,
        failure=failure_to_pb(f),
    )


async def test_forged_and_oversized_notices_are_fenced_and_clipped(
    coordinator: Coordinator,
) -> None:
    svc = coordinator.service
    client = Client(f"127.0.0.1:{coordinator.port}", timeout=10)
    try:
        job = await asyncio.to_thread(
            client.submit, JobSpec(entrypoint=["true"], min_nodes=2, max_nodes=2)
        )
        a = FakeNode(coordinator.address, "n1", "127.0.0.1", slots=1)
        b = FakeNode(coordinator.address, "n2", "127.0.0.2", slots=1)
        intruder = FakeNode(coordinator.address, "n3", "127.0.0.3", slots=1)
        for n in (a, b, intruder):
            await n.connect()
        aa, ab = await run_round(a, b)
        # A node that is not in the round names a rank of it; a member names a process it
        # never started: neither stops the job.
        await intruder.send(worker_failing=notice(ab, 0, 1000 + 1, "forged"))
        await a.send(worker_failing=notice(aa, 0, 4242, "not my pid"))
        await a.send(worker_failing=pb.WorkerFailing(job_id=aa.job_id, round=aa.round + 7))
        await intruder.expect("stop")  # fenced off: told to stop what it says it runs
        # The stale round's notice is answered with a stop of that round: all three were read.
        assert (await a.expect("stop")).stop.round == aa.round + 7
        assert svc.cluster.job_state(job.job_id) == JobState.RUNNING
        assert svc.cluster._jobs[job.job_id].current.failures == {}
        assert all(e.kind != "worker_failed" for e in svc.cluster.job_events(job.job_id))
        # The real notice, with a text far over the bound, repeated: one failure, clipped.
        for _ in range(50):
            await b.send(worker_failing=notice(ab, 0, 1000 + 1, "E" * (4 * MAX_FAILURE_TEXT)))
        assert (await a.expect("stop")).stop.round == aa.round
        assert (await b.expect("stop")).stop.round == ab.round
        # No restart left: FAILED at once, while both nodes still stop.
        await wait_for(
            lambda: svc.cluster.job_state(job.job_id) == JobState.FAILED,
            WAIT_S,
            what="the job to fail",
        )
        failures = svc.cluster._jobs[job.job_id].current.failures
        assert list(failures) == [1]
        assert len(failures[1].message) <= MAX_FAILURE_TEXT + 100
        kinds = [e.kind for e in svc.cluster.job_events(job.job_id)]
        assert kinds.count("worker_failed") == 1
        for n in (a, b, intruder):
            await n.close()
    finally:
        client.close()


_PLANTER = """
import json, os, sys, time
path = os.environ["TORCHELASTIC_ERROR_FILE"]
d = os.path.dirname(path)
os.mkfifo(os.path.join(d, "fifo"))
os.replace(os.path.join(d, "fifo"), path)  # a FIFO where the error file goes
time.sleep(0.2)
os.unlink(path)
for i in range(500):  # then a flood of complete rewrites
    with open(path, "w") as f:
        json.dump({"message": f"ValueError: {i}"}, f)
go = sys.argv[1]
deadline = time.monotonic() + 60
while not os.path.exists(go) and time.monotonic() < deadline:
    time.sleep(0.01)
sys.exit(1)
"""


async def test_a_planted_fifo_and_a_flood_of_rewrites_give_one_notice(h: Harness) -> None:
    script = h.script("planter.py", _PLANTER)
    go = h.tmp / "go"
    seen: list[ProcessFailure] = []
    got = asyncio.Event()

    def on_failing(f: ProcessFailure) -> None:
        seen.append(f)
        got.set()

    g, exits = h.group(JobSpec(entrypoint=[PY, script], args=[str(go)]), on_failing=on_failing)
    await h.start(g)
    await asyncio.wait_for(got.wait(), DEADLINE)
    go.write_text("")
    (ex,) = await exits.wait(1)
    assert len(seen) == 1
    assert seen[0].message.startswith("ValueError: ")
    assert ex.failure is not None and ex.failure.message == seen[0].message
    assert ex.exitcode == 1
