"""A restarted agent gets its node back at once, whatever the order of the restarts.

Before the fix a coordinator that restarted kept a node's name for the agent process it knew
from disk until the reconnect grace ended, and refused a restarted agent of that node meanwhile;
a second coordinator restart inside the grace began the hold again, and the agent, whose
patience kept counting, exited 2 saying a live agent held its name. Now the agent proves it is
the same node with the node secret kept in its state dir, and the coordinator hands it the name
at once; an agent with another state dir (another secret) is still refused, with exit 2, while
the node's own agent is live.

Each test runs a job on the node, SIGKILLs its agent and then the coordinator mid-job (the agent
while the coordinator cannot notice, so that the coordinator's state on disk still has the node
live under the dead process), restarts them in its order, and checks that the node is live again within a second of the coordinator serving
(or of the agent's start, when the coordinator came first) and that the job, which re-forms
without spending a restart, runs its next round there.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from client import Job, JobSpec, WorkerState
from gelastic.local import LocalCluster, poll_until
from tests.e2e.conftest import PY, Gate, script

NODE = "node-0"
GRACE_S = 60.0
"""Long: an agent that had to wait for the grace would miss every bound here by far."""
BACK_WITHIN_S = 1.0
STARTED_LINE = f"nodeagent {NODE} ("
"""What the agent prints once it has started (before its first session)."""


@pytest.fixture
def one_node(make_cluster: Callable[..., LocalCluster]) -> LocalCluster:
    return make_cluster(
        nodes=1,
        slots=1,
        lease=2.0,
        coordinator_args=["--reconnect-grace", str(GRACE_S)],
        # The agent's pause between tries while the coordinator is down: bounded low here, so
        # what is measured is the name coming back, not a long backoff.
        agent_args=["--reconnect-max", "0.5"],
    )


def _kill_both(c: LocalCluster) -> None:
    """SIGKILL the agent, then the coordinator, at the worst moment: the agent dies while its
    coordinator cannot notice (stopped), so the coordinator's state on disk still has the node
    live under the dead process, and a restarted coordinator keeps the name for it."""
    assert c.coordinator is not None
    os.kill(c.coordinator.popen.pid, signal.SIGSTOP)
    try:
        c.kill_agent(NODE)
    finally:
        c.kill_coordinator()


def _running_job(c: LocalCluster, gate: Gate, out: Path) -> tuple[Job, int]:
    job = c.client.submit(
        JobSpec(
            entrypoint=[PY, script("crash_once.py")],
            nproc_per_node=1,
            min_nodes=1,
            max_nodes=1,
            max_restarts=0,
            env={"OUT_DIR": str(out), "CRASH_UNTIL": "0", **gate.env},
        )
    )
    (start,) = gate.wait("start", 1)
    return job, int(start["round"])


def _live_since(c: LocalCluster, t0: float) -> float:
    """Seconds from `t0` (monotonic) until the node shows live, asked on a fresh channel each
    time (a channel that saw the old coordinator go may wait out its own backoff)."""

    def live() -> bool:
        try:
            with c.connect(timeout=2.0) as client:
                return any(n.name == NODE and n.state == "live" for n in client.list_nodes())
        except Exception:
            return False

    poll_until(live, 20 * BACK_WITHIN_S, interval=0.02, what=f"{NODE} to be live again")
    return time.monotonic() - t0


def _start_agent(c: LocalCluster) -> None:
    """Start the node's agent again (its own directories, as before) and wait until it runs."""
    before = c.output(NODE).count(STARTED_LINE)
    c.start_agent(NODE, wait=False)
    poll_until(lambda: c.output(NODE).count(STARTED_LINE) > before, 30, what="the agent to start")


def _refusals(text: str) -> list[str]:
    return [
        line
        for line in text.splitlines()
        if "refused this agent" in line or "keeps this node's name" in line
    ]


def _job_finishes_on_the_node(job: Job, gate: Gate, first_round: int) -> None:
    """The job re-formed without spending a restart, and its next round ran on the node."""
    (start,) = gate.wait("start", 1, round=_next_round(gate, first_round))
    assert start["node"] == NODE
    gate.open("finish")
    result = job.wait(120)
    assert result.state == WorkerState.SUCCEEDED, result.format_failures()
    assert job.status().attempt == 0


def _next_round(gate: Gate, first_round: int) -> int:
    poll_until(
        lambda: any(e["round"] > first_round for e in gate.events("start")),
        60,
        what="the job's next round to start",
    )
    return min(e["round"] for e in gate.events("start") if e["round"] > first_round)


def test_agent_then_coordinator_restarted_gets_its_node_back_at_once(
    one_node: LocalCluster, gate: Gate, out: Path, tmp_path: Path
) -> None:
    c = one_node
    job, first_round = _running_job(c, gate, out)
    _kill_both(c)
    seen = len(c.output(NODE))
    _start_agent(c)  # it tries, and waits, while no coordinator listens
    c.start_coordinator(port=c.port)
    back = _live_since(c, time.monotonic())
    assert back < BACK_WITHIN_S, f"{NODE} was live again {back:.2f} s after the coordinator served"
    assert not _refusals(c.output(NODE)[seen:])
    _job_finishes_on_the_node(job, gate, first_round)
    # Another agent under the live node's name (another state dir, so another secret) is refused
    # for good, and the node's own agent keeps its session.
    other = tmp_path / "other-host"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "nodeagent.cli",
            "--coordinator",
            c.address,
            "--name",
            NODE,
            "--slots",
            "1",
            "--gpus",
            "none",
            "--log-dir",
            str(other / "logs"),
            "--state-dir",
            str(other / "state"),
            "--token-file",
            c.token_file,
        ],
        capture_output=True,
        text=True,
        timeout=60,
        env=c.env,
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith(f"nodeagent: node name '{NODE}' is in use by another live agent"), last
    assert c.agents[NODE].popen.poll() is None
    with c.connect() as client:
        assert [(n.name, n.state) for n in client.list_nodes()] == [(NODE, "live")]


def test_coordinator_then_agent_restarted_gets_its_node_back_at_once(
    one_node: LocalCluster, gate: Gate, out: Path
) -> None:
    c = one_node
    job, first_round = _running_job(c, gate, out)
    _kill_both(c)
    c.start_coordinator(port=c.port)  # it keeps the node's name for the agent it knew
    seen = len(c.output(NODE))
    _start_agent(c)
    back = _live_since(c, time.monotonic())
    assert back < BACK_WITHIN_S, f"{NODE} was live again {back:.2f} s after its agent started"
    assert not _refusals(c.output(NODE)[seen:])
    _job_finishes_on_the_node(job, gate, first_round)


def test_a_second_coordinator_restart_inside_the_grace_keeps_the_node(
    one_node: LocalCluster, gate: Gate, out: Path
) -> None:
    c = one_node
    job, first_round = _running_job(c, gate, out)
    _kill_both(c)
    seen = len(c.output(NODE))
    _start_agent(c)
    c.start_coordinator(port=c.port)
    back = _live_since(c, time.monotonic())
    assert back < BACK_WITHIN_S, f"{NODE} was live again {back:.2f} s after the coordinator served"
    # Again, well inside the reconnect grace the first restart began.
    c.kill_coordinator()
    c.start_coordinator(port=c.port)
    back = _live_since(c, time.monotonic())
    assert back < BACK_WITHIN_S, f"{NODE} was live again {back:.2f} s after the coordinator served"
    assert not _refusals(c.output(NODE)[seen:])
    assert c.agents[NODE].popen.poll() is None
    _job_finishes_on_the_node(job, gate, first_round)
