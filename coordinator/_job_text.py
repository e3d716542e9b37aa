"""A job's stored record as JSON text, its round's members apart and encoded only when they
changed.

A job of ten thousand nodes is mostly its round's members; a burst of their reports (workers
started, exits) dirties the job again and again while each report changes one member. Encoding
the whole job for each write made every write of such a job cost O(nodes) of encoding and JSON,
and the journal's pause after a write grows with that cost. Here each member's text is kept
with a fingerprint of everything it holds; a write encodes the job's other fields and only the
members whose fingerprint moved, and says which those are: the SQLite store writes only them
(`coordinator._store.JobRecord`).

Finding the members that moved costs a fingerprint of every member, which at ten thousand nodes
is most of a write during the round's start, when each node's report changes its own member.
A change the cluster knows to touch one member says so (`note_member_changed`); while every
change since the last write did, the write fingerprints only those members. Any other change
(`note_job_changed`), a new round, or a member list that grew makes the next write look at all.
A change written nowhere (`durable=False`, such as a heartbeat's figures) waits for the next
write that looks at its member.

The whole text is `json.dumps(dump_job(job), separators=(",", ":"))` up to the order of keys
(the decoder reads fields by name). The fingerprint takes every field of `_Member` and `_Worker`:
the containers among them (`workers`, `seen_exits`) by value, the others as they are, so a
field of a mutable type added to either must be added to `_CONTAINERS` (a unit test checks it).
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Callable
from json.encoder import encode_basestring_ascii
from operator import attrgetter
from typing import Any

from coordinator._cluster_records import _Job, _Member, _Round, _Worker
from coordinator._codec import encode
from coordinator._store import JobRecord

__all__ = ["job_record", "note_job_changed", "note_member_changed"]

_CONTAINERS = ("workers", "seen_exits")
"""The fields of `_Member` whose value is changed in place (the fingerprint copies them)."""
_MEMBER_VALUES = attrgetter(
    *(f.name for f in dataclasses.fields(_Member) if f.name not in _CONTAINERS)
)
_WORKER_VALUES = attrgetter(*(f.name for f in dataclasses.fields(_Worker)))
_JOB_FIELDS = tuple(f.name for f in dataclasses.fields(_Job) if f.name not in ("current", "events"))
_ROUND_FIELDS = tuple(f.name for f in dataclasses.fields(_Round) if f.name != "members")
_CACHE = "_member_texts"
"""Where a job keeps its members' (fingerprints, texts) between writes, with the member list
they were taken of and each node's index in it (in its `__dict__`, outside its fields: never
encoded)."""
_TOUCHED = "_members_touched"
"""The nodes whose members alone changed since the last write (in the job's `__dict__`).
Absent: the next write looks at every member."""


def note_member_changed(job: _Job, node: str) -> None:
    """A change of job `job` touched its round's member on `node` and no other member."""
    touched: set[str] | None = job.__dict__.get(_TOUCHED)
    if touched is not None:
        touched.add(node)


def note_job_changed(job: _Job) -> None:
    """A change of job `job` may have touched any member of its round."""
    job.__dict__.pop(_TOUCHED, None)


@dataclasses.dataclass
class _Texts:
    """A job's members as its last write encoded them."""

    members: list[_Member]
    """The member list they were taken of (a new round brings a new list)."""
    prints: list[tuple[Any, ...]]
    texts: list[str]
    index: dict[str, int]
    """Each member's index by its node."""


def _fingerprint(m: _Member) -> tuple[Any, ...]:
    return (
        _MEMBER_VALUES(m),
        tuple(m.workers),
        tuple(map(_WORKER_VALUES, m.workers.values())),
        frozenset(m.seen_exits),
    )


def _dumps(doc: Any) -> str:
    return json.dumps(doc, separators=(",", ":"))


_str: Callable[[str], str] = encode_basestring_ascii  # a JSON string, as json.dumps writes it


def _bool(b: bool) -> str:
    return "true" if b else "false"


def _float(x: float) -> str:
    return repr(x) if math.isfinite(x) else _dumps(x)


def _worker_text(w: _Worker) -> str:
    exitcode = "null" if w.exitcode is None else str(w.exitcode)
    return (
        f'{{"local_rank":{w.local_rank},"global_rank":{w.global_rank},'
        f'"phase":{_str(w.phase.value)},"pid":{w.pid},"exitcode":{exitcode},'
        f'"cpu_percent":{_float(w.cpu_percent)},"rss_bytes":{w.rss_bytes},'
        f'"proc_state":{_str(w.proc_state)},"early":{_bool(w.early)}}}'
    )


def _member_text(m: _Member) -> str:
    """`_dumps(encode(m))`, written out: the generic encoder was most of a large round's write
    (a unit test holds the two equal for members of every shape)."""
    r = m.ranks
    workers = ",".join(f"[{k},{_worker_text(w)}]" for k, w in m.workers.items())
    exits = ",".join(f"[{a},{b}]" for a, b in m.seen_exits)
    gpus = ",".join(map(str, m.gpus))
    return (
        f'{{"node":{_str(m.node)},"addr":{_str(m.addr)},"group_rank":{m.group_rank},'
        f'"ranks":{{"group_rank":{r.group_rank},"role":{_str(r.role)},'
        f'"local_world_size":{r.local_world_size},"base_global_rank":{r.base_global_rank},'
        f'"world_size":{r.world_size},"base_role_rank":{r.base_role_rank},'
        f'"role_world_size":{r.role_world_size}}},'
        f'"workers":{{"__map__":[{workers}]}},"done":{_bool(m.done)},'
        f'"stopped":{_bool(m.stopped)},"released":{_bool(m.released)},"lost":{_bool(m.lost)},'
        f'"seen_exits":[{exits}],"group_state":{_str(m.group_state.value)},"gpus":[{gpus}]}}'
    )


def _inner(obj: object, names: tuple[str, ...]) -> str:
    """The named fields of `obj` as JSON object members, without the braces."""
    return _dumps({name: encode(getattr(obj, name)) for name in names})[1:-1]


def job_record(job: _Job, *, keep: bool = True) -> JobRecord:
    """The job's stored record (its events are stored on their own), its members apart, with
    the indices of those that changed since the last call (all of them on the first).

    `keep`: keep the members' texts for the next call (False for a job that will not change
    again, so a finished job holds no second copy of its last round)."""
    members = job.current.members
    cached: _Texts | None = job.__dict__.get(_CACHE)
    touched: set[str] | None = job.__dict__.get(_TOUCHED)
    changed: list[int] = []
    if (
        cached is not None
        and touched is not None
        and cached.members is members
        and len(cached.prints) == len(cached.index) == len(members)
        and touched.issubset(cached.index)
    ):
        texts = cached.texts
        for i in sorted(map(cached.index.__getitem__, touched)):
            if cached.prints[i] != (fp := _fingerprint(members[i])):
                cached.prints[i], texts[i] = fp, _member_text(members[i])
                changed.append(i)
    else:
        prints, texts = (cached.prints, cached.texts) if cached is not None else ([], [])
        del prints[len(members) :], texts[len(members) :]
        for i, m in enumerate(members):
            fp = _fingerprint(m)
            if i < len(prints):
                if prints[i] != fp:
                    prints[i], texts[i] = fp, _member_text(m)
                    changed.append(i)
            else:
                prints.append(fp)
                texts.append(_member_text(m))
                changed.append(i)
        index = {m.node: i for i, m in enumerate(members)}
        cached = _Texts(members, prints, texts, index)
    if keep:
        job.__dict__[_CACHE] = cached
        job.__dict__[_TOUCHED] = set()
    else:
        job.__dict__.pop(_CACHE, None)
        job.__dict__.pop(_TOUCHED, None)
    rest = _inner(job.current, _ROUND_FIELDS)
    head = _inner(job, _JOB_FIELDS)
    return JobRecord(
        before="{" + (head + "," if head else "") + '"current":{"members":[',
        members=tuple(texts),
        after="]" + ("," + rest if rest else "") + "}}",
        changed=frozenset(changed),
    )
