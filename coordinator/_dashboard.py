"""The coordinator's web dashboard: cluster, jobs and one job, live in a browser; it reads,
and its one action is a job's stack capture (`_dashboard_stacks`).

Served by aiohttp on the coordinator's own asyncio loop, beside the gRPC server, so it reads the
same `Cluster` state the servicers read, one event at a time, without locks or copies. Pages
update through server-sent events fed by the service's own change stream: the job page waits
on `CoordinatorService.wait_changed` (what WatchJob waits on), the cluster and jobs pages on
every batch of effects the service applies (`effect_observers`, what the metrics observe). No
loop polls the store. Log tails are relayed from the agents by `CoordinatorService.read_logs`,
the relay `gelastic logs` uses, with its per-client and global caps.

Authentication is the client token: the login page trades it (a JSON POST) for a random
session id that the page keeps in its origin's storage and sends in an `Authorization: Session`
header, or a request carries the token itself in an `Authorization: Bearer` header. No cookie
is used: a browser sends cookies to every port of a host (`_dashboard_auth` says why that
matters). The data (`/api/...`) needs one or the other; the pages themselves are static shells
without data, served to anyone, whose script fetches the data (event streams too, read with
`fetch`, since `EventSource` cannot send a header). The token never goes in a URL and is never
stored in a session. Everything is bounded: request bodies, header lines, sessions, event
streams. The pages insert data with textContent only, and the Content-Security-Policy allows
no inline script.

This module is the HTTP app: its routes, the middleware (names, authentication, headers), the
pages and the streams. What the pages read is built in `_dashboard_views`, the token and the
sessions are `_dashboard_auth`'s, the event stream's plumbing is `_dashboard_sse`'s, and the
connection limits are `_dashboard_guard`'s.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import ssl
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from aiohttp import web

from client.model import is_job_id as _is_job_id
from coordinator._cluster import JobNotFound
from coordinator._dashboard_auth import DashboardAuth, session_header
from coordinator._dashboard_guard import (
    DEFAULT_IDLE_TIMEOUT_S,
    DEFAULT_MAX_CONNECTIONS,
    LISTEN_BACKLOG,
    WILDCARDS,
    ConnectionGuard,
    HostCheck,
    wildcard_names,
)
from coordinator._dashboard_sse import ChangeFeed, sse_event, with_keepalive
from coordinator._dashboard_stacks import add_stack_routes
from coordinator._dashboard_views import DashboardModel
from coordinator._errors import RequestError
from protos.gelastic.v1 import gelastic_pb2 as pb

if TYPE_CHECKING:
    from coordinator._service import CoordinatorService

__all__ = ["Dashboard", "DashboardAuth", "server_ssl_context"]

logger = logging.getLogger(__name__)

STATIC_DIR = Path(__file__).resolve().parent / "dashboard_static"
MAX_SSE_STREAMS = 32
"""Event streams (all pages of all browsers) served at once; one more is refused with 503."""
MAX_BODY_BYTES = 16 * 1024
"""The largest request body: the login form is the only one."""
MAX_LINE_BYTES = 8 * 1024
"""The request line and each header line."""
MAX_HEADERS = 64
SSE_KEEPALIVE_S = 5.0
"""A comment this often on an idle stream: a browser that went away is noticed."""
SSE_MIN_INTERVAL_S = 0.5
"""Snapshots of one stream are at least this far apart: a burst of changes is one update."""
LOG_TAIL_BYTES = 64 * 1024
"""The most of a rank's log one update carries (the end of it); the page keeps about this much."""
LOG_FLUSH_S = 0.2

CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; "
    "connect-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'"
)
_STATIC_FILES = {"app.js": "text/javascript", "style.css": "text/css"}
_WHO = web.RequestKey("who", str)
"""Who a request is: "bearer", "open" or its session id (the log relay's client key)."""


