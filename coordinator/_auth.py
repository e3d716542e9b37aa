"""Who may call the coordinator: a token check on every RPC, and the server's TLS credentials.

Agents (the NodeSession service) and clients (the Coordinator service) may have separate tokens.
Probes (gRPC health checking, server reflection) are open, as Kubernetes expects. A call without
the right token is refused with UNAUTHENTICATED before it reaches any servicer.
"""

from __future__ import annotations

import hmac
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import grpc.aio

from client.security import AUTH_HEADER

__all__ = ["ServerTLS", "TokenInterceptor"]

logger = logging.getLogger(__name__)

_NODE_PREFIX = "/gelastic.v1.NodeSession/"
_CLIENT_PREFIX = "/gelastic.v1.Coordinator/"


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


def _matches(presented: str, expected: str) -> bool:
    return bool(expected) and hmac.compare_digest(presented.encode(), expected.encode())


class TokenInterceptor(grpc.aio.ServerInterceptor):
    """Refuse every gelastic RPC that does not carry the expected bearer token."""

    def __init__(self, agent_token: str, client_token: str) -> None:
        self._agent = agent_token
        self._client = client_token

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
        handler = await continuation(details)
        if _matches(presented, expected):
            return handler
        reason = (
            f"missing or wrong {who} token" if presented else f"no {who} token: pass --token-file"
        )
        logger.warning("refused %s: %s", method, reason)
        return _refusal(handler, reason)


def _refusal(handler: grpc.RpcMethodHandler, reason: str) -> grpc.RpcMethodHandler:
    async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, reason)

    async def streaming(request: Any, context: grpc.aio.ServicerContext) -> Any:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, reason)
        yield  # pragma: no cover - makes this an async generator

    des = handler.request_deserializer
    ser = handler.response_serializer
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(streaming, des, ser)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(unary, des, ser)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(streaming, des, ser)
    return grpc.unary_unary_rpc_method_handler(unary, des, ser)
