"""Drains: a node taken out of service gracefully, by an operator (`gelastic nodes --drain`) or by
its own agent (a SIGTERM to it).

A drained node gets no new round (placement skips it, as it skips a quarantined one). Each round
running there is replaced on the other nodes as for a lost node, without spending a restart
(`_StopKind.MEMBERSHIP`), and the job waits for nodes when the rest no longer meets min_nodes.
Unlike a lost node nothing failed, and the round's workers are told before they are stopped:
every worker of such a round (on all its nodes: the whole round is replaced, and rank 0 on
another node may be the one that writes the checkpoint) gets a preemption notice at once,
SIGTERM at `deadline - grace` (grace: the job's stop_grace, at most the deadline) and SIGKILL at
the deadline (`drain_timeline`). Workers that leave by themselves after the notice are part of
the drain, and once every one is gone the round is replaced at once.

A node is "draining" while workers of its rounds still run there, "drained" once none does. The
drain is kept with the node's record (it survives a coordinator restart) until `undrain`; one
its agent asked for is also lifted when another agent process takes the node's name.
"""

from __future__ import annotations

import logging

from client.model import JobState
from client.node_protocol import DrainRequest
from coordinator._cluster_records import (
    DrainAccepted,
    NodeChanged,
    Ready,
    _Node,
    _StopKind,
)
from coordinator._cluster_rounds import _Rounds
from coordinator._cluster_words import _clip

logger = logging.getLogger("coordinator._cluster")

MAX_DRAIN_S = 7 * 86400.0
"""The longest deadline a drain may give (seconds)."""
OPERATOR_DRAIN = "an operator asked"
AGENT_DRAIN = "its agent is shutting down"


def drain_timeline(stop_grace: float, deadline_s: float | None, now: float) -> tuple[float, float]:
    """(SIGTERM at, SIGKILL at) for the workers of a round a drain stops at `now`.

    The notice goes at once. The workers get the job's `stop_grace` between SIGTERM and SIGKILL,
    or the whole deadline when it is shorter; before that they run on with the notice. Without a
    deadline the drain gives each job its stop_grace: SIGTERM at once.
    """
    if deadline_s is None:
        return now, now + stop_grace
    kill_at = now + deadline_s
    return kill_at - min(stop_grace, deadline_s), kill_at


def _check_deadline(deadline_s: float | None) -> None:
    if deadline_s is not None and not 0 < deadline_s <= MAX_DRAIN_S:
        raise ValueError(f"deadline: must be in (0, {MAX_DRAIN_S:g}] seconds, got {deadline_s}")


class _Drains(_Rounds):
    """Drains: a node's rounds replaced with a notice, and no new round for it."""

    def drain(self, name: str, deadline_s: float | None, now: float, *, reason: str = "") -> Ready:
        """An operator drains node `name` (see the module docstring); an unknown name is nothing
        to do. `deadline_s` None gives each job's stop_grace. Draining a drained node again
        keeps the earlier deadline unless this one is sooner."""
        _check_deadline(deadline_s)
        node = self._nodes.get(name)
        if node is not None:
            why = _clip(" ".join(reason.split()), 1000) or OPERATOR_DRAIN
            self._drain(node, deadline_s, why, now, incarnation="")
        return self._finish(now)

    def undrain(self, name: str, now: float) -> Ready:
        """Let drained node `name` take new rounds again (nothing to do unless it is drained).
        Rounds its drain already stopped are replaced all the same."""
        node = self._nodes.get(name)
        if node is not None and node.drain_reason:
            self._undrain(node, "undrained by an operator", now)
        return self._finish(now)

    def _on_drain_request(self, node: _Node, msg: DrainRequest, now: float) -> None:
        """The node's own agent asks to be drained (it got SIGTERM); it is told once the drain
        is recorded, after the stops of its rounds."""
        _check_deadline(msg.deadline)
        why = _clip(" ".join(msg.reason.split()), 1000) or AGENT_DRAIN
        self._drain(node, msg.deadline, why, now, incarnation=node.incarnation)
        self._effects.append(DrainAccepted(node.name, node.incarnation, msg.deadline))

    def _drain(
        self, node: _Node, deadline_s: float | None, reason: str, now: float, *, incarnation: str
    ) -> None:
        self._reschedule = True
        first = not node.drain_reason
        deadline = now + deadline_s if deadline_s is not None else 0.0
        if first or not incarnation:
            # An operator's drain outlives (and replaces) the one an agent asked for.
            node.drain_reason, node.drain_incarnation = reason, incarnation
        if first:
            node.drained_since = now
            node.drain_deadline = deadline
            logger.warning(
                "node %s is draining (%s)%s",
                node.name,
                reason,
                f", deadline {deadline_s:g} s" if deadline_s is not None else "",
            )
        elif deadline and (not node.drain_deadline or deadline < node.drain_deadline):
            node.drain_deadline = deadline
        self._effects.append(NodeChanged(node.name))
        why = f"node {node.name} is draining ({node.drain_reason})"
        for job in self._active_jobs():
            m = job.member(node.name)
            if m is None or m.done or m.stopped:
                continue
            if job.state == JobState.RENDEZVOUS:
                # Nothing runs yet: the round is formed again without the node.
                self._event(job, now, "node_draining", why, node=node.name)
                self._begin_stop(
                    job, _StopKind.MEMBERSHIP, f"{why}; re-forming with the remaining nodes", now
                )
            elif job.state == JobState.RUNNING:
                term_at, kill_at = drain_timeline(job.spec.stop_grace, deadline_s, now)
                timeline = (
                    f"its workers have a preemption notice, SIGTERM in {term_at - now:.3g} s and "
                    f"SIGKILL in {kill_at - now:.3g} s unless they leave first"
                )
                self._event(job, now, "node_draining", f"{why}; {timeline}", node=node.name)
                self._begin_stop(
                    job,
                    _StopKind.MEMBERSHIP,
                    f"{why}; re-forming with the remaining nodes ({timeline})",
                    now,
                    drain=(node.name, term_at, kill_at),
                )
            # A job already stopping goes on as it was; its next round avoids the node.
            self._changed(job)

    def _undrain(self, node: _Node, why: str, now: float) -> None:
        logger.info("node %s: drain lifted (%s)", node.name, why)
        node.drain_reason, node.drain_incarnation = "", ""
        node.drain_deadline = node.drained_since = 0.0
        self._reschedule = True
        self._effects.append(NodeChanged(node.name))

    def _draining(self, node: _Node) -> bool:
        """Whether workers of a round still run on the node (its drain is not done yet)."""
        if node.fenced:
            return True
        for job_id in node.jobs:
            job = self._jobs.get(job_id)
            m = job.member(node.name) if job is not None else None
            if m is not None and not m.stopped:
                return True
        return False
