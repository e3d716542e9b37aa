"""The coordinator process: a grpc.aio server hosting the service, with start/stop."""

from __future__ import annotations

import ipaddress
import logging
import socket
from dataclasses import dataclass
from types import TracebackType

import grpc

from coordinator._cluster import ClusterConfig
from coordinator._service import CoordinatorService

__all__ = ["Coordinator", "CoordinatorConfig", "is_loopback"]

logger = logging.getLogger(__name__)

MAX_MESSAGE_BYTES = 16 * 1024 * 1024


@dataclass(frozen=True)
class CoordinatorConfig:
    """How the coordinator listens and times nodes. CLI flags map one-to-one onto fields."""

    host: str = "127.0.0.1"
    """Address to listen on."""
    port: int = 29400
    """Port to listen on (0 = any free port)."""
    heartbeat_interval: float = 1.0
    """Seconds between agent heartbeats."""
    lease: float = 5.0
    """Seconds without a message after which a node is lost."""
    insecure: bool = False
    """Allow listening on a non-loopback address without authentication."""

    def validate(self) -> None:
        if not 0 <= self.port < 65536:
            raise ValueError(f"port: must be 0-65535, got {self.port}")
        if not 0 < self.heartbeat_interval <= 60:
            raise ValueError(f"heartbeat_interval: must be in (0, 60] s, got {self.heartbeat_interval}")
        if not self.heartbeat_interval < self.lease <= 3600:
            raise ValueError(
                f"lease: must be longer than heartbeat_interval and at most 3600 s, got {self.lease}"
            )
        if not self.insecure and not is_loopback(self.host):
            raise ValueError(
                f"refusing to listen on {self.host}: without a token anyone who can reach this "
                "address could run programs on every node; use --token-file, or --insecure to "
                "accept the risk"
            )


def is_loopback(host: str) -> bool:
    if host in ("localhost",):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        try:
            return all(
                ipaddress.ip_address(info[4][0]).is_loopback
                for info in socket.getaddrinfo(host, None)
            )
        except OSError:
            return False


class Coordinator:
    """`async with Coordinator(config) as c:` serves until the block ends."""

    def __init__(self, config: CoordinatorConfig | None = None) -> None:
        self.config = config or CoordinatorConfig()
        self.config.validate()
        self.service = CoordinatorService(
            ClusterConfig(heartbeat_interval=self.config.heartbeat_interval, lease=self.config.lease)
        )
        self._server: grpc.aio.Server | None = None
        self.port = 0

    @property
    def address(self) -> str:
        host = self.config.host
        if ":" in host:
            host = f"[{host}]"
        return f"{host}:{self.port}"

    async def start(self) -> None:
        if self._server is not None:
            return
        server = grpc.aio.server(
            options=[
                ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
                ("grpc.keepalive_time_ms", 10_000),
                ("grpc.keepalive_timeout_ms", 5_000),
                ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
                ("grpc.keepalive_permit_without_calls", 1),
                ("grpc.so_reuseport", 0),
            ]
        )
        self.service.add_to_server(server)
        host = self.config.host
        bind = f"[{host}]:{self.config.port}" if ":" in host else f"{host}:{self.config.port}"
        self.port = server.add_insecure_port(bind)
        if self.port == 0:
            raise OSError(f"could not listen on {bind}")
        await server.start()
        self._server = server
        self.service.start()
        logger.info("coordinator listening on %s", self.address)

    async def stop(self, grace: float = 1.0) -> None:
        server, self._server = self._server, None
        if server is None:
            return
        await self.service.stop()
        await server.stop(grace)

    async def wait(self) -> None:
        if self._server is not None:
            await self._server.wait_for_termination()

    async def __aenter__(self) -> Coordinator:
        await self.start()
        return self

    async def __aexit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.stop()
