"""Fault tolerance and elasticity with real processes: restarts, lost and new nodes, hangs."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import psutil
import torch

from client import FailureCategory, JobSpec, JobState, WorkerState
from gelastic.local import LocalCluster, poll_until
from tests.e2e.conftest import PY, Gate, gone, script, wait_started

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


def test_agent_sigkill_reforms_on_the_survivors(make_cluster: Any, out: Path, gate: Gate) -> None:
    c: LocalCluster = make_cluster(nodes=3)
    spec = JobSpec(
        entrypoint=[PY, script("crash_once.py")],
        nproc_per_node=2,
        min_nodes=2,
        max_nodes=3,
        last_call_timeout=1,
        env={"OUT_DIR": str(out), "CRASH_UNTIL": "0", **gate.env},
        stop_grace=5,
    )
    job = c.client.submit(spec)
    wait_started(job, 6)
    status = job.status()
    first = gate.wait("start", 6, round=status.round)
    victim = status.members[-1].node
    victim_pids = [w.pid for w in status.workers if w.node == victim]
    killed_at = time.time()
    c.kill_agent(victim)
    gate.wait("start", 4, round=status.round + 1)
    gate.open("finish")
    result = job.wait(TIMEOUT)
    assert result.state == WorkerState.SUCCEEDED, result.format_failures()
    # The kill came while every worker of the first round ran, and none of them finished.
    assert all(e["time"] < killed_at for e in first)
    assert not gate.events("finish", round=status.round)
    assert sorted(e["rank"] for e in gate.events("finish")) == [0, 1, 2, 3]
    assert f"node {victim} lost" in result.attempts[0].end_reason
    # Its workers are INFRA failures of that attempt: the host went away, not the program.
    lost = [f for f in result.attempts[0].failures if f.node == victim]
    assert len(lost) == 2 and {f.category for f in lost} == {FailureCategory.INFRA}, lost
    final = job.status()
    assert sorted(m.node for m in final.members) == sorted(
        m.node for m in status.members if m.node != victim
    )
    assert final.attempt == 0  # a lost node does not spend the restart budget
    assert final.round == status.round + 1
    for pid in victim_pids:
        assert gone(pid)


def test_a_new_agent_grows_a_running_job(make_cluster: Any, out: Path, gate: Gate) -> None:
    c: LocalCluster = make_cluster(nodes=2)
    spec = JobSpec(
        entrypoint=[PY, script("crash_once.py")],
        nproc_per_node=2,
        min_nodes=2,
        max_nodes=3,
        last_call_timeout=0.5,
        env={"OUT_DIR": str(out), "CRASH_UNTIL": "0", **gate.env},
        stop_grace=5,
    )
    job = c.client.submit(spec)
    wait_started(job, 4)
    first_round = job.status().round
    first = gate.wait("start", 4, round=first_round)
    joining_at = time.time()
    c.start_agent("node-2")
    poll_until(lambda: len(job.status().members) == 3, 60, what="the job to re-form with 3 nodes")
    gate.wait("start", 6, round=first_round + 1)
    gate.open("finish")
    result = job.wait(TIMEOUT)
    assert result.state == WorkerState.SUCCEEDED, result.format_failures()
    assert job.status().attempt == 0
    # node-2 joined while the first round ran: after its workers started, before it ended,
    # which it did because of the join (no worker of it finished).
    ended = result.attempts[0]
    assert ended.round == first_round and len(ended.nodes) == 2
    assert "node node-2 joined" in ended.end_reason
    assert all(e["time"] < joining_at for e in first)
    assert joining_at < ended.ended_at
    assert not gate.events("finish", round=first_round)
    grown = gate.events("finish", round=first_round + 1)
    assert sorted(e["rank"] for e in grown) == list(range(6))
    assert {e["node"] for e in grown if e["rank"] in (4, 5)} == {"node-2"}


def test_logs_of_each_attempt_come_from_the_node_the_rank_ran_on(
    make_cluster: Any, out: Path, gate: Gate
) -> None:
    # Rounds place nodes in name order, so node-0, joining as a spare during attempt 0, takes
    # group rank 0 of attempt 1: every rank runs on another node in each attempt.
    c: LocalCluster = make_cluster(nodes=0)
    c.start_agent("node-1")
    c.start_agent("node-2")
    spec = JobSpec(
        entrypoint=[PY, script("crash_once.py")],
        nproc_per_node=2,
        min_nodes=2,
        max_nodes=2,
        max_restarts=1,
        env={"OUT_DIR": str(out), "CRASH_RANK": "3", "CRASH_UNTIL": "1", **gate.env},
        stop_grace=5,
    )
    job = c.client.submit(spec)
    gate.wait("start", 4, attempt=0)
    c.start_agent("node-0")
    gate.open("crash")
    gate.wait("start", 4, attempt=1)
    gate.open("finish")
    result = job.wait(TIMEOUT)
    assert result.state == WorkerState.SUCCEEDED, result.format_failures()
    assert [a.attempt for a in result.attempts] == [0, 1]
    placed = {(a.attempt, r): a.nodes[r // 2] for a in result.attempts for r in range(4)}
    # Where each worker really ran (its agent's environment) is where the coordinator says.
    assert {(e["attempt"], e["rank"]): e["node"] for e in gate.events("start")} == placed
    assert all(placed[(0, r)] != placed[(1, r)] for r in range(4)), placed
    for (attempt, rank), node in placed.items():
        fetched = b"".join(job.logs(rank=rank, attempt=attempt)).decode()
        assert f"rank {rank} attempt {attempt} round " in fetched, fetched
        assert f"agent {node} node {node}" in fetched, fetched
        pattern = f"{job.job_id}/attempt_{attempt}*/{rank}/stdout.log"
        (on_disk,) = c.agent_log_dir(node).glob(pattern)
        assert on_disk.read_text() == fetched
        for other in c.agents:
            if other != node:
                assert not list(c.agent_log_dir(other).glob(pattern)), (other, pattern)
    latest = b"".join(job.logs(rank=0)).decode()
    assert latest == b"".join(job.logs(rank=0, attempt=1)).decode()
    assert f"agent {placed[(1, 0)]} " in latest


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


def test_checkpointed_training_resumes_from_its_checkpoint_after_a_crash_and_an_agent_kill(
    make_cluster: Any, tmp_path: Path
) -> None:
    c: LocalCluster = make_cluster(nodes=3)
    ref_job, ref_out = _train(c, tmp_path, "ref", {}, min_nodes=3, max_nodes=3)
    assert ref_job.wait(TIMEOUT).state == WorkerState.SUCCEEDED
    # Rank 1 crashes after step 5 (attempt 0); attempt 1 holds after step 12 while a node is
    # killed; the survivors finish the 30 steps.
    job, out = _train(
        c,
        tmp_path,
        "chaos",
        {"CRASH_AT_STEP": "5", "CRASH_RANK": "1", "HOLD_AT_STEP": "12"},
        min_nodes=2,
        max_nodes=3,
        max_restarts=2,
        last_call_timeout=1,
    )
    holding = out / "holding"
    poll_until(
        lambda: holding.exists() and holding.read_text().endswith("\n"),
        90,
        what="attempt 1 to hold after step 12",
    )
    status = job.status()
    assert holding.read_text().split() == ["1", str(status.round), "12"]
    victim = status.members[-1].node
    c.kill_agent(victim)
    result = job.wait(TIMEOUT)
    assert result.state == WorkerState.SUCCEEDED, result.format_failures()
    progress = [tuple(map(int, ln.split())) for ln in (out / "progress").read_text().splitlines()]
    # (attempt, world) of each step: 6 ranks until the crash, 6 again after the restart
    # until the kill, then 4; and every step ran exactly once, in order: each round resumed
    # from the checkpoint of the step before, none from step 0.
    assert [p[2] for p in progress] == list(range(30))
    assert [(p[0], p[1]) for p in progress] == [(0, 6)] * 6 + [(1, 6)] * 7 + [(1, 4)] * 17
    resumes: dict[tuple[int, int], list[tuple[int, int]]] = {}
    for ln in (out / "resumes").read_text().splitlines():
        attempt, round_, world, loaded = map(int, ln.split())
        resumes.setdefault((attempt, round_), []).append((world, loaded))
    rounds = sorted(resumes)
    assert [r[0] for r in rounds] == [0, 1, 1], rounds
    assert resumes[rounds[0]] == [(6, -1)] * 6  # a fresh start: no checkpoint yet
    assert resumes[rounds[1]] == [(6, 5)] * 6  # the checkpoint of the crash's step
    assert resumes[rounds[2]] == [(4, 12)] * 4  # the checkpoint of the step it held at
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
