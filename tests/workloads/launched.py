"""Functions that `gelastic.launch` and torch's `elastic_launch` both run in the tests."""

from __future__ import annotations

import os


def rank_and_value(x: int) -> tuple[int, int, str]:
    """A tuple (a pickle, not JSON): the global rank, `x` times the world size, the role."""
    return int(os.environ["RANK"]), x * int(os.environ["WORLD_SIZE"]), os.environ["ROLE_NAME"]


def fail_on_rank(rank: int, message: str) -> str:
    """Raise ValueError(message) on global rank `rank`; the other ranks return "ok"."""
    if int(os.environ["RANK"]) == rank:
        raise ValueError(message)
    return "ok"
