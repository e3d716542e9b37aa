"""Every rank's stack, as the coordinator keeps and shows it: the data, the grouping, the text.

A capture holds one stack per rank of a job's round, read by each node's agent (py-spy, or
faulthandler where ptrace is refused). Identical stacks are collapsed into one `StackGroup`
with the ranks that share them, and the groups are ordered odd ones first (the smallest groups
first): in a hang, the rank that is somewhere else is the one to look at.

Pure data and text, no transport: the coordinator stores these in the job's record, the client
and the dashboard show them.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime

__all__ = [
    "CAPTURE_ID",
    "MAX_CAPTURES_KEPT",
    "MAX_CAPTURE_BYTES",
    "MAX_STACK_BYTES",
    "MAX_STACK_NOTE",
    "STACK_STATUSES",
    "RankStack",
    "StackCapture",
    "StackGroup",
    "bounded_stack",
    "format_capture",
    "group_stacks",
    "normalize_stack",
    "rank_list",
]

MAX_STACK_BYTES = 16 * 1024
"""Most of one rank's stack text kept (the rest is cut, and the cut said)."""
MAX_STACK_NOTE = 512
"""Most of what a node says besides a stack (why ptrace was refused, an error)."""
MAX_CAPTURE_BYTES = 128 * 1024
"""Most stack text one capture keeps, its groups together: past it, a group keeps a note only."""
MAX_CAPTURES_KEPT = 2
"""Captures a job keeps, the latest ones. They are written with every change of the job's record
(an etcd request is at most 1.5 MiB by default), so together they stay small."""
MAX_RANKS_NAMED = 64
"""Ranks one group's heading names; the rest are counted."""
STACK_STATUSES = ("ok", "ptrace_refused", "no_answer", "error")
CAPTURE_ID = re.compile(r"st-[0-9a-f]{1,32}")

_CUT = "\n... (cut at {limit} bytes)"
_PROCESS_LINE = re.compile(r"(Process \d+: .*|Python v\S+ \(.*\))")
_THREAD = re.compile(
    r"(?P<lead>\s*(?:Current thread|Thread)) (?:0x[0-9a-fA-F]+|\d+)"
    r"(?: \((?:idle|active|gil|active\+gil)\))?(?P<rest>.*)"
)


@dataclass(frozen=True)
class RankStack:
    """One rank's stack as a node reported it (or did not)."""

    rank: int
    node: str
    status: str
    """One of STACK_STATUSES."""
    text: str = ""
    note: str = ""


@dataclass(frozen=True)
class StackGroup:
    """One stack and the ranks that share it."""

    status: str
    text: str
    note: str = ""
    ranks: tuple[int, ...] = ()
    nodes: tuple[str, ...] = ()


@dataclass(frozen=True)
class StackCapture:
    """Every rank's stack of one job round, taken once."""

    capture_id: str
    job_id: str
    reason: str
    taken_at: float
    native: bool = False
    attempt: int = 0
    round: int = 0
    groups: tuple[StackGroup, ...] = ()

    @property
    def ranks(self) -> int:
        return sum(len(g.ranks) for g in self.groups)


def bounded_stack(text: str, limit: int = MAX_STACK_BYTES) -> str:
    """`text` cut to at most about `limit` bytes of UTF-8, the cut said at its end."""
    data = text.encode("utf-8", "replace")
    cut = _CUT.format(limit=limit)
    if len(data) <= limit or (len(data) <= limit + len(cut) and text.endswith(cut)):
        return text  # short enough, or cut to this limit already
    return data[:limit].decode("utf-8", "ignore") + cut


def normalize_stack(text: str) -> str:
    """A stack as it is compared and shown: without what differs between processes that stand
    at the same place (the process line, thread ids, a thread's idle/active mark)."""
    out = []
    for line in text.splitlines():
        if _PROCESS_LINE.fullmatch(line.strip()):
            continue
        m = _THREAD.fullmatch(line)
        if m is not None:
            # py-spy's 'Thread 42 (idle): "MainThread"' and faulthandler's 'Thread 0x7f...
            # (most recent call first):' lose the id and the state, keep the rest.
            rest = m["rest"]
            line = m["lead"] + (" " + rest[2:] if rest.startswith(': "') else rest)
        out.append(line.rstrip())
    return "\n".join(out).strip("\n")


def group_stacks(stacks: Iterable[RankStack]) -> tuple[StackGroup, ...]:
    """Identical stacks (same status, text and note) collapsed with the ranks that share them,
    the odd ones first: smallest groups first, then by their lowest rank. The texts together
    stay within MAX_CAPTURE_BYTES (a group past it keeps a note that says so)."""
    found: dict[tuple[str, str, str], list[RankStack]] = {}
    for s in stacks:
        text = bounded_stack(normalize_stack(s.text))
        found.setdefault((s.status, text, s.note[:MAX_STACK_NOTE]), []).append(s)
    groups = sorted(
        (
            StackGroup(
                status,
                text,
                note,
                tuple(sorted(s.rank for s in members)),
                tuple(sorted({s.node for s in members})),
            )
            for (status, text, note), members in found.items()
        ),
        key=lambda g: (len(g.ranks), g.ranks[:1]),
    )
    kept, size = [], 0
    for g in groups:
        size += len(g.text.encode("utf-8", "replace"))
        if size > MAX_CAPTURE_BYTES:
            note = f"stack not kept: the capture keeps at most {MAX_CAPTURE_BYTES} bytes of stacks"
            g = StackGroup(g.status, "", (g.note + "; " if g.note else "") + note, g.ranks, g.nodes)
        kept.append(g)
    return tuple(kept)


def rank_list(ranks: Sequence[int], limit: int = MAX_RANKS_NAMED) -> str:
    """ "rank 2" or "ranks 0,1,3", past `limit` ranks "... and N more"."""
    shown = ",".join(str(r) for r in ranks[:limit])
    more = f" and {len(ranks) - limit} more" if len(ranks) > limit else ""
    return f"{'rank' if len(ranks) == 1 else 'ranks'} {shown}{more}"


_STATUS_WORDS = {
    "ok": "",
    "ptrace_refused": "fallback (ptrace refused)",
    "no_answer": "no answer",
    "error": "not read",
}


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def format_capture(c: StackCapture) -> str:
    """The capture as a person reads it: a heading, then each group, the odd ones first."""
    when = datetime.fromtimestamp(c.taken_at, UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
    native = ", native frames" if c.native else ""
    lines = [
        f"capture {c.capture_id} of job {c.job_id} (attempt {c.attempt}, round {c.round}) "
        f"at {when}{native}: {_count(c.ranks, 'rank')} in {_count(len(c.groups), 'group')};"
        f" reason: {c.reason}"
    ]
    for g in c.groups:
        nodes = ", ".join(g.nodes[:MAX_RANKS_NAMED])
        status = _STATUS_WORDS.get(g.status, g.status)
        lines.append("")
        lines.append(f"{rank_list(g.ranks)} ({nodes}):" + (f" [{status}]" if status else ""))
        if g.note:
            lines.append(f"  note: {g.note}")
        lines.extend("  " + line for line in g.text.splitlines())
    return "\n".join(lines)
