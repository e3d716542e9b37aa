"""Who may see the dashboard: the client token, and the sessions a login trades it for.

A login form (POST) trades the token for a random session id in an HttpOnly, SameSite=Strict
cookie, or a request carries the token in an `Authorization: Bearer` header. The token is
compared in constant time, never stored in the cookie; sessions are bounded in number and age.
"""

from __future__ import annotations

import hmac
import secrets
import time
from collections.abc import Callable

from aiohttp import web

SESSION_COOKIE = "gelastic_session"
SESSION_TTL_S = 8 * 3600.0
"""A session lasts this long from its login, used or not."""
MAX_SESSIONS = 64
"""Sessions kept at once; a login beyond ends the oldest (only token holders can log in)."""
MAX_TOKEN_CHARS = 4096


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
