"""Graceful is cheap: workers that a restart or a re-form replaces get their stop grace."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from client import JobSpec, JobState
from client._local import LocalCluster
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
