"""The coordinator's read-only web dashboard: cluster, jobs and one job, live in a browser.

Served by aiohttp on the coordinator's own asyncio loop, beside the gRPC server, so it reads the
same `Cluster` state the servicers read, one event at a time, without locks or copies. Pages
update through server-sent events fed by the service's own change stream: the job page waits
on `CoordinatorService.wait_changed` (what WatchJob waits on), the cluster and jobs pages on
every batch of effects the service applies (`effect_observers`, what the metrics observe). No
loop polls the store. Log tails are relayed from the agents by `CoordinatorService.read_logs`,
the relay `gelastic logs` uses, with its per-client and global caps.

Authentication is the client token: a login form (POST) trades it for a random session id in
an HttpOnly, SameSite=Strict cookie (Secure over TLS), or a request carries it in an
`Authorization: Bearer` header. The token never goes in a URL and is never stored in the
cookie. Everything is bounded: request bodies, header lines, sessions, event streams. The
pages are static files of this package; they insert data with textContent only, and the
Content-Security-Policy allows no inline script.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import secrets
import ssl
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from aiohttp import web

from client.model import (
    AttemptSummary,
    JobEvent,
    JobState,
    ProcessFailure,
    first_failure,
)
from client.model import is_job_id as _is_job_id
from client.wire import shown_spec
from coordinator._cluster import Effect, JobNotFound
from coordinator._dashboard_guard import (
    DEFAULT_IDLE_TIMEOUT_S,
    DEFAULT_MAX_CONNECTIONS,
    LISTEN_BACKLOG,
    WILDCARDS,
    ConnectionGuard,
    HostCheck,
    wildcard_names,
)
from coordinator._errors import RequestError
from protos.gelastic.v1 import gelastic_pb2 as pb

if TYPE_CHECKING:
    from coordinator._service import CoordinatorService

__all__ = ["Dashboard", "DashboardAuth", "server_ssl_context"]

logger = logging.getLogger(__name__)

STATIC_DIR = Path(__file__).resolve().parent / "dashboard_static"
SESSION_COOKIE = "gelastic_session"
SESSION_TTL_S = 8 * 3600.0
"""A session lasts this long from its login, used or not."""
MAX_SESSIONS = 64
"""Sessions kept at once; a login beyond ends the oldest (only token holders can log in)."""
MAX_SSE_STREAMS = 32
"""Event streams (all pages of all browsers) served at once; one more is refused with 503."""
MAX_BODY_BYTES = 16 * 1024
"""The largest request body: the login form is the only one."""
MAX_TOKEN_CHARS = 4096
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
TEXT_MAX = 4096
"""One-line fields (reasons, messages) are cut to this many characters."""
TRACEBACK_MAX = 64 * 1024
EVENTS_SHOWN = 500
"""The latest events of a job the page shows."""
JOBS_SHOWN = 1000
"""The most recent jobs the jobs page lists."""
RANKS_SHOWN = 2000
"""Ranks a job page lists (the lowest global ranks)."""
ATTEMPTS_SHOWN = 20
"""The latest attempts a job's timeline draws."""
NODES_PER_ATTEMPT_SHOWN = 64
"""Nodes of one attempt the timeline draws a bar for."""

CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; "
    "connect-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'"
)
_PUBLIC = frozenset({"/login", "/static/style.css", "/static/login.css"})
_STATIC_FILES = {"app.js": "text/javascript", "style.css": "text/css"}
_WHO = web.RequestKey("who", str)
"""Who a request is: "bearer", "open" or its session id (the log relay's client key)."""


