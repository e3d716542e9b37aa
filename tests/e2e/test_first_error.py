"""First error at record time, end to end with real torch: a rank raises under torch's @record
and then tears down slowly. The coordinator knows the failure when it is recorded and stops the
other rank at once; with no restart left the job is FAILED then, at the client, while the failing
rank is left to end on its own; its exit then adds its real exit code, and the failure is
reported once.
"""

from __future__ import annotations

from pathlib import Path

from client import JobSpec
from gelastic.local import LocalCluster, poll_until
from tests.e2e.conftest import PY, script

TIMEOUT = 120


def test_a_failure_is_known_when_recorded_and_stops_the_others_before_its_teardown_ends(
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
    # No restart left: FAILED at the client while the failing rank still tears down.
    assert not (out / "teardown_done").exists()
    assert result.is_failed()
    root = result.root_cause
    assert root is not None and root.global_rank == 1 and root.root_cause
    assert root.message.startswith("ValueError: boom from rank 1"), root.message
    assert "raise ValueError" in root.traceback
    raised_at = float((out / "raised_at").read_text())

    # The failing rank was left to end on its own: its teardown runs to the end, and its exit
    # (its own code, not a stop's) completes the result afterwards.
    def exited() -> bool:
        return any(e.kind == "worker_exited" and e.rank == 1 for e in job.events())

    poll_until(exited, 60, what="the failing rank's exit to be reported")
    teardown_done = float((out / "teardown_done").read_text())
    assert teardown_done - raised_at >= 2.9
    final = job.poll()
    assert final is not None and final.root_cause is not None
    root = final.root_cause
    assert root.exitcode == 1 and root.signal == "", (root.exitcode, root.signal)
    assert root.pid > 0 and root.message.startswith("ValueError: boom from rank 1")
    events = job.events()
    failed = [e for e in events if e.kind == "worker_failed" and e.rank == 1]
    assert len(failed) == 1, failed
    assert "recorded its error" in failed[0].reason
    # Known when it was recorded, long before the process ended ...
    assert failed[0].timestamp < teardown_done - 2.0, (failed[0].timestamp, teardown_done)
    # ... the round's stop (of the other rank, blocked in all_reduce with it) began then, and
    # the job finished then: the exit came after, once.
    kinds = [e.kind for e in events]
    stopping = [e for e in events if e.kind == "stopping"]
    assert stopping and stopping[0].timestamp < teardown_done - 2.0, [
        (e.kind, e.timestamp) for e in events
    ]
    assert kinds.count("finished") == 1
    last_exit = max(i for i, e in enumerate(events) if e.kind == "worker_exited" and e.rank == 1)
    assert kinds.index("finished") < last_exit
    assert len(final.attempts) == 1
    assert final.attempts[0].failures[0].global_rank == 1
