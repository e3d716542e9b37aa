"""A real multi-node job: coordinator + two node agents as processes, real torch gloo workers."""

from __future__ import annotations

import json
import signal
import subprocess
from pathlib import Path

from client import JobSpec, JobState, WorkerState
from gelastic.local import LocalCluster, poll_until
from tests.e2e.conftest import PY, script

TIMEOUT = 120


def test_gloo_allreduce_2x2_sees_the_torchrun_env(cluster: LocalCluster, tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    spec = JobSpec(
        entrypoint=[PY, script("allreduce.py")],
        nproc_per_node=2,
        min_nodes=2,
        max_nodes=2,
        env={"OUT_DIR": str(out)},
        role="trainer",
    )
    job = cluster.client.submit(spec)
    result = job.wait(TIMEOUT)
    assert result.state == WorkerState.SUCCEEDED, result.format_failures()
    assert result.failures == {}
    seen = {r: json.loads((out / f"rank{r}.json").read_text()) for r in range(4)}
    status = job.status()
    assert status.state == JobState.SUCCEEDED
    group_of = {m.node: m.group_rank for m in status.members}
    assert sorted(group_of.values()) == [0, 1]
    master_ports = {s["env"]["MASTER_PORT"] for s in seen.values()}
    assert len(master_ports) == 1
    for r, s in seen.items():
        env = s["env"]
        assert s["sum"] == 6.0  # 0 + 1 + 2 + 3 through a real gloo all_reduce
        assert env["RANK"] == str(r)
        assert env["LOCAL_RANK"] == str(r % 2)
        assert env["GROUP_RANK"] == str(r // 2)
        assert env["ROLE_RANK"] == str(r)
        assert env["ROLE_NAME"] == "trainer"
        assert env["WORLD_SIZE"] == "4" and env["ROLE_WORLD_SIZE"] == "4"
        assert env["LOCAL_WORLD_SIZE"] == "2" and env["GROUP_WORLD_SIZE"] == "2"
        assert env["MASTER_ADDR"] == "127.0.0.1"
        assert env["TORCHELASTIC_RESTART_COUNT"] == "0"
        assert env["TORCHELASTIC_MAX_RESTARTS"] == "0"
        assert env["TORCHELASTIC_RUN_ID"] == job.job_id
        assert env["TORCHELASTIC_USE_AGENT_STORE"] == "True"  # group rank 0's agent hosts it
        assert env["TORCHELASTIC_ERROR_FILE"].endswith("error.json")
    assert len({s["env"]["TORCHELASTIC_ERROR_FILE"] for s in seen.values()}) == 4


def test_rank_exiting_3_fails_the_job_and_stops_the_others(cluster: LocalCluster) -> None:
    spec = JobSpec(
        entrypoint=[PY, script("exit_code.py")],
        nproc_per_node=2,
        min_nodes=2,
        max_nodes=2,
        env={"FAIL_RANK": "1", "FAIL_CODE": "3", "SLEEP": "120"},
        stop_grace=5,
    )
    job = cluster.client.submit(spec)
    result = job.wait(TIMEOUT)
    assert result.is_failed()
    assert set(result.failures) == {1}, result.failures
    f = result.failures[1]
    assert f.exitcode == 3 and f.local_rank == 1 and f.pid > 0
    assert f.node in ("node-0", "node-1")
    assert f.root_cause
    # The sleeping peers were stopped on purpose: in neither map.
    assert result.return_values == {}
    assert job.status().state == JobState.FAILED


def test_two_jobs_on_a_cluster_that_fits_one_both_finish(cluster: LocalCluster) -> None:
    spec = JobSpec(
        entrypoint=[PY, "-c", "import time; time.sleep(1)"],
        nproc_per_node=2,
        min_nodes=2,
        max_nodes=2,
        join_timeout=1.0,
    )
    first = cluster.client.submit(spec)
    second = cluster.client.submit(spec)
    r1 = first.wait(TIMEOUT)
    r2 = second.wait(TIMEOUT)
    assert r1.state == WorkerState.SUCCEEDED, r1.format_failures()
    assert r2.state == WorkerState.SUCCEEDED, r2.format_failures()
    s1, s2 = first.status(), second.status()
    # The second job could only start once the first had released the nodes.
    assert s2.submitted_at >= s1.submitted_at
    ev2 = [e for e in second.events() if e.kind == "round_formed"]
    assert ev2 and ev2[0].timestamp >= s1.finished_at


def test_a_cluster_stop_reports_the_process_it_had_to_kill(tmp_path: Path) -> None:
    # The e2e fixtures fail a test on what `stop()` killed; this shows that list is not empty
    # when something outlives its agent.
    c = LocalCluster(nodes=1, slots=1, workdir=tmp_path / "cluster")
    with c:
        # Carries the cluster's marker and no agent owns it: a worker that escaped its agent.
        stray = subprocess.Popen(
            [PY, "-c", "import time; time.sleep(120)"], env=c.env, start_new_session=True
        )
        poll_until(
            lambda: stray.pid in {p.pid for p in c.leftovers()}, 10, what="the stray to start"
        )
    assert [k.pid for k in c.killed] == [stray.pid], c.killed
    assert "alive after its cluster stopped" in str(c.killed[0])
    assert stray.wait(10) == -signal.SIGKILL
    assert not c.leftovers()
    assert all(p.popen.poll() is not None for p in c.agents.values())
