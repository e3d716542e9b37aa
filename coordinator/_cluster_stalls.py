"""Progress, stalls and stragglers: the cluster's room for "when a job hangs or slows, say where".

Agents forward their workers' progress (`ProgressReport`, a few a second per node, only what
changed); heartbeats carry each worker's CPU. The tick judges each running round at most every
`CHECK_EVERY_S` (`coordinator._progress_state`):

- stalled (`JobSpec.stall_timeout` > 0): an event `stalled` naming the ranks behind and their
  nodes, a `StallDetected` effect (the service's hook for stack capture), then the job's
  `stall_action`: "report" (the job's status says so until a rank behind steps again),
  "restart" (a HANG failure of the ranks behind: the round stops and the job restarts within its
  budget, as after a crash) or "fail" (the job fails without a restart);
- stragglers: a rank whose steps/s stays under the median's divided by `straggler_factor` for
  `straggler_window` is flagged (event `straggler`, and in status) until it catches up.

Progress is kept in memory, never written (`_progress`, one entry per running job's round).
"""

from __future__ import annotations

from typing import Any

from client.model import FailureCategory, JobState, ProcessFailure
from client.node_protocol import ProgressReport, WorkerHealthSample
from coordinator._cluster_failures import _stamp
from coordinator._cluster_nodes import _Nodes
from coordinator._cluster_records import (
    Ready,
    StallDetected,
    _Job,
    _Member,
    _Node,
    _StopKind,
    _WorkerPhase,
)
from coordinator._cluster_words import _then
from coordinator._progress_state import (
    BUSY_CPU_PERCENT,
    IDLE_CPU_PERCENT,
    JobProgress,
    RankTrack,
    describe_ranks,
    slow_ranks,
    stall_verdict,
)

CHECK_EVERY_S = 0.5
"""How often a round's progress is judged, at most (a stall is said this late at most)."""
RATE_STALE_S = 2.0
"""A rank's steps/s is shown as 0 once it made no step for this long (or three of its steps)."""
STALL_STACKS_S = 5.0
"""How long a stall's restart or failure waits for the capture of every rank's stack (which
needs the workers alive): it acts once the capture is kept (`stall_stacks_taken`), or then."""


