"""Stack captures without processes: grouping, bounds, the wire, and what the cluster keeps."""

from __future__ import annotations

import pytest

from client.model import JobState
from client.node_codec import (
    MAX_STACK_WORKERS,
    MessageError,
    decode_coordinator,
    decode_node,
    encode_coordinator,
    encode_node,
)
from client.node_protocol import StackReply, StackRequest, WorkerStack
from client.stacks import (
    MAX_CAPTURE_BYTES,
    MAX_CAPTURES_KEPT,
    MAX_STACK_BYTES,
    RankStack,
    StackCapture,
    bounded_stack,
    format_capture,
    group_stacks,
    normalize_stack,
)
from client.stacks_wire import capture_from_pb, capture_to_pb
from coordinator._cluster_records import _Job
from coordinator._cluster_stacks import JobNotRunning
from coordinator._codec import decode, encode
from coordinator._stacks import _rank_stacks
from protos.gelastic.v1 import gelastic_pb2 as pb
from tests.unit._cluster_driver import Driver


def py_spy(pid: int, tid: int, state: str, frames: str) -> str:
    return (
        f"Process {pid}: python train.py\nPython v3.11.2 (/usr/bin/python3.11)\n\n"
        f'Thread {tid} ({state}): "MainThread"\n{frames}\n'
    )


WAIT = "    wait_here (train.py:10)\n    <module> (train.py:20)"
ODD = "    elsewhere (train.py:14)\n    <module> (train.py:20)"


def test_identical_stacks_of_other_processes_collapse_and_the_odd_one_comes_first() -> None:
    stacks = [
        RankStack(0, "node-0", "ok", py_spy(100, 100, "idle", WAIT)),
        RankStack(1, "node-0", "ok", py_spy(101, 101, "active", WAIT)),
        RankStack(2, "node-1", "ok", py_spy(200, 200, "idle", ODD)),
        RankStack(3, "node-1", "ok", py_spy(201, 201, "active+gil", WAIT)),
    ]
    groups = group_stacks(stacks)
    assert [(g.ranks, g.nodes) for g in groups] == [
        ((2,), ("node-1",)),
        ((0, 1, 3), ("node-0", "node-1")),
    ]
    assert groups[1].text == 'Thread "MainThread"\n' + WAIT
    c = StackCapture("st-1", "j", "requested", 0.0, groups=groups)
    lines = format_capture(c).splitlines()
    assert lines.index("rank 2 (node-1):") < lines.index("ranks 0,1,3 (node-0, node-1):")


def test_faulthandler_thread_ids_do_not_split_a_group() -> None:
    text = 'Current thread 0x00007f{0} (most recent call first):\n  File "t.py", line 3 in f'
    groups = group_stacks(
        [RankStack(r, "n", "ptrace_refused", text.format(r), "ptrace refused") for r in range(3)]
    )
    assert [g.ranks for g in groups] == [(0, 1, 2)]
    assert groups[0].text.startswith("Current thread (most recent call first):")


def test_a_status_or_note_of_its_own_makes_a_group_of_its_own() -> None:
    groups = group_stacks(
        [
            RankStack(0, "a", "ok", "x"),
            RankStack(1, "a", "ok", "x"),
            RankStack(2, "b", "no_answer", note="node b did not answer in time"),
        ]
    )
    assert [(g.status, g.ranks) for g in groups] == [("no_answer", (2,)), ("ok", (0, 1))]
    assert normalize_stack("\n\nx\n") == "x"


def test_one_stack_and_one_capture_are_bounded() -> None:
    huge = "f (x.py:1)\n" * 100_000
    cut = bounded_stack(huge)
    assert len(cut.encode()) <= MAX_STACK_BYTES + 64
    assert cut.endswith(f"(cut at {MAX_STACK_BYTES} bytes)")
    assert bounded_stack(cut) == cut  # cut once, never twice
    # Every rank in a stack of its own, each at the per-rank cap: the capture keeps its cap.
    stacks = [RankStack(r, "n", "ok", f"rank{r}\n" + huge) for r in range(64)]
    groups = group_stacks(stacks)
    assert len(groups) == 64
    assert sum(len(g.text.encode()) for g in groups) <= MAX_CAPTURE_BYTES
    dropped = [g for g in groups if not g.text]
    assert dropped and all("at most" in g.note for g in dropped)


