"""Stack captures (`client.stacks`) to protobuf and back, for the client RPCs that carry them.

What is read back is bounded again: a capture from the wire keeps at most what the coordinator
would have kept (texts, notes and groups cut to the same limits).
"""

from __future__ import annotations

from client.stacks import (
    MAX_STACK_BYTES,
    MAX_STACK_NOTE,
    STACK_STATUSES,
    StackCapture,
    StackGroup,
    bounded_stack,
)
from protos.gelastic.v1 import gelastic_pb2 as pb

__all__ = ["MAX_GROUPS", "capture_from_pb", "capture_to_pb"]

MAX_GROUPS = 100_000
"""Most groups a capture read from the wire keeps (one per rank at worst)."""


def capture_to_pb(c: StackCapture) -> pb.StackCapture:
    return pb.StackCapture(
        capture_id=c.capture_id,
        job_id=c.job_id,
        reason=c.reason,
        taken_at=c.taken_at,
        native=c.native,
        attempt=c.attempt,
        round=c.round,
        groups=[
            pb.StackGroup(
                status=g.status, text=g.text, note=g.note, ranks=list(g.ranks), nodes=list(g.nodes)
            )
            for g in c.groups
        ],
    )


def capture_from_pb(m: pb.StackCapture) -> StackCapture:
    return StackCapture(
        capture_id=m.capture_id[:64],
        job_id=m.job_id,
        reason=m.reason[:MAX_STACK_NOTE],
        taken_at=m.taken_at,
        native=m.native,
        attempt=m.attempt,
        round=m.round,
        groups=tuple(
            StackGroup(
                g.status if g.status in STACK_STATUSES else "error",
                bounded_stack(g.text, MAX_STACK_BYTES),
                g.note[: 2 * MAX_STACK_NOTE],
                tuple(g.ranks),
                tuple(n[:128] for n in g.nodes),
            )
            for g in m.groups[:MAX_GROUPS]
        ),
    )
