"""A job's stored record (`Cluster.job_record`): the same document as `dump_job` after every
kind of change, while a write re-encodes, and names, only the round's members that changed."""

from __future__ import annotations

import dataclasses
import json
import typing
from enum import Enum

import pytest
from hypothesis import given
from hypothesis import strategies as st

from client.model import WorkerState
from client.node_protocol import GroupHealth, Heartbeat, WorkerHealthSample
from coordinator import _job_text
from coordinator._cluster_records import _Member, _Worker, _WorkerPhase
from coordinator._codec import encode
from coordinator._ranks import GroupRanks
from tests.unit._cluster_driver import Driver


def _same(d: Driver, job_id: str = "j") -> None:
    text = d.cluster.job_record(job_id).text()
    assert json.loads(text) == json.loads(json.dumps(d.cluster.dump_job(job_id)))


def _members_seen(monkeypatch: pytest.MonkeyPatch, step: str) -> list[str]:
    """The nodes whose member `job_text` passes to its function `step` from now on
    (`_member_text`: encodes it; `_fingerprint`: looks at it)."""
    seen: list[str] = []
    real = getattr(_job_text, step)

    def counting(m: _Member) -> object:
        seen.append(m.node)
        return real(m)

    monkeypatch.setattr(_job_text, step, counting)
    return seen


def _job(nodes: int = 4, min_nodes: int | None = None) -> Driver:
    d = Driver()
    for i in range(nodes):
        d.connect(f"n{i}", slots=2)
    d.submit(
        "j",
        min_nodes=min_nodes or nodes,
        max_nodes=nodes,
        nproc_per_node=2,
        last_call_timeout=0,
        max_restarts=1,
    )
    d.settle()
    return d


def test_job_text_is_the_dumped_job_through_a_round_and_its_end() -> None:
    d = _job(min_nodes=3)
    _same(d)
    # Only a worker's sample moves: the member's own fields stay as they were.
    n2 = d.nodes["n2"]
    pid = n2.running[("j", 1)][1]
    sample = WorkerHealthSample(1, pid, 55.0, 123, "running")
    d.cluster.step("n2", n2.incarnation, Heartbeat(groups=(GroupHealth("j", 1, (sample,)),)), d.now)
    assert (
        json.loads(d.cluster.job_record("j").text())["current"]["members"][2]["workers"]["__map__"][
            1
        ][1]["cpu_percent"]
        == 55.0
    )
    _same(d)
    d.exit("n1", 0)  # one worker of one member: its worker map and seen exits change in place
    _same(d)
    d.disconnect("n3")  # the round re-forms: another list of members
    d.settle()
    _same(d)
    for name in ("n0", "n1", "n2"):
        d.finish(name)
    d.settle()
    assert d.cluster.job_state("j").is_terminal()
    _same(d)


def test_a_write_after_one_report_encodes_only_the_member_it_changed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    d = _job(nodes=6)
    assert d.cluster.job_record("j").changed == set(range(6))
    encoded = _members_seen(monkeypatch, "_member_text")
    assert d.cluster.job_record("j").changed == set()
    assert encoded == []
    d.exit("n4", 0)
    assert d.cluster.job_record("j").changed == {4}
    assert encoded == ["n4"]
    _same(d)