class DashboardAuth:
    """The token check and the sessions it hands out. The clock is passed in (tests)."""

    def __init__(
        self,
        token: str,
        clock: Callable[[], float] = time.monotonic,
        ttl: float = SESSION_TTL_S,
        max_sessions: int = MAX_SESSIONS,
    ) -> None:
        self._token = token
        self._clock = clock
        self._ttl = ttl
        self._max = max_sessions
        self._sessions: dict[str, float] = {}
        """Session id -> when it expires; insertion order is login order."""

    @property
    def required(self) -> bool:
        """False when the coordinator has no client token: the dashboard is as open as gRPC."""
        return bool(self._token)

    def token_matches(self, presented: str) -> bool:
        if not self._token or len(presented) > MAX_TOKEN_CHARS:
            return False
        return hmac.compare_digest(presented.encode(), self._token.encode())

    def login(self, presented: str) -> str | None:
        """A new session id for the right token, else None."""
        if not self.token_matches(presented):
            return None
        self._expire()
        while len(self._sessions) >= self._max:
            self._sessions.pop(next(iter(self._sessions)))
        sid = secrets.token_urlsafe(32)
        self._sessions[sid] = self._clock() + self._ttl
        return sid

    def logout(self, sid: str) -> None:
        self._sessions.pop(sid, None)

    def session_valid(self, sid: str) -> bool:
        expires = self._sessions.get(sid) if len(sid) <= 128 else None
        if expires is None:
            return False
        if self._clock() >= expires:
            del self._sessions[sid]
            return False
        return True

    def session_count(self) -> int:
        self._expire()
        return len(self._sessions)

    def authorized(self, request: web.Request) -> str | None:
        """Who the request is ("bearer", "open" or its session id), or None: not allowed."""
        if not self.required:
            return "open"
        header = request.headers.get("Authorization", "")
        if header.startswith("Bearer "):
            return "bearer" if self.token_matches(header[len("Bearer ") :]) else None
        sid = request.cookies.get(SESSION_COOKIE, "")
        return sid if sid and self.session_valid(sid) else None

    def _expire(self) -> None:
        now = self._clock()
        for sid in [s for s, t in self._sessions.items() if now >= t]:
            del self._sessions[sid]


class ChangeFeed:
    """Wakes the cluster-wide streams on every batch of effects the service applies."""

    def __init__(self) -> None:
        self.version = 0
        self._event = asyncio.Event()

    def observe(self, effects: list[Effect]) -> None:
        # Every apply, even one without effects: a heartbeat moves a node's last-seen time.
        self.version += 1
        self._event.set()

    async def wait(self, seen: int, timeout: float) -> int:
        if self.version == seen:
            self._event.clear()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(timeout):
                    await self._event.wait()
        return self.version


# ---- the JSON the pages read -------------------------------------------------------------------


def _cut(text: str, most: int = TEXT_MAX) -> str:
    return text if len(text) <= most else text[:most] + " [...]"


def _one_line(text: str) -> str:
    return _cut(" ".join(text.split()))


def failure_json(f: ProcessFailure) -> dict[str, Any]:
    return {
        "rank": f.global_rank,
        "local_rank": f.local_rank,
        "node": f.node,
        "pid": f.pid,
        "exitcode": f.exitcode,
        "signal": f.signal,
        "message": _cut(f.message),
        "traceback": _cut(f.traceback, TRACEBACK_MAX),
        "stderr_tail": _cut(f.stderr_tail, TRACEBACK_MAX),
        "attempt": f.attempt,
        "round": f.round,
        "root_cause": f.root_cause,
        "category": f.category.value,
        "timestamp": f.timestamp,
    }


def _attempt_json(a: AttemptSummary) -> dict[str, Any]:
    return {
        "attempt": a.attempt,
        "round": a.round,
        "nodes": list(a.nodes[:NODES_PER_ATTEMPT_SHOWN]),
        "nodes_total": len(a.nodes),
        "end_reason": _one_line(a.end_reason),
        "started_at": a.started_at,
        "ended_at": a.ended_at,
        "failed_ranks": [{"rank": f.global_rank, "node": f.node} for f in a.failures],
    }


