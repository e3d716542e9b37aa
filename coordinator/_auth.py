"""Who may call the coordinator: a token check on every RPC, and the server's TLS credentials.

Agents (the NodeSession service) and clients (the Coordinator service) may have separate tokens.
Probes (gRPC health checking, server reflection) are open, as Kubernetes expects. A call without
the right token is refused with UNAUTHENTICATED before it reaches any servicer.
"""

from __future__ import annotations

import hmac
import logging
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import grpc.aio

from client.security import AUTH_HEADER

__all__ = ["RefusalLog", "ServerTLS", "TokenInterceptor", "cert_node_name_refusal", "peer_host"]

logger = logging.getLogger(__name__)

_NODE_PREFIX = "/gelastic.v1.NodeSession/"
_CLIENT_PREFIX = "/gelastic.v1.Coordinator/"


REFUSAL_LOG_INTERVAL_S = 10.0
REFUSAL_LOG_KEYS = 1024
"""Peer and reason pairs remembered for the rate limit; the oldest is forgotten past this."""


def peer_host(peer: str) -> str:
    """The host of a grpc peer string ("ipv4:10.0.0.1:5000" -> "10.0.0.1"), without the port
    (every retry comes from a new one)."""
    p = peer[:300]
    for scheme in ("ipv4:", "ipv6:"):
        if p.startswith(scheme):
            p = p[len(scheme) :]
            if p.startswith("["):
                return p[1:].split("]")[0]
            return p.rpartition(":")[0] or p
    return p


class RefusalLog:
    """Refused callers at WARNING, at most one line per peer host and reason per `interval`
    (an agent retrying a refusal in a loop would flood the log); the next line says how many
    were left out meanwhile."""

    def __init__(
        self, interval: float = REFUSAL_LOG_INTERVAL_S, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._interval = interval
        self._clock = clock
        self._seen: dict[tuple[str, str], tuple[float, int]] = {}
        """(peer host, reason) -> (when last logged, refusals not logged since)."""

    def refused(self, peer: str, what: str, reason: str) -> None:
        key = (peer_host(peer), reason[:300])
        now = self._clock()
        last = self._seen.get(key)
        if last is not None and now - last[0] < self._interval:
            self._seen[key] = (last[0], last[1] + 1)
            return
        suppressed = last[1] if last is not None else 0
        self._seen.pop(key, None)
        self._seen[key] = (now, 0)
        while len(self._seen) > REFUSAL_LOG_KEYS:
            del self._seen[next(iter(self._seen))]
        more = f" ({suppressed} more like it since the last line)" if suppressed else ""
        logger.warning("refused %s from %s: %s%s", what[:200], key[0], key[1], more)


@dataclass(frozen=True)
class ServerTLS:
    cert: str
    key: str
    client_ca: str = ""
    """When set, clients and agents must present a certificate signed by this CA (mTLS)."""

    def credentials(self) -> grpc.ServerCredentials:
        pair = (Path(self.key).read_bytes(), Path(self.cert).read_bytes())
        if self.client_ca:
            return grpc.ssl_server_credentials(
                [pair],
                root_certificates=Path(self.client_ca).read_bytes(),
                require_client_auth=True,
            )
        return grpc.ssl_server_credentials([pair])


_MAX_CERT_NAMES = 256


def _names(auth: Mapping[str, Iterable[bytes]], key: str) -> list[str]:
    out: list[str] = []
    for value in auth.get(key, ()):
        if len(out) >= _MAX_CERT_NAMES:
            break
        if isinstance(value, bytes) and len(value) <= 1024:
            out.append(value.decode("utf-8", errors="replace"))
    return out


def cert_node_name_refusal(node_name: str, auth: Mapping[str, Iterable[bytes]]) -> str:
    """Why a node may not use `node_name` over this connection ("" = it may).

    `auth` is grpc's auth context of the call. The name must equal a DNS name of the peer's
    certificate, or its common name when the certificate lists no DNS name.
    """
    # grpc lists every DNS SAN under "peer_dns"; x509_subject_alternative_name also holds
    # addresses and URIs, which are not names.
    shown_name = repr(node_name[:128])
    dns = _names(auth, "peer_dns")
    names = dns or _names(auth, "x509_common_name")
    if not names:
        return (
            f"node name {shown_name} cannot be checked: the connection has no client "
            "certificate with a DNS name or common name"
        )
    if any(hmac.compare_digest(n.encode(), node_name.encode()) for n in names):
        return ""
    shown = ", ".join(repr(n[:128]) for n in names[:5])
    return (
        f"node name {shown_name} is not in this agent's certificate (names {shown}): "
        "an agent must use the name its certificate was issued for"
    )


def _matches(presented: str, expected: str) -> bool:
    return bool(expected) and hmac.compare_digest(presented.encode(), expected.encode())


class TokenInterceptor(grpc.aio.ServerInterceptor):
    """Refuse every gelastic RPC that does not carry the expected bearer token."""

    def __init__(
        self, agent_token: str, client_token: str, refusals: RefusalLog | None = None
    ) -> None:
        self._agent = agent_token
        self._client = client_token
        self._refusals = refusals or RefusalLog()

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        method: str = details.method
        if method.startswith(_NODE_PREFIX):
            expected, who = self._agent, "agent"
        elif method.startswith(_CLIENT_PREFIX):
            expected, who = self._client, "client"
        else:
            return await continuation(details)
        presented = ""
        for key, value in details.invocation_metadata or ():
            if key == AUTH_HEADER and isinstance(value, str) and value.startswith("Bearer "):
                presented = value[len("Bearer ") :]
        # The token is judged before anything else: an unauthenticated caller gets neither the
        # method lookup nor a parse of its request body. A method that does not exist reaches
        # grpc only with the right token, and grpc answers it UNIMPLEMENTED.
        if _matches(presented, expected):
            return await continuation(details)
        reason = (
            f"missing or wrong {who} token" if presented else f"no {who} token: pass --token-file"
        )
        return _refusal(reason, method, self._refusals)


def _refusal(reason: str, method: str, refusals: RefusalLog) -> grpc.RpcMethodHandler:
    """A handler that aborts at once and never reads, let alone parses, the request.

    Streaming both ways fits every method shape on the wire (the status ends the call whatever
    the caller expected), so the refusal needs no lookup of the method it refuses.
    """

    async def refuse(requests: Any, context: grpc.aio.ServicerContext) -> Any:
        refusals.refused(context.peer() or "?", method, reason)
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, reason)
        yield  # pragma: no cover - makes this an async generator

    # No deserializer and no serializer: the body stays bytes that nobody reads.
    return grpc.stream_stream_rpc_method_handler(refuse)
