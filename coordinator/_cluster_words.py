"""How the cluster says things: the states and reasons of its views and events, bounded."""

from __future__ import annotations

import logging
from collections.abc import Iterable

from client.model import (
    JobSpec,
    WorkerGpu,
    WorkerState,
)
from client.redaction import describe_command
from coordinator._cluster_records import (
    MAX_FAILURE_TEXT,
    MAX_NODES_NAMED,
    _Job,
    _Member,
    _Node,
    _WorkerPhase,
)

logger = logging.getLogger("coordinator._cluster")


_ENDED_GROUP = (WorkerState.FAILED, WorkerState.SUCCEEDED)


def _node_state(n: _Node) -> str:
    if not n.live:
        return "lost"
    if n.quarantine_reason:
        return "quarantined"
    return "live" if n.attached else "reconnecting"


def _worker_gpu(
    node: _Node | None, m: _Member, local_rank: int, *, sampled: bool
) -> WorkerGpu | None:
    """The GPU `local_rank` of member `m` holds, with its node's latest sample of it (none once
    the job is over: the GPU may serve another job by then)."""
    if node is None or not 0 <= local_rank < len(m.gpus):
        return None
    index = m.gpus[local_rank]
    device = next((g for g in node.gpus if g.index == index), None)
    h = node.gpu_health.get(index) if sampled else None
    return WorkerGpu(
        index=index,
        uuid=device.uuid if device is not None else "",
        utilization_percent=h.utilization_percent if h is not None else 0.0,
        memory_used=h.memory_used if h is not None else 0,
        memory_total=device.memory_total if device is not None else 0,
        temperature_c=h.temperature_c if h is not None else 0,
    )


def _worker_state(phase: _WorkerPhase, proc_state: str) -> WorkerState:
    if phase == _WorkerPhase.RUNNING:
        if proc_state in ("disk-sleep", "stopped"):
            return WorkerState.UNHEALTHY
        return WorkerState.HEALTHY
    return {
        _WorkerPhase.INIT: WorkerState.INIT,
        _WorkerPhase.SUCCEEDED: WorkerState.SUCCEEDED,
        _WorkerPhase.FAILED: WorkerState.FAILED,
        _WorkerPhase.STOPPED: WorkerState.STOPPED,
    }[phase]


def _then(job: _Job) -> str:
    """What a failure of the running attempt leads to, in the words of the stop's reason."""
    if job.spec.max_restarts - job.attempt > 0:
        return f"restarting ({job.attempt + 1}/{job.spec.max_restarts} restarts used)"
    return "no restarts left; failing the job"


def _named(items: Iterable[str]) -> str:
    return ", ".join(list(items)[:MAX_NODES_NAMED])


def _count(n: int, noun: str) -> str:
    """``1 node``, ``2 nodes``."""
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def _more(count: int) -> str:
    return f" ... and {count - MAX_NODES_NAMED:,} more nodes" if count > MAX_NODES_NAMED else ""


def _drained_note(nodes: Iterable[_Node]) -> str:
    """The live nodes that are drained, for the reason of a job waiting for nodes."""
    drained = sorted(n.name for n in nodes if n.live and n.drain_reason)
    if not drained:
        return ""
    return f" (drained: {_named(drained)}{_more(len(drained))})"


def _clip(text: str, limit: int = MAX_FAILURE_TEXT) -> str:
    if len(text) <= limit:
        return text
    return (
        text[: limit // 2]
        + f"\n... [{len(text) - limit} characters cut] ...\n"
        + text[-limit // 2 :]
    )


def _describe_spec(spec: JobSpec) -> str:
    # Events are shown and logged: the program and counts, never an argument or an env value.
    if spec.roles:
        parts = [
            f"{r.name} ({describe_command(tuple(r.entrypoint) + tuple(r.args), len(r.env))}: "
            + (f"{r.min_nodes}" if r.min_nodes == r.max_nodes else f"{r.min_nodes}:{r.max_nodes}")
            + f" x {_count(r.nproc_per_node, 'worker')})"
            for r in spec.roles
        ]
        return (
            f"submitted {len(spec.roles)} roles with {len(spec.env)} job env variable(s): "
            f"{', '.join(parts)}, max_restarts={spec.max_restarts}"
        )
    what = (
        f"{spec.function[:200]!r} with {len(spec.env)} env variable(s)"
        if spec.function
        else describe_command(spec.argv, len(spec.env))
    )
    nodes = (
        f"{spec.min_nodes}"
        if spec.min_nodes == spec.max_nodes
        else f"{spec.min_nodes}:{spec.max_nodes}"
    )
    return (
        f"submitted {what}: {nodes} node{'' if nodes == '1' else 's'} x "
        f"{_count(spec.nproc_per_node, 'worker')}, "
        f"max_restarts={spec.max_restarts}"
    )
