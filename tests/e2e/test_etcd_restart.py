"""etcd itself dies under a running cluster (SIGKILL of a single member) and comes back.

While it is away the coordinator answers UNAVAILABLE, naming etcd, to what it cannot write, and
shows nothing it has not written (the job that finished meanwhile is not reported finished).
Once etcd is back it resumes by itself: the job ends, with no worker started twice, and a kill
of the coordinator afterwards loses nothing.
"""

from __future__ import annotations

import signal
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from client import JobSpec, WorkerState
from client.wire import spec_to_pb
from gelastic.local import LocalCluster, poll_until
from protos.gelastic.v1 import gelastic_pb2 as pb
from protos.gelastic.v1 import gelastic_pb2_grpc as pb_grpc
from tests._etcd import EtcdServer
from tests.e2e.conftest import PY, Gate, script

TIMEOUT = 120


@pytest.fixture
def etcd(tmp_path: Path) -> Iterator[EtcdServer]:
    """An etcd of this test's own (it is killed); requested before the cluster, so it is
    stopped after the cluster is."""
    server = EtcdServer(tmp_path / "etcd")
    server.start()
    try:
        yield server
    finally:
        server.stop()


def _running(job: Any, n: int) -> bool:
    return len([w for w in job.status().workers if w.pid and w.state == WorkerState.HEALTHY]) == n


def test_etcd_killed_mid_job_then_back_loses_nothing(
    etcd: EtcdServer, make_cluster: Callable[..., LocalCluster], out: Path, gate: Gate
) -> None:
    # A leader lease longer than the outage: the coordinator leads throughout and resumes (with
    # the default of 3 s it would step down and be elected again, tests/service/test_leader.py).
    cluster = make_cluster(coordinator_args=["--store", etcd.url("gelastic"), "--leader-ttl", "60"])
    spec = JobSpec(
        entrypoint=[PY, script("crash_once.py")],
        nproc_per_node=2,
        min_nodes=2,
        max_nodes=2,
        env={"OUT_DIR": str(out), "CRASH_UNTIL": "0", **gate.env},
    )
    job = cluster.client.submit(spec)
    gate.wait("start", 4)
    poll_until(lambda: _running(job, 4), 60, what="4 workers running")

    etcd.stop(signal.SIGKILL)
    gate.open("finish")
    gate.wait("finish", 4)
    token = Path(cluster.token_file).read_text().strip()
    auth = (("authorization", f"Bearer {token}"),)
    with grpc.insecure_channel(cluster.address) as ch:
        stub = pb_grpc.CoordinatorStub(ch)
        with pytest.raises(grpc.RpcError) as err:
            stub.Submit(
                pb.SubmitRequest(spec=spec_to_pb(spec), request_id="while-down"),
                timeout=30,
                metadata=auth,
            )
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE  # type: ignore[attr-defined]
        details = err.value.details() or ""  # type: ignore[attr-defined]
        assert "etcd is unavailable" in details and "not queued" in details, details
        # The workers are done, but the job's end is not written: it is not reported.
        try:
            seen = stub.GetJob(pb.GetJobRequest(job_id=job.job_id), timeout=5, metadata=auth)
            assert seen.state not in (pb.JOB_STATE_SUCCEEDED, pb.JOB_STATE_FAILED), seen.state
        except grpc.RpcError as exc:
            assert exc.code() in (  # type: ignore[attr-defined]
                grpc.StatusCode.UNAVAILABLE,
                grpc.StatusCode.DEADLINE_EXCEEDED,
            )

    etcd.start()
    result = job.wait(TIMEOUT)
    assert result.state == WorkerState.SUCCEEDED, result.format_failures()
    assert sorted(e["rank"] for e in gate.events("start")) == [0, 1, 2, 3]
    assert not list(out.glob("attempt1_*.json")), "a worker was started again"

    cluster.kill_coordinator()
    cluster.start_coordinator(port=cluster.port)
    again = job.poll()
    assert again is not None and again.state == WorkerState.SUCCEEDED
    # Nothing of the submit that was refused while etcd was away.
    assert [j.job_id for j in cluster.client.list_jobs(include_finished=True)] == [job.job_id]
