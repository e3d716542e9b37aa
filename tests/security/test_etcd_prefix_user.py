"""The coordinator needs no more of etcd than its own prefix: an etcd user whose role may read
and write the keys under `PREFIX/` only is enough to lead and to keep the state, and the same
user on another prefix is refused at start with etcd's reason."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest

from client import JobSpec
from client.wire import spec_to_pb
from coordinator._store import StoreUnavailable
from coordinator.server import Coordinator, CoordinatorConfig
from protos.gelastic.v1 import gelastic_pb2 as pb
from protos.gelastic.v1 import gelastic_pb2_grpc as pb_grpc
from tests._etcd import EtcdServer

SPEC = JobSpec(entrypoint=["python", "train.py"], nproc_per_node=1, min_nodes=1, max_nodes=1)


def _config(url: str, tmp_path: Path, password_file: Path) -> CoordinatorConfig:
    return CoordinatorConfig(
        state_dir=str(tmp_path / "unused"),
        store=url,
        port=0,
        etcd_user="coordinators",
        etcd_password_file=str(password_file),
    )


async def test_a_user_limited_to_the_prefix_leads_and_keeps_the_state(tmp_path: Path) -> None:
    etcd = EtcdServer(tmp_path / "etcd")
    etcd.start()
    try:
        etcd.add_prefix_user("coordinators", "coordinators-pw-1234", "gelastic/")
        etcd.enable_auth("root-pw-1234")
        pw = tmp_path / "etcd.password"
        pw.write_text("coordinators-pw-1234\n")
        pw.chmod(0o600)
        async with (
            Coordinator(_config(etcd.url("gelastic"), tmp_path, pw)) as c,
            grpc.aio.insecure_channel(c.address) as ch,
        ):
            resp = await pb_grpc.CoordinatorStub(ch).Submit(
                pb.SubmitRequest(spec=spec_to_pb(SPEC), request_id="req-1"), timeout=60
            )
        async with (
            Coordinator(_config(etcd.url("gelastic"), tmp_path, pw)) as c,
            grpc.aio.insecure_channel(c.address) as ch,
        ):
            jobs = await pb_grpc.CoordinatorStub(ch).ListJobs(
                pb.ListJobsRequest(include_finished=True), timeout=60
            )
            assert [j.job_id for j in jobs.jobs] == [resp.job_id]
        # The role covers `gelastic/` only: another prefix is etcd's to refuse.
        with pytest.raises(StoreUnavailable, match=r"PERMISSION_DENIED|permission denied"):
            async with Coordinator(_config(etcd.url("other"), tmp_path, pw)):
                pass
    finally:
        etcd.stop()
