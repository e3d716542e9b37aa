"""What the cluster shows and keeps: job and node views, dumps for the store, and restore."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from typing import Any

from client.model import (
    AttemptSummary,
    JobEvent,
    JobSpec,
    JobState,
    JobStatus,
    Member,
    NodeInfo,
    ProcessFailure,
    RunResult,
    WorkerStatus,
)
from coordinator._cluster_records import (
    Ready,
    _Job,
    _Node,
    job_doc_with_round,
)
from coordinator._cluster_stalls import _Stalls
from coordinator._cluster_words import (
    _node_state,
    _worker_gpu,
    _worker_state,
)
from coordinator._codec import decode, encode
from coordinator._job_text import job_record
from coordinator._store import JobRecord

logger = logging.getLogger("coordinator._cluster")


class _Views(_Stalls):
    """Views, dumps and restore."""

    def job_ids(self) -> list[str]:
        return list(self._jobs)

    def has_job(self, job_id: str) -> bool:
        return job_id in self._jobs

    def job_spec(self, job_id: str) -> JobSpec:
        return self._job(job_id).spec

    def job_state(self, job_id: str) -> JobState:
        return self._job(job_id).state

    def job_status(self, job_id: str) -> JobStatus:
        job = self._job(job_id)
        workers: list[WorkerStatus] = []
        for m in job.current.members:
            node = self._nodes.get(m.node) if m.gpus else None
            for w in m.workers.values():
                workers.append(
                    WorkerStatus(
                        global_rank=w.global_rank,
                        local_rank=w.local_rank,
                        node=m.node,
                        state=_worker_state(w.phase, w.proc_state),
                        pid=w.pid,
                        cpu_percent=w.cpu_percent,
                        rss_bytes=w.rss_bytes,
                        proc_state=w.proc_state,
                        exitcode=w.exitcode,
                        role=m.ranks.role,
                        role_rank=m.ranks.role_rank(w.local_rank),
                        world_size=m.ranks.world_size,
                        role_world_size=m.ranks.role_world_size,
                        gpu=_worker_gpu(node, m, w.local_rank, sampled=not job.state.is_terminal()),
                        **self._rank_progress(job, w.global_rank),
                    )
                )
        workers.sort(key=lambda w: w.global_rank)
        summary = self.job_summary(job_id, members_shown=len(job.current.members))
        return dataclasses.replace(summary, workers=tuple(workers))

    def job_summary(self, job_id: str, members_shown: int = 0) -> JobStatus:
        """`job_status` without its workers, and with only its first `members_shown` members:
        what a list of jobs shows, in time and size independent of the job's width.
        `nodes_joined` still counts every member (or, before a round, the nodes that could
        join its rendezvous)."""
        job = self._job(job_id)
        members = job.current.members
        return JobStatus(
            job_id=job.job_id,
            name=job.spec.name,
            state=job.state,
            reason=job.reason,
            attempt=job.attempt,
            round=job.round,
            max_restarts=job.spec.max_restarts,
            min_nodes=job.spec.min_nodes,
            max_nodes=job.spec.max_nodes,
            members=tuple(
                Member(
                    m.node,
                    m.addr,
                    m.group_rank,
                    m.ranks.local_world_size,
                    m.done,
                    role=m.ranks.role,
                    group_state=m.group_state,
                )
                for m in members[: max(0, members_shown)]
            ),
            nodes_joined=len(members) if members else self._free_count(job),
            last_call_deadline=job.last_call_deadline or 0.0,
            world_size=sum(m.ranks.local_world_size for m in members),
            submitted_at=job.submitted_at,
            finished_at=job.finished_at,
            **self._stall_status(job),
        )

    def job_result(self, job_id: str) -> RunResult | None:
        return self._job(job_id).result

    def job_attempts(self, job_id: str) -> list[AttemptSummary]:
        """The attempts kept for the job so far, oldest first (finished or not)."""
        return list(self._job(job_id).attempts)

    def job_events(self, job_id: str, after_seq: int = 0) -> list[JobEvent]:
        return [e for e in self._job(job_id).events if e.seq > after_seq]

    def nodes(self) -> list[NodeInfo]:
        return [
            NodeInfo(
                name=n.name,
                addr=n.addr,
                slots=n.slots,
                slots_used=min(n.slots, n.slots - n.free_slots()),
                state=self._shown_state(n),
                last_seen=n.last_seen,
                jobs=tuple(n.jobs),
                incarnation=n.incarnation,
                gpus=tuple(n.gpus),
                gpu_health=tuple(n.gpu_health[g.index] for g in n.gpus if g.index in n.gpu_health),
                gpus_used=tuple(sorted(i for indices in n.gpu_jobs.values() for i in indices)),
                quarantine_reason=n.quarantine_reason,
                quarantined_until=n.quarantined_until,
                clock_offset=clock.offset if clock is not None else 0.0,
                clock_uncertainty=clock.uncertainty if clock is not None else 0.0,
                drain_reason=n.drain_reason,
                drain_deadline=n.drain_deadline,
                drained_since=n.drained_since,
                drain_by_agent=bool(n.drain_incarnation),
            )
            for n in sorted(self._nodes.values(), key=lambda n: n.name)
            for clock in [self._measured(n)]
        ]

    def _shown_state(self, n: _Node) -> str:
        if n.live and n.drain_reason:
            return "draining" if self._draining(n) else "drained"
        return _node_state(n)

    def node_is_live(self, name: str, incarnation: str) -> bool:
        n = self._nodes.get(name)
        return n is not None and n.live and n.incarnation == incarnation

    def log_location(self, job_id: str, rank: int, attempt: int | None) -> tuple[str, int] | None:
        """(node, attempt) that holds the logs of `rank`; the latest round when attempt is None."""
        job = self._job(job_id)
        if attempt is None or attempt == job.attempt:
            for m in job.current.members:
                for w in m.workers.values():
                    if w.global_rank == rank:
                        return m.node, job.attempt
        for summary in reversed(job.attempts):
            if attempt is not None and summary.attempt != attempt:
                continue
            node = self._rank_node_in_summary(job, summary, rank)
            if node:
                return node, summary.attempt
        return None

    def dump_job(self, job_id: str) -> dict[str, Any]:
        """The job as a JSON-compatible document (its events are stored on their own)."""
        doc: dict[str, Any] = encode(self._job(job_id))
        doc.pop("events", None)
        return doc

    def job_record(self, job_id: str) -> JobRecord:
        """`dump_job` as JSON text, its round's members apart: only the members that changed
        since the last call are encoded again, and named (see coordinator._job_text)."""
        job = self._job(job_id)
        return job_record(job, keep=not job.state.is_terminal())

    def dump_nodes(self) -> list[dict[str, Any]]:
        return [encode(n) for n in self._nodes.values()]

    def dump_node(self, name: str) -> dict[str, Any] | None:
        node = self._nodes.get(name)
        return encode(node) if node is not None else None

    def job_submitted_at(self, job_id: str) -> float:
        return self._job(job_id).submitted_at

    def round_progress(self, job_id: str) -> tuple[JobState, int, bool]:
        """(state, round, every worker of the round started) in O(1): asked on every start."""
        job = self._job(job_id)
        return job.state, job.round, bool(job.current.members) and job.unstarted() == 0

    def failure(self, job_id: str, rank: int, round_: int) -> ProcessFailure | None:
        """The failure of `rank` in `round_`, while its attempt runs or after it ended."""
        job = self._jobs.get(job_id)
        if job is None:
            return None
        found = job.current.failures.get(rank)
        if found is not None and found.round == round_:
            return found
        for summary in reversed(job.attempts):
            if summary.round == round_:
                return next((f for f in summary.failures if f.global_rank == rank), None)
        return None

    def restore(
        self,
        jobs: Sequence[dict[str, Any]],
        events: Sequence[dict[str, Any]],
        nodes: Sequence[dict[str, Any]],
        now: float,
        reconnect_grace: float,
        event_seq_floor: int = 0,
    ) -> Ready:
        """Load state written by an earlier coordinator process.

        Event numbers go on after `event_seq_floor` (the reservation the service kept on disk)
        or the last stored event, whichever is higher: a number is never given out twice.

        Nodes come back as live but without a session: each has `reconnect_grace` seconds to
        reconnect and report what it runs before it counts as lost. Running jobs wait for that;
        a round still choosing its master port is formed again (nothing of it started).
        """
        self._reschedule = True
        if self._jobs or self._nodes:
            raise RuntimeError("restore() needs an empty cluster")
        self._event_seq = max(self._event_seq, event_seq_floor)
        self.bad_records = []
        for i, d in enumerate(nodes):
            try:
                n = decode(_Node, d)
            except Exception as exc:
                self.bad_records.append(("nodes", i, f"{type(exc).__name__}: {exc}"))
                continue
            n.jobs = {}
            n.gpu_jobs = {}
            n.gpu_health = {}
            n.attached = False
            if n.live:
                # A lost node keeps the time it was really last seen; a live one gets the grace.
                n.last_seen = now + max(0.0, reconnect_grace - self.config.lease)
            self._nodes[n.name] = n
            self._n_live += 1 if n.live else 0
        for i, d in enumerate(jobs):
            try:
                job = decode(_Job, job_doc_with_round(d))
            except Exception as exc:
                self.bad_records.append(("jobs", i, f"{type(exc).__name__}: {exc}"))
                continue
            job.awaiting_write = False  # it is on disk: the write it waited for happened
            self._jobs[job.job_id] = job
            if job.request_id:
                self._by_request[job.request_id] = job.job_id
        for i, d in enumerate(events):
            try:
                e = decode(JobEvent, d)
            except Exception as exc:
                self.bad_records.append(("events", i, f"{type(exc).__name__}: {exc}"))
                continue
            job = self._jobs.get(e.job_id)
            if job is not None:
                job.events.append(e)
            self._event_seq = max(self._event_seq, e.seq)
        finished = sorted(
            (j for j in self._jobs.values() if j.state.is_terminal()), key=lambda j: j.finished_at
        )
        self._finished.extend(j.job_id for j in finished)
        for job in self._jobs.values():
            if job.state.is_terminal():
                continue
            if job.current.port_deadline is not None:
                # The assignment may have gone out just before the crash: give the members the
                # reconnect grace to report the round (then it is adopted), else form it again.
                job.current.port_deadline = now + reconnect_grace
            if job.current.start_deadline is not None:
                # Starts reported while the coordinator was away come with the reconnect.
                job.current.start_deadline = max(job.current.start_deadline, now + reconnect_grace)
            for m in job.current.members:
                node = self._nodes.get(m.node)
                if node is None or m.released or m.lost:
                    continue
                if node.live:
                    node.jobs[job.job_id] = m.ranks.local_world_size
                    if m.gpus:
                        node.gpu_jobs[job.job_id] = list(m.gpus)
            self._event(
                job,
                now,
                "recovered",
                f"coordinator restarted; {job.state.value.lower()} job recovered",
            )
        logger.info("restored %d jobs and %d nodes", len(self._jobs), len(self._nodes))
        self._retain(now)
        return self._finish(now)

    @property
    def event_seq(self) -> int:
        """The number of the latest event (0 before the first)."""
        return self._event_seq

    def job_for_request(self, request_id: str) -> str | None:
        """The job an earlier submit with this request id made, if it is still kept."""
        return self._by_request.get(request_id)
