"""What a newcomer sees on a first try: the `gelastic` CLI as a subprocess against a live local
cluster, its stdout, stderr and exit code as a user would read them.

Every call has a timeout; waits poll, never sleep a fixed time.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Callable

import pytest

from client import JobState
from client._local import LocalCluster, poll_until
from tests.e2e.conftest import PY

TIMEOUT = 90
CALL_TIMEOUT = 60

# Rank 0 says which attempt it runs in; it fails the first one, so the job restarts once.
ATTEMPTS = (
    "import os, sys; a = os.environ['TORCHELASTIC_RESTART_COUNT']; "
    "r = os.environ['RANK']; print(f'rank {r} in attempt {a}', flush=True); "
    "sys.exit(1 if a == '0' and r == '0' else 0)"
)


def gelastic(cluster: LocalCluster, *args: str) -> list[str]:
    return [PY, "-m", "client.cli", "--coordinator", cluster.address, *args]


def cli_env(cluster: LocalCluster) -> dict[str, str]:
    return {**os.environ, **cluster.client_env}


def run(cluster: LocalCluster, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        gelastic(cluster, *args),
        env=cli_env(cluster),
        capture_output=True,
        text=True,
        timeout=CALL_TIMEOUT,
    )


@pytest.mark.timeout(TIMEOUT)
def test_logs_follow_waits_for_the_rank_and_follows_it_across_attempts(
    make_cluster: Callable[..., LocalCluster],
) -> None:
    c = make_cluster(nodes=2, slots=2)
    submitted = run(
        c,
        "submit",
        "--nnodes",
        "3",
        "--max-restarts",
        "1",
        "--last-call-timeout",
        "0",
        "--",
        PY,
        "-c",
        ATTEMPTS,
    )
    assert submitted.returncode == 0, submitted.stderr
    job_id = submitted.stdout.strip()
    job = c.client.job(job_id)
    # Two nodes of the three it needs: it waits in rendezvous, rank 0 has no log yet.
    assert job.status().state in (JobState.QUEUED, JobState.RENDEZVOUS)
    follow = subprocess.Popen(
        gelastic(c, "logs", job_id, "-f"),
        env=cli_env(c),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        # It waits for the rank to start as `tail -F` waits for a file (it used to exit 2
        # at once with "NOT_FOUND: no logs for rank 0").
        with pytest.raises(subprocess.TimeoutExpired):
            follow.wait(timeout=3)
        assert job.status().state in (JobState.QUEUED, JobState.RENDEZVOUS)
        c.start_agent("node-2")
        out, err = follow.communicate(timeout=CALL_TIMEOUT)
    finally:
        if follow.poll() is None:
            follow.kill()
            follow.communicate()
    assert follow.returncode == 0, err
    poll_until(lambda: job.status().state.is_terminal(), 30, what="the job to end")
    assert job.status().state == JobState.SUCCEEDED
    assert out.splitlines() == ["rank 0 in attempt 0", "rank 0 in attempt 1"], (out, err)
    assert "gelastic logs: rank 0 runs again in attempt 1 (round 2); following it" in err, err
    assert "NOT_FOUND" not in err
