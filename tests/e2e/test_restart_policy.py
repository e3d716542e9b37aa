"""Retry by failure class: an input error fails the job at once; "always" retries it."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from client import FailureCategory, JobSpec, JobState
from gelastic.local import AGENT_ENV, LocalCluster
from tests.e2e.conftest import PY

TIMEOUT = 120

SCRIPTS = {
    "syntax": ("def f(:\n", "does not compile (SyntaxError)"),
    "import": ("import gelastic_no_such_module\n", "an import of the entrypoint failed"),
    "usage": (
        "import argparse\np = argparse.ArgumentParser()\np.add_argument('--lr', required=True)\n"
        "p.parse_args()\n",
        "the command line was refused (exit 2 with a usage error)",
    ),
}


@pytest.mark.parametrize("case", [*SCRIPTS, "missing"])
def test_an_input_error_fails_at_once_with_restarts_left(
    make_cluster: Callable[..., LocalCluster], tmp_path: Path, case: str
) -> None:
    cluster = make_cluster(nodes=1, slots=1)
    path = tmp_path / f"{case}.py"
    if case in SCRIPTS:
        path.write_text(SCRIPTS[case][0])
    job = cluster.client.submit(JobSpec(entrypoint=[PY, str(path)], max_restarts=3))
    result = job.wait(TIMEOUT)
    assert job.status().state == JobState.FAILED
    # One attempt only, and the result says why it was not retried.
    assert [a.attempt for a in job.attempts()] == [0]
    why = SCRIPTS[case][1] if case in SCRIPTS else "the script does not exist"
    assert why in result.reason and "without a restart" in result.reason, result.reason
    assert result.root_cause is not None and result.root_cause.category == FailureCategory.INPUT


def test_restart_policy_always_retries_an_input_error(
    make_cluster: Callable[..., LocalCluster], tmp_path: Path
) -> None:
    cluster = make_cluster(nodes=1, slots=1)
    path = tmp_path / "syntax.py"
    path.write_text(SCRIPTS["syntax"][0])
    spec = JobSpec(entrypoint=[PY, str(path)], max_restarts=2, restart_policy="always")
    job = cluster.client.submit(spec)
    job.wait(TIMEOUT)
    assert job.status().state == JobState.FAILED
    assert [a.attempt for a in job.attempts()] == [0, 1, 2]


def test_a_node_that_keeps_failing_rounds_is_quarantined_and_the_job_succeeds_on_the_others(
    make_cluster: Callable[..., LocalCluster],
) -> None:
    cluster = make_cluster(nodes=3, slots=1)
    # Fails on node-1 only (its agent's name is in the workers' environment), as a bad host.
    code = (
        "import os, sys, time\n"
        f"if os.environ[{AGENT_ENV!r}] == 'node-1':\n"
        "    time.sleep(0.3)\n"
        "    sys.exit(3)\n"
        "if os.environ['WORLD_SIZE'] != '2':\n"
        "    time.sleep(60)\n"
    )
    spec = JobSpec(
        entrypoint=[PY, "-c", code],
        min_nodes=2,
        max_nodes=3,
        max_restarts=5,
        last_call_timeout=0,
    )
    job = cluster.client.submit(spec)
    result = job.wait(TIMEOUT)
    assert job.status().state == JobState.SUCCEEDED, result.format_failures()
    (node,) = [n for n in cluster.client.list_nodes() if n.name == "node-1"]
    assert node.state == "quarantined" and node.quarantine_reason.startswith("flaky: 3 rounds")
    last = job.attempts()[-1]
    assert "node-1" not in last.nodes
