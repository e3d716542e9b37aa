"""Every rank's stack, on demand: the coordinator asks the agents that run a job's workers.

`StackCollector.capture` sends one `StackRequest` to each node of the job's current round (the
agent reads its own workers' stacks; no pid leaves the coordinator), gathers the `StackReply`s
until a deadline, lists the ranks whose node did not answer as such, groups identical stacks,
and keeps the capture in the job's record with an event that names it. The client RPC and the
dashboard call it; so may any code of the coordinator's that wants the stacks of a job (a stall
detector), with its own reason.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

from client.node_codec import encode_coordinator
from client.node_protocol import StackReply, StackRequest
from client.stacks import MAX_STACK_NOTE, RankStack, StackCapture, group_stacks
from coordinator._cluster import Cluster, Effect, StallDetected
from coordinator._node_sessions import _Session

__all__ = [
    "CAPTURES_AT_ONCE",
    "CAPTURE_WAIT_S",
    "StackCollector",
]

logger = logging.getLogger(__name__)

CAPTURE_WAIT_S = 15.0
"""How long a capture waits for the nodes' answers by default."""
CAPTURE_WAIT_MAX_S = 60.0
WORKER_READ_S = 5.0
"""How long an agent lets one worker's stack read take (py-spy), by default."""
STALL_CAPTURE_WAIT_S = 4.0
"""How long a stall's capture waits for the nodes' stacks (within the cluster's STALL_STACKS_S)."""
MAX_STALL_CAPTURES = 8
"""Stall captures under way at once; a stall beyond them acts at its deadline without stacks."""
CAPTURES_AT_ONCE = 4
"""Captures under way at once, all jobs together: each costs every node of its job a py-spy
per worker."""


@dataclass
class _Pending:
    """One capture's request to one node, until it answers."""

    node: str
    session: _Session
    ranks: dict[int, int]
    """local rank -> global rank of the workers asked for."""
    reply: StackReply | None = None
    done: asyncio.Event = field(default_factory=asyncio.Event)


