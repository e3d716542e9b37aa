"""The web dashboard of an in-process coordinator: authentication, bounds, headers, escaping.

Spoken to over real HTTP with aiohttp's client; jobs are driven by scripted node sessions.
tests/browser/ renders the pages in a real browser against a LocalCluster.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest

from client import Client
from client.model import JobSpec
from coordinator._dashboard import STATIC_DIR, DashboardAuth
from coordinator.server import Coordinator, CoordinatorConfig
from protos.gelastic.v1 import gelastic_pb2 as pb
from tests._helpers import free_port
from tests.service._fakes import FakeNode

TOKEN = "dashboard-token-for-tests-0123456789"
STEP = 10.0


@pytest.fixture
async def coord(tmp_path: Path) -> AsyncIterator[Coordinator]:
    token = tmp_path / "token"
    token.write_text(TOKEN)
    token.chmod(0o600)
    c = Coordinator(
        CoordinatorConfig(
            port=0, state_dir=":memory:", token_file=str(token), dashboard_port=free_port()
        )
    )
    await c.start()
    try:
        yield c
    finally:
        await c.stop()


def base(c: Coordinator) -> str:
    assert c.dashboard is not None
    return c.dashboard.url.rstrip("/")


async def login(http: aiohttp.ClientSession, c: Coordinator, token: str = TOKEN) -> str:
    """The session id a login with `token` gets ("" when refused)."""
    async with http.post(base(c) + "/login", json={"token": token}) as resp:
        if resp.status == 401:
            return ""
        assert resp.status == 200
        assert "Set-Cookie" not in resp.headers
        return str((await resp.json())["session"])


def session(sid: str) -> dict[str, str]:
    return {"Authorization": f"Session {sid}"}


async def test_data_needs_a_session_or_the_bearer_token(coord: Coordinator) -> None:
    async with aiohttp.ClientSession() as http:
        for path in ("/api/overview", "/api/stream/overview"):
            async with http.get(base(coord) + path) as resp:
                assert resp.status == 401
                assert resp.headers["Cache-Control"] == "no-store"
        # A page is a shell without data: its script fetches the data, and logs in for it.
        async with http.get(base(coord) + "/", allow_redirects=False) as resp:
            assert resp.status == 200
            assert "/static/app.js" in await resp.text()
        async with http.get(
            base(coord) + "/api/overview", headers={"Authorization": "Bearer wrong"}
        ) as resp:
            assert resp.status == 401
        async with http.get(
            base(coord) + "/api/overview", headers={"Authorization": f"Bearer {TOKEN}"}
        ) as resp:
            assert resp.status == 200
            assert (await resp.json())["nodes"] == []
        # A wrong token gets no session; a made-up session or the token as one reads nothing.
        assert await login(http, coord, "not-the-token") == ""
        for sid in ("x" * 43, TOKEN, "x" * 4000):
            async with http.get(base(coord) + "/api/overview", headers=session(sid)) as resp:
                assert resp.status == 401


async def test_login_hands_out_a_session_that_is_not_the_token_until_logout(
    coord: Coordinator,
) -> None:
    async with aiohttp.ClientSession() as http:
        sid = await login(http, coord)
        assert len(sid) >= 40 and TOKEN not in sid
        async with http.get(base(coord) + "/api/overview", headers=session(sid)) as resp:
            assert resp.status == 200
        async with http.post(base(coord) + "/logout", headers=session(sid)) as resp:
            assert resp.status == 204
        async with http.get(base(coord) + "/api/overview", headers=session(sid)) as resp:
            assert resp.status == 401, "a session must end with its logout"


async def test_every_response_has_the_security_headers(coord: Coordinator) -> None:
    async with aiohttp.ClientSession() as http:
        for path in ("/login", "/static/app.js", "/static/style.css"):
            async with http.get(base(coord) + path) as resp:
                assert resp.status == 200, path
                csp = resp.headers["Content-Security-Policy"]
                assert "script-src 'self'" in csp and "unsafe-inline" not in csp
                assert resp.headers["X-Content-Type-Options"] == "nosniff"
                assert resp.headers["Cache-Control"] == "no-store"
        async with http.get(base(coord) + "/static/..%2f_dashboard.py") as resp:
            assert resp.status == 404


async def test_request_bounds(coord: Coordinator) -> None:
    async with aiohttp.ClientSession() as http:
        async with http.post(base(coord) + "/login", json={"token": "x" * 100_000}) as resp:
            assert resp.status == 413
        async with http.get(base(coord) + "/login", headers={"X-Big": "y" * 20_000}) as resp:
            assert resp.status in (400, 431)
        async with http.post(
            base(coord) + "/login",
            json={"token": TOKEN},
            headers={"Origin": "https://elsewhere.example"},
            allow_redirects=False,
        ) as resp:
            assert resp.status == 403, "a login posted from another site is refused"


async def test_event_streams_are_capped(coord: Coordinator) -> None:
    assert coord.dashboard is not None
    coord.dashboard.max_streams = 2
    auth = {"Authorization": f"Bearer {TOKEN}"}
    async with aiohttp.ClientSession(headers=auth) as http:
        open_streams = []
        for _ in range(2):
            resp = await http.get(base(coord) + "/api/stream/overview")
            assert resp.status == 200
            line = await asyncio.wait_for(resp.content.readline(), STEP)
            assert line == b"event: overview\n"
            open_streams.append(resp)
        async with http.get(base(coord) + "/api/stream/overview") as resp:
            assert resp.status == 503
        for resp in open_streams:
            resp.close()


async def test_overview_stream_follows_the_change_stream(coord: Coordinator) -> None:
    """A node joining shows up on an open stream without a reload: the service's own changes
    wake it (no poll of the store)."""
    auth = {"Authorization": f"Bearer {TOKEN}"}
    async with aiohttp.ClientSession(headers=auth) as http:
        resp = await http.get(base(coord) + "/api/stream/overview")
        first = await _next_event(resp)
        assert first["nodes"] == []
        node = _node(coord, "n1", slots=3)
        await node.connect()
        try:
            async with asyncio.timeout(STEP):
                while True:
                    d = await _next_event(resp)
                    if d["nodes"]:
                        break
            (n,) = d["nodes"]
            assert n["name"] == "n1" and n["slots"] == 3 and n["state"] == "live"
        finally:
            resp.close()
            await node.close()


async def test_get_dashboard_names_the_url(coord: Coordinator, tmp_path: Path) -> None:
    token = tmp_path / "client-token"
    token.write_text(TOKEN)
    token.chmod(0o600)
    client = Client(coord.address, token_file=str(token))
    try:
        url = await asyncio.to_thread(client.dashboard_url)
    finally:
        client.close()
    assert coord.dashboard is not None
    assert url == f"http://127.0.0.1:{coord.dashboard.port}/"


def test_the_dashboard_listens_by_the_grpc_ports_rules() -> None:
    with pytest.raises(ValueError, match="dashboard_port"):
        CoordinatorConfig(dashboard_port=70000).validate()
    with pytest.raises(ValueError, match="without a token"):
        CoordinatorConfig(host="0.0.0.0", dashboard_port=8080, state_dir=":memory:").validate()


def test_sessions_are_bounded_and_expire() -> None:
    host = "127.0.0.1:8400"
    now = [1000.0]
    auth = DashboardAuth("tok", clock=lambda: now[0], ttl=60.0, max_sessions=3)
    assert auth.login("wrong", host) is None
    assert auth.login("tok" * 2000, host) is None
    sids = [auth.login("tok", host) for _ in range(5)]
    assert all(sids) and len(set(sids)) == 5
    assert auth.session_count() == 3
    assert not auth.session_valid(sids[0] or "", host), "the oldest session makes room"
    assert auth.session_valid(sids[4] or "", host)
    assert auth.session_valid(sids[4] or "", host.upper()), "a host name has no case"
    assert not auth.session_valid(sids[4] or "", "localhost:8400"), "only where it was issued"
    now[0] += 61
    assert not auth.session_valid(sids[4] or "", host)
    assert auth.session_count() == 0
    assert DashboardAuth("").required is False


def test_the_pages_never_write_data_as_markup() -> None:
    """Worker output and tracebacks are hostile: the page script inserts text only."""
    js = (STATIC_DIR / "app.js").read_text()
    for sink in ("innerHTML", "outerHTML", "insertAdjacentHTML", "document.write", "eval("):
        assert sink not in js, sink
    for page in ("page.html", "login.html"):
        html = (STATIC_DIR / page).read_text()
        assert re.search(r"<script>", html) is None, "no inline script (the CSP forbids it)"
        assert "http://" not in html.replace('"http://www.w3.org', "") and "https://" not in html


async def test_hostile_text_reaches_the_page_as_json_text(coord: Coordinator) -> None:
    """A job's failure text comes back verbatim inside JSON strings, never as markup the
    server built."""
    hostile = "<img src=x onerror=alert(1)></script>\x1b[31m"
    node = _node(coord, "n1", slots=1)
    await node.connect()
    svc = coord.service
    job_id = await svc.submit(JobSpec(entrypoint=["true"], name="x"))
    rp = await node.expect("reserve_port")
    await node.send(
        port_reserved=pb.PortReserved(job_id=job_id, round=rp.reserve_port.round, port=40000)
    )
    asg = (await node.expect("assign")).assign
    await node.send(
        workers_started=pb.WorkersStarted(
            job_id=job_id, round=asg.round, workers=[pb.WorkerPid(local_rank=0, pid=4242)]
        )
    )
    await node.send(
        worker_exited=pb.WorkerExited(
            job_id=job_id,
            round=asg.round,
            exit=pb.WorkerExit(
                local_rank=0,
                global_rank=0,
                pid=4242,
                exitcode=1,
                has_failure=True,
                failure=pb.ProcessFailure(message=hostile, traceback=hostile, exitcode=1),
            ),
        )
    )
    auth = {"Authorization": f"Bearer {TOKEN}"}
    async with aiohttp.ClientSession(headers=auth) as http:
        async with asyncio.timeout(STEP):
            while True:
                async with http.get(f"{base(coord)}/api/jobs/{job_id}") as resp:
                    assert resp.status == 200
                    assert resp.content_type == "application/json"
                    d = await resp.json()
                if d["root_cause"]:
                    break
                await asyncio.sleep(0.05)
        assert d["root_cause"]["traceback"] == hostile
        assert json.dumps(d).count("<img") >= 1
    await node.close()


async def _next_event(resp: aiohttp.ClientResponse) -> dict:  # type: ignore[type-arg]
    """The data of the next `event:` of an SSE response (comments skipped)."""
    name = ""
    async with asyncio.timeout(STEP):
        while True:
            line = (await resp.content.readline()).decode()
            if line.startswith("event: "):
                name = line[7:].strip()
            elif line.startswith("data: ") and name:
                return json.loads(line[6:])  # type: ignore[no-any-return]


def _node(coord: Coordinator, name: str, slots: int) -> FakeNode:
    node = FakeNode(coord.address, name, "127.0.0.1", slots=slots)
    asyncio.get_running_loop().create_task(node.channel.close())
    node.channel = _authed_channel(coord.address)
    return node


def _authed_channel(address: str):  # type: ignore[no-untyped-def]
    import grpc

    # grpc.aio files an interceptor under its first matching kind: the session is stream-stream.
    class _Token(grpc.aio.StreamStreamClientInterceptor):  # type: ignore[misc]
        async def intercept_stream_stream(self, continuation, details, request):  # type: ignore[no-untyped-def]
            md = [*(details.metadata or []), ("authorization", f"Bearer {TOKEN}")]
            return await continuation(details._replace(metadata=md), request)

    return grpc.aio.insecure_channel(address, interceptors=[_Token()])


async def test_gelastic_dashboard_prints_the_url(
    coord: Coordinator, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from client import cli

    token = tmp_path / "client-token"
    token.write_text(TOKEN)
    token.chmod(0o600)
    argv = ["--coordinator", coord.address, "--token-file", str(token), "dashboard"]
    assert await asyncio.to_thread(cli.main, argv) == 0
    assert coord.dashboard is not None
    out, err = capsys.readouterr()
    assert out == f"http://127.0.0.1:{coord.dashboard.port}/\n"
    # Which token logs in, said on stderr.
    assert err == (
        f"gelastic dashboard: log in with the token in {token} (the client token this command "
        "sent)\n"
    )
    await coord.dashboard.stop()
    coord.service.dashboard = None
    assert await asyncio.to_thread(cli.main, argv) == 2
    assert "serves no dashboard" in capsys.readouterr().err


async def test_over_tls_a_login_works_and_plain_http_is_refused(tmp_path: Path) -> None:
    import ssl

    from tests.security._certs import TestCA

    ca = TestCA(tmp_path / "ca")
    server = ca.server()
    token = tmp_path / "token"
    token.write_text(TOKEN)
    token.chmod(0o600)
    c = Coordinator(
        CoordinatorConfig(
            port=0,
            state_dir=":memory:",
            token_file=str(token),
            tls_cert=server.cert,
            tls_key=server.key,
            dashboard_port=free_port(),
        )
    )
    await c.start()
    try:
        assert c.dashboard is not None and c.dashboard.url.startswith("https://")
        trust = ssl.create_default_context(cafile=ca.ca)
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=trust)) as http:
            sid = await login(http, c)
            async with http.get(base(c) + "/api/overview", headers=session(sid)) as resp:
                assert resp.status == 200
            plain = base(c).replace("https://", "http://") + "/login"
            with pytest.raises(aiohttp.ClientError):
                async with http.get(plain) as resp:
                    await resp.read()
    finally:
        await c.stop()


async def test_log_tail_is_relayed_from_the_node_with_the_relays_caps(coord: Coordinator) -> None:
    """The log tail is the agents' log relay (what `gelastic logs` reads): the node is asked
    with StartLogs, its chunks reach the page, and the relay's per-client cap holds."""
    from coordinator._log_relay import LOG_STREAMS_PER_CLIENT

    node = _node(coord, "n1", slots=1)
    await node.connect()
    job_id = await coord.service.submit(JobSpec(entrypoint=["true"], name="logs"))
    rp = await node.expect("reserve_port")
    await node.send(
        port_reserved=pb.PortReserved(job_id=job_id, round=rp.reserve_port.round, port=40000)
    )
    asg = (await node.expect("assign")).assign
    await node.send(
        workers_started=pb.WorkersStarted(
            job_id=job_id, round=asg.round, workers=[pb.WorkerPid(local_rank=0, pid=4242)]
        )
    )
    auth = {"Authorization": f"Bearer {TOKEN}"}
    url = f"{base(coord)}/api/stream/logs/{job_id}/0?stream=stdout"
    async with aiohttp.ClientSession(headers=auth) as http:
        streams = []
        try:
            first = await http.get(url)
            assert first.status == 200
            start = (await node.expect("start_logs")).start_logs
            assert start.job_id == job_id and start.rank == 0 and start.follow
            await node.send(
                log_chunk=pb.LogChunk(request_id=start.request_id, data=b"step 1 <b>\n")
            )
            assert await _next_event(first) == {"text": "step 1 <b>\n", "dropped": 0}
            for _ in range(LOG_STREAMS_PER_CLIENT - 1):
                streams.append(await http.get(url))
                await node.expect("start_logs")
            over = await http.get(url)
            streams.append(over)
            ended = await _next_event(over)
            assert "at most" in ended["reason"] and "log streams per client" in ended["reason"]
            await node.send(log_chunk=pb.LogChunk(request_id=start.request_id, eof=True))
            assert (await _next_event(first))["reason"] == "the rank's log ended"
        finally:
            for resp in [first, *streams]:
                resp.close()
    await node.close()


