"""The node registry: sessions that open and close, heartbeats and leases, lost and forgotten
nodes, GPU health, and the adoption of rounds a node comes back with.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence

from client.model import (
    GpuDevice,
    GpuHealth,
    JobState,
    WorkerState,
)
from client.node_protocol import Heartbeat, WorkerHealthSample
from coordinator._cluster_drain import _Drains
from coordinator._cluster_records import (
    PORT_TIMEOUT_S,
    STALE_HOLD_S,
    Forgotten,
    NodeIsLive,
    Ready,
    ReleaseRound,
    RequestPort,
    RunningGroupReport,
    StopRound,
    _Job,
    _Member,
    _Node,
    _stop_round,
    _StopKind,
    _WorkerPhase,
)
from coordinator._cluster_words import (
    _ENDED_GROUP,
)
from coordinator._job_text import note_member_changed
from coordinator._node_claims import Claim, judge_claim

logger = logging.getLogger("coordinator._cluster")


class _Nodes(_Drains):
    """Nodes: sessions, leases, loss, GPU health, adoption."""

    def node_connected(
        self,
        name: str,
        addr: str,
        slots: int,
        incarnation: str,
        now: float,
        running: Sequence[RunningGroupReport] = (),
        gpus: Sequence[GpuDevice] = (),
        *,
        secret_digest: str = "",
        session_open: bool = False,
    ) -> Ready:
        """An agent says hello (NodeNameInUse when the name is not its to take; see
        `judge_claim`). `secret_digest`: the hash of its node secret ("" = none);
        `session_open`: the service still has a session under the name."""
        node = self._nodes.get(name)
        claim = judge_claim(
            node,
            name,
            incarnation,
            secret_digest,
            session_open=session_open,
            lease=self.config.lease,
            now=now,
        )
        if claim == Claim.TAKE_OVER and node is not None:
            # Its previous process is gone (it proved it is the same node): what ran there went
            # with it, as with a lost node; the new one joins like a node that came back.
            self._lose_node(node, "its agent restarted (the new one proved it is this node)", now)
        if node is not None and (claim != Claim.RESUME or not node.secret_digest):
            node.secret_digest = secret_digest
        if node is None:
            self._reschedule = True
            node = _Node(name, addr, slots, incarnation, True, now, gpus=list(gpus))
            node.secret_digest = secret_digest
            self._n_live += 1
            self._nodes[name] = node
            logger.info("node %s joined (%s, %d slots, %d GPUs)", name, addr, slots, len(gpus))
        else:
            resumed = node.incarnation == incarnation
            if (
                not resumed
                or not node.live
                or (node.addr, node.slots) != (addr, slots)
                or node.gpus != list(gpus)
            ):
                self._reschedule = True
            node.addr, node.slots, node.incarnation = addr, slots, incarnation
            if not node.live:
                self._n_live += 1
            node.live, node.last_seen, node.attached = True, now, True
            if not resumed and node.drain_incarnation:
                self._undrain(node, "another agent process took the name", now)
            if not resumed:
                node.jobs.clear()
                node.fenced.clear()
                node.gpu_jobs.clear()
                node.gpu_health.clear()
            node.gpus = list(gpus)
            logger.info("node %s %s", name, "reconnected" if resumed else "rejoined")
        for report in running:
            self._adopt(node, report, now)
        held = {(r.job_id, r.round) for r in running}
        for job in self._active_jobs():
            m = job.member(name)
            if (
                job.state == JobState.STOPPING
                and m is not None
                and not m.stopped
                and (job.job_id, job.round) not in held
            ):
                # The agent stopped the round and forgot it; its confirmation went down with the
                # old stream. Nothing of the round runs there: waiting for the stop deadline
                # would only delay the restart.
                self._event(
                    job,
                    now,
                    "adopted",
                    f"node {name} reconnected with round {job.round} already stopped",
                    node=name,
                )
                self._member_stopped(job, m, now)
                continue
            if (
                job.state == JobState.RENDEZVOUS
                and job.current.port_deadline is not None
                and m is not None
                and m is job.current.members[0]
                and all(self._attached(x.node) for x in job.current.members)
            ):
                # Asked for the round's master port, it is back without the round: the request
                # or its answer went down with the old stream (or the old coordinator). Ask
                # again rather than wait out the port deadline (after a restart: the grace).
                job.current.port_deadline = now + PORT_TIMEOUT_S
                self._effects.append(RequestPort(name, job.job_id, job.round))
                continue
            if (
                m is None
                or job.state != JobState.RUNNING
                or m.done
                or m.stopped
                or m.lost
                or (job.job_id, job.round) in held
            ):
                continue
            # Its assignment went down with the old stream: nothing of this round runs there, and
            # nothing would ever report. Re-form rather than wait forever (no budget spent).
            self._infra_failures(
                job,
                m,
                f"node {name} reconnected without round {job.round} (its agent restarted or "
                "lost the assignment); its workers of that round are gone",
                now,
            )
            m.stopped = True
            self._begin_stop(
                job,
                _StopKind.MEMBERSHIP,
                f"node {name} reconnected without round {job.round}; re-forming",
                now,
            )
        # A node back with every slot still held changes no placement (a round it adopted that
        # ended freed its slots, and asked for one): with a thousand agents reconnecting to a
        # new coordinator, each would otherwise run an O(nodes) placement. The tick places anyway.
        if node.free_slots() > 0:
            self._reschedule = True
        return self._finish(now)

    def node_disconnected(self, name: str, incarnation: str, now: float) -> Ready:
        self._reschedule = True
        node = self._nodes.get(name)
        if node is None or node.incarnation != incarnation or not node.live:
            return self._finish(now)
        self._lose_node(node, "its stream to the coordinator ended", now)
        return self._finish(now)

    def _note_cpu(self, job: _Job, member: _Member, s: WorkerHealthSample, now: float) -> None:
        """A worker's CPU sample, for stall detection (`coordinator._cluster_stalls`)."""
        raise NotImplementedError

    def heartbeats(self, beats: Iterable[tuple[str, str, Heartbeat]], now: float) -> Ready:
        """A batch of heartbeats, each (node, incarnation, heartbeat), taken in order as `step`
        takes one: a beat of a session that is not its node's live one is dropped."""
        for name, incarnation, beat in beats:
            node = self._live(name, incarnation)
            if node is not None:
                node.last_seen = now
                self._take_heartbeat(node, beat, now)
        return self._finish(now) if self._effects or self._reschedule else Ready()

    def _on_heartbeat(self, node: _Node, beat: Heartbeat, now: float) -> Ready:
        self._take_heartbeat(node, beat, now)
        return self._finish(now) if self._effects or self._reschedule else Ready()

    def _take_heartbeat(self, node: _Node, beat: Heartbeat, now: float) -> None:
        """A live node's heartbeat: its groups' states, its workers' and GPUs' health."""
        name = node.name
        group_states = [(g.job_id, g.round, g.state) for g in beat.groups if g.state is not None]
        for job_id, round_, state in group_states:
            job = self._jobs.get(job_id)
            if job is None or job.round != round_:
                continue
            m = job.member(name)
            # UNKNOWN stays: it is how the round ended there, whatever follows.
            if m is None or m.lost or m.group_state in (state, WorkerState.UNKNOWN):
                continue
            if state == WorkerState.STOPPED and m.group_state in _ENDED_GROUP:
                continue  # stopped after it failed or finished: that is how it ended
            m.group_state = state
            self._changed(job, durable=False, member=name)
        if beat.gpus and node.gpus:
            problem = self._gpu_samples(node, beat.gpus)
            if problem and not node.quarantine_reason:
                self._quarantine(node, problem, now)
                return
        if beat.health_problem and not node.quarantine_reason:
            self._quarantine(node, f"its health check failed: {beat.health_problem}", now)
            return
        for g in beat.groups:
            job = self._jobs.get(g.job_id)
            if job is None or job.round != g.round:
                continue
            m = job.member(name)
            if m is None:
                continue
            note_member_changed(job, name)  # its workers' figures, written with its next write
            for s in g.workers:
                w = m.workers.get(s.local_rank)
                if w is not None and w.pid == s.pid:
                    w.cpu_percent, w.rss_bytes, w.proc_state = (
                        s.cpu_percent,
                        s.rss_bytes,
                        s.proc_state,
                    )
                    self._note_cpu(job, m, s, now)

    def _retain_nodes(self, now: float) -> None:
        """Drop lost nodes past `lost_node_retention`, then the longest unseen past the count."""
        lost = sorted(
            (n for n in self._nodes.values() if not n.live and not n.jobs),
            key=lambda n: n.last_seen,
        )
        named = {m.node for job in self._active_jobs() for m in job.current.members}
        keep_for = min(self.config.lost_node_retention, self.config.retain_seconds)
        excess = len(lost) - self.config.max_lost_nodes
        for node in lost:
            too_old = now - node.last_seen > keep_for
            if not (too_old or excess > 0):
                continue
            if node.name in named:
                continue  # an active job's history still names it
            excess -= 1
            del self._nodes[node.name]
            self._effects.append(Forgotten(node=node.name))

    def forget_node(self, name: str, now: float) -> Ready:
        """Drop a lost node from the list now. A live node is refused (NodeIsLive); an unknown
        name is nothing to do."""
        node = self._nodes.get(name)
        if node is not None:
            if node.live:
                raise NodeIsLive(f"node {name!r} is {'live' if node.attached else 'reconnecting'}")
            del self._nodes[name]
            self._effects.append(Forgotten(node=name))
        return self._finish(now)

    def _lose_node(self, node: _Node, why: str, now: float) -> None:
        self._reschedule = True
        if node.live:
            self._n_live -= 1
        node.live = False
        node.attached = False
        logger.warning("node %s lost: %s", node.name, why)
        for job in self._active_jobs():
            m = job.member(node.name)
            if m is None:
                continue
            self._free_member(job, m)
            if m.done:
                continue
            if job.state == JobState.RUNNING:  # while stopping, its workers were being stopped
                self._infra_failures(job, m, f"node {node.name} lost: {why}", now)
            m.lost = True
            m.stopped = True
            m.group_state = WorkerState.UNKNOWN
            self._event(job, now, "node_lost", f"node {node.name} lost: {why}", node=node.name)
            if (
                job.current.stop_kind == _StopKind.FAILURE
                and node.name in job.current.away_at_failure
            ):
                # The failure came while this node was away and it is gone now: its ranks went
                # first and the others failed on them (a peer's collective error), so this is a
                # lost node, which costs no restart.
                job.current.stop_kind = _StopKind.MEMBERSHIP
                job.current.stop_reason = (
                    f"node {node.name} lost ({why}); the failures on the other nodes came after "
                    "it went away; re-forming with the remaining nodes"
                )
                self._set_reason(job, job.current.stop_reason, now)
            if job.state == JobState.STOPPING:
                if all(x.stopped for x in job.current.members):
                    self._after_stop(job, now)
            elif job.state in (JobState.RUNNING, JobState.RENDEZVOUS):
                self._begin_stop(
                    job,
                    _StopKind.MEMBERSHIP,
                    f"node {node.name} lost ({why}); re-forming with the remaining nodes",
                    now,
                )
            self._changed(job)
        node.jobs.clear()
        node.fenced.clear()
        node.gpu_jobs.clear()

    def clear_quarantine(self, name: str, now: float) -> tuple[bool, Ready]:
        """An operator lets a quarantined node take new rounds again: (it was quarantined,
        effects). The uncorrectable ECC counts it shows now are accepted: only a new error
        quarantines it again. A GPU still lost quarantines it again at its next heartbeat."""
        node = self._nodes.get(name)
        if node is None or not node.quarantine_reason:
            return False, self._finish(now)
        self._clear_quarantine(node, "cleared by an operator", now)
        return True, self._finish(now)

    def _gpu_samples(self, node: _Node, samples: Sequence[GpuHealth]) -> str:
        """Keep the node's GPU samples; what makes it unhealthy ("" = nothing)."""
        uuids = {g.index: g.uuid for g in node.gpus}
        problem = ""
        for s in samples[: len(node.gpus)]:
            uuid = uuids.get(s.index)
            if uuid is None:
                continue
            node.gpu_health[s.index] = s
            if problem:
                continue
            if s.lost:
                problem = f"GPU {s.index} ({uuid}) is lost (fell off the bus or cannot be read)"
            elif s.uncorrectable_ecc > node.ecc_accepted.get(uuid, 0):
                problem = (
                    f"GPU {s.index} ({uuid}) has {s.uncorrectable_ecc} uncorrectable ECC errors"
                )
        return problem

    def _adopt(self, node: _Node, report: RunningGroupReport, now: float) -> None:
        job = self._jobs.get(report.job_id)
        member = job.member(node.name) if job is not None else None
        if (
            job is None
            or member is None
            or job.round != report.round
            or job.state.is_terminal()
            or member.lost
        ):
            if not report.stopped:
                self._effects.append(
                    StopRound(
                        node.name,
                        report.job_id,
                        report.round,
                        0.0,
                        "stale round: the job has moved on without this node",
                    )
                )
                # Its old workers still hold the slots until the stop is confirmed: a new
                # round must not start beside them (a GPU would still be busy).
                key = f"{report.job_id}#{report.round}"
                node.fenced.pop(key, None)
                held = min(max(1, len(report.pids)), max(0, node.free_slots()))
                if held:
                    node.fenced[key] = (held, now + STALE_HOLD_S)
            return
        if member.released:
            # The exit barrier already let it go and its slots may serve another job now: repeat
            # the release (it was lost with the old stream) instead of booking the slots again.
            self._effects.append(ReleaseRound(node.name, job.job_id, job.round))
            return
        node.jobs[job.job_id] = member.ranks.local_world_size
        if member.gpus:
            node.gpu_jobs[job.job_id] = list(member.gpus)
        was_stopping = job.state == JobState.STOPPING
        if job.state == JobState.RENDEZVOUS and job.current.port_deadline is not None:
            # The round was assigned just before the coordinator went down: it runs.
            job.current.port_deadline = None
            self._transition(job, JobState.RUNNING, now)
            self._event(job, now, "assigned", f"round {job.round} was assigned before the restart")
            silent = [
                m.node
                for m in job.current.members
                if m is not member
                and (n := self._nodes.get(m.node)) is not None
                and n.attached
                and all(w.phase == _WorkerPhase.INIT for w in m.workers.values())
            ]
            if silent:
                # Those reconnected first without the round: it never reached them.
                for m in job.current.members:
                    if m.node in silent:
                        m.stopped = True
                self._begin_stop(
                    job,
                    _StopKind.MEMBERSHIP,
                    f"round {job.round} never reached {', '.join(silent[:5])}; re-forming",
                    now,
                )
        for local_rank, pid in report.pids:
            w = member.workers.get(local_rank)
            if w is not None and w.phase == _WorkerPhase.INIT:
                w.pid = pid
                job.set_phase(w, _WorkerPhase.RUNNING)
        for ex in report.exits:
            self._apply_exit(job, member, ex, now)
        if report.stopped:
            self._member_stopped(job, member, now)
        elif was_stopping and not member.stopped:
            # The stop may have gone down with the old stream: say it again (the agent treats
            # a repeated stop of a stopping group as one).
            self._effects.append(_stop_round(job, node.name, job.current.stop_reason, now))
        self._event(
            job,
            now,
            "adopted",
            f"node {node.name} reconnected with round {report.round}",
            node=node.name,
        )
        self._changed(job)