class StackCollector:
    """The captures under way, each waiting for the answers of its job's nodes."""

    def __init__(
        self,
        cluster: Cluster,
        sessions: Mapping[str, _Session],
        apply: Callable[[list[Effect]], None],
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._cluster = cluster
        self._sessions = sessions
        self._apply = apply
        self._clock = clock
        self._pending: dict[int, _Pending] = {}
        self._slots = asyncio.Semaphore(CAPTURES_AT_ONCE)
        self.stray_replies = 0
        self.stall_captures: set[asyncio.Task[None]] = set()
        """Captures a stall started, each followed by the stall's action (ended at stop)."""

    def after_stall(self, stall: StallDetected) -> None:
        """Every rank's stack of a stalled round, kept with the job; then the stall's action
        (`Cluster.stall_stacks_taken`), whether the capture worked or not."""
        if len(self.stall_captures) >= MAX_STALL_CAPTURES:
            return  # the stall acts at its deadline, without stacks

        async def capture() -> None:
            ranks = ", ".join(map(str, stall.ranks[:16])) + (
                " ..." if len(stall.ranks) > 16 else ""
            )
            try:
                reason = f"stalled: rank(s) {ranks} behind"
                await self.capture(stall.job_id, reason, wait=STALL_CAPTURE_WAIT_S)
            except Exception as e:  # no worker left, the job gone: the action goes ahead anyway
                logger.info("job %s: no stacks of its stall: %s", stall.job_id, e)
            finally:
                self.stall_captures.discard(task)
            self._apply(self._cluster.stall_stacks_taken(stall.job_id, stall.round, self._clock()))

        task = asyncio.get_running_loop().create_task(capture(), name="stall-stacks")
        self.stall_captures.add(task)

    def on_reply(self, session: _Session, reply: StackReply) -> None:
        """Take a node's answer to one of the requests it was sent; any other is dropped."""
        p = self._pending.get(reply.request_id)
        if p is None or p.session is not session or p.reply is not None:
            self.stray_replies += 1
            if self.stray_replies <= 10:
                logger.warning("node %s sent a stack reply it was not asked for", session.name)
            return
        p.reply = reply
        p.done.set()

    async def capture(
        self,
        job_id: str,
        reason: str,
        *,
        rank: int | None = None,
        native: bool = False,
        wait: float = CAPTURE_WAIT_S,
    ) -> StackCapture:
        """Every running rank's stack of `job_id` (only `rank`, when given), kept with the job.

        Raises JobNotFound, or JobNotRunning when no worker runs. A node that does not answer
        within `wait` seconds has its ranks listed as "no_answer"."""
        wait = min(max(wait, 1.0), CAPTURE_WAIT_MAX_S)
        targets = self._cluster.stack_targets(job_id, rank)
        async with self._slots:
            pending: dict[int, _Pending] = {}
            per_worker = min(WORKER_READ_S, max(0.5, wait - 1.0))
            for node, ranks in targets.nodes.items():
                session = self._sessions.get(node)
                if session is None or session.closed:
                    continue
                p = _Pending(node, session, dict(ranks))
                request_id = self._new_request_id()
                pending[request_id] = self._pending[request_id] = p
                session.send(
                    encode_coordinator(
                        StackRequest(
                            request_id,
                            job_id,
                            targets.round,
                            tuple(lr for lr, _ in ranks),
                            native,
                            per_worker,
                        )
                    )
                )
            try:
                await self._gather(pending.values(), wait)
            finally:
                for request_id in pending:
                    self._pending.pop(request_id, None)
        stacks: list[RankStack] = []
        by_node = {p.node: p for p in pending.values()}
        for node, ranks in targets.nodes.items():
            got = by_node.get(node)
            stacks += _rank_stacks(
                node,
                dict(ranks),
                got.reply if got is not None else None,
                "did not answer in time" if got is not None else "is not connected",
            )
        capture = StackCapture(
            capture_id=f"st-{secrets.token_hex(5)}",
            job_id=job_id,
            reason=" ".join(reason.split())[:MAX_STACK_NOTE] or "requested",
            taken_at=self._clock(),
            native=native,
            attempt=targets.attempt,
            round=targets.round,
            groups=group_stacks(stacks),
        )
        self._apply(self._cluster.record_stacks(capture, self._clock()))
        logger.info(
            "job %s: stacks %s captured, %d ranks in %d groups (%s)",
            job_id,
            capture.capture_id,
            capture.ranks,
            len(capture.groups),
            capture.reason,
        )
        return capture

    async def _gather(self, pending: Iterable[_Pending], wait: float) -> None:
        """Wait for every answer, a node's session ending, or the deadline: what comes first."""
        waits = [asyncio.ensure_future(_answered_or_gone(p)) for p in pending]
        if not waits:
            return
        try:
            await asyncio.wait(waits, timeout=wait)
        finally:
            for w in waits:
                w.cancel()

    def _new_request_id(self) -> int:
        # Random, not sequential: a request id names nothing another node could guess.
        request_id = secrets.randbits(63)
        while request_id == 0 or request_id in self._pending:
            request_id = secrets.randbits(63)
        return request_id


async def _answered_or_gone(p: _Pending) -> None:
    done = asyncio.ensure_future(p.done.wait())
    gone = asyncio.ensure_future(p.session.ended.wait())
    try:
        await asyncio.wait([done, gone], return_when=asyncio.FIRST_COMPLETED)
    finally:
        done.cancel()
        gone.cancel()


def _rank_stacks(
    node: str, ranks: dict[int, int], reply: StackReply | None, silence: str
) -> list[RankStack]:
    """One RankStack per worker asked of `node`, from its reply (None: it did not answer). A
    stack for a worker that was not asked is dropped; the global rank is the coordinator's."""
    if reply is None:
        return [
            RankStack(g, node, "no_answer", note=f"node {node} {silence}") for g in ranks.values()
        ]
    got = {w.local_rank: w for w in reply.stacks if w.local_rank in ranks}
    out = []
    for local_rank, global_rank in ranks.items():
        w = got.get(local_rank)
        if w is not None:
            out.append(RankStack(global_rank, node, w.status, w.text, w.note))
        else:
            why = reply.error or f"node {node} sent no stack for local rank {local_rank}"
            out.append(RankStack(global_rank, node, "error", note=why[:MAX_STACK_NOTE]))
    return out
