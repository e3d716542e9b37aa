"""The cluster's state and the bookkeeping every room of it shares: lookups, fencing,
transitions, reasons, events and the effects a step returns.
"""

from __future__ import annotations

import collections
import logging

from client.model import (
    AttemptSummary,
    JobEvent,
    JobState,
)
from coordinator._clock_offset import ClockOffset
from coordinator._cluster_records import (
    EVENTS_HEAD,
    MAX_EVENTS_PER_JOB,
    ClusterConfig,
    Effect,
    EventRecorded,
    EventsCut,
    JobChanged,
    JobNotFound,
    Ready,
    StopRound,
    _Job,
    _Member,
    _Node,
)
from coordinator._job_text import note_job_changed, note_member_changed
from coordinator._progress_state import JobProgress

logger = logging.getLogger("coordinator._cluster")


class _Core:
    """The state of `Cluster` and its shared bookkeeping."""

    def _schedule(self, now: float, *, tick: bool = False) -> None:
        """Place what waits (the rounds' room, `coordinator._cluster_rounds`)."""
        raise NotImplementedError

    def __init__(self, config: ClusterConfig | None = None) -> None:
        self.config = config or ClusterConfig()
        self._nodes: dict[str, _Node] = {}
        self._jobs: dict[str, _Job] = {}
        self._event_seq = 0
        self._by_request: dict[str, str] = {}
        self.bad_records: list[tuple[str, int, str]] = []
        """What the last `restore` could not read: (kind, index in its input, why)."""
        self._next_node_retention = 0.0
        self._next_node_sweep = 0.0
        self._finished: collections.deque[str] = collections.deque()
        """Finished jobs, oldest first: what retention deletes first."""
        self._effects: list[Effect] = []
        self._reschedule = True
        self._changed_keys: set[tuple[str, bool]] = set()
        self._n_live = 0  # kept as a count: a join must not cost O(nodes)
        self._now = 0.0
        """The latest time an input brought: views that show an age (of a step) count from it."""
        self._progress: dict[str, JobProgress] = {}
        """Each running job's round's progress (`coordinator._cluster_stalls`); in memory only."""
        self._clocks: dict[str, tuple[str, ClockOffset]] = {}
        """Each node's clock as measured: name -> (the agent's incarnation, its estimate). In
        memory only (measuring again after a restart takes one probe), never written."""

    def _finish(self, now: float, *, force: bool = False) -> Ready:
        # Placement only changes when capacity or the queue does (or time passes, on a tick):
        # skipping it otherwise keeps a worker message O(1) however large the cluster.
        self._now = max(self._now, now)
        if force or self._reschedule:
            self._reschedule = False
            self._schedule(now, tick=force)
        effects, self._effects = Ready(self._effects), []
        self._changed_keys.clear()
        return effects

    def _attached(self, name: str) -> bool:
        node = self._nodes.get(name)
        return node is not None and node.attached

    def _release_all(self, job: _Job) -> None:
        for m in job.current.members:
            self._free_member(job, m)

    def _free_member(self, job: _Job, member: _Member) -> None:
        node = self._nodes.get(member.node)
        if node is not None:
            node.gpu_jobs.pop(job.job_id, None)
        if node is not None and node.jobs.pop(job.job_id, None) is not None:
            self._reschedule = True

    def _fenced(
        self, node: _Node, job_id: str, round_: int, now: float
    ) -> tuple[_Job | None, _Member | None]:
        job = self._jobs.get(job_id)
        member = job.member(node.name) if job is not None else None
        if job is None or member is None or job.round != round_ or member.lost:
            logger.info(
                "refused a message from node %s for stale round %s/%d", node.name, job_id, round_
            )
            self._effects.append(
                StopRound(node.name, job_id, round_, 0.0, "stale round: the job has moved on")
            )
            return None, None
        return job, member

    def _measured(self, node: _Node) -> ClockOffset | None:
        """The estimate of the node's clock, of its current agent; None before any probe."""
        held = self._clocks.get(node.name)
        return held[1] if held is not None and held[0] == node.incarnation else None

    def _clock(self, node: _Node) -> ClockOffset:
        """The estimate of the node's clock, new for an agent not measured before."""
        found = self._measured(node)
        if found is not None:
            return found
        if node.name not in self._clocks and len(self._clocks) >= len(self._nodes):
            # Bounded by the nodes known: drop the estimates of nodes that were forgotten.
            for name in [n for n in self._clocks if n not in self._nodes]:
                del self._clocks[name]
        clock = ClockOffset()
        self._clocks[node.name] = (node.incarnation, clock)
        return clock

    def _live(self, name: str, incarnation: str) -> _Node | None:
        node = self._nodes.get(name)
        if node is None or not node.live or node.incarnation != incarnation:
            return None
        return node

    def _job(self, job_id: str) -> _Job:
        job = self._jobs.get(job_id)
        if job is None:
            raise JobNotFound(job_id)
        return job

    def _active_jobs(self) -> list[_Job]:
        return [j for j in self._jobs.values() if not j.state.is_terminal()]

    def _all_started(self, job: _Job) -> bool:
        return job.unstarted() == 0

    def _worker_count(self, job: _Job) -> int:
        return sum(len(m.workers) for m in job.current.members)

    def _transition(self, job: _Job, state: JobState, now: float) -> None:
        if job.state == state:
            return
        if not job.state.can_become(state):
            raise RuntimeError(
                f"job {job.job_id}: illegal transition {job.state.value} -> {state.value}"
            )
        logger.info("job %s: %s -> %s", job.job_id, job.state.value, state.value)
        job.state = state

    def _set_reason(self, job: _Job, reason: str, now: float) -> None:
        if reason != job.reason:
            job.reason = reason
            self._changed(job, durable=False)

    def _changed(self, job: _Job, *, durable: bool = True, member: str = "") -> None:
        """Job `job` changed: watchers hear of it, and the journal writes it when `durable`.
        `member`: the change touched that member of the round alone (besides the job's and the
        round's own fields), so a write looks only at it (`coordinator._job_text`). A change
        that is not durable and names no member touched no member."""
        if member:
            note_member_changed(job, member)
        elif durable:
            note_job_changed(job)
        key = (job.job_id, durable)
        if key not in self._changed_keys:
            self._changed_keys.add(key)
            self._effects.append(JobChanged(job.job_id, durable))

    def _event(
        self, job: _Job, now: float, kind: str, reason: str, *, node: str = "", rank: int = -1
    ) -> None:
        self._event_seq += 1
        event = JobEvent(
            seq=self._event_seq,
            job_id=job.job_id,
            timestamp=now,
            kind=kind,
            reason=reason,
            attempt=job.attempt,
            round=job.round,
            node=node,
            rank=rank,
        )
        job.events.append(event)
        logger.info("job %s attempt %d round %d: %s", job.job_id, job.attempt, job.round, reason)
        self._effects.append(EventRecorded(event))
        if len(job.events) > MAX_EVENTS_PER_JOB:
            self._cut_events(job)

    def _cut_events(self, job: _Job) -> None:
        # Keep the head (how the job started) and the latest; in between one note says how
        # many were cut. The note takes the number of the last event it replaces. A tenth of
        # the room goes at once: a cut copies the whole log, and one cut per event made a round
        # of 30,000 nodes' reports quadratic.
        head = job.events[:EVENTS_HEAD]
        note = job.events[EVENTS_HEAD] if job.events[EVENTS_HEAD].kind == "events_cut" else None
        room = MAX_EVENTS_PER_JOB - EVENTS_HEAD - 1  # the latest events a full log keeps
        kept = room - max(0, room // 10 - 1)  # after the cut, a tenth of the room is free
        cut_before = len(job.events) - kept
        dropped = job.events[EVENTS_HEAD + (1 if note else 0) : cut_before]
        if not dropped:
            return
        earlier = int(note.node) if note is not None and note.node.isdigit() else 0
        total = earlier + len(dropped)
        last = dropped[-1]
        marker = JobEvent(
            seq=last.seq,
            job_id=job.job_id,
            timestamp=last.timestamp,
            kind="events_cut",
            reason=f"... {total:,} events not kept here (a job keeps at most {MAX_EVENTS_PER_JOB:,})",
            attempt=last.attempt,
            round=last.round,
            node=str(total),
        )
        first_cut = (note.seq if note is not None else dropped[0].seq) - 1
        job.events = [*head, marker, *job.events[cut_before:]]
        self._effects.append(EventsCut(job.job_id, first_cut, last.seq))
        self._effects.append(EventRecorded(marker))

    def _rank_node_in_summary(self, job: _Job, summary: AttemptSummary, rank: int) -> str:
        if job.spec.roles:
            # Groups differ in size: only a failed rank's node is kept with the attempt.
            return next((f.node for f in summary.failures if f.global_rank == rank), "")
        nproc = job.spec.nproc_per_node
        index = rank // nproc if nproc else -1
        if 0 <= index < len(summary.nodes):
            return summary.nodes[index]
        return ""
