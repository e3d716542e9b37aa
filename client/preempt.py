"""The worker side of a drain: `preempted()` says whether this worker's node asked it to leave.

When a node is drained (`gelastic nodes --drain NAME --deadline S`, or a SIGTERM to its agent),
every worker of each round that runs there, on every node of the round, gets a preemption
notice before its SIGTERM: its agent writes a small JSON file at the path in
`GELASTIC_PREEMPT_FILE` (`{"deadline": <epoch s>, "node": "...", "reason": "..."}`). A training
loop polls it once a step, checkpoints and exits 0 before the deadline; the job is then re-formed
on the other nodes without spending a restart::

    from client import preempted

    for step in range(start, steps):
        train_one_step()
        if preempted():          # one stat() per call: cheap enough for every step
            save_checkpoint(step)
            break

With several ranks, agree first (one all_reduce of a flag, see examples/train_ddp_preempt.py),
so that every rank stops at the same step.

This module uses the standard library only and imports nothing else from gelastic: a worker
imports it without grpc. Outside gelastic (no `GELASTIC_PREEMPT_FILE`) `preempted()` is None.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass

__all__ = ["PREEMPT_FILE_ENV", "PreemptNotice", "notice_json", "preempted"]

PREEMPT_FILE_ENV = "GELASTIC_PREEMPT_FILE"
MAX_NOTICE_BYTES = 64 * 1024
"""A notice is a few hundred bytes; a bigger file is not one."""


@dataclass(frozen=True)
class PreemptNotice:
    """The node this worker runs for is drained: leave (checkpoint, exit 0) before `deadline`."""

    deadline: float
    """When the worker is killed (SIGKILL), in seconds since the epoch, by this host's clock.
    SIGTERM comes before it, the job's stop_grace before (at most the whole deadline)."""
    node: str
    """The node that drains (maybe not this worker's own: the whole round is replaced)."""
    reason: str

    def seconds_left(self, now: float | None = None) -> float:
        """Seconds until the deadline (negative once it passed)."""
        return self.deadline - (time.time() if now is None else now)


_cache: tuple[str, tuple[int, int, int], PreemptNotice | None] | None = None
"""(path, the file's (inode, mtime, size), the notice read from it)."""


def preempted() -> PreemptNotice | None:
    """The preemption notice of this worker's round, or None (none yet, or not under gelastic).

    One stat() per call; the file is read only when it changed. A file that cannot be read as
    a notice counts as none.
    """
    global _cache
    path = os.environ.get(PREEMPT_FILE_ENV)
    if not path:
        return None
    try:
        st = os.stat(path)
    except OSError:
        return None
    key = (st.st_ino, st.st_mtime_ns, st.st_size)
    if _cache is not None and _cache[0] == path and _cache[1] == key:
        return _cache[2]
    notice = _read(path) if st.st_size <= MAX_NOTICE_BYTES else None
    _cache = (path, key, notice)
    return notice


def _read(path: str) -> PreemptNotice | None:
    try:
        with open(path, "rb") as f:
            doc = json.loads(f.read(MAX_NOTICE_BYTES + 1))
        deadline = float(doc["deadline"])
        node, reason = doc.get("node", ""), doc.get("reason", "")
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        return None
    if deadline != deadline or not isinstance(node, str) or not isinstance(reason, str):
        return None  # NaN, or a field of the wrong type
    return PreemptNotice(deadline, node, reason)


def notice_json(deadline: float, node: str, reason: str) -> bytes:
    """The notice file's content, as the agent writes it."""
    return json.dumps({"deadline": deadline, "node": node, "reason": reason}).encode() + b"\n"
