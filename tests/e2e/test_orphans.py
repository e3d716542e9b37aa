"""Every process a job starts dies with its agent, even when the agent is SIGKILLed.

Each worker starts long-lived children (tests/workloads/orphans.py) and would itself live for
minutes, so nothing here is gone unless something killed it. The checks look right after the
kill, before the job is cancelled and before the cluster's teardown kills anything.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from client import JobSpec, JobState, WorkerState
from gelastic.local import LocalCluster, poll_until
from tests.e2e.conftest import PY, gone

ROOT = Path(__file__).resolve().parents[2]
ORPHANS = str(ROOT / "tests" / "workloads" / "orphans.py")
GONE_WITHIN = 3.0
"""Seconds from the agent's SIGKILL to the last of its processes gone."""
TIMEOUT = 60

# The binary worker: a shell that starts `sleep 300` in its session and waits for it.
BINARY = ["/bin/sh", str(ROOT / "tests" / "workloads" / "orphans.sh")]


def _spec(entrypoint: Any, out: Path, nodes: int = 2, **env: str) -> JobSpec:
    return JobSpec(
        entrypoint=entrypoint,
        nproc_per_node=2,
        min_nodes=nodes,
        max_nodes=nodes,
        cwd=str(ROOT),
        env={"OUT_DIR": str(out), "PYTHONPATH": str(ROOT), **env},
        stop_grace=2,
    )


def _reports(out: Path, n: int) -> dict[int, dict[str, Any]]:
    """{rank: {"worker": pid, "children": [pids]}} once all `n` ranks have written theirs."""
    poll_until(lambda: len(list(out.glob("*.json"))) == n, TIMEOUT, what=f"{n} worker reports")
    return {int(p.stem): json.loads(p.read_text()) for p in out.glob("*.json")}


def _processes_by_node(job: Any, out: Path, n: int) -> dict[str, list[int]]:
    """{node: pids of its workers and of their children}, every one of them alive."""
    reports = _reports(out, n)
    poll_until(
        lambda: len([w for w in job.status().workers if w.pid]) == n, TIMEOUT, what="worker pids"
    )
    by_node: dict[str, list[int]] = {}
    for w in job.status().workers:
        report = reports[w.global_rank]
        # The pid the agent reports is the worker's own (the exec stub execs in place).
        assert report["worker"] == w.pid, (w.global_rank, report, w.pid)
        by_node.setdefault(w.node, []).extend([w.pid, *report["children"]])
    alive = [pid for pids in by_node.values() for pid in pids if gone(pid)]
    assert not alive, f"gone before the test began: {alive}"
    return by_node


def _wait_gone(pids: Sequence[int], within: float, what: str) -> float:
    """Seconds until every pid is gone; fails after `within`."""
    t0 = time.monotonic()
    try:
        poll_until(lambda: all(gone(p) for p in pids), within, interval=0.005, what=what)
    except TimeoutError:
        left = [p for p in pids if not gone(p)]
        raise AssertionError(f"{what}: still alive after {within:g} s: {left}") from None
    return time.monotonic() - t0


def _sigkill_one_agent_and_check(cluster: LocalCluster, job: Any, out: Path) -> None:
    by_node = _processes_by_node(job, out, 4)
    assert len(by_node) == 2
    victim = sorted(by_node)[-1]
    survivor = next(n for n in by_node if n != victim)

    t0 = time.monotonic()
    cluster.kill_agent(victim)
    _wait_gone(by_node[victim], GONE_WITHIN, f"the processes of {victim}'s workers")
    elapsed = time.monotonic() - t0
    print(f"kill-to-gone {victim}: {elapsed * 1000:.0f} ms for {len(by_node[victim])} processes")

    # Not the other node's: its processes run until the coordinator stops them for a new round.
    survivors = [p for p in by_node[survivor] if not gone(p)]
    assert survivors == by_node[survivor] or job.status().state != JobState.RUNNING, survivors

    job.cancel()
    # Stopped by a live agent: the workers' children go with them.
    _wait_gone(by_node[survivor], 15, f"the processes of {survivor}'s workers after cancel")


@pytest.mark.parametrize(
    "entrypoint",
    [
        pytest.param([PY, ORPHANS], id="script"),
        pytest.param([PY, "-m", "tests.workloads.orphans"], id="module"),
        pytest.param("tests.workloads.orphans:spawn_and_sleep", id="function"),
        pytest.param(BINARY, id="binary"),
    ],
)
def test_sigkilled_agent_takes_its_workers_and_their_children(
    cluster: LocalCluster, out: Path, entrypoint: Any
) -> None:
    job = cluster.client.submit(_spec(entrypoint, out, ORPHAN_CHILDREN="plain"))
    _sigkill_one_agent_and_check(cluster, job, out)


def test_children_that_leave_the_session_or_drop_the_env_die_with_the_agent(
    cluster: LocalCluster, out: Path
) -> None:
    # setsid keeps the env mark; an empty env keeps the session: each is found one way.
    job = cluster.client.submit(_spec([PY, ORPHANS], out, ORPHAN_CHILDREN="setsid,noenv"))
    _sigkill_one_agent_and_check(cluster, job, out)


def test_leftovers_of_a_worker_that_exited_do_not_outlive_it(
    cluster: LocalCluster, out: Path
) -> None:
    # The workers exit 0 at once; their children (one in a session of its own) would live on.
    spec = _spec([PY, ORPHANS], out, nodes=1, ORPHAN_CHILDREN="plain,setsid,noenv", ORPHAN_EXIT="1")
    job = cluster.client.submit(spec)
    reports = _reports(out, 2)
    children = [c for r in reports.values() for c in r["children"]]
    assert job.wait(TIMEOUT).state == WorkerState.SUCCEEDED
    # The agents are still running: nothing else kills these.
    assert all(a.popen.poll() is None for a in cluster.agents.values())
    _wait_gone(children, GONE_WITHIN, "the children of the exited workers")
