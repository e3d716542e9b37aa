"""The JSON the dashboard's pages read: the cluster and jobs overview, and one job in full.

`DashboardModel` builds it from the service's state (the gRPC servicers' own objects), each list
bounded and each text cut, so that one page of a large cluster or a long job stays small.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from client.model import (
    AttemptSummary,
    JobEvent,
    ProcessFailure,
    first_failure,
)
from client.wire import shown_spec

if TYPE_CHECKING:
    from coordinator._service import CoordinatorService

TEXT_MAX = 4096
"""One-line fields (reasons, messages) are cut to this many characters."""
TRACEBACK_MAX = 64 * 1024
EVENTS_SHOWN = 500
"""The latest events of a job the page shows."""
JOBS_SHOWN = 1000
"""The most recent jobs the jobs page lists."""
RANKS_SHOWN = 2000
"""Ranks a job page lists (the lowest global ranks)."""
ATTEMPTS_SHOWN = 20
"""The latest attempts a job's timeline draws."""
NODES_PER_ATTEMPT_SHOWN = 64
"""Nodes of one attempt the timeline draws a bar for."""
NODES_PER_JOB_ROW = 16
"""Nodes a job's row names (`nodes_total` counts them all)."""
ROW_TEXT_MAX = 1024
"""A job row's reason and root cause are cut to this many characters."""


def _cut(text: str, most: int = TEXT_MAX) -> str:
    return text if len(text) <= most else text[:most] + " [...]"


def _one_line(text: str) -> str:
    return _cut(" ".join(text.split()))


def failure_json(f: ProcessFailure) -> dict[str, Any]:
    return {
        "rank": f.global_rank,
        "local_rank": f.local_rank,
        "node": f.node,
        "pid": f.pid,
        "exitcode": f.exitcode,
        "signal": f.signal,
        # A report: gelastic's account where torch's message is only its generic hint.
        "message": _cut(f.report_text),
        "traceback": _cut(f.traceback, TRACEBACK_MAX),
        "stderr_tail": _cut(f.stderr_tail, TRACEBACK_MAX),
        "attempt": f.attempt,
        "round": f.round,
        "root_cause": f.root_cause,
        "category": f.category.value,
        "timestamp": f.precise_timestamp,
        "executable": _cut(f.executable),
    }


def _attempt_json(a: AttemptSummary) -> dict[str, Any]:
    return {
        "attempt": a.attempt,
        "round": a.round,
        "nodes": list(a.nodes[:NODES_PER_ATTEMPT_SHOWN]),
        "nodes_total": len(a.nodes),
        "end_reason": _one_line(a.end_reason),
        "started_at": a.started_at,
        "ended_at": a.ended_at,
        "failed_ranks": [{"rank": f.global_rank, "node": f.node} for f in a.failures],
    }


def _event_json(e: JobEvent) -> dict[str, Any]:
    return {
        "seq": e.seq,
        "timestamp": e.timestamp,
        "kind": e.kind,
        "reason": _cut(e.reason),
        "attempt": e.attempt,
        "round": e.round,
        "node": e.node,
        "rank": e.rank,
    }