def _documented_data_api() -> dict[str, str]:
    """docs/deployment.md's table of the dashboard's data URLs: path -> what it answers."""
    text = (Path(__file__).resolve().parents[2] / "docs" / "deployment.md").read_text()
    section = text.split("### The dashboard's data, for scripts", 1)[1].split("\n#", 1)[0]
    rows = re.findall(r"^\| `GET (/api/[^`?]+)(?:\?[^`]*)?` \| (.*) \|$", section, re.M)
    return dict(rows)


async def test_the_data_api_the_docs_list_is_the_dashboards(coord: Coordinator) -> None:
    assert coord.dashboard is not None
    routes = {
        r.canonical
        for r in coord.dashboard.app().router.resources()
        if r.canonical.startswith("/api/")
    }
    documented = _documented_data_api()
    assert set(documented) == routes
    job_id = await coord.service.submit(
        JobSpec(entrypoint=["python", "t.py"], min_nodes=1, max_nodes=1)
    )
    bearer = {"Authorization": f"Bearer {TOKEN}"}
    async with aiohttp.ClientSession() as http:
        for path, keys in (("/api/overview", "overview"), (f"/api/jobs/{job_id}", "job")):
            async with http.get(base(coord) + path, headers=bearer) as resp:
                assert resp.status == 200
                data = await resp.json()
            # Every key the page's JSON has is named where the docs describe it.
            doc = documented["/api/overview" if keys == "overview" else "/api/jobs/{job_id}"]
            missing = [k for k in data if f"`{k}`" not in doc]
            assert not missing, (path, missing)
