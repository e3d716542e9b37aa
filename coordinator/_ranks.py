"""Worker rank assignment: torchelastic's algorithm, computed once by the coordinator.

Nodes are walked in group-rank order; global ranks and per-role ranks are prefix sums of each
node's local world size. Roles may interleave, so one role's global ranks need not be contiguous.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["GroupRanks", "NodeRole", "assign_worker_ranks"]


@dataclass(frozen=True)
class NodeRole:
    """What one node brings to a round, in group-rank order."""

    role: str
    local_world_size: int


@dataclass(frozen=True)
class GroupRanks:
    """The ranks of one node's workers: worker `l` has global rank `base_global_rank + l`."""

    group_rank: int
    role: str
    local_world_size: int
    base_global_rank: int
    world_size: int
    base_role_rank: int
    role_world_size: int

    def global_rank(self, local_rank: int) -> int:
        return self.base_global_rank + local_rank

    def role_rank(self, local_rank: int) -> int:
        return self.base_role_rank + local_rank


def assign_worker_ranks(nodes: Sequence[NodeRole]) -> list[GroupRanks]:
    """Ranks for every node; `nodes[i]` is the node of group rank i."""
    world_size = sum(n.local_world_size for n in nodes)
    role_sizes: dict[str, int] = {}
    for n in nodes:
        role_sizes[n.role] = role_sizes.get(n.role, 0) + n.local_world_size
    out: list[GroupRanks] = []
    base_global = 0
    role_bases: dict[str, int] = {}
    for group_rank, n in enumerate(nodes):
        base_role = role_bases.get(n.role, 0)
        out.append(
            GroupRanks(
                group_rank=group_rank,
                role=n.role,
                local_world_size=n.local_world_size,
                base_global_rank=base_global,
                world_size=world_size,
                base_role_rank=base_role,
                role_world_size=role_sizes[n.role],
            )
        )
        base_global += n.local_world_size
        role_bases[n.role] = base_role + n.local_world_size
    return out
