"""`Ready.of` splits a batch of effects into what the store must hold first and what goes to the
nodes' sessions after, each part in the order the state machine made it.
"""

from __future__ import annotations

from coordinator._cluster import (
    CloseSession,
    Effect,
    EventsCut,
    Forgotten,
    JobChanged,
    NodeChanged,
    ReleaseRound,
    RequestPort,
    StopRound,
)
from coordinator._journal import Ready


def test_a_batch_splits_into_changes_then_actions_each_in_its_order() -> None:
    port = RequestPort("n1", "j1", 0)
    changed = JobChanged("j1")
    stop = StopRound("n2", "j2", 3, 5.0, "cancelled")
    close = CloseSession("n3", "inc-3", "lease expired")
    node = NodeChanged("n4")
    cut = EventsCut("j1", 10, 20)
    release = ReleaseRound("n1", "j1", 0)
    forgotten = Forgotten(job_id="j0", node="n0")
    effects: list[Effect] = [port, changed, stop, close, node, cut, release, forgotten]

    ready = Ready.of(effects)

    assert ready.persist == (changed, close, node, cut, forgotten)
    assert ready.send == (port, stop, close, release)
    # A closed session is both: its node's record is written, and its stream is dropped.
    assert close in ready.persist and close in ready.send


def test_an_empty_batch_has_nothing_to_write_or_send() -> None:
    assert Ready.of([]) == Ready((), ())
