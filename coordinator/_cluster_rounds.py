"""Rendezvous rounds: which waiting job gets which nodes (through `coordinator._placement`),
forming a round, assigning ranks and the port, the start deadline, and scale-up.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from client.assignment import RoundAssignment, WorkerRanks
from client.model import (
    FailureCategory,
    JobState,
    ProcessFailure,
    WorkerState,
)
from coordinator._cluster_exits import _Exits
from coordinator._cluster_failures import (
    _stamp,
)
from coordinator._cluster_records import (
    MAX_NODES_NAMED,
    PORT_TIMEOUT_S,
    AssignRound,
    RequestPort,
    _Job,
    _Member,
    _Node,
    _Round,
    _StopKind,
    _Worker,
    _WorkerPhase,
)
from coordinator._cluster_words import (
    _count,
    _drained_note,
    _more,
    _named,
    _then,
)
from coordinator._placement import (
    _growth,
    _place,
    _smallest_group,
    _total_room,
)
from coordinator._ranks import NodeRole, assign_worker_ranks

logger = logging.getLogger("coordinator._cluster")


class _Rounds(_Exits):
    """Scheduling and forming rounds."""

    def _schedule(self, now: float, *, tick: bool = False) -> None:
        claimed: set[str] = set()
        waiting = [
            j
            for j in self._jobs.values()
            if j.state in (JobState.QUEUED, JobState.RENDEZVOUS) and not j.awaiting_write
        ]
        for job in sorted(waiting, key=lambda j: j.submitted_at):
            if job.round == 0 and "_fit_checked" not in job.__dict__:
                # Once per job (O(nodes)): a job no node could ever hold fails now, not at its
                # join timeout, unless it asked to wait for one to join.
                job.__dict__["_fit_checked"] = True
                never = "" if job.spec.wait_for_nodes else self._never_fits(job)
                if never:
                    self._end(
                        job,
                        JobState.FAILED,
                        WorkerState.FAILED,
                        never,
                        now,
                        category=FailureCategory.INFRA,
                    )
                    continue
            if len(waiting) == 1 and self._cannot_change_yet(job, now, tick):
                continue
            if self._assigned(job) or job.current.port_deadline is not None:
                claimed.update(m.node for m in job.current.members)
                continue
            if now < job.not_before:
                self._set_reason(job, f"next round in {job.not_before - now:.1f} s (backoff)", now)
                # Hold the nodes it will restart on: a later job must not take them meanwhile.
                backoff_free = [n for n in self._candidates(job) if n.name not in claimed]
                claimed.update(n.name for n in backoff_free[: job.spec.max_nodes])
                continue
            free = [n for n in self._candidates(job) if n.name not in claimed]
            spec = job.spec
            placed = _place(spec, free)
            if placed is not None:
                chosen, full = placed
                # With wait_for_nodes more nodes are on their way (the launchers of a
                # multi-node `gelastic run`): the last call waits for them.
                everyone = (
                    not full and not spec.wait_for_nodes and self._all_with_room_joined(job, chosen)
                )
                if full or spec.last_call_timeout == 0 or everyone:
                    # Every live node that could take a group is in: no one to wait for (a node
                    # that registers later scales the job up).
                    why = (
                        f"every live node with room joined ({len(chosen)} of "
                        f"max_nodes={spec.max_nodes}); closed without the last call"
                        if everyone and spec.last_call_timeout
                        else ""
                    )
                    self._form(job, chosen, now, why=why)
                    claimed.update(n.name for n, _ in chosen)
                    continue
                if job.last_call_deadline is None:
                    job.last_call_deadline = now + spec.last_call_timeout
                    self._transition(job, JobState.RENDEZVOUS, now)
                if now >= job.last_call_deadline:
                    self._form(job, chosen, now)
                else:
                    self._set_reason(
                        job,
                        f"rendezvous: {len(chosen)}/{spec.max_nodes} nodes, last call closes in "
                        f"{job.last_call_deadline - now:.0f} s",
                        now,
                    )
                claimed.update(n.name for n, _ in chosen)
                continue
            if job.last_call_deadline is not None:
                job.last_call_deadline = None
                self._transition(job, JobState.QUEUED, now)
            capacity = self._capacity(job)
            if capacity >= spec.min_nodes:
                job.join_deadline = now + spec.join_timeout
                self._set_reason(
                    job,
                    f"waiting for free nodes: {len(free)}/{spec.min_nodes} free "
                    f"({_count(capacity, 'node')} fit this job once busy ones finish)",
                    now,
                )
            elif now >= job.join_deadline:
                self._end(
                    job,
                    JobState.FAILED,
                    WorkerState.FAILED,
                    f"rendezvous timed out after {spec.join_timeout:g} s: only {capacity} of "
                    f"min_nodes={spec.min_nodes} nodes with {_count(spec.nproc_per_node, 'free slot')} "
                    "joined",
                    now,
                    category=FailureCategory.INFRA,
                )
            else:
                self._set_reason(
                    job,
                    f"rendezvous: {capacity}/{spec.min_nodes} nodes, waiting up to "
                    f"{job.join_deadline - now:.0f} s more for min_nodes"
                    + self._too_small(job, capacity)
                    + _drained_note(self._nodes.values()),
                    now,
                )
        self._scale_up(claimed, now)

    def _all_with_room_joined(self, job: _Job, chosen: Sequence[tuple[_Node, NodeRole]]) -> bool:
        """No live node outside `chosen` could take a group of `job`, even once it is free."""
        taken = {n.name for n, _ in chosen}
        need = _smallest_group(job.spec)
        return not any(
            n.live
            and not n.quarantine_reason
            and not n.drain_reason
            and n.name not in taken
            and job.job_id not in n.jobs
            and _total_room(n) >= need
            for n in self._nodes.values()
        )

    def _never_fits(self, job: _Job) -> str:
        """Why no node known (live or not) could ever hold a group of `job`; "" when one could,
        or when no node is known yet (the nodes may still be starting)."""
        known = list(self._nodes.values())
        if not known:
            return ""
        spec = job.spec
        needs = [(r.name, r.nproc_per_node) for r in spec.roles] or [
            (spec.role, spec.nproc_per_node)
        ]
        for role, need in needs:
            if any(_total_room(n) >= need for n in known):
                continue
            largest = max(known, key=lambda n: (_total_room(n), n.name))
            group = f"a group of role {role!r}" if spec.roles else "one group of this job"
            return (
                f"no live or known node could ever hold {group} ({_count(need, 'worker')}): "
                f"the largest, {largest.name}, has room for "
                f"{_count(_total_room(largest), 'worker')}; submit with wait_for_nodes "
                "(--wait-for-nodes) to wait for a bigger node to join"
            )
        return ""

    def _too_small(self, job: _Job, capacity: int) -> str:
        """Why the live nodes do not count for `job` when none of them can hold a group."""
        if capacity:
            return ""
        live = [
            n
            for n in self._nodes.values()
            if n.live and not n.quarantine_reason and not n.drain_reason
        ]
        if not live:
            return ""
        need = _smallest_group(job.spec)
        largest = max(_total_room(n) for n in live)
        return f" (no live node has {need} free slots; the largest has {largest})"

    def _cannot_change_yet(self, job: _Job, now: float, tick: bool) -> bool:
        """A cheap answer for a lone waiting job while nodes join one by one (10,000 of them).

        Counting live nodes bounds what a full placement could find; when that cannot form the
        round (yet), skip the O(nodes) placement. Deadlines are checked on ticks.
        """
        spec, live = job.spec, self._n_live
        if job.current.port_deadline is not None or self._assigned(job) or now < job.not_before:
            return False
        if job.last_call_deadline is None:
            if live < spec.min_nodes and now < job.join_deadline:
                self._set_reason(
                    job,
                    f"rendezvous: {live}/{spec.min_nodes} nodes, waiting up to "
                    f"{job.join_deadline - now:.0f} s more for min_nodes",
                    now,
                )
                return True
            return False
        return not tick and now < job.last_call_deadline and spec.min_nodes <= live < spec.max_nodes

    def _scale_up(self, claimed: set[str], now: float) -> None:
        for job in self._active_jobs():
            if job.state != JobState.RUNNING or job.spec.scale_up != "restart":
                continue
            if len(job.current.members) >= job.spec.max_nodes or any(
                m.done for m in job.current.members
            ):
                continue
            if not self._all_started(job):
                continue
            extra = [n for n in self._candidates(job) if n.name not in claimed]
            if job.spec.roles:
                extra = _growth(job.spec, [m.ranks.role for m in job.current.members], extra)
            if extra:
                self._begin_stop(
                    job,
                    _StopKind.MEMBERSHIP,
                    f"node {extra[0].name} joined; re-forming to grow from {len(job.current.members)} "
                    f"nodes (max_nodes={job.spec.max_nodes})",
                    now,
                )
                claimed.update(
                    n.name for n in extra[: job.spec.max_nodes - len(job.current.members)]
                )

    def _candidates(self, job: _Job) -> list[_Node]:
        need = _smallest_group(job.spec)
        nodes = [
            n
            for n in self._nodes.values()
            if n.live
            and n.attached
            and not n.quarantine_reason
            and not n.drain_reason
            and job.job_id not in n.jobs
            and n.fits(need)
        ]
        return sorted(nodes, key=lambda n: (n.addr, n.name))

    def _capacity(self, job: _Job) -> int:
        need = _smallest_group(job.spec)
        fit = [
            n
            for n in self._nodes.values()
            if n.live
            and not n.quarantine_reason
            and not n.drain_reason
            and n.slots >= need
            and (not n.gpus or len(n.gpus) >= need)
        ]
        if job.spec.roles and _place(job.spec, fit, room=_total_room) is None:
            # Enough nodes, but not of the sizes the roles need: short of min_nodes until
            # nodes that fit join, and the join timeout runs.
            return min(len(fit), job.spec.min_nodes - 1)
        return len(fit)

    def _free_count(self, job: _Job) -> int:
        return len(self._candidates(job)) if not job.state.is_terminal() else 0

    def _form(
        self, job: _Job, placed: Sequence[tuple[_Node, NodeRole]], now: float, *, why: str = ""
    ) -> None:
        spec = job.spec
        # Group ranks follow the nodes' order whatever their roles; ranks are torch's prefix sums.
        in_order = sorted(placed, key=lambda p: (p[0].addr, p[0].name))
        ordered = [n for n, _ in in_order]
        ranks = assign_worker_ranks([r for _, r in in_order])
        job.round += 1
        # A new round, whole: nothing of the one before (its failures, stop, deadlines) carries.
        job.current = _Round(started_at=now)
        for node, gr in zip(ordered, ranks, strict=True):
            workers = {
                lr: _Worker(local_rank=lr, global_rank=gr.global_rank(lr))
                for lr in range(gr.local_world_size)
            }
            gpus = tuple(node.free_gpus()[: gr.local_world_size]) if node.gpus else ()
            member = _Member(node.name, node.addr, gr.group_rank, gr, workers, gpus=gpus)
            job.current.members.append(member)
            node.jobs[job.job_id] = gr.local_world_size
            if gpus:
                node.gpu_jobs[job.job_id] = list(gpus)
        job.last_call_deadline = None
        if job.state == JobState.QUEUED:
            self._transition(job, JobState.RENDEZVOUS, now)
        if not spec.master_port:
            job.current.port_deadline = now + PORT_TIMEOUT_S
            self._effects.append(RequestPort(ordered[0].name, job.job_id, job.round))
        self._event(
            job,
            now,
            "round_formed",
            f"round {job.round} formed with {_count(len(ordered), 'node')} "
            f"({_named(f'{m.node}=group {m.group_rank}' for m in job.current.members[: MAX_NODES_NAMED + 1])}"
            f"{_more(len(job.current.members))}); world size {ranks[0].world_size}"
            + (f"; {why}" if why else ""),
        )
        if spec.master_port:
            # A fixed port: nothing to reserve; the store host (or worker RANK 0) binds it, and
            # fails the round naming it if it is taken.
            job.current.master_port = spec.master_port
            self._assign(job, now)
        else:
            # What the job waits for now; the reason of the wait before ("queued", "last call
            # closes in 0 s") is over.
            self._set_reason(
                job,
                f"rendezvous: round {job.round} formed; waiting for {ordered[0].name} to "
                "reserve a master port",
                now,
            )
        self._changed(job)

    def _assign(self, job: _Job, now: float) -> None:
        master = job.current.members[0]
        for m in job.current.members:
            node = self._nodes.get(m.node)
            uuids = {g.index: g.uuid for g in node.gpus} if node is not None else {}
            workers = tuple(
                WorkerRanks(
                    local_rank=lr,
                    global_rank=m.ranks.global_rank(lr),
                    role_rank=m.ranks.role_rank(lr),
                    world_size=m.ranks.world_size,
                    role_world_size=m.ranks.role_world_size,
                    role=m.ranks.role,
                )
                for lr in range(m.ranks.local_world_size)
            )
            self._effects.append(
                AssignRound(
                    m.node,
                    RoundAssignment(
                        job_id=job.job_id,
                        round=job.round,
                        attempt=job.attempt,
                        spec=job.spec,
                        group_rank=m.group_rank,
                        group_world_size=len(job.current.members),
                        master_addr=job.spec.master_addr or master.addr,
                        master_port=job.current.master_port,
                        workers=workers,
                        run_id=job.job_id,
                        gpus=m.gpus,
                        gpu_uuids=tuple(uuids.get(i, "") for i in m.gpus),
                    ),
                )
            )
        job.current.start_deadline = now + self.config.start_timeout
        self._transition(job, JobState.RUNNING, now)
        self._set_reason(
            job, f"attempt {job.attempt} starting: {_count(self._worker_count(job), 'worker')}", now
        )
        self._changed(job)

    def _assigned(self, job: _Job) -> bool:
        return job.state in (JobState.RUNNING, JobState.STOPPING)

    def _start_timed_out(self, job: _Job, now: float) -> None:
        """The round's workers did not all start in time: each late rank is a platform failure.

        One stop for the whole round, so however many ranks or nodes were late it spends one
        restart, exactly as one failed rank does; the deadline is cleared so it fires once.
        """
        job.current.start_deadline = None
        timeout = self.config.start_timeout
        late_nodes: list[str] = []
        late_ranks = 0
        for m in job.current.members:
            late = [w for w in m.workers.values() if w.phase == _WorkerPhase.INIT]
            if not late:
                continue
            late_nodes.append(m.node)
            late_ranks += len(late)
            for w in late:
                job.set_phase(w, _WorkerPhase.FAILED)
                job.current.failures[w.global_rank] = _stamp(
                    ProcessFailure(
                        global_rank=w.global_rank,
                        local_rank=w.local_rank,
                        pid=0,
                        exitcode=-1,
                        message=f"rank {w.global_rank} did not start on node {m.node} within "
                        f"{timeout:g} s of the assignment (start timeout): its agent never "
                        "reported it started",
                        timestamp=now,
                        category=FailureCategory.PLATFORM,
                    ),
                    m.node,
                    w,
                    job,
                )
        if not late_nodes:
            return
        nodes = _named(late_nodes[: MAX_NODES_NAMED + 1]) + _more(len(late_nodes))
        reason = (
            f"{late_ranks} rank(s) on {nodes} did not start within {timeout:g} s of the "
            f"assignment (start timeout); {_then(job)}"
        )
        self._event(job, now, "start_timeout", reason)
        self._begin_stop(job, _StopKind.FAILURE, reason, now)
        self._changed(job)
