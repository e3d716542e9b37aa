"""Fault tolerance and elasticity with real processes: restarts, lost and new nodes, hangs."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import psutil
import torch

from client import JobSpec, JobState, WorkerState
from client._local import LocalCluster, poll_until
from tests.e2e.conftest import PY, gone, script, wait_started

TIMEOUT = 120


def _seen(out: Path) -> dict[str, dict[str, Any]]:
    return {p.stem: json.loads(p.read_text()) for p in out.glob("*.json")}


def test_crash_once_restarts_every_rank_with_the_same_restart_count(
    cluster: LocalCluster, out: Path
) -> None:
    spec = JobSpec(
        entrypoint=[PY, script("crash_once.py")],
        nproc_per_node=2,
        min_nodes=2,
        max_nodes=2,
        max_restarts=1,
        env={"OUT_DIR": str(out), "CRASH_RANK": "3", "CRASH_UNTIL": "1", "SLEEP": "1"},
        stop_grace=5,
    )
    job = cluster.client.submit(spec)
    result = job.wait(TIMEOUT)
    assert result.state == WorkerState.SUCCEEDED, result.format_failures()
    seen = _seen(out)
    for r in range(4):
        assert seen[f"attempt1_rank{r}"]["TORCHELASTIC_RESTART_COUNT"] == "1"
    assert job.status().attempt == 1
    assert [a.attempt for a in result.attempts] == [0, 1]
    assert "rank 3 failed" in result.attempts[0].end_reason
    assert result.attempts[1].end_reason == "all workers succeeded"


def test_crash_on_every_attempt_exhausts_the_budget(cluster: LocalCluster, out: Path) -> None:
    spec = JobSpec(
        entrypoint=[PY, script("crash_once.py")],
        nproc_per_node=2,
        min_nodes=2,
        max_nodes=2,
        max_restarts=2,
        env={"OUT_DIR": str(out), "CRASH_RANK": "0", "CRASH_UNTIL": "99", "SLEEP": "60"},
        stop_grace=5,
    )
    result = cluster.client.submit(spec).wait(TIMEOUT)
    assert result.is_failed()
    assert [a.attempt for a in result.attempts] == [0, 1, 2]
    assert all("rank 0 failed" in a.end_reason for a in result.attempts)
    assert set(result.failures) == {0} and result.failures[0].attempt == 2


def test_failure_on_any_node_fails_the_whole_job_at_once(cluster: LocalCluster, out: Path) -> None:
    # torchrun lets node 0 finish and wait 300 s in its exit barrier when rank 3 fails elsewhere.
    spec = JobSpec(
        entrypoint=[PY, script("crash_once.py")],
        nproc_per_node=2,
        min_nodes=2,
        max_nodes=2,
        env={
            "OUT_DIR": str(out),
            "CRASH_RANK": "3",
            "CRASH_UNTIL": "1",
            "CRASH_AFTER": "2",
            "SLEEP": "0",
        },
    )
    job = cluster.client.submit(spec)
    result = job.wait(60)
    assert result.is_failed() and set(result.failures) == {3}
    events = [e.kind for e in job.events()]
    assert "barrier_wait" in events  # node 0's ranks finished first and waited
    assert events.index("barrier_wait") < events.index("barrier_released")
    status = job.status()
    assert status.finished_at - status.submitted_at < 30


def test_healthy_ranks_exiting_while_a_peer_crashes_restart_every_rank(
    cluster: LocalCluster, out: Path
) -> None:
    spec = JobSpec(
        entrypoint=[PY, script("crash_once.py")],
        nproc_per_node=2,
        min_nodes=2,
        max_nodes=2,
        max_restarts=1,
        env={
            "OUT_DIR": str(out),
            "CRASH_RANK": "2",
            "CRASH_UNTIL": "1",
            "CRASH_AFTER": "0.5",
            "SLEEP": "0.5",
        },
        stop_grace=5,
    )
    result = cluster.client.submit(spec).wait(TIMEOUT)
    assert result.state == WorkerState.SUCCEEDED, result.format_failures()
    seen = _seen(out)
    assert all(f"attempt1_rank{r}" in seen for r in range(4)), sorted(seen)


def test_agent_sigkill_reforms_on_the_survivors(make_cluster: Any, out: Path) -> None:
    c: LocalCluster = make_cluster(nodes=3)
    spec = JobSpec(
        entrypoint=[PY, script("crash_once.py")],
        nproc_per_node=2,
        min_nodes=2,
        max_nodes=3,
        last_call_timeout=1,
        env={"OUT_DIR": str(out), "CRASH_UNTIL": "0", "SLEEP": "4"},
        stop_grace=5,
    )
    job = c.client.submit(spec)
    wait_started(job, 6)
    status = job.status()
    victim = status.members[-1].node
    victim_pids = [w.pid for w in status.workers if w.node == victim]
    c.kill_agent(victim)
    result = job.wait(TIMEOUT)
    assert result.state == WorkerState.SUCCEEDED, result.format_failures()
    final = job.status()
    assert sorted(m.node for m in final.members) == sorted(
        m.node for m in status.members if m.node != victim
    )
    assert final.attempt == 0  # a lost node does not spend the restart budget
    assert final.round == status.round + 1
    for pid in victim_pids:
        assert gone(pid)


def test_a_new_agent_grows_a_running_job(make_cluster: Any, out: Path) -> None:
    c: LocalCluster = make_cluster(nodes=2)
    spec = JobSpec(
        entrypoint=[PY, script("crash_once.py")],
        nproc_per_node=2,
        min_nodes=2,
        max_nodes=3,
        last_call_timeout=0.5,
        env={"OUT_DIR": str(out), "CRASH_UNTIL": "0", "SLEEP": "3"},
        stop_grace=5,
    )
    job = c.client.submit(spec)
    wait_started(job, 4)
    c.start_agent("node-2")
    poll_until(lambda: len(job.status().members) == 3, 60, what="the job to re-form with 3 nodes")
    result = job.wait(TIMEOUT)
    assert result.state == WorkerState.SUCCEEDED, result.format_failures()
    assert job.status().attempt == 0
    assert any(p.stem.endswith("_rank5") for p in out.glob("*.json"))


def test_watchdog_kills_a_hung_worker_and_the_agent_lives_on(cluster: LocalCluster) -> None:
    spec = JobSpec(
        entrypoint=[PY, script("hang_with_timer.py")],
        nproc_per_node=2,
        min_nodes=2,
        max_nodes=2,
        watchdog=True,
        env={"HANG_RANK": "1"},
        stop_grace=5,
    )
    job = cluster.client.submit(spec)
    result = job.wait(TIMEOUT)
    assert result.is_failed()
    f = result.failures[1]
    assert "train_step" in f.message and "watchdog" in f.message.lower()
    assert f.signal == "SIGKILL"
    cluster.wait_nodes(lambda live: {"node-0", "node-1"} <= live, "both agents still live")
    for name, proc in cluster.agents.items():
        assert proc.popen.poll() is None, f"agent {name} died"
    ok = cluster.client.submit(
        JobSpec(entrypoint=[PY, "-c", "pass"], nproc_per_node=2, min_nodes=2, max_nodes=2)
    )
    assert ok.wait(TIMEOUT).state == WorkerState.SUCCEEDED


def test_cancel_stops_every_worker(cluster: LocalCluster, out: Path) -> None:
    spec = JobSpec(
        entrypoint=[PY, script("crash_once.py")],
        nproc_per_node=2,
        min_nodes=2,
        max_nodes=2,
        env={"OUT_DIR": str(out), "CRASH_UNTIL": "0", "SLEEP": "120"},
        stop_grace=5,
    )
    job = cluster.client.submit(spec)
    wait_started(job, 4)
    pids = [w.pid for w in job.status().workers]
    job.cancel()
    result = job.wait(60)
    assert job.status().state == JobState.CANCELED
    assert result.state == WorkerState.STOPPED and result.failures == {}
    for pid in pids:
        assert gone(pid)


def test_status_shows_health_per_rank(cluster: LocalCluster, out: Path) -> None:
    spec = JobSpec(
        entrypoint=[PY, script("crash_once.py")],
        nproc_per_node=2,
        min_nodes=2,
        max_nodes=2,
        env={"OUT_DIR": str(out), "CRASH_UNTIL": "0", "SLEEP": "30"},
        stop_grace=5,
    )
    job = cluster.client.submit(spec)
    poll_until(
        lambda: (
            all(w.rss_bytes > 0 for w in job.status().workers) and len(job.status().workers) == 4
        ),
        60,
        what="health samples of every rank",
    )
    for w in job.status().workers:
        assert w.state == WorkerState.HEALTHY and w.pid > 0 and w.proc_state
    job.cancel()
    job.wait(60)


def _train(
    c: LocalCluster, tmp: Path, name: str, env: dict[str, str], **kw: Any
) -> tuple[Any, Path]:
    out, ckpt = tmp / f"{name}-out", tmp / f"{name}-ckpt"
    out.mkdir()
    ckpt.mkdir()
    spec = JobSpec(
        entrypoint=[PY, script("ckpt_train.py")],
        nproc_per_node=2,
        env={"OUT_DIR": str(out), "CKPT_DIR": str(ckpt), "STEPS": "30", **env},
        stop_grace=5,
        **kw,
    )
    return c.client.submit(spec), out


def test_checkpointed_training_survives_a_crash_and_an_agent_kill(
    make_cluster: Any, tmp_path: Path
) -> None:
    c: LocalCluster = make_cluster(nodes=3)
    ref_job, ref_out = _train(c, tmp_path, "ref", {}, min_nodes=3, max_nodes=3)
    assert ref_job.wait(TIMEOUT).state == WorkerState.SUCCEEDED
    job, out = _train(
        c,
        tmp_path,
        "chaos",
        {"CRASH_AT_STEP": "5", "CRASH_RANK": "1", "STEP_SLEEP": "0.15"},
        min_nodes=2,
        max_nodes=3,
        max_restarts=2,
        last_call_timeout=1,
    )
    progress = out / "progress"

    def steps_in(attempt: int) -> int:
        if not progress.exists():
            return 0
        return sum(1 for ln in progress.read_text().splitlines() if ln.split()[0] == str(attempt))

    poll_until(lambda: steps_in(1) >= 5, 90, what="attempt 1 to make progress after the crash")
    victim = job.status().members[-1].node
    c.kill_agent(victim)
    result = job.wait(TIMEOUT)
    assert result.state == WorkerState.SUCCEEDED, result.format_failures()
    worlds = {ln.split()[1] for ln in progress.read_text().splitlines()}
    assert worlds == {"6", "4"}, worlds  # 3 nodes, then 2 after the kill
    ref = torch.load(ref_out / "final.pt")
    got = torch.load(out / "final.pt")
    for k in ref:
        assert torch.allclose(ref[k], got[k], atol=1e-5), (k, ref[k], got[k])


def test_a_stopped_worker_makes_the_group_unhealthy_and_fails_the_job(
    cluster: LocalCluster,
) -> None:
    spec = JobSpec(
        entrypoint=[PY, script("stop_self.py")],
        nproc_per_node=2,
        min_nodes=2,
        max_nodes=2,
        env={"STOP_RANK": "2"},
        unhealthy_timeout=1.0,
        stop_grace=5,
    )
    job = cluster.client.submit(spec)
    result = job.wait(TIMEOUT)
    assert result.is_failed()
    assert set(result.failures) == {2}
    f = result.failures[2]
    assert "stopped" in f.message.lower(), f.message
    status = job.status()
    assert status.finished_at - status.submitted_at < 30


def test_binary_workers_die_with_their_agent(cluster: LocalCluster) -> None:
    spec = JobSpec(
        entrypoint=["sleep", "300"], nproc_per_node=2, min_nodes=2, max_nodes=2, stop_grace=5
    )
    job = cluster.client.submit(spec)
    wait_started(job, 4)
    victims = [w.pid for w in job.status().workers if w.node == "node-1"]

    def named_sleep() -> bool:
        try:
            return all(psutil.Process(p).name() == "sleep" for p in victims)
        except psutil.NoSuchProcess:
            return False

    # The stub arms the parent-death signal and execs in place: the pid stays the worker's.
    poll_until(named_sleep, 10, what="the workers to exec sleep")
    cluster.kill_agent("node-1")
    poll_until(lambda: all(gone(p) for p in victims), 10, what="the dead agent's workers to die")
    job.cancel()
    job.wait(60)