def test_stack_messages_cross_the_node_codec_and_are_bounded_there() -> None:
    req = StackRequest(7, "job-1", 3, (0, 1), True, 2.5)
    assert decode_coordinator(encode_coordinator(req)) == req
    reply = StackReply(
        7, (WorkerStack(0, 11, "ok", "t", ""), WorkerStack(1, 12, "bogus", "x" * 10**6))
    )
    back = decode_node(encode_node(reply))
    assert isinstance(back, StackReply)
    assert back.stacks[0] == reply.stacks[0]
    assert back.stacks[1].status == "error"
    assert len(back.stacks[1].text.encode()) <= MAX_STACK_BYTES + 64
    too_many = pb.NodeMessage(
        stack_reply=pb.StackReply(
            request_id=1, stacks=[pb.WorkerStack() for _ in range(MAX_STACK_WORKERS + 1)]
        )
    )
    with pytest.raises(MessageError, match=r"stack_reply\.stacks"):
        decode_node(too_many)
    long_wait = pb.CoordinatorMessage(stack_request=pb.StackRequest(timeout_ms=10**9))
    got = decode_coordinator(long_wait)
    assert isinstance(got, StackRequest) and got.timeout == 60.0


def test_a_capture_crosses_the_client_wire() -> None:
    groups = group_stacks([RankStack(0, "a", "ok", "x"), RankStack(1, "b", "ok", "y")])
    c = StackCapture("st-ab", "j", "stall", 12.5, True, 1, 2, groups)
    assert capture_from_pb(capture_to_pb(c)) == c


def test_ranks_of_a_node_that_did_not_answer_are_listed_as_such() -> None:
    assert _rank_stacks("a", {0: 4, 1: 5}, None, "is not connected") == [
        RankStack(4, "a", "no_answer", note="node a is not connected"),
        RankStack(5, "a", "no_answer", note="node a is not connected"),
    ]
    # A stack for a worker that was not asked for is dropped; one missing is said.
    reply = StackReply(1, (WorkerStack(0, 9, "ok", "t"), WorkerStack(7, 9, "ok", "forged")))
    got = _rank_stacks("a", {0: 4, 1: 5}, reply, "did not answer in time")
    assert got[0] == RankStack(4, "a", "ok", "t")
    assert got[1].status == "error" and "no stack for local rank 1" in got[1].note
    assert len(got) == 2


def running_job() -> Driver:
    d = Driver()
    for i in range(2):
        d.connect(f"n{i}", slots=2)
    d.submit("j", nproc_per_node=2, min_nodes=2, max_nodes=2, last_call_timeout=0.0)
    d.settle()
    assert d.state("j") == JobState.RUNNING
    return d


def test_the_cluster_names_the_running_workers_and_keeps_the_latest_captures() -> None:
    d = running_job()
    t = d.cluster.stack_targets("j")
    assert t.nodes == {"n0": ((0, 0), (1, 1)), "n1": ((0, 2), (1, 3))}
    assert d.cluster.stack_targets("j", rank=3).nodes == {"n1": ((1, 3),)}
    with pytest.raises(JobNotRunning):
        d.cluster.stack_targets("j", rank=9)
    ids = [f"st-{i:x}" for i in range(MAX_CAPTURES_KEPT + 2)]
    for cid in ids:
        c = StackCapture(
            cid, "j", "a stall", d.now, groups=group_stacks([RankStack(0, "n0", "ok", "x")])
        )
        effects = d.cluster.record_stacks(c, d.now)
        assert effects.persist  # written with the job
    kept = d.cluster.job_stacks("j")
    assert [k.capture_id for k in kept] == ids[-MAX_CAPTURES_KEPT:]
    events = [e for e in d.cluster.job_events("j") if e.kind == "stacks"]
    assert (
        len(events) == len(ids) and ids[-1] in events[-1].reason and "a stall" in events[-1].reason
    )
    # As the store writes and reads the job: the captures come back whole.
    doc = d.cluster.dump_job("j")
    assert decode(_Job, encode(decode(_Job, doc))).stacks == kept
    d.cancel("j")
    d.settle()
    with pytest.raises(JobNotRunning):
        d.cluster.stack_targets("j")
    assert d.cluster.job_stacks("j") == kept
