"""The dashboard shows no more of a job than GetJob, and answers only under its own names.

Before the fix a job's page (`/api/jobs/ID` and its event stream) joined the stored argv as it
was, so `--password=hunter2` was on the page while GetJob showed `--password=<redacted>`. And
it answered whatever Host a request named: a page of another site whose name was pointed at
the dashboard's address (DNS rebinding) could read it from the operator's browser.
"""

from __future__ import annotations

import asyncio
import http.client
import json

import aiohttp
import grpc
import pytest

from client.model import JobSpec
from client.redaction import REDACTED
from coordinator._dashboard_guard import HostCheck
from coordinator.server import Coordinator
from protos.gelastic.v1 import gelastic_pb2 as pb
from protos.gelastic.v1 import gelastic_pb2_grpc as pb_grpc
from tests.service.test_dashboard import TOKEN, _next_event, base, coord  # noqa: F401 - fixture

BEARER = {"Authorization": f"Bearer {TOKEN}"}
SECRETS = ("hunter2", "k3y-value", "hf-token-value")


async def _get_job(c: Coordinator, job_id: str) -> pb.Job:
    async with grpc.aio.insecure_channel(c.address) as channel:
        resp = await pb_grpc.CoordinatorStub(channel).GetJob(
            pb.GetJobRequest(job_id=job_id), metadata=(("authorization", f"Bearer {TOKEN}"),)
        )
    return resp


async def test_a_jobs_page_shows_the_argv_getjob_shows(coord: Coordinator) -> None:  # noqa: F811
    spec = JobSpec(
        entrypoint=["python", "train.py", "--password=hunter2", "--api-key", "k3y-value"],
        args=("--lr=0.1",),
        env={"HF_TOKEN": "hf-token-value"},
    )
    job_id = await coord.service.submit(spec)
    shown = await _get_job(coord, job_id)
    grpc_argv = " ".join([*shown.spec.entrypoint, *shown.spec.args])
    assert grpc_argv == f"python train.py --password={REDACTED} --api-key {REDACTED} --lr=0.1"
    async with aiohttp.ClientSession(headers=BEARER) as session:
        async with session.get(f"{base(coord)}/api/jobs/{job_id}") as resp:
            assert resp.status == 200
            body = await resp.text()
        async with session.get(f"{base(coord)}/api/stream/jobs/{job_id}") as resp:
            assert resp.status == 200
            streamed = await _next_event(resp)
    page = json.loads(body)
    assert page["spec"]["entrypoint"] == grpc_argv
    assert streamed["spec"]["entrypoint"] == grpc_argv
    for secret in SECRETS:
        assert secret not in body and secret not in json.dumps(streamed), secret


def _status(port: int, host: str | None, path: str = "/api/overview") -> int:
    """The status of GET `path` on 127.0.0.1:`port` naming `host` (None: no Host at all)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.putrequest("GET", path, skip_host=True)
        if host is not None:
            conn.putheader("Host", host)
        conn.putheader("Authorization", BEARER["Authorization"])
        conn.endheaders()
        resp = conn.getresponse()
        resp.read()
        return resp.status
    finally:
        conn.close()


async def test_only_the_dashboards_own_names_are_served(coord: Coordinator) -> None:  # noqa: F811
    assert coord.dashboard is not None
    port = coord.dashboard.port
    for host in (f"127.0.0.1:{port}", f"localhost:{port}", f"LocalHost.:{port}", f"[::1]:{port}"):
        assert await asyncio.to_thread(_status, port, host) == 200, host
    for host in (
        f"evil.example:{port}",
        f"127.0.0.1.nip.io:{port}",
        f"localhost.evil.example:{port}",
        f"127.0.0.1:{port + 1}",
        "127.0.0.1",  # port 80 implied
        f"127.0.0.2:{port}",
        f"::1:{port}",
        "",
    ):
        for path in ("/api/overview", "/login", "/static/style.css"):
            assert await asyncio.to_thread(_status, port, host, path) == 421, (host, path)
    # No Host at all: HTTP/1.1's parser refuses it before the dashboard sees it.
    assert await asyncio.to_thread(_status, port, None) == 400


def test_the_names_served_for_each_kind_of_bind() -> None:
    named = HostCheck("10.0.0.5", 8400, 80, names=["coord.example.com"])
    assert named.allows("10.0.0.5:8400") and named.allows("coord.example.com:8400")
    assert named.allows("COORD.example.com.:8400")
    assert not named.allows("localhost:8400") and not named.allows("127.0.0.1:8400")
    assert not named.allows("10.0.0.6:8400") and not named.allows("evil.example:8400")
    v6 = HostCheck("::1", 8400, 80)
    assert v6.allows("[::1]:8400") and v6.allows("[0:0::1]:8400") and v6.allows("localhost:8400")
    tls = HostCheck("127.0.0.1", 443, 443)
    assert tls.allows("localhost") and tls.allows("localhost:443") and not tls.allows("x:443")
    anywhere = HostCheck("0.0.0.0", 8400, 80, names=["node7", "node7.example.com"])
    assert anywhere.allows("node7:8400") and anywhere.allows("node7.example.com:8400")
    assert anywhere.allows("10.1.2.3:8400") and anywhere.allows("[fd00::5]:8400")
    assert not anywhere.allows("evil.example:8400") and not anywhere.allows("node7:8401")
    assert not anywhere.allows("0.0.0.0.evil.example:8400")


@pytest.mark.parametrize(
    "header", ["[::1", "[evil]:8400", "host:80x", "host:", ":8400", "a b:8400"]
)
def test_malformed_host_headers_are_refused(header: str) -> None:
    assert not HostCheck("127.0.0.1", 8400, 80).allows(header)
