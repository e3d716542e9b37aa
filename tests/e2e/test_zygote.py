"""Forked workers end to end: real agents, one zygote per node and job, no torch.

The job preloads `tests.workloads.preload_marker`, which appends the importing pid to a file:
one line per node means the import ran once per node. Workers of attempt 0 and of attempt 1 are
forks of their node's zygote; a forked worker SIGKILLed shows as SIGKILL; its output is in its
logs; a SIGKILLed zygote fails its round and leaves nothing; a SIGKILLed agent takes its zygote
and every fork with it (the pids are looked at before anything else could kill them).
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from client import JobSpec, WorkerState
from gelastic.local import LocalCluster, poll_until
from tests.e2e.conftest import PY, assert_no_leftovers, gone

TIMEOUT = 120
REPO = str(Path(__file__).resolve().parents[2])
PRELOAD = "tests.workloads.preload_marker"
WORKER = r"""
import os, pathlib, time
out = pathlib.Path(os.environ["OUT_DIR"])
a, r = os.environ["TORCHELASTIC_RESTART_COUNT"], os.environ["RANK"]
print(f"hello from rank {r} attempt {a}", flush=True)
(out / f"start-{a}-{r}.tmp").write_text(f"{os.getpid()} {os.getppid()}")
os.replace(out / f"start-{a}-{r}.tmp", out / f"start-{a}-{r}")
if a == "0" or os.environ.get("HOLD"):
    deadline = time.monotonic() + 120
    while not (out / "go").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
"""


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    c = LocalCluster(
        nodes=2,
        slots=2,
        workdir=tmp_path_factory.mktemp("zygote") / "cluster",
        lease=3.0,
        heartbeat_interval=0.5,
    )
    with c:
        yield c
    assert_no_leftovers(c)


def _submit(c: LocalCluster, out: Path, **kw: Any) -> Any:
    out.mkdir()
    env = {
        "PYTHONPATH": REPO,
        "OUT_DIR": str(out),
        "PRELOAD_MARKS": str(out / "marks"),
        **kw.pop("env", {}),
    }
    spec = JobSpec(
        entrypoint=[PY, "-c", WORKER],
        nproc_per_node=2,
        min_nodes=2,
        max_nodes=2,
        preload=(PRELOAD,),
        env=env,
        stop_grace=2,
        **kw,
    )
    return c.client.submit(spec)


def _starts(out: Path, attempt: int) -> dict[int, tuple[int, int]]:
    """{rank: (pid, parent pid)} of the workers of `attempt` that have started."""
    found = {}
    for r in range(4):
        f = out / f"start-{attempt}-{r}"
        if f.exists():
            pid, ppid = map(int, f.read_text().split())
            found[r] = (pid, ppid)
    return found


def _is_zygote(pid: int) -> bool:
    try:
        return "--zygote" in psutil.Process(pid).cmdline()
    except psutil.Error:
        return False


def _all_gone(pids: set[int]) -> bool:
    return all(gone(p) for p in pids)


def _family(zygotes: set[int]) -> set[int]:
    """The zygotes and every process below them."""
    pids = set(zygotes)
    for z in zygotes:
        with contextlib.suppress(psutil.Error):
            pids |= {p.pid for p in psutil.Process(z).children(recursive=True)}
    return pids


def test_workers_of_both_attempts_are_forks_of_one_zygote_per_node(
    cluster: LocalCluster, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    job = _submit(cluster, out, max_restarts=1)
    poll_until(lambda: len(_starts(out, 0)) == 4, 60, what="attempt 0 to start")
    first = _starts(out, 0)
    victim = first[3][0]
    os.kill(victim, signal.SIGKILL)
    result = job.wait(TIMEOUT)
    assert result.state == WorkerState.SUCCEEDED, result.format_failures()
    second = _starts(out, 1)
    assert len(second) == 4
    # The preload was imported once per node, by its zygote; every worker is a fork of one.
    zygotes = {int(line) for line in (out / "marks").read_text().split()}
    assert len(zygotes) == 2, zygotes
    for starts in (first, second):
        assert {ppid for _, ppid in starts.values()} == zygotes
        assert starts[0][1] == starts[1][1] and starts[2][1] == starts[3][1]
    # The forked worker the test killed fails attempt 0 with SIGKILL, as a spawned one does.
    (attempt0, *_) = job.attempts()
    failure = next(f for f in attempt0.failures if f.global_rank == 3)
    assert failure.signal == "SIGKILL" and failure.exitcode == -9, failure
    assert failure.pid == victim
    # What a forked worker printed is in its rank's log.
    assert "hello from rank 3 attempt 1" in b"".join(job.logs(rank=3)).decode()
    # The job is done: its zygotes go once their last fork has exited.
    poll_until(lambda: _all_gone(zygotes), 30, what="the zygotes to go with the job")


def test_a_sigkilled_zygote_fails_its_round_and_leaves_nothing(
    cluster: LocalCluster, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    job = _submit(cluster, out, max_restarts=0, env={"HOLD": "1"})
    poll_until(lambda: len(_starts(out, 0)) == 4, 60, what="the workers to start")
    starts = _starts(out, 0)
    zygote = starts[0][1]
    assert _is_zygote(zygote)
    family = _family({p for _, p in starts.values()}) | {pid for pid, _ in starts.values()}
    os.kill(zygote, signal.SIGKILL)
    result = job.wait(TIMEOUT)
    assert result.is_failed()
    # Ranks 0 and 1, forked from it, die with it: the round fails with SIGKILL (the first of
    # them seen fails it; the other may be counted as stopped).
    failures = [*result.failures.values(), *(x for a in job.attempts() for x in a.failures)]
    assert failures, result.format_failures()
    assert all(f.global_rank in (0, 1) and f.signal == "SIGKILL" for f in failures), failures
    poll_until(lambda: _all_gone(family), 30, what="every zygote and fork of the job to go")


def test_a_sigkilled_agent_leaves_no_forked_worker_or_zygote(
    cluster: LocalCluster, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    job = _submit(cluster, out, max_restarts=1, env={"HOLD": "1"})
    poll_until(lambda: len(_starts(out, 0)) == 4, 60, what="the workers to start")
    agent = cluster.agents["node-1"].popen.pid
    starts = _starts(out, 0)
    zygotes = {ppid for _, ppid in starts.values()}
    theirs = {z for z in zygotes if psutil.Process(z).ppid() == agent}
    assert len(theirs) == 1
    # The standbys of the next attempt are forked too: wait for them, then record them all.
    # (and a warm c10d store host, on the node that serves the store).
    poll_until(
        lambda: len(_family(theirs)) >= 5, 60, what="2 workers and 2 standbys under the zygote"
    )
    doomed = _family(theirs)
    cluster.kill_agent("node-1", signal.SIGKILL)
    # Looked at first: nothing else (the cluster's stop, the job's end) has killed them yet.
    deadline = time.monotonic() + 15
    while not _all_gone(doomed) and time.monotonic() < deadline:
        time.sleep(0.05)
    left = {p for p in doomed if not gone(p)}
    assert not left, f"left behind by the SIGKILLed agent: {left}"
    job.cancel()
    job.wait(60)
    cluster.start_agent("node-1")
