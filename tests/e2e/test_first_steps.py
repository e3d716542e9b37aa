"""What a newcomer sees on a first try: the `gelastic` CLI as a subprocess against a live local
cluster, its stdout, stderr and exit code as a user would read them.

Every call has a timeout; waits poll, never sleep a fixed time.
"""

from __future__ import annotations

import os
import re
import select
import signal
import subprocess
import time
from collections.abc import Callable, Iterator

import pytest

from client import JobState
from gelastic.local import LocalCluster, poll_until
from tests.e2e.conftest import PY, assert_no_leftovers, ctrl_c_as_on_a_terminal

TIMEOUT = 90
CALL_TIMEOUT = 60

# Rank 0 says which attempt it runs in; it fails the first one, so the job restarts once.
ATTEMPTS = (
    "import os, sys; a = os.environ['TORCHELASTIC_RESTART_COUNT']; "
    "r = os.environ['RANK']; print(f'rank {r} in attempt {a}', flush=True); "
    "sys.exit(1 if a == '0' and r == '0' else 0)"
)


@pytest.fixture(scope="module")
def shared(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    # Two live nodes of two slots each; each test's jobs end before the next test.
    c = LocalCluster(
        nodes=2,
        slots=2,
        workdir=tmp_path_factory.mktemp("first-steps"),
        lease=3.0,
        heartbeat_interval=0.5,
    )
    with c:
        yield c
    assert_no_leftovers(c)


def gelastic(cluster: LocalCluster, *args: str) -> list[str]:
    return [PY, "-m", "gelastic", "--coordinator", cluster.address, *args]


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


def _read_until(fd: int, seen: bytearray, want: bytes, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while want not in seen:
        left = deadline - time.monotonic()
        if left <= 0:
            raise AssertionError(f"no {want!r} within {timeout} s in {bytes(seen)[-2000:]!r}")
        ready, _, _ = select.select([fd], [], [], min(left, 1.0))
        if ready:
            chunk = os.read(fd, 65536)
            if not chunk:
                raise AssertionError(f"output ended without {want!r}: {bytes(seen)[-2000:]!r}")
            seen.extend(chunk)


@pytest.mark.timeout(TIMEOUT)
def test_a_job_no_node_could_ever_hold_fails_at_once_saying_why(shared: LocalCluster) -> None:
    started = time.monotonic()
    r = run(shared, "submit", "--watch", "--nnodes", "1", "--nproc-per-node", "4", "--", "true")
    # It used to wait out its join timeout (600 s): "rendezvous: 0/1 nodes, waiting up to
    # 598 s more for min_nodes".
    assert r.returncode == 1, (r.stdout, r.stderr)
    assert time.monotonic() - started < CALL_TIMEOUT
    job_id = r.stdout.splitlines()[0]
    why = (
        "no live or known node could ever hold one group of this job (4 workers): the largest, "
        "node-1, has room for 2 workers; submit with wait_for_nodes (--wait-for-nodes) to wait "
        "for a bigger node to join"
    )
    assert f"{job_id} FAILED: {why}" in r.stdout, r.stdout
    assert "waiting up to" not in r.stderr, r.stderr


@pytest.mark.timeout(TIMEOUT)
def test_ctrl_c_on_a_queued_job_says_it_is_queued_and_why_it_waits(shared: LocalCluster) -> None:
    with ctrl_c_as_on_a_terminal():
        proc = subprocess.Popen(
            gelastic(
                shared,
                "submit",
                "--watch",
                "--wait-for-nodes",
                "--nnodes",
                "1",
                "--nproc-per-node",
                "4",
                "--",
                "true",
            ),
            env=cli_env(shared),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
    assert proc.stdout is not None
    seen = bytearray()
    job_id = ""
    try:
        _read_until(proc.stdout.fileno(), seen, b"the largest has 2)\n", 30)
        job_id = bytes(seen).split(b"\n", 1)[0].decode().strip()
        text = bytes(seen).decode()
        assert re.search(
            rf"\[{job_id}\] queued: rendezvous: 0/1 nodes, waiting up to \d+ s more for "
            r"min_nodes \(no live node has 4 free slots; the largest has 2\)\n",
            text,
        ), text
        proc.send_signal(signal.SIGINT)
        _read_until(proc.stdout.fileno(), seen, f"(gelastic cancel {job_id})".encode(), 30)
        assert proc.wait(timeout=30) == 130
        text = bytes(seen).decode()
        # It used to say "is still running" of a job that never started.
        assert f"detached; job {job_id} is still queued (gelastic cancel {job_id})" in text, text
        assert "still running" not in text
        assert shared.client.job(job_id).status().state == JobState.QUEUED
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
        proc.stdout.close()
        if job_id:
            shared.client.job(job_id).cancel()


@pytest.mark.timeout(TIMEOUT)
def test_a_range_job_starts_at_once_when_every_node_with_room_joined(shared: LocalCluster) -> None:
    started = time.monotonic()
    # The last call is long: the job must not wait it out for a third node that does not exist.
    r = run(
        shared, "submit", "--watch", "--nnodes", "1:3", "--last-call-timeout", "120", "--", "true"
    )
    assert r.returncode == 0, (r.stdout, r.stderr)
    assert time.monotonic() - started < CALL_TIMEOUT
    assert (
        "world size 2; every live node with room joined (2 of max_nodes=3); closed without the "
        "last call" in r.stderr
    ), r.stderr
    assert "last call closes in" not in r.stderr, r.stderr
