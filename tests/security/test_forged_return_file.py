"""End to end: a return file rewritten on the node never gets unpickled by any client.

(Whoever could also write a tag with the job's key, a node of the job, is the subject of
test_return_value_pickles.py.)

Before the fix the client unpickled whatever `return.pkl` held when the worker exited, so any
process of the same user on the node (another job's worker, say) chose code that ran in the
submitter's process, and in `gelastic result` on anyone's machine.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from client import JobSpec, WorkerState
from client.results import PickledReturnValue, ReturnValueError
from gelastic.local import LocalCluster
from tests.e2e.conftest import assert_no_leftovers

TIMEOUT = 120
REPO = str(Path(__file__).resolve().parents[2])


def test_a_return_file_forged_on_the_node_is_refused_and_never_loaded(tmp_path: Path) -> None:
    marker = tmp_path / "loaded"
    spec = JobSpec(
        entrypoint="tests.workloads.forged_return:forge_return_file",
        args=(str(marker),),
        cwd=REPO,
        env={"PYTHONPATH": REPO},
    )
    cluster = LocalCluster(
        nodes=1, slots=1, workdir=tmp_path / "cluster", lease=3.0, heartbeat_interval=0.5
    )
    with cluster:
        job = cluster.client.submit(spec)
        with pytest.raises(ReturnValueError, match="rank 0"):
            job.wait(TIMEOUT)
        with cluster.connect() as other:
            result = other.job(job.job_id).wait(TIMEOUT)
        assert result.state == WorkerState.SUCCEEDED
        assert set(result.raw_return_values) == {0}
        # Without the key nothing is verified, and nothing is unpickled either.
        value = result.return_values[0]
        assert isinstance(value, PickledReturnValue) and not value.verified
        assert not marker.exists()
    assert_no_leftovers(cluster)
