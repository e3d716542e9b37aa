"""The client's calls about stacks: take a capture of a job's ranks, read the ones it keeps.

A part of `Client` (its base), in a room of its own.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from client.stacks import StackCapture
from client.stacks_wire import capture_from_pb
from protos.gelastic.v1 import gelastic_pb2 as pb

T = TypeVar("T")

STACK_WAIT_S = 15.0
"""How long a stack capture waits for the nodes by default (the coordinator's own default)."""
STACK_CALL_MARGIN_S = 10.0
"""What the call gives the coordinator beyond the capture's wait (to write it, to answer)."""


class _StackCalls:
    _md: Any

    def _call(self, fn: Callable[[Any, float], T], *, idempotent: bool) -> T:
        raise NotImplementedError  # Client's

    def capture_stacks(
        self,
        job_id: str,
        *,
        rank: int | None = None,
        native: bool = False,
        wait: float = STACK_WAIT_S,
    ) -> StackCapture:
        """Every running rank's stack now (only `rank`'s, when given), read by the agents that
        run them with py-spy (`native`: C/C++ frames too); the coordinator waits `wait` seconds
        for the nodes, keeps the capture with the job and returns it, grouped. Not retried: a
        retry would take another capture."""
        req = pb.CaptureStacksRequest(
            job_id=job_id,
            rank=-1 if rank is None else rank,
            native=native,
            timeout_ms=max(1, round(wait * 1000)),
        )
        # The call outlives the capture's own wait: the answer comes once it is written.
        call = lambda stub, t: stub.CaptureStacks(  # noqa: E731
            req, timeout=max(t, wait + STACK_CALL_MARGIN_S), metadata=self._md
        )
        return capture_from_pb(self._call(call, idempotent=False))

    def stacks(self, job_id: str, capture_id: str = "") -> list[StackCapture]:
        """The stack captures the job keeps, oldest first (only `capture_id`, when given); they
        outlive the job's workers."""
        req = pb.GetStacksRequest(job_id=job_id, capture_id=capture_id)
        resp = self._call(
            lambda stub, t: stub.GetStacks(req, timeout=t, metadata=self._md), idempotent=True
        )
        return [capture_from_pb(c) for c in resp.captures]
