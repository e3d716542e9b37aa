"""A round's end: stops, restarts and their budget, the job's end and result, retention, and
the quarantine of nodes (a GPU fault, a node that keeps failing rounds).
"""

from __future__ import annotations

import logging

from client.model import (
    AttemptSummary,
    FailureCategory,
    JobState,
    ProcessFailure,
    RunResult,
    WorkerState,
    first_failure,
)
from coordinator._cluster_core import _Core
from coordinator._cluster_failures import (
    JOB_FAILURE_RANK,
    _bare_message,
    _jittered,
    _job_failure,
    _label_failures,
    _last_line,
    _stamp,
    _with_order_note,
)
from coordinator._cluster_records import (
    MAX_ATTEMPTS_KEPT,
    MAX_FAILURES_PER_ATTEMPT,
    MAX_NODES_KEPT,
    STOP_MARGIN_S,
    Forgotten,
    NodeChanged,
    _Job,
    _Member,
    _Node,
    _replaced,
    _Round,
    _stop_round,
    _StopKind,
    _WorkerPhase,
)
from coordinator._cluster_words import (
    _clip,
)

logger = logging.getLogger("coordinator._cluster")


class _Outcome(_Core):
    """Stops, restarts, the end of a job, and quarantine."""

    def _begin_stop(
        self,
        job: _Job,
        kind: _StopKind,
        reason: str,
        now: float,
        *,
        drain: tuple[str, float, float] | None = None,
    ) -> None:
        """Stop the job's round on every member. `drain` (node, SIGTERM at, SIGKILL at): a
        drain of that node stops it, and its workers get a notice first."""
        if job.state == JobState.STOPPING:
            # A cancel overrides a restart that was under way; nothing overrides a cancel.
            if kind == _StopKind.CANCEL and job.current.stop_kind != _StopKind.CANCEL:
                job.current.stop_kind, job.current.stop_reason = kind, reason
                self._set_reason(job, reason, now)
            return
        if job.state in (JobState.QUEUED, JobState.RENDEZVOUS):
            # Nothing runs yet: go straight to what the stop would lead to.
            self._release_all(job)
            job.current.port_deadline = None
            if kind == _StopKind.CANCEL:
                self._end(job, JobState.CANCELED, WorkerState.STOPPED, reason, now)
            else:
                self._back_to_queue(job, reason, now)
            return
        job.current.stop_kind, job.current.stop_reason = kind, reason
        if job.current.barrier_deadline is not None:
            waiting = [m.node for m in job.current.members if m.done and not m.released]
            self._event(
                job,
                now,
                "barrier_released",
                f"exit barrier released at once for {len(waiting)} finished node(s): {reason}",
            )
        job.current.barrier_deadline = None
        self._transition(job, JobState.STOPPING, now)
        self._set_reason(job, reason, now)
        self._event(job, now, "stopping", reason)
        job.current.stop_deadline = now + job.spec.stop_grace + STOP_MARGIN_S
        if drain is not None:
            job.current.drain_node, job.current.term_at, job.current.kill_at = drain
            job.current.stop_deadline = job.current.kill_at + STOP_MARGIN_S
        for m in job.current.members:
            if not m.stopped or (m.done and not m.released):
                self._effects.append(_stop_round(job, m.node, reason, now))
        if all(m.stopped for m in job.current.members):
            self._after_stop(job, now)
        elif kind == _StopKind.FAILURE and not _replaced(job) and not job.current.away_at_failure:
            # (With a member away the outcome is not known yet: its loss would make this a
            # re-form.)
            self._fail_now(job, reason, now)
        self._changed(job)

    def _fail_now(self, job: _Job, reason: str, now: float) -> None:
        """A failure with no restart left: the job is FAILED now, while its workers still stop.

        The outcome cannot change any more, so the client learns it when the failure is known,
        not after every process has torn down (seconds, for a torch worker). The slots stay held
        by a fence until each node confirms its stop (or the stop deadline passes), so no other
        job starts beside the dying workers; exits that arrive later still complete the result.
        """
        hold_until = now + job.spec.stop_grace + STOP_MARGIN_S
        for m in job.current.members:
            node = self._nodes.get(m.node)
            if m.stopped or node is None:
                continue
            held = node.jobs.pop(job.job_id, None)
            if held:
                node.fenced[f"{job.job_id}#{job.round}"] = (held, hold_until)
        self._close_attempt(job, reason, now)
        self._release_all(job)
        self._end(job, JobState.FAILED, WorkerState.FAILED, reason, now, with_failures=True)

    def _after_stop(self, job: _Job, now: float) -> None:
        job.current.stop_deadline = None
        kind, reason = job.current.stop_kind, job.current.stop_reason
        # Every rank exited 0 before a re-form for membership took effect: the job is done, and
        # running it again would repeat finished work (torchelastic never scales up a SUCCEEDED
        # group either).
        done = kind == _StopKind.MEMBERSHIP and bool(job.current.members)
        done = done and all(m.done for m in job.current.members)
        if done:
            reason = "all workers succeeded"
        suspect = self._flaky_suspect(job) if kind == _StopKind.FAILURE else None
        self._close_attempt(job, reason, now)
        self._release_all(job)
        if done:
            self._end(job, JobState.SUCCEEDED, WorkerState.SUCCEEDED, reason, now)
        elif kind == _StopKind.CANCEL:
            self._end(job, JobState.CANCELED, WorkerState.STOPPED, reason, now)
        elif kind == _StopKind.INPUT:
            self._end(job, JobState.FAILED, WorkerState.FAILED, reason, now, with_failures=True)
        elif kind == _StopKind.FAILURE:
            if job.attempt < job.spec.max_restarts:
                job.attempt += 1
                job.not_before = now + _jittered(job.spec.restart_backoff, job.job_id, job.attempt)
                self._event(
                    job,
                    now,
                    "restart",
                    f"restarting: attempt {job.attempt} ({job.attempt}/{job.spec.max_restarts} restarts used)",
                )
                self._back_to_queue(job, f"restarting: attempt {job.attempt}", now)
            else:
                self._end(job, JobState.FAILED, WorkerState.FAILED, reason, now, with_failures=True)
        else:
            self._back_to_queue(job, reason, now)
        if suspect is not None:
            self._count_flaky(suspect[0], job.job_id, suspect[1], now)

    def _back_to_queue(self, job: _Job, reason: str, now: float) -> None:
        self._reschedule = True
        # The round is dropped whole. Its failures live on in its AttemptSummary; a result made
        # later (say, a rendezvous timeout) must not present them as its own.
        job.current = _Round()
        job.last_call_deadline = None
        job.join_deadline = now + job.spec.join_timeout
        self._transition(job, JobState.QUEUED, now)
        self._set_reason(job, reason, now)
        self._changed(job)

    def _reform(self, job: _Job, reason: str, now: float) -> None:
        self._event(job, now, "reform", reason)
        self._release_all(job)
        self._back_to_queue(job, reason, now)

    def _close_attempt(self, job: _Job, reason: str, now: float) -> None:
        if not job.current.members:
            return
        failures, cut = self._attempt_failures(job)
        if cut:
            reason += f" ({cut:,} more failures not kept)"
        nodes = [m.node for m in job.current.members]
        job.attempts.append(
            AttemptSummary(
                attempt=job.attempt,
                round=job.round,
                nodes=tuple(nodes[:MAX_NODES_KEPT]),
                end_reason=reason
                + (
                    f" ({len(nodes) - MAX_NODES_KEPT:,} more nodes not listed)"
                    if len(nodes) > MAX_NODES_KEPT
                    else ""
                ),
                failures=failures,
                started_at=job.current.started_at,
                ended_at=now,
            )
        )
        if len(job.attempts) > MAX_ATTEMPTS_KEPT:
            self._cut_attempts(job)

    def _attempt_failures(self, job: _Job) -> tuple[tuple[ProcessFailure, ...], int]:
        """The round's failures as an attempt keeps them (root cause first), and how many were cut."""
        failures = sorted(
            _label_failures(job.current.failures).values(),
            key=lambda f: (not f.root_cause, f.precise_timestamp, f.global_rank),
        )
        cut = max(0, len(failures) - MAX_FAILURES_PER_ATTEMPT)
        return tuple(failures[:MAX_FAILURES_PER_ATTEMPT]), cut

    def _cut_attempts(self, job: _Job) -> None:
        # The first attempt, a note for the cut ones, then the latest.
        first, rest = job.attempts[0], job.attempts[1:]
        note = rest[0] if rest and rest[0].round == 0 and rest[0].ended_at == 0.0 else None
        tail = rest[1:] if note is not None else rest
        keep = MAX_ATTEMPTS_KEPT - 2
        cut = tail[: len(tail) - keep]
        if not cut:
            return
        start = note.attempt if note is not None else cut[0].attempt
        end = cut[-1].attempt
        marker = AttemptSummary(
            attempt=start,
            round=0,
            nodes=(),
            end_reason=f"attempts {start:,}-{end:,} not kept (a job keeps at most {MAX_ATTEMPTS_KEPT})",
        )
        job.attempts = [first, marker, *tail[len(cut) :]]

    def _end(
        self,
        job: _Job,
        state: JobState,
        wstate: WorkerState,
        reason: str,
        now: float,
        *,
        with_failures: bool = False,
        category: FailureCategory = FailureCategory.PLATFORM,
    ) -> None:
        failures = (
            _label_failures(job.current.failures)
            if with_failures or state == JobState.FAILED
            else {}
        )
        if state == JobState.FAILED and not failures:
            # No worker failed (a rendezvous timeout, a job no node could hold): the job's own
            # failure, under JOB_FAILURE_RANK, so that a FAILED result always has a root cause.
            failures = {JOB_FAILURE_RANK: _job_failure(job, reason, category, now)}
        job.finished_at = now
        job.result = RunResult(
            state=wstate,
            return_values=dict(job.current.return_values) if state == JobState.SUCCEEDED else {},
            failures=failures,
            attempts=tuple(job.attempts),
            reason=_with_order_note(reason, failures),
            job_id=job.job_id,
            name=job.spec.name,
        )
        job.current.port_deadline = job.current.stop_deadline = job.current.barrier_deadline = None
        job.last_call_deadline = None
        self._transition(job, state, now)
        self._set_reason(job, reason, now)
        self._event(job, now, "finished", f"{state.value}: {reason}")
        self._changed(job)
        self._finished.append(job.job_id)
        self._retain(now)

    def _retain(self, now: float) -> None:
        """Delete finished jobs past retention (count, then age), oldest first."""
        cfg = self.config
        while self._finished:
            job = self._jobs.get(self._finished[0])
            if job is None or not job.state.is_terminal():
                self._finished.popleft()  # withdrawn, or a stale entry
                continue
            too_many = len(self._finished) > cfg.retain_jobs
            if not too_many and now - job.finished_at <= cfg.retain_seconds:
                break
            self._finished.popleft()
            del self._jobs[job.job_id]
            if job.request_id:
                self._by_request.pop(job.request_id, None)
            self._effects.append(Forgotten(job_id=job.job_id))

    def _flaky_suspect(self, job: _Job) -> tuple[str, ProcessFailure] | None:
        """(node, failure) when the round that just stopped for a failure failed on one node
        alone: its first failure was there, and no other node's rank failed with the same error
        (a job that fails everywhere is the job's fault, not a node's). Ranks of other nodes that
        failed after it with other errors (a peer's collective error) do not clear the node."""
        if len(job.current.members) < 2 or not job.current.failures:
            return None
        root = first_failure(job.current.failures)
        if root is None or root.category not in (FailureCategory.USER, FailureCategory.PLATFORM):
            return None
        same = _bare_message(root.report_text)
        for f in job.current.failures.values():
            if f.node != root.node and _bare_message(f.report_text) == same:
                return None
        return root.node, root

    def _count_flaky(self, name: str, job_id: str, failure: ProcessFailure, now: float) -> None:
        """One more round failed on node `name` alone; `flaky_rounds` of them within
        `flaky_window` quarantine it."""
        cfg = self.config
        node = self._nodes.get(name)
        if node is None or cfg.flaky_rounds <= 0:
            return
        recent = [t for t in node.failed_rounds if now - t <= cfg.flaky_window]
        node.failed_rounds = (*recent, now)[-cfg.flaky_rounds :]
        if len(node.failed_rounds) >= cfg.flaky_rounds and not node.quarantine_reason:
            self._quarantine(
                node,
                f"flaky: {len(node.failed_rounds)} rounds failed first on this node within "
                f"{cfg.flaky_window:g} s while their other nodes were healthy (the last: rank "
                f"{failure.global_rank} of job {job_id}: {_last_line(failure.report_text)})",
                now,
            )

    def _quarantine(self, node: _Node, reason: str, now: float) -> None:
        """No new round goes to the node; a round running there re-forms as for a lost node."""
        self._reschedule = True
        node.quarantine_reason = _clip(reason, 1000)
        node.quarantined_until = now + self.config.quarantine_ttl
        self._effects.append(NodeChanged(node.name))
        logger.warning(
            "node %s quarantined for %g s: %s", node.name, self.config.quarantine_ttl, reason
        )
        why = f"node {node.name} quarantined: {reason}"
        for job in self._active_jobs():
            m = job.member(node.name)
            if m is None or m.done or m.stopped:
                continue
            if job.state == JobState.RUNNING:
                self._infra_failures(job, m, why, now)
            self._event(job, now, "node_quarantined", why, node=node.name)
            if job.state in (JobState.RUNNING, JobState.RENDEZVOUS):
                self._begin_stop(
                    job, _StopKind.MEMBERSHIP, f"{why}; re-forming with the remaining nodes", now
                )
            self._changed(job)

    def _clear_quarantine(self, node: _Node, why: str, now: float) -> None:
        logger.info("node %s: quarantine lifted (%s)", node.name, why)
        uuids = {g.index: g.uuid for g in node.gpus}
        for index, h in node.gpu_health.items():
            if index in uuids:
                node.ecc_accepted[uuids[index]] = h.uncorrectable_ecc
        if len(node.ecc_accepted) > 4 * len(node.gpus) + 64:  # GPUs long gone: bounded
            node.ecc_accepted = {u: node.ecc_accepted.get(u, 0) for u in uuids.values()}
        node.quarantine_reason, node.quarantined_until = "", 0.0
        node.failed_rounds = ()
        self._reschedule = True
        self._effects.append(NodeChanged(node.name))

    def _infra_failures(self, job: _Job, member: _Member, message: str, now: float) -> None:
        """The workers of `member` that were starting or running are gone with their node or
        agent: INFRA failures of this round (a re-form for membership spends no budget)."""
        if member.stopped:
            return
        for w in member.workers.values():
            if w.phase not in (_WorkerPhase.INIT, _WorkerPhase.RUNNING):
                continue
            job.set_phase(w, _WorkerPhase.FAILED)
            job.current.failures.setdefault(
                w.global_rank,
                _stamp(
                    ProcessFailure(
                        global_rank=w.global_rank,
                        local_rank=w.local_rank,
                        pid=w.pid,
                        exitcode=-1,
                        message=message,
                        timestamp=now,
                        signal="<N/A>",  # the exit is unknown: not a SIGHUP (-1)
                        category=FailureCategory.INFRA,
                    ),
                    member.node,
                    w,
                    job,
                ),
            )
