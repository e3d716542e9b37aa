"""The coordinator's decisions: node registry, job queue, rendezvous rounds, restarts, barrier.

`Cluster` takes one fact at a time and returns the effects to carry out (send this node an
assignment, stop that round, the job changed) as a `Ready`: `persist`, what the store must hold
before anything follows, and `send`, what goes to the agents once it does. It never touches the network, the disk or the
clock (`now` is a parameter), so every decision is tested directly with a fake clock. Its inputs:

- node sessions: `step(node, incarnation, msg, now)` takes every message of an agent's session
  (`client.node_protocol`: heartbeats, reserved ports, started workers, exits, failure notices,
  stopped and unknown groups, log chunks, answers to clock probes, an agent's drain request;
  stack replies pass through to `coordinator._stacks`), and `heartbeats(beats, now)` takes a
  batch of heartbeats of many sessions as `step` would;
  the session's opening and end are `node_connected` and `node_disconnected`, and
  `assign_undeliverable` says an assignment could not be sent;
- clients: `submit`, `confirm_written`, `withdraw`, `cancel`, `forget_node`, `clear_quarantine`,
  `drain`, `undrain`; a stack capture the agents answered: `record_stacks`, and the
  one a stall asked for kept (or given up): `stall_stacks_taken`;
- time: `tick`; the store: `restore` (and `dump_job`, `job_record`, `dump_nodes`, `dump_node`
  out).

Everything else public is a read: `job_ids`, `has_job`, `job_spec`, `job_state`, `job_status`,
`job_summary`, `job_result`, `job_attempts`, `job_events`, `job_for_request`,
`job_submitted_at`, `round_progress`, `failure`, `log_location`, `nodes`, `node_is_live`,
`event_seq`, `job_stacks`; `clock_probe_due` says when to probe a node's clock, and
`stack_targets` which workers a stack capture asks for.

`step` checks once what every node message needs: that it comes from the node's live session,
and, for a message about a round, that the round is the job's current one (any other is refused
and that round stopped on the node). Restart accounting is one budget per job; a change of
membership (a node lost, joined or drained) re-forms the job without spending it.

The class is a facade over rooms, each a module of its own, stacked from the bottom:
`_cluster_core` (state, fencing, transitions, events), `_cluster_outcome` (stops, restarts, the
end of a job, quarantine), `_cluster_exits` (exits and failures), `_cluster_rounds` (scheduling
and forming rounds, with `_placement`), `_cluster_drain` (drains: a node's rounds replaced with
a notice to their workers), `_cluster_nodes` (sessions, leases, adoption),
`_cluster_views` (views, dumps, restore), `_cluster_stacks` (stack captures); the records and
effects are in `_cluster_records`.
A job's round is a `_Round` record of its own (`job.current`): `_form` makes it whole and
going back to the queue drops it whole, so no field of one round leaks into the next.
"""

from __future__ import annotations

import logging

from client.model import (
    FailureCategory,
    JobSpec,
    JobState,
    ProcessFailure,
    WorkerState,
)
from client.node_protocol import (
    ClockReply,
    DrainRequest,
    GroupStopped,
    GroupUnknown,
    Heartbeat,
    Hello,
    LogChunk,
    NodeMsg,
    PortReserved,
    ProgressReport,
    StackReply,
    WorkerExited,
    WorkerFailing,
    WorkerHealthSample,
    WorkersStarted,
)
from coordinator._cluster_failures import (
    _sanitized,
    _stamp,
)
from coordinator._cluster_records import (
    MAX_FAILURE_TEXT,
    NODE_RETENTION_EVERY_S,
    NODE_SWEEP_MAX_S,
    PORT_RETRY_MAX_S,
    STOP_MARGIN_S,
    Action,
    AssignRound,
    Change,
    CloseSession,
    ClusterConfig,
    DrainAccepted,
    Effect,
    EventRecorded,
    EventsCut,
    Forgotten,
    JobChanged,
    JobNotFound,
    NodeChanged,
    NodeIsLive,
    NodeNameInUse,
    Ready,
    ReleaseRound,
    RequestPort,
    RunningGroupReport,
    StallDetected,
    StopRound,
    WorkerExitReport,
    _Job,
    _Member,
    _Node,
    _StopKind,
    _WorkerPhase,
)
from coordinator._cluster_stacks import _Stacks
from coordinator._cluster_words import (
    _clip,
    _count,
    _describe_spec,
    _then,
)
from coordinator._job_text import note_member_changed

