"""A real `nodeagent` with its fault-injection variable set: a start that fails half-way leaves
no worker behind, and the job fails with the node's INFRA failures; `gelastic status` shows the
node's worker group UNKNOWN. No torch: the workers only sleep."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import psutil

from client import JobSpec
from client.model import FailureCategory
from gelastic.local import LocalCluster, poll_until
from tests.e2e.conftest import PY
from tests.e2e.test_cli import gelastic

TIMEOUT = 120


def test_a_start_that_fails_half_way_kills_the_started_worker_and_fails_as_infra(
    make_cluster: Callable[..., LocalCluster], tmp_path: Path
) -> None:
    cluster = make_cluster(nodes=1, slots=2, env={"GELASTIC_AGENT_FAULTS": "start-fail-after:1"})
    sleeper = tmp_path / "sleeper.py"
    sleeper.write_text("import time\ntime.sleep(300)\n")
    job = cluster.client.submit(JobSpec(entrypoint=[PY, str(sleeper)], nproc_per_node=2))
    result = job.wait(TIMEOUT)
    assert result.is_failed()
    assert set(result.failures) == {0, 1}
    for f in result.failures.values():
        assert f.category == FailureCategory.INFRA, f
        assert "the start failed after 1 of 2 worker(s)" in f.message, f.message
    # While the agent still runs: the worker it had started is gone, not left unsupervised.
    poll_until(lambda: not _running(sleeper), 30, what="the started worker to be gone")
    proc = gelastic("status", job.job_id, "--json", cluster=cluster)
    assert proc.returncode == 0, proc.stderr
    status = json.loads(proc.stdout)
    assert [m["group_state"] for m in status["members"]] == ["UNKNOWN"]
    # The cluster's stop (make_cluster) checks that no worker was left to kill.


def _running(script: Path) -> list[int]:
    """Live (not zombie) processes running `script`."""
    found = []
    for p in psutil.process_iter(["cmdline", "status"]):
        cmdline = p.info["cmdline"] or []
        if str(script) in cmdline and p.info["status"] != psutil.STATUS_ZOMBIE:
            found.append(p.pid)
    return found
