"""The node session's codec: every message survives encode then decode, and bad ones are named.

One property per message (hypothesis draws the values); the decoder's bounds are checked with
the messages an agent-token holder could send that no agent does.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from client import node_codec
from client.assignment import RoundAssignment, WorkerRanks
from client.model import FailureCategory, GpuDevice, GpuHealth, JobSpec, ProcessFailure, WorkerState
from client.node_codec import (
    MAX_GPUS,
    MAX_HEALTH_PROBLEM,
    MAX_REASON_TEXT,
    MessageError,
    decode_coordinator,
    decode_node,
    encode_coordinator,
    encode_node,
)
from client.node_protocol import (
    Assign,
    CancelLogs,
    ClockProbe,
    ClockReply,
    CoordinatorMsg,
    DrainAccepted,
    DrainRequest,
    GroupHealth,
    GroupStopped,
    GroupUnknown,
    Heartbeat,
    Hello,
    LogChunk,
    LogCredit,
    NodeMsg,
    PortReserved,
    ProgressReport,
    RankProgress,
    Release,
    ReservePort,
    RunningGroup,
    StackReply,
    StackRequest,
    StartLogs,
    Stop,
    Welcome,
    WorkerExit,
    WorkerExited,
    WorkerFailing,
    WorkerHealthSample,
    WorkersStarted,
    WorkerStack,
)
from client.stacks import STACK_STATUSES
from protos.gelastic.v1 import gelastic_pb2 as pb

I32 = st.integers(min_value=-(2**31), max_value=2**31 - 1)
N32 = st.integers(min_value=0, max_value=2**31 - 1)
I64 = st.integers(min_value=-(2**63), max_value=2**63 - 1)
N64 = st.integers(min_value=0, max_value=2**63 - 1)
TEXT = st.text(max_size=40)
FLOAT = st.floats(allow_nan=False, allow_infinity=False)
# Whole milliseconds: the wire carries durations in ms.
MS = st.integers(min_value=0, max_value=10**9).map(lambda ms: ms / 1000)
# A drain's deadline: None, or whole milliseconds up to a week.
DEADLINES = st.none() | st.integers(min_value=1, max_value=7 * 86400 * 1000).map(
    lambda ms: ms / 1000
)
PIDS = st.lists(st.tuples(I32, I32), max_size=4).map(tuple)

FAILURES = st.builds(
    ProcessFailure,
    global_rank=I32,
    local_rank=I32,
    pid=I32,
    exitcode=I32,
    message=TEXT,
    timestamp=FLOAT,
    node=TEXT,
    signal=TEXT,
    error_file=st.text(min_size=1, max_size=40),
    traceback=TEXT,
    attempt=N32,
    round=N32,
    root_cause=st.booleans(),
    category=st.sampled_from(FailureCategory),
    stderr_tail=TEXT,
    role=TEXT,
    role_rank=I32,
    clock_offset=FLOAT,
    time_uncertainty=FLOAT,
)
EXITS = st.builds(
    WorkerExit,
    local_rank=I32,
    global_rank=I32,
    pid=I32,
    exitcode=I32,
    stopped_by_agent=st.booleans(),
    failure=st.none() | FAILURES,
    return_value=st.none() | st.binary(max_size=64),
    timestamp=FLOAT,
)
GPU_HEALTH = st.builds(
    GpuHealth,
    index=I32,
    utilization_percent=st.floats(min_value=0, max_value=100),
    memory_used=N64,
    temperature_c=I32,
    uncorrectable_ecc=N64,
    lost=st.booleans(),
)
SAMPLES = st.builds(
    WorkerHealthSample,
    local_rank=I32,
    pid=I32,
    cpu_percent=FLOAT,
    rss_bytes=I64,
    proc_state=TEXT,
    global_rank=I32,
)
GROUPS = st.builds(
    GroupHealth,
    job_id=TEXT,
    round=I32,
    workers=st.lists(SAMPLES, max_size=3).map(tuple),
    state=st.none() | st.sampled_from(WorkerState),
    reason=TEXT,
)


@st.composite
def _ranked_pids(draw: st.DrawFn) -> tuple[tuple[tuple[int, int], ...], tuple[int, ...]]:
    pids = draw(PIDS)
    return pids, tuple(draw(I32) for _ in pids)


@st.composite
def _running(draw: st.DrawFn) -> RunningGroup:
    pids, ranks = draw(_ranked_pids())
    return RunningGroup(
        job_id=draw(TEXT),
        round=draw(I32),
        attempt=draw(I32),
        pids=pids,
        exits=tuple(draw(st.lists(EXITS, max_size=2))),
        stopped=draw(st.booleans()),
        global_ranks=ranks,
    )


@st.composite
def _gpus(draw: st.DrawFn) -> tuple[GpuDevice, ...]:
    indices = draw(st.lists(st.integers(0, 1023), unique=True, max_size=4))
    uuid = st.text(
        st.characters(min_codepoint=33, max_codepoint=126, exclude_characters=","),
        min_size=1,
        max_size=96,
    )
    name = st.text(st.characters(min_codepoint=32, max_codepoint=126), max_size=96)
    return tuple(GpuDevice(i, draw(uuid), draw(name), draw(N64)) for i in indices)


@st.composite
def _started(draw: st.DrawFn) -> WorkersStarted:
    pids, ranks = draw(_ranked_pids())
    return WorkersStarted(draw(TEXT), draw(I32), pids, ranks)


NODE_MESSAGES: dict[type, st.SearchStrategy[NodeMsg]] = {
    Hello: st.builds(
        Hello,
        name=TEXT,
        addr=TEXT,
        slots=I32,
        incarnation=TEXT,
        version=TEXT,
        running=st.lists(_running(), max_size=2).map(tuple),
        gpus=_gpus(),
    ),
    Heartbeat: st.builds(
        Heartbeat,
        seq=I64,
        groups=st.lists(GROUPS, max_size=3).map(tuple),
        gpus=st.lists(GPU_HEALTH, max_size=3).map(tuple),
    ),
    PortReserved: st.builds(PortReserved, job_id=TEXT, round=I32, port=I32, error=TEXT),
    WorkersStarted: _started(),
    WorkerExited: st.builds(WorkerExited, job_id=TEXT, round=I32, exit=EXITS),
    WorkerFailing: st.builds(WorkerFailing, job_id=TEXT, round=I32, failure=FAILURES),
    GroupStopped: st.builds(
        GroupStopped, job_id=TEXT, round=I32, unkillable_pids=st.lists(I32, max_size=4).map(tuple)
    ),
    GroupUnknown: st.builds(GroupUnknown, job_id=TEXT, round=I32, reason=TEXT),
    LogChunk: st.builds(
        LogChunk, request_id=I64, data=st.binary(max_size=64), eof=st.booleans(), error=TEXT
    ),
    ClockReply: st.builds(ClockReply, probe_sent_at=FLOAT, received_at=FLOAT, sent_at=FLOAT),
    DrainRequest: st.builds(DrainRequest, deadline=DEADLINES, reason=TEXT),
    StackReply: st.builds(
        StackReply,
        request_id=I64,
        stacks=st.lists(
            st.builds(
                WorkerStack,
                local_rank=I32,
                pid=I32,
                status=st.sampled_from(STACK_STATUSES),
                text=TEXT,
                note=TEXT,
            ),
            max_size=3,
        ).map(tuple),
        error=TEXT,
    ),
    ProgressReport: st.builds(
        ProgressReport,
        job_id=TEXT,
        round=I32,
        ranks=st.lists(
            st.builds(
                RankProgress,
                local_rank=I32,
                global_rank=I32,
                step=st.integers(min_value=0, max_value=2**62),
                steps_per_s=st.floats(min_value=0, max_value=1e9),
                metrics=st.dictionaries(
                    st.from_regex(r"[A-Za-z_][A-Za-z0-9_.]{0,20}", fullmatch=True),
                    FLOAT,
                    max_size=16,
                ).map(lambda d: tuple(sorted(d.items()))),
            ),
            max_size=3,
        ).map(tuple),
    ),
}

SPECS = st.sampled_from(
    [
        JobSpec(entrypoint=("python", "train.py"), args=("--lr", "1")),
        JobSpec(
            entrypoint="train.py",
            nproc_per_node=4,
            min_nodes=1,
            max_nodes=3,
            max_restarts=2,
            name="ddp",
            env={"A": "1"},
            stop_grace=2.5,
        ),
    ]
)
RANKS = st.builds(
    WorkerRanks,
    local_rank=I32,
    global_rank=I32,
    role_rank=I32,
    world_size=I32,
    role_world_size=I32,
    role=TEXT,
)
ASSIGNMENTS = st.builds(
    RoundAssignment,
    job_id=TEXT,
    round=I32,
    attempt=I32,
    spec=SPECS,
    group_rank=I32,
    group_world_size=I32,
    master_addr=TEXT,
    master_port=I32,
    workers=st.lists(RANKS, max_size=3).map(tuple),
    run_id=TEXT,
    gpus=st.lists(I32, max_size=3).map(tuple),
    gpu_uuids=st.lists(TEXT, max_size=3).map(tuple),
)
COORDINATOR_MESSAGES: dict[type, st.SearchStrategy[CoordinatorMsg]] = {
    Welcome: st.builds(Welcome, heartbeat_interval=MS, lease=MS, coordinator_id=TEXT),
    ReservePort: st.builds(ReservePort, job_id=TEXT, round=I32),
    Assign: st.builds(Assign, assignment=ASSIGNMENTS),
    Stop: st.builds(
        Stop,
        job_id=TEXT,
        round=I32,
        grace=MS,
        reason=TEXT,
        replaced=st.booleans(),
        notice=st.booleans(),
        term_after=DEADLINES.map(lambda d: d or 0.0),
        drain_node=TEXT,
    ),
    Release: st.builds(Release, job_id=TEXT, round=I32),
    StartLogs: st.builds(
        StartLogs,
        request_id=I64,
        job_id=TEXT,
        attempt=I32,
        rank=I32,
        stream=TEXT,
        follow=st.booleans(),
        credit_chunks=I64,
    ),
    CancelLogs: st.builds(CancelLogs, request_id=I64),
    LogCredit: st.builds(LogCredit, request_id=I64, chunks=I64),
    ClockProbe: st.builds(ClockProbe, sent_at=FLOAT),
    DrainAccepted: st.builds(DrainAccepted, deadline=DEADLINES),
    StackRequest: st.builds(
        StackRequest,
        request_id=I64,
        job_id=TEXT,
        round=I32,
        local_ranks=st.lists(I32, max_size=4).map(tuple),
        native=st.booleans(),
        timeout=st.integers(min_value=1, max_value=60_000).map(lambda ms: ms / 1000),
    ),
}


def test_every_message_of_the_protocol_has_a_property() -> None:
    node_kinds = {f.name for f in pb.NodeMessage.DESCRIPTOR.oneofs_by_name["kind"].fields}
    coordinator_kinds = {
        f.name for f in pb.CoordinatorMessage.DESCRIPTOR.oneofs_by_name["kind"].fields
    }
    assert len(NODE_MESSAGES) == len(node_kinds)
    assert len(COORDINATOR_MESSAGES) == len(coordinator_kinds)


@pytest.mark.parametrize("kind", list(NODE_MESSAGES), ids=lambda k: k.__name__)
@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_a_node_message_survives_encode_then_decode(kind: type, data: st.DataObject) -> None:
    msg = data.draw(NODE_MESSAGES[kind])
    wire = pb.NodeMessage.FromString(encode_node(msg).SerializeToString())
    assert decode_node(wire) == msg


@pytest.mark.parametrize("kind", list(COORDINATOR_MESSAGES), ids=lambda k: k.__name__)
@settings(max_examples=60, deadline=None)
@given(data=st.data(), epoch=N64)
def test_a_coordinator_message_survives_encode_then_decode(
    kind: type, data: st.DataObject, epoch: int
) -> None:
    msg = data.draw(COORDINATOR_MESSAGES[kind])
    wire = pb.CoordinatorMessage.FromString(encode_coordinator(msg, epoch).SerializeToString())
    assert wire.epoch == epoch
    assert decode_coordinator(wire) == msg


def test_an_empty_message_is_refused_by_name() -> None:
    with pytest.raises(MessageError, match="empty node message"):
        decode_node(pb.NodeMessage())
    with pytest.raises(MessageError, match="empty coordinator message"):
        decode_coordinator(pb.CoordinatorMessage())


@pytest.mark.parametrize(
    ("gpus", "says"),
    [
        ([pb.GpuDevice(index=i, uuid=f"GPU-{i}") for i in range(MAX_GPUS + 1)], "at most 64 GPUs"),
        ([pb.GpuDevice(index=0, uuid="a"), pb.GpuDevice(index=0, uuid="b")], "given twice"),
        ([pb.GpuDevice(index=0, uuid="GPU-0,GPU-1")], "no comma"),
        ([pb.GpuDevice(index=0, uuid="")], "uuid must be"),
        ([pb.GpuDevice(index=0, uuid="u", name="x" * 97)], "name must be"),
        ([pb.GpuDevice(index=0, uuid="u", memory_total=-1)], "memory_total"),
    ],
)
def test_a_hello_offering_impossible_gpus_is_refused_naming_the_field(
    gpus: list[pb.GpuDevice], says: str
) -> None:
    hello = pb.NodeMessage(hello=pb.Hello(name="n", slots=1, incarnation="i", gpus=gpus))
    with pytest.raises(MessageError, match=f"hello.gpus: .*{says}"):
        decode_node(hello)


def test_the_decoder_bounds_what_the_coordinator_keeps() -> None:
    beat = pb.Heartbeat(
        gpus=[
            pb.GpuHealth(index=i, utilization_percent=250.0, memory_used=-5, uncorrectable_ecc=-1)
            for i in range(MAX_GPUS + 10)
        ]
    )
    decoded = decode_node(pb.NodeMessage(heartbeat=beat))
    assert isinstance(decoded, Heartbeat)
    assert len(decoded.gpus) == MAX_GPUS
    assert {(g.utilization_percent, g.memory_used, g.uncorrectable_ecc) for g in decoded.gpus} == {
        (100.0, 0, 0)
    }
    unknown = pb.GroupUnknown(job_id="j", round=1, reason="x" * (MAX_REASON_TEXT + 100))
    decoded = decode_node(pb.NodeMessage(group_unknown=unknown))
    assert isinstance(decoded, GroupUnknown)
    assert len(decoded.reason) == MAX_REASON_TEXT


def test_an_assignment_whose_spec_cannot_be_read_says_why_and_keeps_its_ranks(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # No spec of today's wire fails to decode; a field added later might, and must then refuse
    # the round (the agent says why), never end the session.
    def unreadable(_msg: pb.JobSpec) -> JobSpec:
        raise ValueError("roles[0].kind: unknown")

    monkeypatch.setattr(node_codec, "spec_from_pb", unreadable)
    bad = pb.Assign(job_id="j", round=2, workers=[pb.WorkerRanks(local_rank=0, global_rank=3)])
    decoded = decode_coordinator(pb.CoordinatorMessage(assign=bad))
    assert isinstance(decoded, Assign)
    assert decoded.spec_error == "roles[0].kind: unknown"
    assert decoded.assignment.spec == JobSpec()
    assert [(w.local_rank, w.global_rank) for w in decoded.assignment.workers] == [(0, 3)]


def test_a_heartbeats_health_problem_is_one_bounded_line() -> None:
    beat = pb.Heartbeat(health_problem="disk\n\x1b[2Jfull " + "x" * (MAX_HEALTH_PROBLEM + 50))
    decoded = decode_node(pb.NodeMessage(heartbeat=beat))
    assert isinstance(decoded, Heartbeat)
    assert decoded.health_problem.startswith("disk \x1b[2Jfull xx")
    assert len(decoded.health_problem) <= MAX_HEALTH_PROBLEM
    assert encode_node(Heartbeat(health_problem="ok")).heartbeat.health_problem == "ok"
