"""What the coordinator knows of a round's progress, and the judgements made from it (pure).

Each rank of a running round has a `RankTrack`: the step its worker last reported
(`client.progress`, through its agent's `ProgressReport`), its steps/s, its metrics, and when
(on the coordinator's clock, so skewed node clocks do not matter) the step last advanced; and,
for jobs without progress reports, since when its CPU has been idle or busy (heartbeats).

`stall_verdict` says which ranks are behind when the round is stalled, `slow_ranks` which ranks
step slower than the median by the job's straggler factor. Kept in memory only: a restarted
coordinator starts tracking again from the next report.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

__all__ = [
    "BUSY_CPU_PERCENT",
    "IDLE_CPU_PERCENT",
    "JobProgress",
    "RankTrack",
    "describe_ranks",
    "slow_ranks",
    "stall_verdict",
]

IDLE_CPU_PERCENT = 2.0
"""A worker under this much CPU (one heartbeat's sample) is idle: asleep or blocked in a read."""
BUSY_CPU_PERCENT = 90.0
"""A worker over this much is busy: computing, or spinning in a collective (NCCL does)."""
MAX_NAMED = 8
"""Ranks a reason names; the rest are counted."""


@dataclass
class RankTrack:
    node: str
    local_rank: int
    advanced_at: float
    """When the step last changed (coordinator clock); when tracking began before any report."""
    step: int = -1
    """-1: never reported."""
    steps_per_s: float = 0.0
    metrics: tuple[tuple[str, float], ...] = ()
    slow_since: float | None = None
    straggler: bool = False
    active: bool = False
    """Some CPU sample of it was over IDLE_CPU_PERCENT: idle counts only from then (a first
    sample reads 0, and a worker still starting is no stall)."""
    idle_since: float | None = None
    busy_since: float | None = None
    behind: bool = False


@dataclass
class JobProgress:
    """A round's progress: its ranks' tracks and the stall, if the round is stalled."""

    round: int
    ranks: dict[int, RankTrack] = field(default_factory=dict)
    reported: bool = False
    """Some rank of the round reported progress: stalls are judged on steps, not on CPU."""
    stalled_since: float | None = None
    stall_reason: str = ""
    next_check: float = 0.0
    pending: tuple[tuple[int, ...], str, float] | None = None
    """A stall's action waiting for its stacks: the ranks behind, why, and when it acts anyway."""


def describe_ranks(ranks: dict[int, RankTrack], chosen: list[int]) -> str:
    """ "ranks 2 (node-a), 5 (node-b) and 3 more" """
    named = [f"{r} ({ranks[r].node})" for r in chosen[:MAX_NAMED]]
    more = f" and {len(chosen) - MAX_NAMED} more" if len(chosen) > MAX_NAMED else ""
    return f"rank{'s' if len(chosen) > 1 else ''} {', '.join(named)}{more}"


def stall_verdict(progress: JobProgress, timeout: float, now: float) -> tuple[list[int], str]:
    """The ranks behind, and why, when the round is stalled; ([], "") when it is not.

    With progress reports: a rank is stale when its step has not advanced for `timeout`; the
    stale ranks at a lower step than the highest are behind (they are what the others wait for,
    or have left behind). When every rank is stale and all stopped at the same step, all are.

    Without: every rank idle on the CPU for `timeout` stalls the round (all behind: a peer
    blocked in a gloo collective sleeps too, so the culprit cannot be told apart); idle ranks
    while every other rank was busy for as long (peers spinning in an NCCL collective) are
    behind.
    """
    ranks = progress.ranks
    if not ranks or timeout <= 0:
        return [], ""
    if progress.reported:
        stale = sorted(r for r, t in ranks.items() if now - t.advanced_at >= timeout)
        if not stale:
            return [], ""
        top = max(t.step for t in ranks.values())
        behind = [r for r in stale if ranks[r].step < top]
        if len(stale) < len(ranks):
            # Reports of different nodes arrive apart: a stale rank the others have not passed
            # is not behind yet.
            if not behind:
                return [], ""
            return behind, (
                f"{describe_ranks(ranks, behind)} made no step for {timeout:g} s while others "
                f"went on to step {top}"
            )
        if behind:
            return behind, (
                f"no rank made a step for {timeout:g} s; {describe_ranks(ranks, behind)} "
                f"behind, the others at step {top}"
            )
        return stale, f"no rank made a step for {timeout:g} s (all at step {top})"
    idle = sorted(
        r for r, t in ranks.items() if t.idle_since is not None and now - t.idle_since >= timeout
    )
    if not idle:
        return [], ""
    if len(idle) == len(ranks):
        return idle, f"every rank idle on the CPU for {timeout:g} s (no progress reports)"
    others = [t for r, t in ranks.items() if r not in idle]
    if all(t.busy_since is not None and now - t.busy_since >= timeout for t in others):
        return idle, (
            f"{describe_ranks(ranks, idle)} idle on the CPU for {timeout:g} s while the others "
            "were busy (no progress reports)"
        )
    return [], ""


def slow_ranks(progress: JobProgress, factor: float) -> tuple[list[int], float]:
    """The ranks stepping slower than the median rate divided by `factor`, and that median
    (ranks with no rate yet are left out; fewer than two rates judge nothing)."""
    rates = {r: t.steps_per_s for r, t in progress.ranks.items() if t.steps_per_s > 0}
    if len(rates) < 2:
        return [], 0.0
    median = statistics.median(rates.values())
    return sorted(r for r, rate in rates.items() if rate * factor < median), median
