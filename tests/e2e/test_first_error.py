"""First error at record time, end to end with real torch: a rank raises under torch's @record
and then tears down slowly; the client sees the job FAILED, with that rank as its root cause,
before the teardown would have ended, and the failure is reported once, with its exit code.
"""

from __future__ import annotations

import time
from pathlib import Path

from client import JobSpec
from client._local import LocalCluster
from tests.e2e.conftest import PY, script

TIMEOUT = 120


def test_a_rank_that_raises_under_record_fails_the_job_before_its_teardown_ends(
    cluster: LocalCluster, out: Path
) -> None:
    spec = JobSpec(
        entrypoint=[PY, script("raise_slow_teardown.py")],
        nproc_per_node=1,
        min_nodes=2,
        max_nodes=2,
        env={"RAISE_RANK": "1", "OUT_DIR": str(out), "TEARDOWN_S": "3"},
        stop_grace=10,
    )
    job = cluster.client.submit(spec)
    result = job.wait(TIMEOUT)
    seen_at = time.time()
    # The teardown (3 s after the raise) had not ended when the client saw the result.
    assert not (out / "teardown_done").exists()
    raised_at = float((out / "raised_at").read_text())
    assert seen_at - raised_at < 3.0, seen_at - raised_at
    assert result.is_failed()
    root = result.root_cause
    assert root is not None and root.global_rank == 1 and root.root_cause
    assert root.message.startswith("ValueError: boom from rank 1"), root.message
    assert "raise ValueError" in root.traceback
    # The exit is known by then: the stop the early report started ended the teardown.
    assert root.exitcode == -15 and root.signal == "SIGTERM", (root.exitcode, root.signal)
    assert root.pid > 0
    failed = [e for e in job.events() if e.kind == "worker_failed" and e.rank == 1]
    assert len(failed) == 1, failed
    assert "recorded its error" in failed[0].reason
    assert len(result.attempts) == 1
