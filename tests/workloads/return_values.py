"""Return values of several kinds, one per global rank: what a function job's worker stores as
JSON (rank 0) and what only as a pickle (every other rank)."""

from __future__ import annotations

import os

VALUES: list[object] = [
    {
        "loss": 0.25,
        "steps": [1, 2, 3],
        "ok": True,
        "none": None,
        "name": "r\u00e9sum\u00e9 \u2603",
        "big": 2**70,
        "neg": -0.0,
        "nested": {"a": [{"b": -1.5e-300, "c": []}, {}]},
    },
    (1, "a"),
    {1: "one", 2: "two"},
    float("nan"),
]


def value_of_rank() -> object:
    return VALUES[int(os.environ["RANK"])]
