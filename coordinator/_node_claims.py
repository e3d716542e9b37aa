"""Who gets a node's name when an agent says hello under it.

A name belongs to one agent process at a time (its incarnation). The same process gets it back
whenever its stream breaks; a new process of the same node proves it is that node with the node
secret its agent keeps on disk (`Hello.node_secret`; the node record keeps only `secret_digest`),
and gets the name at once: the old process is gone, whether this coordinator still holds a
session of it (a stream half-open since its process died) or knows it only from disk (the
reconnect grace after a restart). Any other agent is refused while the name is held: for good
while a live agent holds it, for now while a restored record keeps it for its previous agent
(until the grace ends: the refusal says so and until when).

Pure: no I/O, the time passed in.
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import time

from coordinator._cluster_records import NodeNameInUse, _Node

__all__ = ["Claim", "judge_claim", "secret_digest"]

_DIGEST_CONTEXT = b"gelastic node secret\0"


def secret_digest(secret: str) -> str:
    """What the coordinator keeps of a node secret (SHA-256, hex); "" for none."""
    if not secret:
        return ""
    return hashlib.sha256(_DIGEST_CONTEXT + secret.encode("utf-8")).hexdigest()


class Claim(enum.Enum):
    """What a hello under a name gets."""

    JOIN = "join"
    """No live node holds the name: a new node, or a lost one back."""
    RESUME = "resume"
    """The same agent process again (its previous stream broke)."""
    TAKE_OVER = "take_over"
    """A new process of the same node (its secret matches): the previous one is gone."""


def judge_claim(
    node: _Node | None,
    name: str,
    incarnation: str,
    digest: str,
    *,
    session_open: bool,
    lease: float,
    now: float,
) -> Claim:
    """What a hello from `incarnation` with a secret of `digest` gets under `name`, held by
    `node` (None: unknown); raises NodeNameInUse when it is refused, with `grace_left` set when
    the refusal ends with a reconnect grace. `session_open`: this coordinator still has a
    session under the name."""
    on_record = node.secret_digest if node is not None else ""
    proven = bool(on_record and digest) and hmac.compare_digest(on_record, digest)
    if session_open and not proven:
        # Whatever its incarnation: a second session never takes over a live one unproven.
        raise NodeNameInUse(
            f"node name {name!r} already has a live session; a new one is refused until that "
            "one ends"
        )
    if node is None or not node.live:
        return Claim.JOIN
    if node.incarnation == incarnation and (proven or not node.secret_digest):
        return Claim.RESUME
    if proven:
        return Claim.TAKE_OVER
    if node.attached:
        raise NodeNameInUse(f"node name {name!r} is already used by a live agent")
    # Known only from the coordinator's state on disk: the name stays its own agent's for the
    # reconnect grace, so that no other agent takes over its rounds meanwhile.
    until = node.last_seen + lease
    if not digest:
        why = "this agent sent no node secret"
    elif not node.secret_digest:
        why = "no node secret is on record for it (its agent predates them)"
    else:
        why = "this agent's node secret is another (another state dir, or a new secret)"
    raise NodeNameInUse(
        f"node name {name!r} is kept for its previous agent until {_clock(until)} (its "
        f"reconnect grace after a coordinator restart): {why}; this agent gets the name then, "
        "unless the previous one comes back first",
        grace_left=max(0.0, until - now),
    )


def _clock(t: float) -> str:
    """HH:MM:SS of the coordinator's local time."""
    return time.strftime("%H:%M:%S", time.localtime(t))