def test_a_finished_job_keeps_no_copy_of_its_members_text(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    d = _job(nodes=2)
    d.finish("n0")
    d.finish("n1")
    d.settle()
    encoded = _members_seen(monkeypatch, "_member_text")
    d.cluster.job_record("j")
    assert d.cluster.job_record("j").changed == {0, 1}
    assert encoded == ["n0", "n1", "n0", "n1"]


_RANK_FIELDS = tuple(f.name for f in dataclasses.fields(GroupRanks))
_IMMUTABLE = {str, int, float, bool, WorkerState, GroupRanks, tuple[int, ...], int | None}


@pytest.mark.parametrize("cls", [_Member, _Worker])
def test_the_fingerprint_copies_every_field_that_can_change_in_place(cls: type) -> None:
    # A field of a mutable type changed in place would look unchanged to the fingerprint, and
    # the store would keep its old value: such a field belongs in `_CONTAINERS`.
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if cls is _Member and f.name in _job_text._CONTAINERS:
            continue
        hint = hints[f.name]
        assert hint in _IMMUTABLE or (isinstance(hint, type) and issubclass(hint, Enum)), (
            f"{cls.__name__}.{f.name}: {hint} may change in place; add it to _CONTAINERS"
        )


_names = st.text(max_size=12)  # any characters: quotes, controls, non-ASCII
_workers = st.builds(
    _Worker,
    local_rank=st.integers(0, 64),
    global_rank=st.integers(0, 10**6),
    phase=st.sampled_from(_WorkerPhase),
    pid=st.integers(0, 2**22),
    exitcode=st.none() | st.integers(-64, 255),
    cpu_percent=st.floats(allow_nan=False, allow_infinity=False),
    rss_bytes=st.integers(0, 2**50),
    proc_state=_names,
    early=st.booleans(),
)
_members = st.builds(
    _Member,
    node=_names,
    addr=_names,
    group_rank=st.integers(0, 10**5),
    ranks=st.builds(
        GroupRanks,
        *(st.integers(0, 10**6) if n != "role" else _names for n in _RANK_FIELDS),
    ),
    workers=st.dictionaries(st.integers(0, 64), _workers, max_size=3),
    done=st.booleans(),
    stopped=st.booleans(),
    released=st.booleans(),
    lost=st.booleans(),
    seen_exits=st.sets(st.tuples(st.integers(0, 64), st.integers(0, 10**6)), max_size=3),
    group_state=st.sampled_from(WorkerState),
    gpus=st.lists(st.integers(0, 15), max_size=3).map(tuple),
)


@given(_members)
def test_a_member_written_out_is_the_member_encoded(m: _Member) -> None:
    # Every field of every kind, so a field added to _Member or _Worker fails here until the
    # written-out text has it too.
    text = _job_text._member_text(m)
    assert json.loads(text) == json.loads(json.dumps(encode(m), separators=(",", ":")))
    assert text.isascii()


def test_a_write_after_reports_of_single_members_looks_at_those_members_alone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Ten thousand nodes starting their workers each change their own member: the write after
    # such reports must not fingerprint every member of the round.
    d = Driver()
    for i in range(6):
        d.connect(f"n{i}", slots=2)
    d.nodes["n5"].mute = True  # its assignment waits: it reports its workers started later
    d.submit("j", min_nodes=6, max_nodes=6, nproc_per_node=2, last_call_timeout=0)
    d.settle()
    assert d.cluster.job_record("j").changed == set(range(6))
    looked = _members_seen(monkeypatch, "_fingerprint")
    d.unmute("n5")
    d.settle()
    assert d.cluster.job_record("j").changed == {5}
    assert looked == ["n5"]
    _same(d)
    # A heartbeat's figures are not a durable change, but the next write has them.
    looked.clear()
    pid = d.nodes["n2"].running[("j", 1)][1]
    sample = WorkerHealthSample(1, pid, 55.0, 123, "running")
    n2 = d.nodes["n2"]
    d.cluster.step("n2", n2.incarnation, Heartbeat(groups=(GroupHealth("j", 1, (sample,)),)), d.now)
    assert d.cluster.job_record("j").changed == {2}
    assert looked == ["n2"]
    _same(d)
    # A failure stops every member: the write looks at all of them.
    looked.clear()
    d.exit("n1", 1)
    record = d.cluster.job_record("j")
    assert sorted(looked) == [f"n{i}" for i in range(6)]
    assert 1 in record.changed
    _same(d)


def test_an_exit_taken_without_a_change_of_its_own_is_in_the_next_write() -> None:
    # A worker the agent stopped while the job stops changes its member and nothing else: no
    # change is announced, and the write after it must have the exit all the same.
    d = _job(nodes=3)
    for n in d.nodes.values():
        n.auto_stop = False  # the job stays STOPPING while its workers report their exits
    d.exit("n0", 0, exitcode=1)
    d.settle()
    assert d.cluster.job_state("j").value == "STOPPING"
    d.cluster.job_record("j")
    d.exit("n1", 0, exitcode=-15, stopped_by_agent=True)
    d.exit("n2", 1, exitcode=-15, stopped_by_agent=True)
    record = d.cluster.job_record("j")
    assert record.changed == {1, 2}
    _same(d)