class Dashboard:
    """`start()` listens; `stop()` ends every stream and closes the socket. Both idempotent."""

    def __init__(
        self,
        svc: CoordinatorService,
        host: str,
        port: int,
        token: str,
        ssl_context: ssl.SSLContext | None = None,
        *,
        max_streams: int = MAX_SSE_STREAMS,
        names: Iterable[str] = (),
        max_connections: int = DEFAULT_MAX_CONNECTIONS,
        idle_timeout: float = DEFAULT_IDLE_TIMEOUT_S,
    ) -> None:
        self.svc = svc
        self.host = host
        self.port = port
        self.names = tuple(names)
        """Host names the dashboard is also reached by (the advertised name)."""
        self.host_check = HostCheck(host, port, 443 if ssl_context is not None else 80)
        self.tls = ssl_context is not None
        self.auth = DashboardAuth(token)
        self.model = DashboardModel(svc)
        self.feed = ChangeFeed()
        self.max_streams = max_streams
        self.streams = 0
        self.max_connections = max_connections
        self.idle_timeout = idle_timeout
        self.guard: ConnectionGuard | None = None
        self._server: asyncio.Server | None = None
        self._ssl = ssl_context
        self._runner: web.AppRunner | None = None
        # The last message built, by what it shows: every browser on a page shares one build.
        self._overview_cache: tuple[int, bytes] = (-1, b"")
        self._job_cache: dict[str, tuple[tuple[int, int], bytes]] = {}
        self._static = {name: (STATIC_DIR / name).read_bytes() for name in _STATIC_FILES}
        self._page = (STATIC_DIR / "page.html").read_bytes()
        self._login = (STATIC_DIR / "login.html").read_bytes()

    @property
    def scheme(self) -> str:
        return "https" if self.tls else "http"

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{self.scheme}://{host}:{self.port}/"

    def app(self) -> web.Application:
        app = web.Application(client_max_size=MAX_BODY_BYTES, middlewares=[self._middleware])
        r = app.router
        r.add_get("/", self._page_handler)
        r.add_get("/jobs", self._page_handler)
        r.add_get("/jobs/{job_id}", self._page_handler)
        r.add_get("/login", self._login_page)
        r.add_post("/login", self._login_post)
        r.add_post("/logout", self._logout)
        r.add_get("/static/{name}", self._static_handler)
        r.add_get("/api/overview", self._api_overview)
        r.add_get("/api/jobs/{job_id}", self._api_job)
        r.add_get("/api/stream/overview", self._stream_overview)
        r.add_get("/api/stream/jobs/{job_id}", self._stream_job)
        r.add_get("/api/stream/logs/{job_id}/{rank}", self._stream_logs)
        add_stack_routes(r, self.svc, self._job_id, self._written, _same_origin)
        return app

    async def start(self) -> None:
        if self._runner is not None:
            return
        self.svc.effect_observers.append(self.feed.observe)
        runner = web.AppRunner(
            self.app(),
            access_log=None,
            handle_signals=False,
            shutdown_timeout=1.0,
            max_line_size=MAX_LINE_BYTES,
            max_field_size=MAX_LINE_BYTES,
            max_headers=MAX_HEADERS,
            # aiohttp's own timer for idle keep-alive connections (its default is an hour).
            keepalive_timeout=self.idle_timeout,
        )
        await runner.setup()
        assert runner.server is not None
        loop = asyncio.get_running_loop()
        # The guard sits below aiohttp: it counts and times connections whatever aiohttp's
        # version does with idle ones (some never close a connection that sends nothing).
        guard = ConnectionGuard(self.max_connections, self.idle_timeout, loop)
        try:
            server = await loop.create_server(
                guard.protocol_factory(runner.server),
                self.host or None,
                self.port,
                ssl=self._ssl,
                backlog=LISTEN_BACKLOG,
                ssl_handshake_timeout=self.idle_timeout if self._ssl is not None else None,
            )
        except OSError as exc:
            await runner.cleanup()
            raise OSError(f"dashboard: could not listen on {self.host}:{self.port}: {exc}") from exc
        self.port = int(server.sockets[0].getsockname()[1])  # asked for 0: any free one
        self.guard, self._server = guard, server
        names = [*self.names, *(wildcard_names() if self.host.strip("[]") in WILDCARDS else ())]
        self.host_check = HostCheck(self.host, self.port, 443 if self.tls else 80, names)
        self._runner = runner
        logger.info("dashboard on %s", self.url)

    def adopt(self, svc: CoordinatorService) -> None:
        """Show `svc` from now on (a replica that took over, or stepped down)."""
        if self._runner is not None:
            with contextlib.suppress(ValueError):
                self.svc.effect_observers.remove(self.feed.observe)
            svc.effect_observers.append(self.feed.observe)
        self.svc = svc
        self.model.svc = svc
        self._overview_cache = (-1, b"")
        self._job_cache = {}

    async def stop(self) -> None:
        runner, self._runner = self._runner, None
        if runner is None:
            return
        with contextlib.suppress(ValueError):
            self.svc.effect_observers.remove(self.feed.observe)
        server, self._server = self._server, None
        if server is not None:
            server.close()  # no new connection
        await runner.cleanup()
        if self.guard is not None:
            self.guard.close()

    # ---- middleware: headers and authentication --------------------------------------------

    @web.middleware
    async def _middleware(
        self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        guard = self.guard
        if guard is None:
            return await self._guarded(request, handler)
        transport = request.transport
        guard.request_started(transport)
        try:
            return await self._guarded(request, handler)
        finally:
            guard.request_ended(transport)

    async def _guarded(
        self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        if not self.host_check.allows(request.headers.get("Host")):
            refused = web.Response(status=421, text="this dashboard is not served under that name")
            _secure_headers(refused)
            return refused
        if request.path.startswith("/api/"):
            # Only the data needs a session: a page is a shell whose script fetches it.
            who = self.auth.authorized(request)
            if who is None:
                refused = _error(401, "log in first: no valid session or bearer token")
                _secure_headers(refused)
                return refused
            request[_WHO] = who
        try:
            resp = await handler(request)
        except web.HTTPException as exc:
            _secure_headers(exc)
            raise
        _secure_headers(resp)
        return resp

    # ---- pages -----------------------------------------------------------------------------

    async def _page_handler(self, request: web.Request) -> web.Response:
        return web.Response(body=self._page, content_type="text/html", charset="utf-8")

    async def _login_page(self, request: web.Request) -> web.StreamResponse:
        if not self.auth.required:
            return _redirect("/")
        return web.Response(body=self._login, content_type="text/html", charset="utf-8")

    async def _login_post(self, request: web.Request) -> web.StreamResponse:
        """The token, as JSON `{"token": ...}`, for `{"session": ID, "expires_in": S}`.

        JSON only: a page of another origin cannot send it without a CORS preflight (which
        is never answered), and a form cannot send it at all."""
        if not _same_origin(request):
            return _error(403, "cross-origin login refused")
        if request.content_type != "application/json":
            return _error(415, 'a login is a JSON object: {"token": ...}')
        try:
            body = await request.json()
        except web.HTTPRequestEntityTooLarge:
            return _error(413, "request too large")
        except ValueError:
            return _error(400, 'a login is a JSON object: {"token": ...}')
        token = body.get("token") if isinstance(body, dict) else None
        host = request.headers.get("Host", "")
        sid = self.auth.login(token.strip() if isinstance(token, str) else "", host)
        if sid is None:
            # Rate-limited per host with the gRPC refusals: a login loop cannot flood the log.
            self.svc.refusals.refused(request.remote or "?", "a dashboard login", "wrong token")
            return _error(401, "that is not the coordinator's client token")
        return _json({"session": sid, "expires_in": int(self.auth.ttl)})

    async def _logout(self, request: web.Request) -> web.StreamResponse:
        if not _same_origin(request):
            return _error(403, "cross-origin logout refused")
        self.auth.logout(session_header(request))
        return web.Response(status=204)

    async def _static_handler(self, request: web.Request) -> web.Response:
        name = request.match_info["name"]
        if name == "login.css":
            name = "style.css"
        kind = _STATIC_FILES.get(name)
        if kind is None:
            raise web.HTTPNotFound()
        return web.Response(body=self._static[name], content_type=kind, charset="utf-8")

    # ---- data ------------------------------------------------------------------------------

    async def _api_overview(self, request: web.Request) -> web.Response:
        await self._written(None)
        return _json(self.model.overview())

    async def _api_job(self, request: web.Request) -> web.Response:
        job_id = self._job_id(request)
        await self._written([job_id])
        return _json(self.model.job(job_id))

    def _job_id(self, request: web.Request) -> str:
        job_id = request.match_info["job_id"]
        if not self.svc.cluster.has_job(job_id):
            shown = job_id[:80] if _is_job_id(job_id) else "that id"
            raise web.HTTPNotFound(
                text=json.dumps({"error": f"no job {shown}"}), content_type="application/json"
            )
        return job_id

    async def _written(self, job_ids: list[str] | None) -> None:
        ids = self.svc.cluster.job_ids() if job_ids is None else job_ids
        try:
            await self.svc.written(ids)
        except RequestError as exc:
            raise web.HTTPServiceUnavailable(
                text=json.dumps({"error": exc.message}), content_type="application/json"
            ) from None

    # ---- streams ---------------------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def _stream(self, request: web.Request) -> AsyncIterator[web.StreamResponse]:
        if self.streams >= self.max_streams:
            raise web.HTTPServiceUnavailable(
                text=json.dumps(
                    {"error": f"the dashboard already serves {self.max_streams} streams"}
                ),
                content_type="application/json",
            )
        self.streams += 1
        try:
            resp = web.StreamResponse(
                headers={"Content-Type": "text/event-stream", "X-Accel-Buffering": "no"}
            )
            _secure_headers(resp)
            await resp.prepare(request)
            with contextlib.suppress(ConnectionResetError):
                yield resp
        finally:
            self.streams -= 1

    def _overview_message(self) -> bytes:
        version, message = self._overview_cache
        if version != self.feed.version:
            version, message = self.feed.version, sse_event("overview", self.model.overview())
            self._overview_cache = (version, message)
        return message

    def _job_message(self, job_id: str) -> bytes:
        # Per second too: a job that does not change still shows its duration growing.
        version = (self.svc.job_version(job_id), int(self.svc.now()))
        cached = self._job_cache.get(job_id)
        if cached is not None and cached[0] == version:
            return cached[1]
        message = sse_event("job", self.model.job(job_id))
        if len(self._job_cache) >= self.max_streams:
            self._job_cache.clear()  # at most one entry per open stream is of any use
        self._job_cache[job_id] = (version, message)
        return message

    async def _stream_overview(self, request: web.Request) -> web.StreamResponse:
        async with self._stream(request) as resp:
            seen = -1
            while True:
                version = self.feed.version
                if version != seen:
                    seen = version
                    try:
                        await self.svc.written(self.svc.cluster.job_ids())
                        await resp.write(self._overview_message())
                    except RequestError as exc:
                        await resp.write(sse_event("problem", {"error": exc.message}))
                else:
                    await resp.write(b": keepalive\n\n")
                await asyncio.sleep(SSE_MIN_INTERVAL_S)
                await self.feed.wait(seen, SSE_KEEPALIVE_S)
        return resp

    async def _stream_job(self, request: web.Request) -> web.StreamResponse:
        job_id = self._job_id(request)
        svc = self.svc
        async with self._stream(request) as resp:
            version = svc.job_version(job_id)
            while True:
                try:
                    await svc.written([job_id])
                    if not svc.cluster.has_job(job_id):
                        await resp.write(sse_event("end", {"reason": "the job was deleted"}))
                        break
                    await resp.write(self._job_message(job_id))
                except RequestError as exc:
                    await resp.write(sse_event("problem", {"error": exc.message}))
                if svc.cluster.job_state(job_id).is_terminal():
                    await resp.write(sse_event("end", {"reason": "the job finished"}))
                    break
                # The change stream WatchJob follows; the pause coalesces a burst of changes.
                await asyncio.sleep(max(SSE_MIN_INTERVAL_S, svc.watch_interval(job_id)))
                seen, version = version, await svc.wait_changed(job_id, version, SSE_KEEPALIVE_S)
                if version == seen:
                    await resp.write(b": keepalive\n\n")
        return resp

    async def _stream_logs(self, request: web.Request) -> web.StreamResponse:
        job_id = self._job_id(request)
        try:
            rank = int(request.match_info["rank"])
        except ValueError:
            raise web.HTTPBadRequest(text="rank: not a number") from None
        stream = request.query.get("stream", "stdout")
        if stream not in ("stdout", "stderr") or not 0 <= rank < 2**31:
            raise web.HTTPBadRequest(text="stream must be stdout or stderr; rank >= 0")
        req = pb.ReadLogsRequest(job_id=job_id, rank=rank, stream=stream, attempt=-1, follow=True)
        # The relay's per-client cap counts per browser session (all bearer callers are one).
        client = f"dashboard:{request.get(_WHO, 'open')}"
        async with self._stream(request) as resp:
            pending = bytearray()
            dropped = 0
            loop = asyncio.get_running_loop()
            last = 0.0
            quiet_since = loop.time()

            async def flush() -> None:
                nonlocal dropped, last, quiet_since
                now = loop.time()
                if pending or dropped:
                    text = bytes(pending).decode("utf-8", errors="replace")
                    await resp.write(sse_event("log", {"text": text, "dropped": dropped}))
                    pending.clear()
                    dropped = 0
                    quiet_since = now
                elif now - quiet_since >= SSE_KEEPALIVE_S:
                    # A write is how a browser that left is noticed, and its relay ended.
                    await resp.write(b": keepalive\n\n")
                    quiet_since = now
                last = now

            try:
                logs = self.svc.log_relay.read_logs(req, client)
                async for data in with_keepalive(logs, LOG_FLUSH_S):
                    if data is not None:
                        pending += data
                        if len(pending) > LOG_TAIL_BYTES:
                            cut = len(pending) - LOG_TAIL_BYTES
                            dropped += cut
                            del pending[:cut]
                    if loop.time() - last >= LOG_FLUSH_S or data is None:
                        await flush()
                await flush()
                await resp.write(sse_event("end", {"reason": "the rank's log ended"}))
            except (RequestError, JobNotFound) as exc:
                await flush()
                message = exc.message if isinstance(exc, RequestError) else "no such job"
                await resp.write(sse_event("end", {"reason": message}))
        return resp


def _same_origin(request: web.Request) -> bool:
    """A login or logout from a page of this dashboard (or a client that sends no Origin)."""
    origin = request.headers.get("Origin")
    if origin is None:
        return True
    return origin == f"{request.scheme}://{request.host}"


def _secure_headers(resp: web.StreamResponse) -> None:
    if resp.prepared:
        return
    h = resp.headers
    h["Content-Security-Policy"] = CSP
    h["X-Content-Type-Options"] = "nosniff"
    h["X-Frame-Options"] = "DENY"
    h["Referrer-Policy"] = "same-origin"  # "no-referrer" makes a form post's Origin "null"
    h["Cache-Control"] = "no-store"


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"error": message}, status=status)


def _redirect(location: str) -> web.Response:
    return web.Response(status=303, headers={"Location": location})


def _json(data: Any) -> web.Response:
    return web.Response(
        text=json.dumps(data, allow_nan=False), content_type="application/json", charset="utf-8"
    )


def server_ssl_context(cert: str, key: str, client_ca: str = "") -> ssl.SSLContext:
    """The dashboard's TLS: the gRPC port's certificate, and its client CA when mTLS is on."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.load_cert_chain(cert, key)
    if client_ca:
        ctx.load_verify_locations(client_ca)
        ctx.verify_mode = ssl.CERT_REQUIRED
    return ctx
