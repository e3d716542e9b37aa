"""Every input to `Cluster` returns a `Ready`: its effects in order, split into what the store
must hold first (`persist`) and what goes to the nodes' sessions after (`send`), each part in
the order the state machine made it.
"""

from __future__ import annotations

from client.model import JobSpec
from coordinator._cluster import (
    CloseSession,
    Cluster,
    Effect,
    EventRecorded,
    EventsCut,
    Forgotten,
    JobChanged,
    NodeChanged,
    Ready,
    ReleaseRound,
    RequestPort,
    StopRound,
)


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

    ready = Ready(effects)

    assert ready == effects  # still the effects, in the order they were made
    assert ready.persist == (changed, close, node, cut, forgotten)
    assert ready.send == (port, stop, close, release)
    # A closed session is both: its node's record is written, and its stream is dropped.
    assert close in ready.persist and close in ready.send


def test_an_empty_batch_has_nothing_to_write_or_send() -> None:
    assert Ready().persist == () and Ready().send == ()


def test_the_cluster_answers_each_input_with_a_ready() -> None:
    c = Cluster()
    spec = JobSpec(entrypoint=["python", "train.py"], nproc_per_node=1, min_nodes=1, max_nodes=1)
    joined = c.node_connected("n1", "10.0.0.1", 1, "inc-1", 0.0, [])
    submitted = c.submit("j1", spec, 1.0)
    ticked = c.tick(2.0)
    for out in (joined, submitted, ticked):
        assert isinstance(out, Ready)
    # The submit is written (the job, its "submitted" event) before its round's first message.
    assert {type(e) for e in submitted.persist} >= {JobChanged, EventRecorded}
    assert [type(e) for e in submitted.send] == [RequestPort]
    assert submitted.send[0].node == "n1"
