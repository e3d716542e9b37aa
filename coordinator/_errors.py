"""The one mapping from domain errors to gRPC status codes."""

from __future__ import annotations

import grpc

from client.model import SpecError
from coordinator._cluster import JobNotFound, NodeNameInUse
from coordinator._cluster_stacks import JobNotRunning
from coordinator._store import StoreFenced, StoreUnavailable

__all__ = ["RequestError", "status_for"]


class RequestError(Exception):
    """A request the service refuses, with the status code to answer."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def status_for(exc: BaseException) -> tuple[grpc.StatusCode, str] | None:
    """(code, message) for a known domain error; None for anything else (a bug)."""
    if isinstance(exc, RequestError):
        return exc.code, exc.message
    if isinstance(exc, SpecError):
        return grpc.StatusCode.INVALID_ARGUMENT, f"invalid spec: {exc}"
    if isinstance(exc, JobNotFound):
        return grpc.StatusCode.NOT_FOUND, f"no job with id {exc.args[0]!r}"
    if isinstance(exc, StoreUnavailable | StoreFenced):
        return grpc.StatusCode.UNAVAILABLE, f"the coordinator could not write its state: {exc}"
    if isinstance(exc, JobNotRunning):
        return grpc.StatusCode.FAILED_PRECONDITION, str(exc)
    if isinstance(exc, NodeNameInUse):
        return grpc.StatusCode.ALREADY_EXISTS, str(exc)
    return None