class DashboardModel:
    """Builds what the pages show from the service's state (the gRPC servicers' own objects)."""

    def __init__(self, svc: CoordinatorService) -> None:
        self.svc = svc
        self.standby: Callable[[], str] = lambda: ""
        """What a replica that does not lead says ("" while it leads, and with SQLite)."""

    def root_cause_line(self, job_id: str) -> str:
        c = self.svc.cluster
        result = c.job_result(job_id)
        if result is not None:
            root = result.root_cause
            if root is not None:
                first = (root.report_text or root.traceback or "").strip().splitlines()
                text = first[-1] if first else f"exit code {root.exitcode}"
                return _one_line(f"rank {root.global_rank} on {root.node or '?'}: {text}")
            if result.is_failed():
                return _one_line(result.reason)
        return ""

    def job_row(self, job_id: str, now: float) -> dict[str, Any]:
        """A job as the jobs page lists it: bounded in size and time whatever the job's width."""
        c = self.svc.cluster
        s = c.job_summary(job_id, members_shown=NODES_PER_JOB_ROW)
        end = s.finished_at if s.state.is_terminal() and s.finished_at else now
        return {
            "job_id": s.job_id,
            "name": s.name,
            "state": s.state.value,
            "reason": _cut(_one_line(s.reason), ROW_TEXT_MAX),
            "attempt": s.attempt,
            "round": s.round,
            "max_restarts": s.max_restarts,
            "restarts_left": max(0, s.max_restarts - s.attempt),
            "submitted_at": s.submitted_at,
            "finished_at": s.finished_at,
            "duration": max(0.0, end - s.submitted_at) if s.submitted_at else 0.0,
            "world_size": s.world_size,
            "nodes": [m.node for m in s.members],
            "nodes_total": s.nodes_joined if s.members else 0,
            "root_cause": _cut(self.root_cause_line(job_id), ROW_TEXT_MAX),
        }

    def overview(self) -> dict[str, Any]:
        """The cluster and jobs pages: every node and the most recent jobs."""
        c = self.svc.cluster
        now = self.svc.now()
        ids = c.job_ids()
        # Active jobs first, then the most recent: only the rows shown are made.
        shown = sorted(ids, key=lambda j: (c.job_state(j).is_terminal(), -c.job_submitted_at(j)))[
            :JOBS_SHOWN
        ]
        rows = [self.job_row(j, now) for j in shown]
        usage: dict[str, list[float]] = {}
        for j in ids:
            if c.job_state(j).is_terminal():
                continue
            for w in c.job_status(j).workers:
                u = usage.setdefault(w.node, [0.0, 0.0, 0.0])
                u[0] += w.cpu_percent
                u[1] += w.rss_bytes
                u[2] += 1
        nodes = []
        for n in c.nodes():
            u = usage.get(n.name, [0.0, 0.0, 0.0])
            nodes.append(
                {
                    "name": n.name,
                    "addr": n.addr,
                    "slots": n.slots,
                    "slots_used": n.slots_used,
                    "slots_free": max(0, n.slots - n.slots_used),
                    "state": n.state,
                    "last_seen": n.last_seen,
                    "heartbeat_age": max(0.0, now - n.last_seen),
                    "cpu_percent": round(u[0], 1),
                    "rss_bytes": int(u[1]),
                    "workers": int(u[2]),
                    "jobs": list(n.jobs),
                    "drain_reason": n.drain_reason,
                    "drain_deadline": n.drain_deadline,
                }
            )
        overview: dict[str, Any] = {
            "now": now,
            "nodes": nodes,
            "jobs": rows,
            "jobs_total": len(ids),
        }
        standby = self.standby()
        if standby:
            overview["standby"] = standby
        return overview

    def job(self, job_id: str) -> dict[str, Any]:
        c = self.svc.cluster
        now = self.svc.now()
        s = c.job_status(job_id)
        spec = shown_spec(c.job_spec(job_id))  # what GetJob shows: no secret in argv or env
        result = c.job_result(job_id)
        attempts = [_attempt_json(a) for a in c.job_attempts(job_id)[-ATTEMPTS_SHOWN:]]
        if s.members and not any(
            a["attempt"] == s.attempt and a["round"] == s.round for a in attempts
        ):
            attempts.append(
                {
                    "attempt": s.attempt,
                    "round": s.round,
                    "nodes": [m.node for m in s.members[:NODES_PER_ATTEMPT_SHOWN]],
                    "nodes_total": len(s.members),
                    "end_reason": "",
                    "started_at": 0.0,
                    "ended_at": 0.0,
                    "failed_ranks": [],
                }
            )
        events = c.job_events(job_id)[-EVENTS_SHOWN:]
        root = result.root_cause if result is not None else None
        found: list[ProcessFailure] = list(result.failures.values()) if result is not None else []
        root_from = "result"
        if root is None:
            # A job that recovered (or is still running) shows its latest failed attempt's.
            for summary in reversed(c.job_attempts(job_id)):
                if summary.failures:
                    found = list(summary.failures)
                    marked = [f for f in found if f.root_cause]
                    root = (
                        marked[0] if marked else first_failure({i: f for i, f in enumerate(found)})
                    )
                    root_from = f"attempt {summary.attempt}"
                    break
        failures = sorted(found, key=lambda f: (f is not root, f.precise_timestamp, f.global_rank))
        return {
            "now": now,
            "job": self.job_row(job_id, now),
            "spec": {
                "nproc_per_node": spec.nproc_per_node,
                "min_nodes": spec.min_nodes,
                "max_nodes": spec.max_nodes,
                "max_restarts": spec.max_restarts,
                "role": ", ".join(r.name for r in spec.roles) or spec.role,
                "entrypoint": _cut(
                    spec.function
                    or " ".join(spec.argv)
                    # A multi-role job: each role's program (its arguments are not shown).
                    or "; ".join(f"{r.name}: {r.entrypoint[0]}" for r in spec.roles if r.entrypoint)
                ),
            },
            "workers": [
                {
                    "rank": w.global_rank,
                    "local_rank": w.local_rank,
                    "node": w.node,
                    "pid": w.pid,
                    "state": w.state.value,
                    "proc_state": w.proc_state,
                    "cpu_percent": round(w.cpu_percent, 1),
                    "rss_bytes": w.rss_bytes,
                    "exitcode": w.exitcode,
                    "step": w.step,
                    "steps_per_s": round(w.steps_per_s, 2),
                    "last_step_age": w.last_step_age,
                    "metrics": {k: round(v, 6) for k, v in list(w.metrics.items())[:4]},
                    "behind": w.behind,
                    "straggler": w.straggler,
                }
                for w in s.workers[:RANKS_SHOWN]
            ],
            "stall_reason": _cut(_one_line(s.stall_reason), ROW_TEXT_MAX),
            "ranks_total": len(s.workers),
            "attempts": attempts,
            "events": [_event_json(e) for e in events],
            "root_cause": failure_json(root) if root is not None else None,
            "root_cause_from": root_from if root is not None else "",
            "failures": [failure_json(f) for f in failures[:50] if f is not root],
            "result_reason": _one_line(result.reason) if result is not None else "",
        }
