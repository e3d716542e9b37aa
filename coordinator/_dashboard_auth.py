"""Who may see the dashboard: the client token, and the sessions a login trades it for.

A request carries either the token itself (`Authorization: Bearer TOKEN`, for scripts) or a
session (`Authorization: Session ID`, the pages). A login (a JSON POST of the token) answers
a random session id, which the page keeps in its own origin's `localStorage` and adds to each
of its requests; `session_header` reads it back. There is no cookie, on purpose:

- A browser keeps cookies per host, not per port, and SameSite treats every port of
  127.0.0.1 as one site. A session cookie of a dashboard on 127.0.0.1:A goes with every request
  the browser makes to 127.0.0.1:B, so another local user's server there receives it and can
  replay it from anywhere; and a page of theirs makes the browser carry it to the dashboard,
  where it authenticates the page's requests. A per-port cookie name does not help: the
  browser still sends the cookie to the other port's server.
- Web storage is per origin (scheme, host and port): a page on another port can neither read
  the session nor make the browser send it, and the browser never sends it anywhere on its own.
  The dashboard's script sends it only to its own origin. (`localStorage` rather than
  `sessionStorage`: every tab of the dashboard shares one login; it lasts no longer on disk
  than the 8-hour cookie it replaces, and a logout clears it.)

A session is also bound to the `Host` it was issued under (name and port): presented under
another name of the dashboard (another origin, whose storage is not the one it came from) it is
refused. The token is compared in constant time and never stored in a session; sessions are
bounded in number and age. A header cannot be sent by a cross-origin form, image or frame, and
a cross-origin script can send one only after a CORS preflight the dashboard never answers, so
no other page can make an authenticated request (no CSRF).
"""

from __future__ import annotations

import hmac
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass

from aiohttp import web

SESSION_SCHEME = "Session"
"""`Authorization: Session ID`: a session the login handed out."""
BEARER_SCHEME = "Bearer"
"""`Authorization: Bearer TOKEN`: the client token itself."""
SESSION_TTL_S = 8 * 3600.0
"""A session lasts this long from its login, used or not."""
MAX_SESSIONS = 64
"""Sessions kept at once; a login beyond ends the oldest (only token holders can log in)."""
MAX_TOKEN_CHARS = 4096
MAX_SESSION_ID_CHARS = 128
MAX_HOST_CHARS = 300


@dataclass(frozen=True)
class _Session:
    expires: float
    host: str
    """The Host (name:port, lower case) it was issued under: the only one it is good for."""


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
        self._sessions: dict[str, _Session] = {}
        """Session id -> the session; insertion order is login order."""

    @property
    def required(self) -> bool:
        """False when the coordinator has no client token: the dashboard is as open as gRPC."""
        return bool(self._token)

    @property
    def ttl(self) -> float:
        return self._ttl

    def token_matches(self, presented: str) -> bool:
        if not self._token or len(presented) > MAX_TOKEN_CHARS:
            return False
        return hmac.compare_digest(presented.encode(), self._token.encode())

    def login(self, presented: str, host: str) -> str | None:
        """A new session id, good under `host` only, for the right token; else None."""
        if not self.token_matches(presented) or not host or len(host) > MAX_HOST_CHARS:
            return None
        self._expire()
        while len(self._sessions) >= self._max:
            self._sessions.pop(next(iter(self._sessions)))
        sid = secrets.token_urlsafe(32)
        self._sessions[sid] = _Session(self._clock() + self._ttl, host.lower())
        return sid

    def logout(self, sid: str) -> None:
        self._sessions.pop(sid, None)

    def session_valid(self, sid: str, host: str) -> bool:
        session = self._sessions.get(sid) if len(sid) <= MAX_SESSION_ID_CHARS else None
        if session is None:
            return False
        if self._clock() >= session.expires:
            del self._sessions[sid]
            return False
        return hmac.compare_digest(session.host.encode(), host.lower().encode())

    def session_count(self) -> int:
        self._expire()
        return len(self._sessions)

    def authorized(self, request: web.Request) -> str | None:
        """Who the request is ("bearer", "open" or its session id), or None: not allowed."""
        if not self.required:
            return "open"
        scheme, _, credential = request.headers.get("Authorization", "").partition(" ")
        if scheme == BEARER_SCHEME:
            return "bearer" if self.token_matches(credential) else None
        if scheme == SESSION_SCHEME:
            host = request.headers.get("Host", "")
            return credential if self.session_valid(credential, host) else None
        return None

    def _expire(self) -> None:
        now = self._clock()
        for sid in [s for s, v in self._sessions.items() if now >= v.expires]:
            del self._sessions[sid]


def session_header(request: web.Request) -> str:
    """The session id a request presents ("" for none)."""
    scheme, _, credential = request.headers.get("Authorization", "").partition(" ")
    return credential if scheme == SESSION_SCHEME else ""