def _event_json(e: JobEvent) -> dict[str, Any]:
    return {
        "seq": e.seq,
        "timestamp": e.timestamp,
        "kind": e.kind,
        "reason": _cut(e.reason),
        "attempt": e.attempt,
        "round": e.round,
        "node": e.node,
        "rank": e.rank,
    }


class DashboardModel:
    """Builds what the pages show from the service's state (the gRPC servicers' own objects)."""

    def __init__(self, svc: CoordinatorService) -> None:
        self.svc = svc
        self.standby: Callable[[], str] = lambda: ""
        """What a replica that does not lead says ("" while it leads, and with SQLite)."""

    def root_cause_line(self, job_id: str) -> str:
        c = self.svc.cluster
        result = c.job_result(job_id)
        if result is not None:
            root = result.root_cause
            if root is not None:
                first = (root.message or root.traceback or "").strip().splitlines()
                text = first[-1] if first else f"exit code {root.exitcode}"
                return _one_line(f"rank {root.global_rank} on {root.node or '?'}: {text}")
            if result.is_failed():
                return _one_line(result.reason)
        return ""

    def job_row(self, job_id: str, now: float) -> dict[str, Any]:
        c = self.svc.cluster
        s = c.job_status(job_id)
        end = s.finished_at if s.state.is_terminal() and s.finished_at else now
        return {
            "job_id": s.job_id,
            "name": s.name,
            "state": s.state.value,
            "reason": _one_line(s.reason),
            "attempt": s.attempt,
            "round": s.round,
            "max_restarts": s.max_restarts,
            "restarts_left": max(0, s.max_restarts - s.attempt),
            "submitted_at": s.submitted_at,
            "finished_at": s.finished_at,
            "duration": max(0.0, end - s.submitted_at) if s.submitted_at else 0.0,
            "world_size": s.world_size,
            "nodes": [m.node for m in s.members],
            "root_cause": self.root_cause_line(job_id),
        }

    def overview(self) -> dict[str, Any]:
        """The cluster and jobs pages: every node and the most recent jobs."""
        c = self.svc.cluster
        now = self.svc.now()
        ids = c.job_ids()
        rows = [self.job_row(j, now) for j in ids]
        rows.sort(key=lambda r: (r["state"] in _TERMINAL_NAMES, -r["submitted_at"]))
        rows = rows[:JOBS_SHOWN]
        usage: dict[str, list[float]] = {}
        for j in ids:
            if c.job_state(j).is_terminal():
                continue
            for w in c.job_status(j).workers:
                u = usage.setdefault(w.node, [0.0, 0.0, 0.0])
                u[0] += w.cpu_percent
                u[1] += w.rss_bytes
                u[2] += 1
        nodes = []
        for n in c.nodes():
            u = usage.get(n.name, [0.0, 0.0, 0.0])
            nodes.append(
                {
                    "name": n.name,
                    "addr": n.addr,
                    "slots": n.slots,
                    "slots_used": n.slots_used,
                    "slots_free": max(0, n.slots - n.slots_used),
                    "state": n.state,
                    "last_seen": n.last_seen,
                    "heartbeat_age": max(0.0, now - n.last_seen),
                    "cpu_percent": round(u[0], 1),
                    "rss_bytes": int(u[1]),
                    "workers": int(u[2]),
                    "jobs": list(n.jobs),
                }
            )
        overview: dict[str, Any] = {
            "now": now,
            "nodes": nodes,
            "jobs": rows,
            "jobs_total": len(ids),
        }
        standby = self.standby()
        if standby:
            overview["standby"] = standby
        return overview

    def job(self, job_id: str) -> dict[str, Any]:
        c = self.svc.cluster
        now = self.svc.now()
        s = c.job_status(job_id)
        spec = shown_spec(c.job_spec(job_id))  # what GetJob shows: no secret in argv or env
        result = c.job_result(job_id)
        attempts = [_attempt_json(a) for a in c.job_attempts(job_id)[-ATTEMPTS_SHOWN:]]
        if s.members and not any(
            a["attempt"] == s.attempt and a["round"] == s.round for a in attempts
        ):
            attempts.append(
                {
                    "attempt": s.attempt,
                    "round": s.round,
                    "nodes": [m.node for m in s.members[:NODES_PER_ATTEMPT_SHOWN]],
                    "nodes_total": len(s.members),
                    "end_reason": "",
                    "started_at": 0.0,
                    "ended_at": 0.0,
                    "failed_ranks": [],
                }
            )
        events = c.job_events(job_id)[-EVENTS_SHOWN:]
        root = result.root_cause if result is not None else None
        found: list[ProcessFailure] = list(result.failures.values()) if result is not None else []
        root_from = "result"
        if root is None:
            # A job that recovered (or is still running) shows its latest failed attempt's.
            for summary in reversed(c.job_attempts(job_id)):
                if summary.failures:
                    found = list(summary.failures)
                    marked = [f for f in found if f.root_cause]
                    root = (
                        marked[0] if marked else first_failure({i: f for i, f in enumerate(found)})
                    )
                    root_from = f"attempt {summary.attempt}"
                    break
        failures = sorted(found, key=lambda f: (f is not root, f.timestamp, f.global_rank))
        return {
            "now": now,
            "job": self.job_row(job_id, now),
            "spec": {
                "nproc_per_node": spec.nproc_per_node,
                "min_nodes": spec.min_nodes,
                "max_nodes": spec.max_nodes,
                "max_restarts": spec.max_restarts,
                "role": ", ".join(r.name for r in spec.roles) or spec.role,
                "entrypoint": _cut(
                    spec.function
                    or " ".join(spec.argv)
                    # A multi-role job: each role's program (its arguments are not shown).
                    or "; ".join(f"{r.name}: {r.entrypoint[0]}" for r in spec.roles if r.entrypoint)
                ),
            },
            "workers": [
                {
                    "rank": w.global_rank,
                    "local_rank": w.local_rank,
                    "node": w.node,
                    "pid": w.pid,
                    "state": w.state.value,
                    "proc_state": w.proc_state,
                    "cpu_percent": round(w.cpu_percent, 1),
                    "rss_bytes": w.rss_bytes,
                    "exitcode": w.exitcode,
                }
                for w in s.workers[:RANKS_SHOWN]
            ],
            "ranks_total": len(s.workers),
            "attempts": attempts,
            "events": [_event_json(e) for e in events],
            "root_cause": failure_json(root) if root is not None else None,
            "root_cause_from": root_from if root is not None else "",
            "failures": [failure_json(f) for f in failures[:50] if f is not root],
            "result_reason": _one_line(result.reason) if result is not None else "",
        }


