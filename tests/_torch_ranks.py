"""torch's own worker rank assignment, run as the oracle of gelastic's (tests only).

`SimpleElasticAgent._assign_worker_ranks` is what every torchelastic agent runs after a
rendezvous: each agent publishes (role, group rank, local world size) to the round's store and
group rank 0 computes everyone's ranks. Run here agent by agent against one in-memory store.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = ["torch_ranks"]


def torch_ranks(groups: Sequence[tuple[str, int]]) -> list[list[dict[str, Any]]]:
    """For each group (role, local world size) in group-rank order: its workers' ranks as torch
    assigns them, {"RANK", "ROLE_RANK", "WORLD_SIZE", "ROLE_WORLD_SIZE", "LOCAL_RANK"}."""
    import torch.distributed as dist
    from torch.distributed.elastic.agent.server.api import (
        SimpleElasticAgent,
        WorkerSpec,
        _RoleInstanceInfo,
    )

    store = dist.HashStore()
    n = len(groups)
    specs = [
        WorkerSpec(role=role, local_world_size=lws, rdzv_handler=None, entrypoint="true")  # type: ignore[arg-type]
        for role, lws in groups
    ]
    # Every agent publishes its role info before group rank 0 reads them all (in torch they run
    # at once; here the publishing is done first so one thread can play every agent).
    for g, (role, lws) in enumerate(groups):
        store.set(f"torchelastic/role_info/{g}", _RoleInstanceInfo(role, g, lws).serialize())
    out: list[list[dict[str, Any]]] = []
    for g in range(n):
        workers = SimpleElasticAgent._assign_worker_ranks(None, store, g, n, specs[g])  # type: ignore[arg-type]
        out.append(
            [
                {
                    "LOCAL_RANK": w.local_rank,
                    "RANK": w.global_rank,
                    "ROLE_RANK": w.role_rank,
                    "WORLD_SIZE": w.world_size,
                    "ROLE_WORLD_SIZE": w.role_world_size,
                }
                for w in workers
            ]
        )
    return out