class _Stalls(_Nodes):
    """Progress reports in; stalls and stragglers out, as events, effects and status."""

    def _tracked(self, job: _Job, now: float) -> JobProgress | None:
        """The round's progress, made (with a track for each of its workers) on first use."""
        if job.state != JobState.RUNNING or not job.current.members:
            return None
        progress = self._progress.get(job.job_id)
        if progress is None or progress.round != job.round:
            progress = JobProgress(round=job.round)
            for m in job.current.members:
                for w in m.workers.values():
                    progress.ranks[w.global_rank] = RankTrack(m.node, w.local_rank, now)
            self._progress[job.job_id] = progress
        return progress

    def _current_progress(self, job: _Job) -> JobProgress | None:
        progress = self._progress.get(job.job_id)
        if progress is None or progress.round != job.round or job.state != JobState.RUNNING:
            return None
        return progress

    def _rank_progress(self, job: _Job, rank: int) -> dict[str, Any]:
        """The WorkerStatus fields of a rank's progress (none when it reported nothing)."""
        progress = self._current_progress(job)
        t = progress.ranks.get(rank) if progress is not None else None
        if t is None:
            return {}
        shown: dict[str, Any] = {"behind": t.behind, "straggler": t.straggler}
        if t.step >= 0:
            age = max(0.0, self._now - t.advanced_at)
            # The rate a worker measured goes stale once it stops stepping: 0 for a stuck rank.
            fresh = t.steps_per_s > 0 and age <= max(RATE_STALE_S, 3.0 / t.steps_per_s)
            shown.update(
                step=t.step,
                steps_per_s=t.steps_per_s if fresh else 0.0,
                last_step_age=age,
                metrics=dict(t.metrics),
            )
        return shown

    def _stall_status(self, job: _Job) -> dict[str, Any]:
        """The JobStatus fields of the job's stall (none when it is not stalled)."""
        progress = self._current_progress(job)
        if progress is None or not progress.stall_reason:
            return {}
        return {
            "stall_reason": progress.stall_reason,
            "stalled_since": progress.stalled_since or 0.0,
        }

    def _on_progress(self, node: _Node, msg: ProgressReport, now: float) -> None:
        job = self._jobs.get(msg.job_id)
        if job is None or job.round != msg.round:
            return
        member = job.member(node.name)
        progress = self._tracked(job, now)
        if member is None or progress is None:
            return
        if not progress.reported:
            progress.reported = True  # the ranks yet to report count from here
            for track in progress.ranks.values():
                track.advanced_at = now
        for r in msg.ranks:
            w = member.workers.get(r.local_rank)
            t = progress.ranks.get(w.global_rank) if w is not None else None
            if t is None or t.node != node.name:
                continue
            if r.step != t.step:
                t.step, t.advanced_at = r.step, now
            t.steps_per_s, t.metrics = r.steps_per_s, r.metrics

    def _note_cpu(self, job: _Job, member: _Member, s: WorkerHealthSample, now: float) -> None:
        """A worker's CPU sample (heartbeat): the stall fallback of jobs without progress."""
        if job.spec.stall_timeout <= 0:
            return
        progress = self._tracked(job, now)
        w = member.workers.get(s.local_rank)
        t = progress.ranks.get(w.global_rank) if progress and w is not None else None
        if t is None:
            return
        idle, busy = s.cpu_percent < IDLE_CPU_PERCENT, s.cpu_percent >= BUSY_CPU_PERCENT
        t.active = t.active or not idle
        idle = idle and t.active
        t.idle_since = (t.idle_since if t.idle_since is not None else now) if idle else None
        t.busy_since = (t.busy_since if t.busy_since is not None else now) if busy else None

    def _check_progress(self, now: float) -> None:
        for job_id in list(self._progress):
            job = self._jobs.get(job_id)
            progress = self._progress[job_id]
            if job is None or job.state != JobState.RUNNING or job.round != progress.round:
                del self._progress[job_id]
                if job is not None and progress.stall_reason:
                    self._changed(job, durable=False)
                continue
            if now < progress.next_check:
                continue
            if progress.pending is not None and now >= progress.pending[2]:
                self._act_on_stall(job, progress, now)
                continue
            progress.next_check = now + CHECK_EVERY_S
            self._judge_stragglers(job, progress, now)
            if job.spec.stall_timeout > 0:
                self._judge_stall(job, progress, now)
        for job in self._active_jobs():
            # Jobs with no report yet: the CPU fallback needs their tracks from the start.
            if (
                job.spec.stall_timeout > 0
                and job.job_id not in self._progress
                and job.state == JobState.RUNNING
                and self._all_started(job)
            ):
                self._tracked(job, now)

    def _judge_stragglers(self, job: _Job, progress: JobProgress, now: float) -> None:
        slow, median = slow_ranks(progress, job.spec.straggler_factor)
        slow_set = set(slow)
        for rank, t in progress.ranks.items():
            if rank not in slow_set:
                t.slow_since = None
                if t.straggler:
                    t.straggler = False
                    self._event(
                        job,
                        now,
                        "straggler_cleared",
                        f"rank {rank} on {t.node} caught up ({t.steps_per_s:g} steps/s, "
                        f"median {median:g})",
                        node=t.node,
                        rank=rank,
                    )
                continue
            if t.slow_since is None:
                t.slow_since = now
            if not t.straggler and now - t.slow_since >= job.spec.straggler_window:
                t.straggler = True
                self._event(
                    job,
                    now,
                    "straggler",
                    f"rank {rank} on {t.node} is a straggler: {t.steps_per_s:g} steps/s against "
                    f"the median {median:g} for {job.spec.straggler_window:g} s "
                    f"(straggler_factor {job.spec.straggler_factor:g})",
                    node=t.node,
                    rank=rank,
                )
                self._changed(job, durable=False)

    def _judge_stall(self, job: _Job, progress: JobProgress, now: float) -> None:
        behind, why = stall_verdict(progress, job.spec.stall_timeout, now)
        if not behind:
            if progress.stall_reason:
                for t in progress.ranks.values():
                    t.behind = False
                progress.stalled_since, progress.stall_reason = None, ""
                progress.pending = None
                self._event(job, now, "stall_cleared", "the ranks behind made a step again")
                self._changed(job, durable=False)
            return
        if progress.stall_reason and all(progress.ranks[r].behind for r in behind):
            return  # said once per stall (a stall naming other ranks is said again)
        for rank, t in progress.ranks.items():
            t.behind = rank in behind
        action = job.spec.stall_action
        progress.stalled_since, progress.stall_reason = now, f"stalled: {why}"
        first = progress.ranks[behind[0]]
        self._event(
            job,
            now,
            "stalled",
            f"stalled: {why}; stall_action {action}",
            node=first.node,
            rank=behind[0],
        )
        nodes = tuple(progress.ranks[r].node for r in behind)
        self._effects.append(StallDetected(job.job_id, job.round, tuple(behind), nodes))
        self._changed(job, durable=False)
        if action != "report" and progress.pending is None:
            # The ranks' stacks first (StallDetected): a restart or a failure ends the workers.
            progress.pending = (tuple(behind), why, now + STALL_STACKS_S)
            progress.next_check = min(progress.next_check, progress.pending[2])

    def stall_stacks_taken(self, job_id: str, round_: int, now: float) -> Ready:
        """The stacks StallDetected asked for are kept (or could not be taken): a stalled
        round's restart or failure goes ahead now rather than at its deadline."""
        progress = self._progress.get(job_id)
        job = self._jobs.get(job_id)
        if (
            job is not None
            and progress is not None
            and progress.pending is not None
            and job.state == JobState.RUNNING
            and job.round == progress.round == round_
        ):
            self._act_on_stall(job, progress, now)
        return self._finish(now)

    def _act_on_stall(self, job: _Job, progress: JobProgress, now: float) -> None:
        assert progress.pending is not None
        behind, why, _ = progress.pending
        progress.pending = None
        self._stall_failures(job, progress, list(behind), why, now)

    def _stall_failures(
        self, job: _Job, progress: JobProgress, behind: list[int], why: str, now: float
    ) -> None:
        """The ranks behind failed (HANG): restart the job as after a crash, or fail it."""
        for rank in behind:
            t = progress.ranks[rank]
            member = job.member(t.node)
            w = member.workers.get(t.local_rank) if member is not None else None
            if member is None or w is None or w.phase != _WorkerPhase.RUNNING:
                continue
            job.set_phase(w, _WorkerPhase.FAILED)
            w.early = True  # its exit, when the stop kills it, only completes this failure
            at = f"at step {t.step}" if t.step >= 0 else "before any step"
            failure = ProcessFailure(
                global_rank=rank,
                local_rank=t.local_rank,
                pid=w.pid,
                exitcode=-1,
                message=f"stalled {at}: no progress for {job.spec.stall_timeout:g} s",
                timestamp=now,
                category=FailureCategory.HANG,
            )
            job.current.failures[rank] = _stamp(failure, t.node, w, job)
        who = describe_ranks(progress.ranks, behind)
        if job.spec.stall_action == "fail":
            reason = f"stalled ({why}); failing the job (stall_action fail)"
            self._begin_stop(job, _StopKind.INPUT, reason, now)
        else:
            self._begin_stop(job, _StopKind.FAILURE, f"{who} stalled (HANG); {_then(job)}", now)
        self._changed(job)
