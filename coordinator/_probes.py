"""Standard probes on the coordinator's port: gRPC health checking and server reflection.

`grpc.health.v1.Health` answers for "" (the whole server) and for each gelastic service: NOT_SERVING
until the coordinator has started, SERVING while it runs, NOT_SERVING again once it begins to
stop, so a Kubernetes gRPC probe or `grpc_health_probe` needs none of our stubs. Server reflection
lists the services, so `grpcurl` works without the .proto files. The token check leaves both open
(see `_auth.py`): they reveal nothing about jobs or nodes.
"""

from __future__ import annotations

import grpc.aio
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer  # what grpc_health.v1.health.aio names
from grpc_health.v1.health import SERVICE_NAME as HEALTH_SERVICE
from grpc_reflection.v1alpha import reflection

from protos.gelastic.v1 import gelastic_pb2 as pb

__all__ = ["GELASTIC_SERVICES", "Probes"]

GELASTIC_SERVICES: tuple[str, ...] = tuple(
    s.full_name for s in pb.DESCRIPTOR.services_by_name.values()
)
"""Full names of the gelastic services: gelastic.v1.Coordinator, gelastic.v1.NodeSession."""


class Probes:
    """The health and reflection services of one server. Add before the server starts."""

    def __init__(self, server: grpc.aio.Server) -> None:
        self._health = HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self._health, server)
        reflection.enable_server_reflection(
            (*GELASTIC_SERVICES, HEALTH_SERVICE, reflection.SERVICE_NAME), server
        )

    async def _set_all(self, status: int) -> None:
        for service in ("", *GELASTIC_SERVICES):
            await self._health.set(service, status)

    async def starting(self) -> None:
        """Answer NOT_SERVING until `serving()`: the port may accept calls before we are ready."""
        await self._set_all(health_pb2.HealthCheckResponse.NOT_SERVING)

    async def serving(self) -> None:
        await self._set_all(health_pb2.HealthCheckResponse.SERVING)

    async def standby(self) -> None:
        """A replica that does not lead: the process serves (""), the gelastic services do not
        (they answer UNAVAILABLE with the leader's address)."""
        await self._health.set("", health_pb2.HealthCheckResponse.SERVING)
        for service in GELASTIC_SERVICES:
            await self._health.set(service, health_pb2.HealthCheckResponse.NOT_SERVING)

    async def stopping(self) -> None:
        """NOT_SERVING for good: probes see it during the stop's grace period."""
        await self._health.enter_graceful_shutdown()
