"""Per-job bounds: events, attempt summaries, failures per attempt and node lists are capped, and
what is cut is said."""

from __future__ import annotations

import pytest

from client.model import JobState
from coordinator import _cluster_core, _cluster_outcome
from coordinator._cluster import EventsCut

from ._cluster_driver import Driver, of_type

_ROOM_OF = {
    "MAX_EVENTS_PER_JOB": _cluster_core,
    "EVENTS_HEAD": _cluster_core,
    "MAX_ATTEMPTS_KEPT": _cluster_outcome,
    "MAX_FAILURES_PER_ATTEMPT": _cluster_outcome,
}
"""The room of the cluster that reads each bound."""


def _crash_loop(monkeypatch: pytest.MonkeyPatch, restarts: int, **bounds: int) -> Driver:
    for name, value in bounds.items():
        monkeypatch.setattr(_ROOM_OF[name], name, value)
    d = Driver()
    d.connect("n0", slots=1)
    d.submit(
        "j",
        nproc_per_node=1,
        min_nodes=1,
        max_nodes=1,
        max_restarts=restarts,
        last_call_timeout=0.0,
    )
    d.settle()
    for _ in range(restarts + 1):
        assert d.state("j") == JobState.RUNNING
        d.exit("n0", 0, 1)
        d.settle()
    assert d.state("j") == JobState.FAILED
    return d


def test_events_keep_the_head_and_the_latest_with_a_note_of_the_cut(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    d = _crash_loop(monkeypatch, 30, MAX_EVENTS_PER_JOB=40, EVENTS_HEAD=5)
    events = d.cluster.job_events("j")
    assert len(events) <= 40
    assert [e.kind for e in events[:2]] == ["submitted", "round_formed"]
    note = events[5]
    assert note.kind == "events_cut" and "events not kept" in note.reason
    seqs = [e.seq for e in events]
    assert seqs == sorted(set(seqs))
    assert events[-1].kind == "finished"
    # The note counts exactly what is missing between the head and the tail.
    total = d.cluster.event_seq
    assert int(note.node) == total - (len(events) - 1)
    assert f"{int(note.node):,} events" in note.reason
    cuts = of_type(d.history, EventsCut)
    assert cuts and all(c.after_seq < c.before_seq for c in cuts)
    # Each cut makes room for a tenth of the log (3 events here), not for one event.
    assert all(c.before_seq - c.after_seq >= 3 for c in cuts)
    assert len(cuts) <= (total - 40) // 3 + 1


def test_attempt_summaries_keep_the_first_and_the_latest(monkeypatch: pytest.MonkeyPatch) -> None:
    d = _crash_loop(monkeypatch, 12, MAX_ATTEMPTS_KEPT=5)
    result = d.cluster.job_result("j")
    assert result is not None
    attempts = [a.attempt for a in result.attempts]
    assert len(attempts) == 5
    assert attempts[0] == 0 and attempts[-3:] == [10, 11, 12]
    assert result.attempts[1].end_reason == "attempts 1-9 not kept (a job keeps at most 5)"


def test_an_attempt_keeps_its_root_cause_first_and_counts_the_other_failures(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(_cluster_outcome, "MAX_FAILURES_PER_ATTEMPT", 2)
    d = Driver()
    d.connect("n0", slots=4)
    d.submit("j", nproc_per_node=4, min_nodes=1, max_nodes=1, max_restarts=1, last_call_timeout=0.0)
    d.settle()
    for lr in (2, 0, 3, 1):
        d.exit("n0", lr, 1, timestamp=d.now + lr)
    d.settle()
    status = d.cluster.job_status("j")
    assert status.attempt == 1
    d.finish("n0")
    result = d.cluster.job_result("j")
    assert result is not None
    first = result.attempts[0]
    assert len(first.failures) == 2 and first.failures[0].root_cause
    assert "2 more failures not kept" in first.end_reason


def test_a_round_of_many_nodes_names_a_few_and_counts_the_rest() -> None:
    d = Driver()
    for i in range(20):
        d.connect(f"n{i:02d}")
    d.submit("j", nproc_per_node=1, min_nodes=20, max_nodes=20, last_call_timeout=0.0)
    d.settle()
    (formed,) = [e for e in d.cluster.job_events("j") if e.kind == "round_formed"]
    assert "... and 12 more nodes" in formed.reason
    assert formed.reason.count("=group") == 8


def test_a_round_wider_than_the_event_log_still_says_that_all_its_workers_started(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # 12 nodes give 12 `workers_started` events, more than a job keeps: the cut takes some of
    # them, but the one event for the whole round comes last and stays.
    monkeypatch.setattr(_cluster_core, "MAX_EVENTS_PER_JOB", 10)
    monkeypatch.setattr(_cluster_core, "EVENTS_HEAD", 2)
    d = Driver()
    names = [f"n{i:02d}" for i in range(12)]
    for name in names:
        d.connect(name, slots=1)
    d.submit("j", nproc_per_node=1, min_nodes=12, max_nodes=12, last_call_timeout=0.0)
    d.settle()
    assert d.state("j") == JobState.RUNNING
    events = d.cluster.job_events("j")
    kinds = [e.kind for e in events]
    assert "events_cut" in kinds
    assert kinds.count("workers_started") < len(names)
    assert kinds.count("round_started") == 1 and kinds[-1] == "round_started"
    last = events[-1]
    assert last.round == 1 and last.node in names
    assert "every worker started (12 workers on 12 nodes" in last.reason
    # A heartbeat, or a repeated WorkersStarted, announces nothing again.
    d.heartbeat_all()
    d.settle()
    assert d.event_kinds("j").count("round_started") == 1
