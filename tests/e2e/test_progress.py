"""Progress, stalls and stragglers with real processes: a coordinator and two agents, real torch
gloo workers calling `client.progress`, `gelastic status` and `gelastic top` (in a pty)."""

from __future__ import annotations

import os
import pty
import select
import subprocess
import time
from pathlib import Path

from client import FailureCategory, JobSpec, JobState, WorkerState
from gelastic.local import LocalCluster, poll_until
from tests.e2e.conftest import PY, script

TIMEOUT = 120
RANK_CELLS = (["0"], ["1"], ["2"], ["3"])
_SLEEP_AT = next(
    i
    for i, line in enumerate(Path(script("stall_train.py")).read_text().splitlines(), 1)
    if "time.sleep(3600)" in line
)
SLEEP_LINE = f"stall_train.py:{_SLEEP_AT}"  # where a stack shows the hung rank


def hang_spec(out: Path, **kw: object) -> JobSpec:
    return JobSpec(
        entrypoint=[PY, script("stall_train.py")],
        nproc_per_node=2,
        min_nodes=2,
        max_nodes=2,
        env={"OUT_DIR": str(out), "HANG_RANK": "2", "HANG_STEP": "5"},
        stall_timeout=3.0,
        **kw,  # type: ignore[arg-type]
    )


def test_a_rank_that_hangs_in_a_gloo_job_is_named_behind_within_seconds(
    cluster: LocalCluster, out: Path
) -> None:
    job = cluster.client.submit(hang_spec(out))
    poll_until(lambda: (out / "hung").exists(), TIMEOUT)
    hung_at = time.monotonic()
    poll_until(lambda: job.status().stalled, 10.0, interval=0.1)
    took = time.monotonic() - hung_at
    assert took < 5.0, f"the stall was seen {took:.1f} s after the hang"
    status = job.status()
    assert status.state == JobState.RUNNING  # stall_action report: it keeps running
    node_of = {w.global_rank: w.node for w in status.workers}
    assert [w.global_rank for w in status.workers if w.behind] == [2]
    [stalled] = [e for e in job.events() if e.kind == "stalled"]
    assert f"rank 2 ({node_of[2]})" in stalled.reason and "rank 3" not in stalled.reason
    assert stalled.rank == 2 and stalled.node == node_of[2]
    steps = {w.global_rank: w.step for w in status.workers}
    assert steps[2] == 4 and steps[0] == steps[1] == steps[3] == 5
    # The stall took every rank's stack: rank 2 alone in its sleep, the others in all_reduce.
    poll_until(lambda: any(e.kind == "stacks" for e in job.events()), 30.0, interval=0.1)
    [capture] = job.stored_stacks()
    assert capture.reason.startswith("stalled: rank(s) 2 behind"), capture.reason
    odd, rest = capture.groups
    assert odd.ranks == (2,) and SLEEP_LINE in odd.text, odd.text
    assert rest.ranks == (0, 1, 3) and "all_reduce" in rest.text, rest.text
    job.cancel()
    job.wait(TIMEOUT)


def test_stall_action_restart_restarts_the_job_and_it_finishes(
    cluster: LocalCluster, out: Path
) -> None:
    job = cluster.client.submit(hang_spec(out, stall_action="restart", max_restarts=1))
    result = job.wait(TIMEOUT)
    assert result.state == WorkerState.SUCCEEDED, result.format_failures()
    # On a loaded host a round of attempt 0 may re-form before the hang (a re-form spends no
    # restart): the attempt-0 round that ended on the stall is the last one of attempt 0.
    attempts = job.attempts()
    *reformed, first = [a for a in attempts if a.attempt == 0]
    seen = (attempts, [(e.kind, e.reason) for e in job.events()])
    assert all("re-form" in a.end_reason for a in reformed), seen
    hang = [f for f in first.failures if f.category == FailureCategory.HANG]
    assert [f.global_rank for f in hang] == [2], seen
    assert "stalled at step 4" in hang[0].message
    assert job.status().attempt == 1
    # Its stacks were taken before the restart ended the workers: in attempt 0, rank 2 asleep.
    [capture] = job.stored_stacks()
    assert capture.attempt == 0 and capture.groups[0].ranks == (2,), capture
    assert SLEEP_LINE in capture.groups[0].text


def test_a_rank_that_sleeps_50ms_more_a_step_is_flagged_a_straggler_and_only_it(
    cluster: LocalCluster,
) -> None:
    spec = JobSpec(
        entrypoint=[PY, script("progress_steps.py")],
        nproc_per_node=2,
        min_nodes=2,
        max_nodes=2,
        env={"SLOW_RANK": "1", "EXTRA_S": "0.05", "RUN_S": "60"},
        straggler_window=3.0,
    )
    job = cluster.client.submit(spec)
    poll_until(lambda: any(e.kind == "straggler" for e in job.events()), 30.0)
    flagged = [e for e in job.events() if e.kind == "straggler"]
    assert [e.rank for e in flagged] == [1]
    status = job.status()
    assert [w.global_rank for w in status.workers if w.straggler] == [1]
    job.cancel()
    job.wait(TIMEOUT)


def _read_pty(fd: int, until: str, timeout: float) -> str:
    seen = b""
    end = time.monotonic() + timeout
    while until.encode() not in seen and time.monotonic() < end:
        ready, _, _ = select.select([fd], [], [], max(0.0, end - time.monotonic()))
        if ready:
            try:
                seen += os.read(fd, 65536)
            except OSError:
                break
    return seen.decode(errors="replace")


def test_progress_of_four_ranks_shows_in_status_and_in_top(cluster: LocalCluster) -> None:
    spec = JobSpec(
        entrypoint=[PY, script("progress_steps.py")],
        nproc_per_node=2,
        min_nodes=2,
        max_nodes=2,
        env={"RUN_S": "60"},
    )
    job = cluster.client.submit(spec)
    poll_until(lambda: all((w.step or 0) > 10 for w in job.status().workers), 30.0)
    gelastic = [PY, "-m", "gelastic"]
    env = {**os.environ, **cluster.client_env}

    def cli(*args: str) -> str:
        done = subprocess.run(
            [*gelastic, *args], capture_output=True, text=True, timeout=30, check=True, env=env
        )
        return done.stdout

    shown = cli("status", job.job_id)
    assert "progress:" in shown and "STEPS/S" in shown and "loss=" in shown
    frame = cli("top", job.job_id)  # not a tty: one frame, then it returns
    rows = [r for r in (line.split() for line in frame.splitlines()) if r[:1] in RANK_CELLS]
    assert sorted(int(r[0]) for r in rows) == [0, 1, 2, 3]
    assert all(int(r[3]) > 10 for r in rows)  # STEP
    # In a pty: it redraws, and q quits.
    main, sub = pty.openpty()
    top = subprocess.Popen(
        [*gelastic, "top", job.job_id, "--interval", "0.3"],
        stdin=sub,
        stdout=sub,
        stderr=sub,
        env=env,
    )
    os.close(sub)
    try:
        first = _read_pty(main, "(q to quit)", 30.0)
        assert "STEPS/S" in first
        again = _read_pty(main, "(q to quit)", 10.0)
        assert "\x1b[2J" in again  # a second frame
        os.write(main, b"q")
        assert top.wait(10) == 0
    finally:
        if top.poll() is None:
            top.kill()
            top.wait(10)
        os.close(main)
    job.cancel()
    job.wait(TIMEOUT)
