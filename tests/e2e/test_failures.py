"""The worker contract end to end: first errors, tracebacks, signals, return values, logs."""

from __future__ import annotations

from pathlib import Path

import pytest

from client import JobSpec, WorkerState
from gelastic.local import LocalCluster, poll_until
from tests.e2e.conftest import PY, script

TIMEOUT = 120
REPO = str(Path(__file__).resolve().parents[2])


@pytest.mark.parametrize("use_record", ["1", "0"], ids=["torch-record", "no-decorator"])
def test_root_cause_is_the_rank_that_raised_first(cluster: LocalCluster, use_record: str) -> None:
    spec = JobSpec(
        entrypoint=[PY, script("raise_first.py")],
        nproc_per_node=2,
        min_nodes=2,
        max_nodes=2,
        env={"RAISE_RANK": "1", "USE_RECORD": use_record},
        stop_grace=10,
    )
    job = cluster.client.submit(spec)
    result = job.wait(TIMEOUT)
    assert result.is_failed()
    root = result.root_cause
    assert root is not None and root.global_rank == 1 and root.root_cause
    assert root.message.startswith("ValueError: boom from rank 1"), root.message
    assert "Traceback (most recent call last)" in root.traceback
    assert "raise ValueError" in root.traceback
    assert root.error_file.endswith("error.json")

    # Ranks on the other node fail on the broken collective after the root cause: collateral.
    # The job was FAILED when the root cause was known; their failures join its result after.
    def collateral() -> bool:
        nonlocal result
        result = job.poll() or result
        return any(r != 1 for r in result.failures)

    poll_until(collateral, 60, what="the peers to crash on the broken collective")
    assert result.root_cause is not None and result.root_cause.global_rank == 1
    others = {r: f for r, f in result.failures.items() if r != 1}
    for f in others.values():
        assert not f.root_cause
        assert f.precise_timestamp >= root.precise_timestamp
    report = result.format_failures()
    assert report.index("boom from rank 1") < report.index("Other Failures")


def test_sigkill_names_the_signal_and_keeps_the_stderr_tail(cluster: LocalCluster) -> None:
    spec = JobSpec(
        entrypoint=[PY, script("sigkill_self.py")],
        nproc_per_node=2,
        min_nodes=2,
        max_nodes=2,
        env={"KILL_RANK": "2", "SLEEP": "60"},
        stop_grace=5,
    )
    result = cluster.client.submit(spec).wait(TIMEOUT)
    assert result.is_failed()
    assert set(result.failures) == {2}
    f = result.failures[2]
    assert f.message == f"Signal 9 (SIGKILL) received by PID {f.pid}" and f.executable == PY
    assert f.signal == "SIGKILL" and f.exitcode == -9
    assert "last words 2 of rank 2" in f.stderr_tail
    assert "SIGKILL" in result.format_failures()


def test_function_entrypoint_returns_values_by_global_rank(cluster: LocalCluster) -> None:
    spec = JobSpec(
        entrypoint="tests.e2e.funcs:report_rank",
        args=("hi",),
        kwargs={"scale": 10},
        nproc_per_node=2,
        min_nodes=2,
        max_nodes=2,
        cwd=REPO,
        env={"PYTHONPATH": REPO},
    )
    result = cluster.client.submit(spec).wait(TIMEOUT)
    assert result.state == WorkerState.SUCCEEDED, result.format_failures()
    assert result.return_values == {r: {"rank": 10 * r, "tag": "hi", "sum": 6.0} for r in range(4)}
    assert result.failures == {}


def test_logs_of_a_rank_come_from_its_agent(cluster: LocalCluster) -> None:
    spec = JobSpec(
        entrypoint=[PY, script("sigkill_self.py")],
        nproc_per_node=2,
        min_nodes=2,
        max_nodes=2,
    )
    job = cluster.client.submit(spec)
    result = job.wait(TIMEOUT)
    assert result.state == WorkerState.SUCCEEDED, result.format_failures()
    out = b"".join(job.logs(rank=3, stream="stdout")).decode()
    err = b"".join(job.logs(rank=3, stream="stderr")).decode()
    assert "hello stdout from rank 3" in out and "stderr" not in out
    assert "hello stderr from rank 3" in err
    assert "rank 1" in b"".join(job.logs(rank=1)).decode()
