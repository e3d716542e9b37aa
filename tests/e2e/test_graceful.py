"""Graceful is cheap: workers that a restart or a re-form replaces get their stop grace."""

from __future__ import annotations

import signal
from collections.abc import Callable
from pathlib import Path

from client import JobSpec, JobState
from gelastic.local import LocalCluster, poll_until
from tests.e2e.conftest import PY, script

TIMEOUT = 120


def stamp(out: Path, what: str, rank: int, restart: int) -> float:
    return float((out / f"{what}.{rank}.{restart}").read_text())


def test_the_survivors_of_a_crash_finish_their_sigterm_checkpoint_before_the_restart(
    make_cluster: Callable[..., LocalCluster], out: Path
) -> None:
    cluster = make_cluster(nodes=2, slots=1)
    spec = JobSpec(
        entrypoint=[PY, script("checkpoint_on_term.py")],
        nproc_per_node=1,
        min_nodes=2,
        max_nodes=2,
        max_restarts=1,
        stop_grace=10,
        env={"OUT_DIR": str(out)},
    )
    job = cluster.client.submit(spec)
    result = job.wait(TIMEOUT)
    assert job.status().state == JobState.SUCCEEDED, result
    # Rank 0 got SIGTERM when rank 1 crashed, wrote its 2 s checkpoint whole, and only then did
    # the restart start any worker.
    term, ckpt = stamp(out, "term", 0, 0), stamp(out, "ckpt", 0, 0)
    assert ckpt - term >= 2.0
    assert min(stamp(out, "start", r, 1) for r in (0, 1)) > ckpt


def test_a_sigtermed_agent_re_forms_its_job_without_a_restart_after_its_workers_checkpoint(
    make_cluster: Callable[..., LocalCluster], out: Path
) -> None:
    # What systemctl stop, a pod eviction or a spot drain sends: the node leaves gracefully.
    cluster = make_cluster(nodes=2, slots=1)
    spec = JobSpec(
        entrypoint=[PY, script("checkpoint_on_term.py")],
        nproc_per_node=1,
        min_nodes=1,
        max_nodes=2,
        max_restarts=0,
        stop_grace=10,
        last_call_timeout=0,
        env={"OUT_DIR": str(out), "CKPT_MODE": "world"},
    )
    job = cluster.client.submit(spec)
    poll_until(lambda: len(list(out.glob("start.*.2"))) == 2, 60, what="both ranks running")
    node = next(w.node for w in job.status().workers if w.global_rank == 1)
    cluster.kill_agent(node, signal.SIGTERM)
    result = job.wait(TIMEOUT)
    assert job.status().state == JobState.SUCCEEDED, result.format_failures()
    # No restart was spent: the agent had the coordinator drain its node, which re-formed the
    # job on the other one.
    assert [a.attempt for a in job.attempts()] == [0, 0]
    assert any(e.kind == "node_draining" and e.node == node for e in job.events())
    # The drained node's worker got SIGTERM and finished its 2 s checkpoint before it went.
    assert stamp(out, "ckpt", 1, 2) - stamp(out, "term", 1, 2) >= 2.0
    assert (out / "start.0.1").exists()
