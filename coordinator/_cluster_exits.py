"""Workers' exits and failures: what an exit means for its round (done, failed, stopped as
told), the failure recorded with its class (no restart for an input error), and the result
amended by exits that come after the job ended.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import replace

from client.model import (
    FailureCategory,
    JobState,
    ProcessFailure,
    WorkerState,
)
from coordinator._cluster_failures import (
    _exit_text,
    _label_failures,
    _last_line,
    _on_coordinator_clock,
    _sanitized,
    _stamp,
    _with_order_note,
    _within_result_budget,
)
from coordinator._cluster_outcome import _Outcome
from coordinator._cluster_records import (
    ReleaseRound,
    WorkerExitReport,
    _Job,
    _Member,
    _StopKind,
    _Worker,
    _WorkerPhase,
)
from coordinator._cluster_words import (
    _then,
)
from coordinator._failure_class import no_restart_reason

logger = logging.getLogger("coordinator._cluster")


class _Exits(_Outcome):
    """Exits and failures of a round's workers."""

    def _apply_exit(self, job: _Job, member: _Member, report: WorkerExitReport, now: float) -> None:
        key = (report.local_rank, report.pid)
        if key in member.seen_exits:
            return
        w = member.workers.get(report.local_rank)
        if w is None:
            return
        member.seen_exits.add(key)
        report = _sanitized(report, now)
        if report.return_value is not None:
            report = _within_result_budget(job, w.global_rank, report)
        w.exitcode = report.exitcode
        if report.pid:
            w.pid = report.pid
        if w.early and w.phase == _WorkerPhase.FAILED:
            self._complete_failure(job, member, w, report, now)
            return
        if job.state.is_terminal() and (report.stopped_by_agent or w.phase != _WorkerPhase.RUNNING):
            # The job failed before this worker ended, and the agent stopped it as told.
            if w.phase in (_WorkerPhase.INIT, _WorkerPhase.RUNNING):
                job.set_phase(w, _WorkerPhase.STOPPED)
            return
        # A worker that leaves cleanly after a drain's notice (it checkpointed) is part of the
        # drain, as one stopped by its agent: neither a failure nor a result.
        left = bool(job.current.drain_node) and report.exitcode == 0 and report.failure is None
        if (report.stopped_by_agent or left) and job.state == JobState.STOPPING:
            if w.phase in (_WorkerPhase.INIT, _WorkerPhase.RUNNING):
                job.set_phase(w, _WorkerPhase.STOPPED)  # a failed one stays failed
            return
        if report.stopped_by_agent and report.failure is None:
            # Nobody asked for this stop (an agent shutting down, or a confused one): the worker
            # is gone all the same, and waiting for it would wedge the job.
            report = dataclasses.replace(
                report,
                failure=ProcessFailure(
                    global_rank=w.global_rank,
                    local_rank=w.local_rank,
                    pid=report.pid,
                    exitcode=report.exitcode,
                    message=f"stopped by the agent on {member.node} without the coordinator "
                    "asking (was the agent shut down?)",
                    timestamp=report.timestamp or now,
                    category=FailureCategory.PLATFORM,
                ),
            )
        if report.exitcode == 0 and report.failure is None:
            job.set_phase(w, _WorkerPhase.SUCCEEDED)
            if report.return_value is not None:
                job.current.return_values[w.global_rank] = report.return_value
            self._event(
                job,
                now,
                "worker_exited",
                f"rank {w.global_rank} on {member.node} exited 0",
                node=member.node,
                rank=w.global_rank,
            )
            if all(x.phase == _WorkerPhase.SUCCEEDED for x in member.workers.values()):
                self._member_done(job, member, now)
            self._changed(job)
            return
        failure = report.failure or ProcessFailure(
            global_rank=w.global_rank,
            local_rank=w.local_rank,
            pid=report.pid,
            exitcode=report.exitcode,
            message=f"Process exited with exit code {report.exitcode} (pid {report.pid})",
            timestamp=report.timestamp or now,
        )
        self._record_failure(job, member, w, failure, now)

    def _record_failure(
        self, job: _Job, member: _Member, w: _Worker, failure: ProcessFailure, now: float
    ) -> None:
        job.set_phase(w, _WorkerPhase.FAILED)
        if member.group_state != WorkerState.UNKNOWN:
            member.group_state = WorkerState.FAILED
        failure = _stamp(failure, member.node, w, job)
        node = self._nodes.get(member.node)
        # On one clock with the other nodes' failures, for the root cause's sake.
        failure = _on_coordinator_clock(
            failure, self._measured(node) if node is not None else None, now
        )
        # A failure of the running attempt that no restart can mend fails the job at once.
        no_restart = (
            no_restart_reason(job.spec, failure)
            if job.state == JobState.RUNNING and failure.category == FailureCategory.USER
            else ""
        )
        if no_restart:
            failure = replace(failure, category=FailureCategory.INPUT)
        job.current.failures[w.global_rank] = failure
        how = "recorded its error" if w.early else _exit_text(failure)
        self._event(
            job,
            now,
            "worker_failed",
            f"rank {w.global_rank} failed on {member.node} ({how}): {_last_line(failure.report_text)}",
            node=member.node,
            rank=w.global_rank,
        )
        if job.state == JobState.RUNNING and no_restart:
            self._begin_stop(
                job,
                _StopKind.INPUT,
                f"rank {w.global_rank} failed on {member.node} ({how}): {no_restart}; failing "
                "the job without a restart (restart_policy 'always' retries it)",
                now,
            )
        elif job.state == JobState.RUNNING:
            job.current.away_at_failure = tuple(
                m.node
                for m in job.current.members
                if m is not member and not m.done and not m.stopped and not self._attached(m.node)
            )
            self._begin_stop(
                job,
                _StopKind.FAILURE,
                f"rank {w.global_rank} failed on {member.node} ({how}); {_then(job)}",
                now,
            )
        elif job.state.is_terminal():
            self._amend_result(job)
        self._changed(job)

    def _complete_failure(
        self, job: _Job, member: _Member, w: _Worker, report: WorkerExitReport, now: float
    ) -> None:
        """The exit of a worker whose failure came at record time: add how it ended.

        The recorded message, traceback and time stay (the first complete record wins).
        """
        known = job.current.failures.get(w.global_rank)
        if known is None:
            return
        exited = report.failure
        job.current.failures[w.global_rank] = replace(
            known,
            exitcode=report.exitcode,
            pid=report.pid or known.pid,
            signal=exited.signal if exited is not None else known.signal,
            stderr_tail=exited.stderr_tail if exited is not None else known.stderr_tail,
        )
        self._event(
            job,
            now,
            "worker_exited",
            f"rank {w.global_rank} on {member.node} exited "
            f"({_exit_text(job.current.failures[w.global_rank])}) after recording its failure",
            node=member.node,
            rank=w.global_rank,
        )
        if job.state.is_terminal():
            self._amend_result(job)
        self._changed(job)

    def _member_done(self, job: _Job, member: _Member, now: float) -> None:
        if not member.done:
            member.done = True
            job.note_done()
            member.group_state = WorkerState.SUCCEEDED
        member.stopped = True
        pending = job.pending_count()
        if job.state != JobState.RUNNING:
            return
        if not pending:
            for m in job.current.members:
                if not m.released:
                    self._effects.append(ReleaseRound(m.node, job.job_id, job.round))
            self._close_attempt(job, "all workers succeeded", now)
            self._release_all(job)
            self._end(job, JobState.SUCCEEDED, WorkerState.SUCCEEDED, "all workers succeeded", now)
            return
        if job.current.barrier_deadline is None:
            job.current.barrier_deadline = now + job.spec.exit_barrier_timeout
        if pending <= 5:
            waiting_for = ", ".join(m.node for m in job.current.members if not m.done)
        else:
            waiting_for = f"{pending} nodes"
        self._event(
            job,
            now,
            "barrier_wait",
            f"node {member.node} finished; waiting in the exit barrier for {waiting_for}",
            node=member.node,
        )
        self._set_reason(
            job,
            f"exit barrier: {len(job.current.members) - pending}/{len(job.current.members)} nodes done",
            now,
        )

    def _amend_result(self, job: _Job) -> None:
        """A FAILED job's exits came after its result: add what they tell (exit codes, later
        failures) to the result and to its last attempt, keeping the root cause."""
        result = job.result
        if result is None or result.state != WorkerState.FAILED or not job.attempts:
            return
        last = job.attempts[-1]
        if last.attempt == job.attempt and last.round == job.round:
            job.attempts[-1] = replace(last, failures=self._attempt_failures(job)[0])
        failures = _label_failures(job.current.failures)
        job.result = replace(
            result,
            failures=failures,
            attempts=tuple(job.attempts),
            reason=_with_order_note(result.reason, failures),
        )
        self._changed(job)

    def _member_stopped(self, job: _Job, member: _Member, now: float) -> None:
        member.stopped = True
        if member.group_state in (WorkerState.INIT, WorkerState.HEALTHY, WorkerState.UNHEALTHY):
            member.group_state = WorkerState.STOPPED
        for w in member.workers.values():
            if w.phase in (_WorkerPhase.INIT, _WorkerPhase.RUNNING):
                job.set_phase(w, _WorkerPhase.STOPPED)
        if job.state == JobState.STOPPING and all(m.stopped for m in job.current.members):
            self._after_stop(job, now)
        self._changed(job)
