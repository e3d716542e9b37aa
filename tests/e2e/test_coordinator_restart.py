"""The coordinator restarts (kill -9) with nothing lost and no worker restarted."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from client import JobSpec, JobState, WorkerState
from client._local import LocalCluster, poll_until
from tests.e2e.conftest import PY, script

TIMEOUT = 120


def _running(job: Any, n: int) -> bool:
    return len([w for w in job.status().workers if w.pid and w.state == WorkerState.HEALTHY]) == n


def test_kill_9_mid_job_loses_nothing(cluster: LocalCluster, out: Path) -> None:
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
        env={"OUT_DIR": str(out), "CRASH_UNTIL": "0", "SLEEP": "6"},
    )
    job = cluster.client.submit(spec)
    poll_until(lambda: _running(job, 4), 60, what="4 workers running")
    pids = {w.global_rank: w.pid for w in job.status().workers}
    queued = cluster.client.submit(
        JobSpec(entrypoint=[PY, "-c", "pass"], nproc_per_node=2, min_nodes=2, max_nodes=2)
    )
    assert queued.status().state == JobState.QUEUED

    cluster.kill_coordinator()
    cluster.start_coordinator(port=cluster.port)

    result = job.wait(TIMEOUT)
    assert result.state == WorkerState.SUCCEEDED, result.format_failures()
    seen = {
        int(p.stem.split("rank")[1]): json.loads(p.read_text())["pid"]
        for p in out.glob("attempt0_*.json")
    }
    assert seen == pids  # the same worker processes finished the job: none was restarted
    assert not list(out.glob("attempt1_*.json"))
    assert job.status().attempt == 0
    assert queued.wait(TIMEOUT).state == WorkerState.SUCCEEDED
    again = done.poll()
    assert again is not None and again.state == WorkerState.SUCCEEDED
    kinds = [e.kind for e in job.events()]
    assert "recovered" in kinds and "adopted" in kinds
    assert kinds.index("submitted") < kinds.index("round_formed") < kinds.index("recovered")


def test_an_exit_while_the_coordinator_is_down_is_applied(cluster: LocalCluster, out: Path) -> None:
    spec = JobSpec(
        entrypoint=[PY, script("crash_once.py")],
        nproc_per_node=2,
        min_nodes=2,
        max_nodes=2,
        max_restarts=1,
        env={
            "OUT_DIR": str(out),
            "CRASH_RANK": "3",
            "CRASH_UNTIL": "1",
            "CRASH_AFTER": "2",
            "SLEEP": "4",
        },
        stop_grace=5,
    )
    job = cluster.client.submit(spec)
    poll_until(lambda: _running(job, 4), 60, what="4 workers running")
    cluster.kill_coordinator()
    # Rank 3 exits 1 while nobody listens; its agent must keep that exit for the next coordinator.
    poll_until(
        lambda: _rank3_exited(cluster), 30, what="rank 3 to exit while the coordinator is down"
    )
    cluster.start_coordinator(port=cluster.port)
    result = job.wait(TIMEOUT)
    assert result.state == WorkerState.SUCCEEDED, result.format_failures()
    assert [a.attempt for a in result.attempts] == [0, 1]
    first = result.attempts[0]
    assert [f.global_rank for f in first.failures] == [3]
    assert first.failures[0].exitcode == 1
    assert (out / "attempt1_rank3.json").exists()


def _rank3_exited(cluster: LocalCluster) -> bool:
    return any(
        "rank 3" in line and "exited with 1" in line
        for line in cluster.output("node-1").splitlines()
    )
