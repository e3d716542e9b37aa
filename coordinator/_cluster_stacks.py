"""The stacks a job keeps: whose stacks a capture asks for, and the captures kept in the record.

A capture is taken outside (`coordinator._stacks` asks the agents); here the cluster says which
workers of the job's current round run where, and keeps what came back in the job's record
(so it is written with the job and outlives its workers), at most MAX_CAPTURES_KEPT of them, each
announced by an event of kind "stacks" that names it.
"""

from __future__ import annotations

from dataclasses import dataclass

from client.stacks import MAX_CAPTURES_KEPT, StackCapture
from coordinator._cluster_records import Ready, _WorkerPhase
from coordinator._cluster_views import _Views

__all__ = ["JobNotRunning", "StackTargets", "_Stacks"]


class JobNotRunning(ValueError):
    """A capture was asked of a job that has no running workers."""


@dataclass(frozen=True)
class StackTargets:
    """The workers a capture asks for: by node, (local rank, global rank) of each."""

    job_id: str
    attempt: int
    round: int
    nodes: dict[str, tuple[tuple[int, int], ...]]


class _Stacks(_Views):
    def stack_targets(self, job_id: str, rank: int | None = None) -> StackTargets:
        """The running workers of the job's current round (only `rank`, when given), by node.

        Raises JobNotFound, or JobNotRunning when none runs (or no worker has that rank)."""
        job = self._job(job_id)
        nodes: dict[str, tuple[tuple[int, int], ...]] = {}
        for m in job.current.members:
            if m.lost or m.stopped:
                continue
            ranks = tuple(
                (w.local_rank, w.global_rank)
                for w in sorted(m.workers.values(), key=lambda w: w.local_rank)
                if w.phase == _WorkerPhase.RUNNING and rank in (None, w.global_rank)
            )
            if ranks:
                nodes[m.node] = ranks
        if not nodes:
            which = "no worker" if rank is None else f"no worker of rank {rank}"
            raise JobNotRunning(f"job {job_id} ({job.state.value}) has {which} running now")
        return StackTargets(job_id, job.attempt, job.round, nodes)

    def record_stacks(self, capture: StackCapture, now: float) -> Ready:
        """Keep a capture in its job's record (the oldest beyond MAX_CAPTURES_KEPT go), with an
        event of kind "stacks" that names it."""
        job = self._job(capture.job_id)
        job.stacks = [*job.stacks, capture][-MAX_CAPTURES_KEPT:]
        groups = len(capture.groups)
        self._event(
            job,
            now,
            "stacks",
            f"stacks captured: {capture.capture_id}, {capture.ranks} ranks in {groups} "
            f"group{'s' if groups != 1 else ''} ({capture.reason})",
        )
        self._changed(job)
        return self._finish(now)

    def job_stacks(self, job_id: str) -> list[StackCapture]:
        """The captures the job keeps, oldest first."""
        return list(self._job(job_id).stacks)