__all__ = [
    "MAX_FAILURE_TEXT",
    "STOP_MARGIN_S",
    "Action",
    "AssignRound",
    "Change",
    "CloseSession",
    "Cluster",
    "ClusterConfig",
    "DrainAccepted",
    "Effect",
    "EventRecorded",
    "EventsCut",
    "Forgotten",
    "JobChanged",
    "JobNotFound",
    "NodeChanged",
    "NodeIsLive",
    "NodeNameInUse",
    "Ready",
    "ReleaseRound",
    "RequestPort",
    "RunningGroupReport",
    "StallDetected",
    "StopRound",
    "WorkerExitReport",
    "WorkerHealthSample",
]

logger = logging.getLogger("coordinator._cluster")


class Cluster(_Stacks):
    """Every decision of the coordinator. Not thread-safe: one event at a time."""

    def submit(
        self,
        job_id: str,
        spec: JobSpec,
        now: float,
        *,
        request_id: str = "",
        awaiting_write: bool = False,
    ) -> Ready:
        """A validated spec enters the queue.

        With `awaiting_write` the job waits, unscheduled, until `confirm_written` (its write is on
        disk) or `withdraw` (the write failed): a job the client was not told of never runs.
        """
        self._reschedule = True
        if job_id in self._jobs:
            raise ValueError(f"job id {job_id} already exists")
        if request_id and request_id in self._by_request:
            raise ValueError(
                f"request id {request_id} already made job {self._by_request[request_id]}"
            )
        job = _Job(
            job_id=job_id,
            spec=spec,
            state=JobState.QUEUED,
            reason="queued",
            submitted_at=now,
            join_deadline=now + spec.join_timeout,
            request_id=request_id,
            awaiting_write=awaiting_write,
        )
        self._jobs[job_id] = job
        if request_id:
            self._by_request[request_id] = job_id
        self._event(job, now, "submitted", _describe_spec(spec))
        self._changed(job)
        return self._finish(now)

    def confirm_written(self, job_id: str, now: float) -> Ready:
        """The submitted job is on disk: it may be scheduled."""
        job = self._job(job_id)
        if job.awaiting_write:
            job.awaiting_write = False
            job.join_deadline = now + job.spec.join_timeout
            self._reschedule = True
        return self._finish(now)

    def withdraw(self, job_id: str) -> None:
        """Forget a job whose submit could not be written (it was never scheduled)."""
        job = self._jobs.get(job_id)
        if job is None or not job.awaiting_write:
            raise ValueError(f"job {job_id} is not awaiting its write")
        del self._jobs[job_id]
        if job.request_id:
            self._by_request.pop(job.request_id, None)

    def cancel(self, job_id: str, now: float) -> Ready:
        self._reschedule = True
        job = self._job(job_id)
        if job.state.is_terminal():
            return self._finish(now)
        if job.state in (JobState.QUEUED, JobState.RENDEZVOUS) and not self._assigned(job):
            self._release_all(job)
            self._end(job, JobState.CANCELED, WorkerState.STOPPED, "canceled by the user", now)
        else:
            self._begin_stop(job, _StopKind.CANCEL, "canceled by the user", now)
        return self._finish(now)

    def step(self, name: str, incarnation: str, msg: NodeMsg, now: float) -> Ready:
        """One message of node `name`'s session, from the agent process `incarnation`.

        A message of any session but the node's live one is dropped here, once. Any other
        proves the node alive. A message about a job round that has moved on is refused (and
        the node told to stop that round) before it reaches its handler, except the two that
        answer a request of the coordinator's (a reserved port, a confirmed stop), which
        check their own round.
        """
        if isinstance(msg, PortReserved | GroupStopped | GroupUnknown):
            self._reschedule = True
        node = self._live(name, incarnation)
        if node is None:
            return self._finish(now) if isinstance(msg, PortReserved) else Ready()
        node.last_seen = now
        if isinstance(msg, Heartbeat):
            return self._on_heartbeat(node, msg, now)
        if isinstance(msg, ProgressReport):
            self._on_progress(node, msg, now)
            return self._finish(now) if self._effects else Ready()
        if isinstance(msg, LogChunk | StackReply):
            return self._finish(now) if self._effects else Ready()
        if isinstance(msg, ClockReply):
            self._clock(node).add(msg.probe_sent_at, msg.received_at, msg.sent_at, now)
            return self._finish(now) if self._effects else Ready()
        if isinstance(msg, Hello):
            raise ValueError(f"node {name} said hello twice on one session")
        if isinstance(msg, DrainRequest):
            self._on_drain_request(node, msg, now)
            return self._finish(now)
        if isinstance(msg, PortReserved):
            self._on_port_reserved(node, msg, now)
        elif isinstance(msg, GroupStopped):
            self._on_group_stopped(node, msg, now)
        else:
            job, member = self._fenced(node, msg.job_id, msg.round, now)
            if job is not None and member is not None:
                # What a handler changes of its own member without a `_changed` of its own (an
                # exit while the job stops) goes out with the job's next write all the same.
                note_member_changed(job, member.node)
                if isinstance(msg, WorkersStarted):
                    self._on_workers_started(job, member, msg, now)
                elif isinstance(msg, WorkerExited):
                    self._apply_exit(job, member, msg.exit, now)
                elif isinstance(msg, WorkerFailing):
                    self._on_worker_failing(job, member, msg, now)
                else:
                    self._on_group_unknown(job, member, msg, now)
        return self._finish(now)

    def clock_probe_due(self, name: str, incarnation: str, now: float, busy: bool = False) -> bool:
        """Whether to probe the clock of node `name` now, with a `ClockProbe` sent at `now`;
        asked when its session opens and at each of its heartbeats (`busy`: while the service
        has changes to write, see `ClockOffset.probe_due`). Its `ClockReply` comes back
        through `step`, and failures the node reports are put on this clock
        (`coordinator._clock_offset`)."""
        node = self._live(name, incarnation)
        return node is not None and self._clock(node).probe_due(now, busy)

    def _on_port_reserved(self, node: _Node, msg: PortReserved, now: float) -> None:
        name, port, error = node.name, msg.port, msg.error
        job = self._jobs.get(msg.job_id)
        if job is None or job.round != msg.round or job.current.port_deadline is None:
            return
        if job.current.members[0].node != name:
            return
        job.current.port_deadline = None
        if error or not 0 < port < 65536:
            # Back off, doubling, so an agent that cannot bind does not spin the rendezvous.
            job.port_failures += 1
            job.not_before = now + min(PORT_RETRY_MAX_S, 0.25 * 2 ** (job.port_failures - 1))
            self._reform(job, f"node {name} could not reserve a master port: {error or port}", now)
            return
        job.port_failures = 0
        job.current.master_port = port
        self._assign(job, now)

    def _on_workers_started(
        self, job: _Job, member: _Member, msg: WorkersStarted, now: float
    ) -> None:
        name = member.node
        was_all_started = self._all_started(job)
        started = []
        for local_rank, pid in msg.pids:
            w = member.workers.get(local_rank)
            if w is None:
                continue
            w.pid = pid
            if w.phase == _WorkerPhase.INIT:
                job.set_phase(w, _WorkerPhase.RUNNING)
            started.append(f"{w.global_rank}:{pid}")
        if member.group_state == WorkerState.INIT and all(
            w.phase != _WorkerPhase.INIT for w in member.workers.values()
        ):
            member.group_state = WorkerState.HEALTHY
        self._event(
            job,
            now,
            "workers_started",
            f"node {name} started ranks {', '.join(started)}",
            node=name,
        )
        if self._all_started(job):
            job.current.start_deadline = None
            if not was_all_started:
                # One event for the whole round: a round of more nodes than a job keeps events
                # pushes its own first `workers_started` out of the log, this one never.
                self._event(
                    job,
                    now,
                    "round_started",
                    f"round {job.round}: every worker started "
                    f"({_count(self._worker_count(job), 'worker')} on "
                    f"{_count(len(job.current.members), 'node')}; the last on node {name})",
                    node=name,
                )
        if job.state == JobState.RUNNING and self._all_started(job):
            self._set_reason(
                job,
                f"attempt {job.attempt} running: {_count(self._worker_count(job), 'worker')}",
                now,
            )
        self._changed(job, member=name)

    def _on_worker_failing(
        self, job: _Job, member: _Member, msg: WorkerFailing, now: float
    ) -> None:
        """A worker recorded its failure and is still tearing down: it failed, now.

        The round starts stopping at once, as for a failed exit. The exit that follows completes
        this failure (exit code, signal) and counts no second failure nor a second restart; a
        notice for a worker already gone, or for another round, changes nothing.
        """
        failure, local_rank = msg.failure, msg.local_rank
        w = member.workers.get(local_rank)
        if w is None or w.early or w.phase not in (_WorkerPhase.INIT, _WorkerPhase.RUNNING):
            return
        if failure.pid and w.pid and failure.pid != w.pid:
            return  # not the process this round started
        report = _sanitized(
            WorkerExitReport(
                local_rank=local_rank,
                global_rank=w.global_rank,
                pid=failure.pid,
                exitcode=failure.exitcode,
                failure=failure,
                timestamp=failure.precise_timestamp,
            ),
            now,
        )
        assert report.failure is not None
        w.early = True
        self._record_failure(job, member, w, report.failure, now)

    def _on_group_stopped(self, node: _Node, msg: GroupStopped, now: float) -> None:
        name, unkillable = node.name, msg.unkillable_pids
        node.fenced.pop(f"{msg.job_id}#{msg.round}", None)
        job = self._jobs.get(msg.job_id)
        if job is None or job.round != msg.round:
            return
        member = job.member(name)
        if member is None:
            return
        if unkillable:
            self._event(
                job,
                now,
                "unkillable",
                f"node {name}: pids {', '.join(map(str, unkillable))} could not be killed "
                "(uninterruptible sleep); abandoned",
                node=name,
            )
        self._member_stopped(job, member, now)

    def _on_group_unknown(self, job: _Job, member: _Member, msg: GroupUnknown, now: float) -> None:
        """The member's agent can no longer supervise its workers of the round: UNKNOWN.

        It killed what it could before saying so. As for a lost node, the workers that were
        starting or running there are INFRA failures; unlike a lost node the agent is still
        here and may fail the same way again, so the round ends as a failure: the job restarts
        within its budget, or fails when none is left.
        """
        if member.group_state == WorkerState.UNKNOWN:
            return
        name = member.node
        member.group_state = WorkerState.UNKNOWN
        why = _clip(" ".join(msg.reason.split()), 1000) or "no reason given"
        message = f"node {name}: worker group UNKNOWN (the agent cannot supervise it): {why}"
        self._event(job, now, "group_unknown", message, node=name)
        if job.state == JobState.RUNNING and not member.done:  # done: nothing of it runs
            self._infra_failures(job, member, message, now)
            self._begin_stop(job, _StopKind.FAILURE, f"{message}; {_then(job)}", now)
        self._changed(job)

    def assign_undeliverable(
        self, name: str, job_id: str, round_: int, why: str, now: float
    ) -> Ready:
        """The round's assignment to node `name` could not be sent (say, over the message limit).

        The spec is what makes it unsendable, so every round would fail alike: an input failure
        of the job, which ends it without spending its budget, and never a lost node. The node
        never received the round, so it counts as stopped and is not asked to stop it.
        """
        self._reschedule = True
        job = self._jobs.get(job_id)
        if job is None or job.round != round_ or not self._assigned(job):
            return self._finish(now)
        member = job.member(name)
        if member is None or member.stopped:
            return self._finish(now)
        reason = f"the assignment for node {name} cannot be sent: {_clip(why, 1000)}"
        member.stopped = True
        for w in member.workers.values():
            if w.phase in (_WorkerPhase.INIT, _WorkerPhase.RUNNING):
                job.set_phase(w, _WorkerPhase.FAILED)
                job.current.failures[w.global_rank] = _stamp(
                    ProcessFailure(
                        global_rank=w.global_rank,
                        local_rank=w.local_rank,
                        pid=0,
                        exitcode=-1,
                        message=reason,
                        timestamp=now,
                        category=FailureCategory.INPUT,
                    ),
                    name,
                    w,
                    job,
                )
        self._event(job, now, "assign_undeliverable", reason, node=name)
        if job.state == JobState.STOPPING:
            if job.current.stop_kind != _StopKind.CANCEL:
                job.current.stop_kind, job.current.stop_reason = _StopKind.INPUT, reason
                self._set_reason(job, reason, now)
            if all(m.stopped for m in job.current.members):
                self._after_stop(job, now)
        else:
            self._begin_stop(job, _StopKind.INPUT, reason, now)
        self._changed(job)
        return self._finish(now)

    def tick(self, now: float) -> Ready:
        """Time passed: leases, last calls, join timeouts, barrier and stop deadlines, retention."""
        self._retain(now)
        if now >= self._next_node_retention:
            # O(nodes): once a minute is plenty for a bound measured in days.
            self._next_node_retention = now + NODE_RETENTION_EVERY_S
            self._retain_nodes(now)
        if now >= self._next_node_sweep:
            # O(nodes): at a tenth of the lease (a second at most), not at every tick; with ten
            # thousand nodes, ten sweeps a second were a tenth of the coordinator's time.
            self._next_node_sweep = now + min(NODE_SWEEP_MAX_S, self.config.lease / 10)
            self._sweep_nodes(now)
        for job in self._active_jobs():
            if job.current.port_deadline is not None and now >= job.current.port_deadline:
                job.current.port_deadline = None
                self._reform(
                    job,
                    f"node {job.current.members[0].node} did not reserve a master port in time",
                    now,
                )
            elif (
                job.current.start_deadline is not None
                and now >= job.current.start_deadline
                and job.state == JobState.RUNNING
            ):
                self._start_timed_out(job, now)
            elif job.current.stop_deadline is not None and now >= job.current.stop_deadline:
                for m in job.current.members:
                    if not m.stopped:
                        self._event(
                            job,
                            now,
                            "stop_timeout",
                            f"node {m.node} did not confirm the stop in time; treating it as stopped",
                            node=m.node,
                        )
                        m.stopped = True
                self._after_stop(job, now)
            elif job.current.barrier_deadline is not None and now >= job.current.barrier_deadline:
                job.current.barrier_deadline = None
                waiting = [m for m in job.current.members if m.done and not m.released]
                self._event(
                    job,
                    now,
                    "barrier_timeout",
                    f"exit barrier timed out after {job.spec.exit_barrier_timeout:g} s; released "
                    f"{', '.join(m.node for m in waiting)}; still running: "
                    f"{', '.join(m.node for m in job.current.members if not m.done)}",
                )
                for m in waiting:
                    m.released = True
                    m.stopped = True
                    self._effects.append(ReleaseRound(m.node, job.job_id, job.round))
                    self._free_member(job, m)
                self._changed(job)
        self._check_progress(now)
        return self._finish(now, force=True)

    def _sweep_nodes(self, now: float) -> None:
        """Every node: fences and quarantines that ran out, leases that expired."""
        for node in list(self._nodes.values()):
            if node.fenced:
                for key, (_, until) in list(node.fenced.items()):
                    if now >= until:
                        del node.fenced[key]
            if node.quarantine_reason and now >= node.quarantined_until:
                self._clear_quarantine(node, "its quarantine time passed", now)
            if node.live and now - node.last_seen > self.config.lease:
                self._effects.append(CloseSession(node.name, node.incarnation, "lease expired"))
                self._lose_node(
                    node,
                    f"no message for {now - node.last_seen:.1f} s (lease {self.config.lease:g} s)",
                    now,
                )