_TERMINAL_NAMES = frozenset(s.value for s in JobState if s.is_terminal())


# ---- serving -----------------------------------------------------------------------------------


def _sse(event: str, data: Any) -> bytes:
    # json.dumps never writes a newline without indent: the data is one `data:` line.
    return f"event: {event}\ndata: {json.dumps(data, allow_nan=False)}\n\n".encode()


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
        path = request.path
        if path not in _PUBLIC and not path.startswith("/static/"):
            who = self.auth.authorized(request)
            if who is None:
                if path.startswith("/api/"):
                    resp: web.StreamResponse = web.json_response(
                        {"error": "log in first: no valid session or bearer token"}, status=401
                    )
                else:
                    resp = _redirect("/login")
                _secure_headers(resp)
                return resp
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
        if not self.auth.required or self.auth.authorized(request) is not None:
            return _redirect("/")
        return web.Response(body=self._login, content_type="text/html", charset="utf-8")

    async def _login_post(self, request: web.Request) -> web.StreamResponse:
        if not _same_origin(request):
            return web.Response(status=403, text="cross-origin login refused")
        try:
            form = await request.post()
        except web.HTTPRequestEntityTooLarge:
            return web.Response(status=413, text="request too large")
        token = form.get("token")
        sid = self.auth.login(token.strip() if isinstance(token, str) else "")
        if sid is None:
            # Rate-limited per host with the gRPC refusals: a login loop cannot flood the log.
            self.svc.refusals.refused(request.remote or "?", "a dashboard login", "wrong token")
            return _redirect("/login?failed=1")
        resp = _redirect("/")
        resp.set_cookie(
            SESSION_COOKIE,
            sid,
            max_age=int(SESSION_TTL_S),
            path="/",
            httponly=True,
            samesite="Strict",
            secure=self.tls,
        )
        return resp

    async def _logout(self, request: web.Request) -> web.StreamResponse:
        if not _same_origin(request):
            return web.Response(status=403, text="cross-origin logout refused")
        self.auth.logout(request.cookies.get(SESSION_COOKIE, ""))
        resp = _redirect("/login")
        resp.del_cookie(SESSION_COOKIE, path="/")
        return resp

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
            version, message = self.feed.version, _sse("overview", self.model.overview())
            self._overview_cache = (version, message)
        return message

    def _job_message(self, job_id: str) -> bytes:
        # Per second too: a job that does not change still shows its duration growing.
        version = (self.svc.job_version(job_id), int(self.svc.now()))
        cached = self._job_cache.get(job_id)
        if cached is not None and cached[0] == version:
            return cached[1]
        message = _sse("job", self.model.job(job_id))
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
                        await resp.write(_sse("problem", {"error": exc.message}))
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
                        await resp.write(_sse("end", {"reason": "the job was deleted"}))
                        break
                    await resp.write(self._job_message(job_id))
                except RequestError as exc:
                    await resp.write(_sse("problem", {"error": exc.message}))
                if svc.cluster.job_state(job_id).is_terminal():
                    await resp.write(_sse("end", {"reason": "the job finished"}))
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
                    await resp.write(_sse("log", {"text": text, "dropped": dropped}))
                    pending.clear()
                    dropped = 0
                    quiet_since = now
                elif now - quiet_since >= SSE_KEEPALIVE_S:
                    # A write is how a browser that left is noticed, and its relay ended.
                    await resp.write(b": keepalive\n\n")
                    quiet_since = now
                last = now

            try:
                logs = self.svc.read_logs(req, client)
                async for data in _with_keepalive(logs, LOG_FLUSH_S):
                    if data is not None:
                        pending += data
                        if len(pending) > LOG_TAIL_BYTES:
                            cut = len(pending) - LOG_TAIL_BYTES
                            dropped += cut
                            del pending[:cut]
                    if loop.time() - last >= LOG_FLUSH_S or data is None:
                        await flush()
                await flush()
                await resp.write(_sse("end", {"reason": "the rank's log ended"}))
            except (RequestError, JobNotFound) as exc:
                await flush()
                message = exc.message if isinstance(exc, RequestError) else "no such job"
                await resp.write(_sse("end", {"reason": message}))
        return resp


async def _with_keepalive(
    source: AsyncIterator[bytes], interval: float
) -> AsyncIterator[bytes | None]:
    """The items of `source`, and None whenever `interval` s pass without one."""
    it = aiter(source)
    next_item: asyncio.Task[bytes] | None = None
    try:
        while True:
            if next_item is None:
                next_item = asyncio.ensure_future(anext(it))
            done, _ = await asyncio.wait((next_item,), timeout=interval)
            if not done:
                yield None
                continue
            task, next_item = next_item, None
            try:
                item = task.result()
            except StopAsyncIteration:
                return
            yield item
    finally:
        if next_item is not None:
            next_item.cancel()
            with contextlib.suppress(BaseException):
                await next_item
        aclose = getattr(it, "aclose", None)
        if aclose is not None:
            await aclose()


def _same_origin(request: web.Request) -> bool:
    """A form post from a page of this dashboard (or a client that sends no Origin)."""
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
