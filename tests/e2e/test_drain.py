"""Draining a node with the real CLI: its jobs re-form elsewhere without a restart, its workers
are killed at the drain's deadline, and it takes no new job until it is undrained."""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import psutil

from client import JobSpec, JobState
from gelastic.local import LocalCluster, poll_until
from tests.e2e.conftest import PY, script

TIMEOUT = 120


def gelastic(cluster: LocalCluster, *args: str) -> str:
    env = {k: v for k, v in os.environ.items() if k != "GELASTIC_COORDINATOR"}
    env["GELASTIC_TOKEN_FILE"] = cluster.token_file
    proc = subprocess.run(
        [PY, "-m", "gelastic", "--coordinator", cluster.address, *args],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def node_row(listing: str, name: str) -> list[str]:
    (row,) = [line.split() for line in listing.splitlines() if line.startswith(f"{name} ")]
    return row


def gone_at(pid: int, timeout: float) -> float:
    """When process `pid` was seen gone (reaped, or a zombie), polled every 10 ms."""

    def dead() -> bool:
        try:
            return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return True

    poll_until(dead, timeout, interval=0.01, what=f"pid {pid} to be gone")
    return time.time()


def test_a_drain_kills_at_its_deadline_and_the_node_takes_no_job_until_undrained(
    make_cluster: Callable[..., LocalCluster], out: Path
) -> None:
    cluster = make_cluster(nodes=2, slots=1)
    spec = JobSpec(
        entrypoint=[PY, script("checkpoint_on_term.py")],
        nproc_per_node=1,
        min_nodes=1,
        max_nodes=2,
        max_restarts=0,
        stop_grace=10,
        last_call_timeout=0,
        # Its SIGTERM handler needs 5 s, more than the drain's 1 s deadline gives it.
        env={"OUT_DIR": str(out), "CKPT_MODE": "world", "CKPT_S": "5"},
    )
    job = cluster.client.submit(spec)
    poll_until(lambda: len(list(out.glob("start.*.2"))) == 2, 60, what="both ranks running")
    node = next(w.node for w in job.status().workers if w.global_rank == 1)
    pid = int((out / "pid.1.2").read_text())

    said = gelastic(cluster, "nodes", "--drain", node, "--deadline", "1")
    assert f"{node}: draining (workers killed in 1 s)" in said
    killed = gone_at(pid, 30)
    term = float((out / "term.1.2").read_text())
    # SIGTERM at once (the job's 10 s grace is longer than the deadline), SIGKILL 1 s later:
    # the 5 s checkpoint never finished.
    assert not (out / "ckpt.1.2").exists()
    assert 0.8 <= killed - term <= 3.0, killed - term
    poll_until(
        lambda: node_row(gelastic(cluster, "nodes"), node)[2] == "drained", 30, what="drained"
    )
    listing = gelastic(cluster, "nodes")
    assert f"{node}: an operator asked" in listing and "--undrain" in listing

    result = job.wait(TIMEOUT)
    assert job.status().state == JobState.SUCCEEDED, result.format_failures()
    assert [a.attempt for a in job.attempts()] == [0, 0]
    assert any(e.kind == "node_draining" and e.node == node for e in job.events())

    # A job of two nodes cannot start while one of the two is drained...
    pair = cluster.client.submit(
        JobSpec(
            entrypoint=[PY, "-c", "pass"],
            nproc_per_node=1,
            min_nodes=2,
            max_nodes=2,
            last_call_timeout=0,
        )
    )
    poll_until(lambda: "1/2 nodes" in pair.status().reason, 30, what="the job waiting")
    assert pair.status().state == JobState.QUEUED
    # ... and starts once it is undrained.
    assert f"{node}: undrained" in gelastic(cluster, "nodes", "--undrain", node)
    pair.wait(TIMEOUT)
    assert pair.status().state == JobState.SUCCEEDED
    assert node_row(gelastic(cluster, "nodes"), node)[2] == "live"


TRAIN_DDP = str(Path(__file__).resolve().parents[2] / "examples" / "train_ddp.py")


def test_a_ddp_job_checkpoints_on_the_notice_and_resumes_from_that_step_elsewhere(
    make_cluster: Callable[..., LocalCluster], tmp_path: Path
) -> None:
    cluster = make_cluster(nodes=2, slots=1)
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    steps = 300
    spec = JobSpec(
        entrypoint=[PY, TRAIN_DDP],
        args=[
            "--steps",
            str(steps),
            "--step-time",
            "0.05",
            "--checkpoint-dir",
            str(ckpt),
            "--checkpoint-every",
            "100000",
            "--leave-on-notice",
        ],
        nproc_per_node=1,
        min_nodes=1,
        max_nodes=2,
        max_restarts=0,
        stop_grace=10,
        last_call_timeout=0,
    )
    job = cluster.client.submit(spec)

    def both_running() -> bool:
        status = job.status()
        return status.state == JobState.RUNNING and len(status.workers) == 2

    poll_until(both_running, 120, what="both ranks running")
    ranks = {w.global_rank: w.node for w in job.status().workers}
    first, drained = ranks[0], ranks[1]

    def rank0_log() -> str:
        """Rank 0's output over both rounds (the job re-forms with rank 0 where it was)."""
        logs = cluster.agent_log_dir(first).glob(f"{job.job_id}/attempt_0*/0/stdout.log")
        return "".join(p.read_text() for p in logs)

    poll_until(lambda: "step  20" in rank0_log(), 120, what="training under way")
    drained_at = time.time()
    # 30 s to go, 10 s of stop_grace: 20 s with the notice before any SIGTERM.
    assert cluster.client.drain_node(drained, 30.0, "spot reclaim") == "draining"
    result = job.wait(TIMEOUT)
    assert job.status().state == JobState.SUCCEEDED, result.format_failures()
    assert [a.attempt for a in job.attempts()] == [0, 0]
    assert job.attempts()[0].failures == ()

    # Every rank of the round, on both nodes, got the notice.
    for node in (first, drained):
        (path,) = cluster.agent_log_dir(node).glob(f"{job.job_id}/attempt_0/preempt-{node}.json")
        notice = json.loads(path.read_text())
        assert notice["node"] == drained and "spot reclaim" in notice["reason"]
        assert drained_at + 25 < notice["deadline"] < drained_at + 40
    # They left on it, long before SIGTERM would have come: the next round formed within 20 s.
    (formed,) = [e for e in job.events() if e.kind == "round_formed" and e.round == 2]
    assert formed.timestamp < drained_at + 20
    # The job checkpointed step N on the notice and the re-formed job went on from step N.
    said = rank0_log()
    left = int(re.search(r"preemption notice: checkpointed step (\d+); leaving", said)[1])  # type: ignore[index]
    assert 20 < left < steps
    assert f"resumed from step {left} (world size 1, round 2)" in said
    # It ran to the end, and from step 0 only once (the first round).
    assert f"step {steps - 1:3d}" in said and said.count("step   0 ") == 1
    assert json.loads((ckpt / "checkpoint.json").read_text()) == {"step": steps}
