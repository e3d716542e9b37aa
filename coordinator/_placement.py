"""Placement, pure: which free nodes can hold a job's groups (feasibility), in which order they
are taken (ranking), and how far a running job could grow.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

from client.model import (
    JobSpec,
)
from coordinator._cluster_records import (
    _Node,
)
from coordinator._ranks import NodeRole

logger = logging.getLogger("coordinator._cluster")


def _smallest_group(spec: JobSpec) -> int:
    """The fewest free slots a node needs to take a group of the job."""
    if spec.roles:
        return min(r.nproc_per_node for r in spec.roles)
    return spec.nproc_per_node


def _free_slots(node: _Node) -> int:
    """The workers a node could take now: its free slots, and its free GPUs when it has any."""
    return min(node.free_slots(), len(node.free_gpus())) if node.gpus else node.free_slots()


def _total_room(node: _Node) -> int:
    """The most workers a node could ever take: its slots, and its GPUs when it has any."""
    return min(node.slots, len(node.gpus)) if node.gpus else node.slots


def _fit_order(
    nodes: Sequence[_Node], need: int, taken: set[str], room: Callable[[_Node], int] = _free_slots
) -> list[_Node]:
    """The nodes that have `room` for a group of `need` slots, the tightest first (best fit): a
    role with small groups does not take the big nodes another role needs."""
    fit = [n for n in nodes if n.name not in taken and room(n) >= need]
    return sorted(fit, key=room)


def _place(
    spec: JobSpec, free: Sequence[_Node], room: Callable[[_Node], int] = _free_slots
) -> tuple[list[tuple[_Node, NodeRole]], bool] | None:
    """The nodes a round would take and the role of each, and whether it is full (every role at
    its max_nodes); None while some role cannot have its min_nodes.

    One node runs one group of the job: a node never carries two roles of one job.
    """
    if not spec.roles:
        if len(free) < spec.min_nodes:
            return None
        chosen = free[: spec.max_nodes]
        role = NodeRole(spec.role, spec.nproc_per_node)
        return [(n, role) for n in chosen], len(free) >= spec.max_nodes
    taken: set[str] = set()
    placed: list[tuple[_Node, NodeRole]] = []
    # Minimums first, the biggest groups first (they fit the fewest nodes); then each role grows
    # toward its maximum in the spec's order.
    by_size = sorted(spec.roles, key=lambda r: -r.nproc_per_node)
    for want in ("min", "max"):
        for r in by_size if want == "min" else spec.roles:
            have = sum(1 for _, p in placed if p.role == r.name)
            goal = r.min_nodes if want == "min" else r.max_nodes
            for n in _fit_order(free, r.nproc_per_node, taken, room)[: max(0, goal - have)]:
                taken.add(n.name)
                placed.append((n, NodeRole(r.name, r.nproc_per_node)))
            if want == "min" and sum(1 for _, p in placed if p.role == r.name) < r.min_nodes:
                return None
    full = all(sum(1 for _, p in placed if p.role == r.name) >= r.max_nodes for r in spec.roles)
    return placed, full


def _growth(spec: JobSpec, roles_now: Sequence[str], free: Sequence[_Node]) -> list[_Node]:
    """The free nodes a running multi-role round could grow by: ones that fit a role below its
    max_nodes."""
    out: list[_Node] = []
    taken: set[str] = set()
    for r in spec.roles:
        room = r.max_nodes - sum(1 for x in roles_now if x == r.name)
        for n in _fit_order(free, r.nproc_per_node, taken)[: max(0, room)]:
            taken.add(n.name)
            out.append(n)
    return out
