"""The coordinator restarts (kill -9) with nothing lost and no worker restarted."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from client import JobSpec, JobState, WorkerState
from gelastic.local import LocalCluster, poll_until
from tests.e2e.conftest import PY, Gate, script

TIMEOUT = 120


def _running(job: Any, n: int) -> bool:
    return len([w for w in job.status().workers if w.pid and w.state == WorkerState.HEALTHY]) == n


def test_kill_9_mid_job_loses_nothing(cluster: LocalCluster, out: Path, gate: Gate) -> None:
    done = cluster.client.submit(
        JobSpec(entrypoint=[PY, "-c", "pass"], nproc_per_node=2, min_nodes=2, max_nodes=2)
    )
    done_result = done.wait(TIMEOUT)
    assert done_result.state == WorkerState.SUCCEEDED
    spec = JobSpec(
        entrypoint=[PY, script("crash_once.py")],
        nproc_per_node=2,
        min_nodes=2,
        max_nodes=2,
        env={"OUT_DIR": str(out), "CRASH_UNTIL": "0", **gate.env},
    )
    job = cluster.client.submit(spec)
    gate.wait("start", 4)
    poll_until(lambda: _running(job, 4), 60, what="4 workers running")
    pids = {w.global_rank: w.pid for w in job.status().workers}
    queued = cluster.client.submit(
        JobSpec(entrypoint=[PY, "-c", "pass"], nproc_per_node=2, min_nodes=2, max_nodes=2)
    )
    assert queued.status().state == JobState.QUEUED

    killed_at = time.time()
    cluster.kill_coordinator()
    cluster.start_coordinator(port=cluster.port)
    back_at = time.time()
    # The workers may finish only once the new coordinator has taken both nodes' rounds back.
    poll_until(
        lambda: {e.node for e in job.events() if e.kind == "adopted"} == {"node-0", "node-1"},
        60,
        what="both nodes to reconnect with their running workers",
    )
    gate.open("finish")

    result = job.wait(TIMEOUT)
    assert result.state == WorkerState.SUCCEEDED, result.format_failures()
    # Mid-job: every worker started before the kill and finished after the restart.
    assert all(e["time"] < killed_at for e in gate.events("start"))
    finished = gate.events("finish")
    assert sorted(e["rank"] for e in finished) == [0, 1, 2, 3]
    assert all(e["time"] > back_at for e in finished)
    seen = {
        int(p.stem.split("rank")[1]): json.loads(p.read_text())["pid"]
        for p in out.glob("attempt0_*.json")
    }
    assert seen == pids  # the same worker processes finished the job: none was restarted
    assert {e["rank"]: e["pid"] for e in finished} == pids
    assert not list(out.glob("attempt1_*.json"))
    assert job.status().attempt == 0
    assert queued.wait(TIMEOUT).state == WorkerState.SUCCEEDED
    again = done.poll()
    assert again is not None and again.state == WorkerState.SUCCEEDED
    kinds = [e.kind for e in job.events()]
    assert "recovered" in kinds and "adopted" in kinds
    assert kinds.index("submitted") < kinds.index("round_formed") < kinds.index("recovered")


def test_an_exit_while_the_coordinator_is_down_is_applied(
    cluster: LocalCluster, out: Path, gate: Gate
) -> None:
    spec = JobSpec(
        entrypoint=[PY, script("crash_once.py")],
        nproc_per_node=2,
        min_nodes=2,
        max_nodes=2,
        max_restarts=1,
        env={"OUT_DIR": str(out), "CRASH_RANK": "3", "CRASH_UNTIL": "1", **gate.env},
        stop_grace=5,
    )
    job = cluster.client.submit(spec)
    gate.wait("start", 4, attempt=0)
    poll_until(lambda: _running(job, 4), 60, what="4 workers running")
    cluster.kill_coordinator()
    down_at = time.time()
    gate.open("crash")
    (crash,) = gate.wait("crash", 1)
    # Rank 3 exits 1 while nobody listens; its agent must keep that exit for the next coordinator.
    poll_until(
        lambda: _exited(cluster, crash["node"], 3),
        30,
        what="rank 3's agent to see it exit while the coordinator is down",
    )
    up_at = time.time()
    cluster.start_coordinator(port=cluster.port)
    gate.wait("start", 4, attempt=1)
    gate.open("finish")
    result = job.wait(TIMEOUT)
    assert result.state == WorkerState.SUCCEEDED, result.format_failures()
    assert [a.attempt for a in result.attempts] == [0, 1]
    first = result.attempts[0]
    assert [f.global_rank for f in first.failures] == [3]
    assert first.failures[0].exitcode == 1
    # The exit happened, and was stamped, between the kill and the restart.
    assert down_at < crash["time"] < up_at
    assert down_at < first.failures[0].precise_timestamp < up_at
    assert (out / "attempt1_rank3.json").exists()
    assert sorted(e["rank"] for e in gate.events("finish", attempt=1)) == [0, 1, 2, 3]


def _exited(cluster: LocalCluster, node: str, rank: int) -> bool:
    return any(
        f"rank {rank}" in line and "exited with 1" in line
        for line in cluster.output(node).splitlines()
    )
