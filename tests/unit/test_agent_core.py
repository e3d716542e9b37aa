"""The node agent's decisions (`nodeagent._agent_core`), driven directly: no network, no sleeps.

What an agent accepts (an assignment, a coordinator's leader epoch) and what it says (its hello,
what follows a welcome, its heartbeats) are plain functions of what it holds; `now` is given.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from client import node_codec
from client.assignment import RoundAssignment, WorkerRanks
from client.model import (
    FailureCategory,
    GpuDevice,
    GpuHealth,
    JobSpec,
    ProcessFailure,
    Role,
    WorkerState,
)
from client.node_codec import decode_coordinator, encode_coordinator
from client.node_protocol import (
    Assign,
    GroupStopped,
    GroupUnknown,
    ReservePort,
    RunningGroup,
    StartLogs,
    Welcome,
    WorkerExit,
    WorkerExited,
    WorkerFailing,
    WorkerHealthSample,
)
from nodeagent._agent_core import (
    STALE_LOG_EVERY_S,
    VERSION,
    EpochGuard,
    HeldRound,
    Refusal,
    StaleEpoch,
    check_assignment,
    group_health,
    heartbeat_of,
    hello,
    message_kind,
    rank_running,
    replay,
    stop_grace,
)
from nodeagent._workers import WorkerHealth

JOB = "job-0123456789"
SPEC = JobSpec(entrypoint=["true"], nproc_per_node=2)
GPUS = (GpuDevice(0, "GPU-a", "A100", 1), GpuDevice(1, "GPU-b", "A100", 1))


def _assignment(
    job_id: str = JOB,
    spec: JobSpec = SPEC,
    *,
    round_: int = 3,
    roles: tuple[str, ...] = ("", ""),
    gpus: tuple[int, ...] = (),
) -> RoundAssignment:
    return RoundAssignment(
        job_id=job_id,
        round=round_,
        attempt=1,
        spec=spec,
        group_rank=0,
        group_world_size=1,
        master_addr="10.0.0.1",
        master_port=29500,
        workers=tuple(
            WorkerRanks(lr, 4 + lr, lr, 6, 2, role=role) for lr, role in enumerate(roles)
        ),
        run_id=job_id,
        gpus=gpus,
        gpu_uuids=("GPU-forged",) * len(gpus),
    )


def _refusal(msg: Assign, gpus: tuple[GpuDevice, ...] = GPUS) -> str:
    checked = check_assignment(msg, gpus)
    assert isinstance(checked, Refusal), checked
    return checked.why


# ---- an assignment -------------------------------------------------------------------------------


def test_an_assignment_that_passes_is_run_with_this_nodes_own_gpu_uuids() -> None:
    a = _assignment(gpus=(1, 0))
    checked = check_assignment(Assign(a), GPUS)
    assert isinstance(checked, RoundAssignment)
    assert checked.gpu_uuids == ("GPU-b", "GPU-a")  # never the message's
    assert checked == replace(a, gpu_uuids=("GPU-b", "GPU-a"))


def test_an_assignment_for_a_job_id_this_agent_does_not_accept_is_refused() -> None:
    why = _refusal(Assign(_assignment(job_id="x\n-0123456789")))
    assert why == "job id 'x\\n-0123456789' is not one this agent accepts"


def test_an_assignment_whose_spec_does_not_validate_is_refused_naming_the_field() -> None:
    why = _refusal(Assign(_assignment(spec=JobSpec(entrypoint=[], nproc_per_node=2))))
    assert why.startswith("its spec does not validate here: ") and "entrypoint" in why


def test_a_spec_the_codec_could_not_read_is_refused_as_one_that_does_not_validate() -> None:
    # The codec keeps the ranks and says why; the agent refuses as it does a spec that fails.
    why = _refusal(Assign(_assignment(spec=JobSpec()), spec_error="nproc_per_node: bad"))
    assert why == "its spec does not validate here: nproc_per_node: bad"


def test_a_spec_the_codec_cannot_read_refuses_the_round_with_the_codecs_reason(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def unreadable(_msg: object) -> JobSpec:
        raise ValueError("roles[0].kind: unknown")

    monkeypatch.setattr(node_codec, "spec_from_pb", unreadable)
    msg = decode_coordinator(encode_coordinator(Assign(_assignment())))
    assert isinstance(msg, Assign)
    assert _refusal(msg) == "its spec does not validate here: roles[0].kind: unknown"


def test_a_spec_through_the_codec_that_does_not_validate_is_refused() -> None:
    wire = encode_coordinator(Assign(_assignment()))
    wire.assign.spec.nproc_per_node = -5
    msg = decode_coordinator(wire)
    assert isinstance(msg, Assign) and not msg.spec_error
    why = _refusal(msg)
    assert why.startswith("its spec does not validate here: ") and "nproc_per_node" in why


@pytest.mark.parametrize(
    ("gpus", "why"),
    [
        ((0, 7), "it names GPUs [0, 7] but this node offers [0, 1]"),
        ((0, 0), "it gives 2 GPUs to 2 workers"),
        ((1,), "it gives 1 GPUs to 2 workers"),
    ],
)
def test_an_assignment_naming_gpus_this_node_does_not_offer_is_refused(
    gpus: tuple[int, ...], why: str
) -> None:
    assert _refusal(Assign(_assignment(gpus=gpus))) == why


def test_gpus_on_a_node_that_offers_none_are_refused() -> None:
    why = _refusal(Assign(_assignment(gpus=(0, 1))), gpus=())
    assert why == "it names GPUs [0, 1] but this node offers []"


PS = Role("ps", ["python", "ps.py"], nproc_per_node=2, min_nodes=1, max_nodes=1)
TRAINER = Role("trainer", ["python", "train.py"], nproc_per_node=2, max_nodes=2)
ROLES = JobSpec(roles=(PS, TRAINER))


@pytest.mark.parametrize(
    ("roles", "named"),
    [(("ps", "trainer"), "['ps', 'trainer']"), (("critic", "critic"), "['critic']")],
)
def test_a_multi_role_assignment_naming_no_single_role_of_the_spec_is_refused(
    roles: tuple[str, ...], named: str
) -> None:
    why = _refusal(Assign(_assignment(spec=ROLES, roles=roles)))
    assert why == f"its workers name no single role of the spec ({named})"


def test_a_multi_role_assignment_runs_its_roles_spec() -> None:
    checked = check_assignment(Assign(_assignment(spec=ROLES, roles=("trainer", "trainer"))), ())
    assert isinstance(checked, RoundAssignment)
    assert checked.spec.roles == () and checked.spec.entrypoint == ("python", "train.py")


def test_a_refusal_is_a_platform_failure_of_each_rank_naming_node_round_and_reason() -> None:
    a = _assignment(job_id="../x")
    refusal = check_assignment(Assign(a), GPUS)
    assert isinstance(refusal, Refusal)
    exits = refusal.exits(a, "n1", now=123.5)
    message = (
        "node n1 refused the assignment of round 3: job id '../x' is not one this agent accepts"
    )
    assert refusal.message("n1", 3) == message
    assert [(e.job_id, e.round, e.exit.local_rank, e.exit.global_rank) for e in exits] == [
        ("../x", 3, 0, 4),
        ("../x", 3, 1, 5),
    ]
    for e in exits:
        assert (e.exit.pid, e.exit.exitcode, e.exit.timestamp) == (0, -1, 123.5)
        assert not e.exit.stopped_by_agent and e.exit.return_value is None
        f = e.exit.failure
        assert f is not None and f.category == FailureCategory.PLATFORM
        assert (f.message, f.node, f.precise_timestamp, f.pid) == (message, "n1", 123.5, 0)
        assert (f.local_rank, f.global_rank) == (e.exit.local_rank, e.exit.global_rank)


# ---- the leader epoch ----------------------------------------------------------------------------


def test_a_newer_or_equal_epoch_is_accepted_and_becomes_the_newest() -> None:
    guard = EpochGuard()
    guard.check(0, "welcome", "c1", now=0.0)
    guard.check(5, "welcome", "c1", now=1.0)
    assert guard.newest == 5
    guard.check(5, "assign", "c1", now=2.0)
    guard.check(9, "assign", "c2", now=3.0)
    assert guard.newest == 9


def test_an_older_epoch_is_refused_with_a_text_naming_both_epochs() -> None:
    guard = EpochGuard()
    guard.check(5, "welcome", "c2", now=0.0)
    with pytest.raises(StaleEpoch) as refused:
        guard.check(3, "assign", "c1", now=1.0)
    assert str(refused.value) == (
        "coordinator c1 speaks for leader epoch 3, older than 5; its assign was not acted on"
    )
    assert refused.value.report == (
        "refused assign from c1: it carries leader epoch 3, older than epoch 5 seen before "
        "(a deposed leader); closing that session"
    )
    assert guard.newest == 5  # a refused epoch changes nothing
    with pytest.raises(StaleEpoch):
        guard.check(0, "welcome", "c0", now=1.0)  # no election once one has spoken


def test_stale_refusals_are_reported_at_most_every_so_often_with_the_count_between() -> None:
    guard = EpochGuard()
    guard.check(5, "welcome", "c2", now=0.0)
    reports = []
    for now in (1.0, 2.0, 3.0, 1.0 + STALE_LOG_EVERY_S, 2.0 + STALE_LOG_EVERY_S):
        with pytest.raises(StaleEpoch) as refused:
            guard.check(4, "stop", "c1", now=now)
        reports.append(refused.value.report)
    assert reports[0].startswith("refused stop from c1:") and "more refused" not in reports[0]
    assert reports[1:3] == ["", ""]
    assert reports[3].endswith("closing that session (2 more refused since the last report)")
    assert reports[4] == ""


def test_a_message_is_named_as_on_the_wire() -> None:
    assert message_kind(Assign(_assignment())) == "assign"
    assert message_kind(ReservePort(JOB, 1)) == "reserve_port"
    assert message_kind(StartLogs(1, JOB, 0, 0, "stdout")) == "start_logs"
    assert message_kind(Welcome(1.0, 10.0)) == "welcome"
    assert message_kind(None) == "message"


# ---- what the agent holds ------------------------------------------------------------------------


def _exit(local_rank: int, code: int = 1) -> WorkerExit:
    return WorkerExit(local_rank, 4 + local_rank, 100 + local_rank, code, timestamp=1.0)


def _failure(local_rank: int) -> ProcessFailure:
    return ProcessFailure(
        global_rank=4 + local_rank,
        local_rank=local_rank,
        pid=100 + local_rank,
        exitcode=1,
        message=f"rank {local_rank} failed",
        timestamp=1.0,
        node="n1",
    )


def test_replay_sends_notices_of_ranks_not_exited_then_exits_then_unknown_then_stop() -> None:
    h = HeldRound(_assignment(), pids={0: 100, 1: 101}, stopped=True, unknown="lost it")
    h.failing = {0: _failure(0), 1: _failure(1)}
    h.exits = [_exit(1)]
    other = HeldRound(_assignment(job_id="job-9999999999", round_=1), exits=[_exit(0, 0)])
    assert replay({(JOB, 3): h, ("job-9999999999", 1): other}) == [
        WorkerFailing(JOB, 3, _failure(0)),  # rank 1's notice: its exit says it all
        WorkerExited(JOB, 3, _exit(1)),
        GroupUnknown(JOB, 3, "lost it"),
        GroupStopped(JOB, 3),
        WorkerExited("job-9999999999", 1, _exit(0, 0)),  # not stopped: no stop follows
    ]


def test_replay_of_a_round_stopped_without_exits_says_nothing_the_hello_did_not() -> None:
    h = HeldRound(_assignment(), pids={0: 100}, stopped=True)
    assert replay({(JOB, 3): h}) == []


def test_the_hello_lists_every_held_round_and_leaves_the_exits_to_the_replay() -> None:
    running = HeldRound(_assignment(), pids={0: 100, 1: 101})
    stopped = HeldRound(_assignment(round_=2), pids={0: 90}, stopped=True)
    stopped_with_exits = HeldRound(_assignment(round_=1), stopped=True, exits=[_exit(0)])
    held = {(JOB, 3): running, (JOB, 2): stopped, (JOB, 1): stopped_with_exits}
    msg = hello(held, name="n1", addr="10.0.0.1", slots=4, incarnation="inc", gpus=GPUS)
    assert (msg.name, msg.addr, msg.slots, msg.incarnation, msg.version, msg.gpus) == (
        "n1",
        "10.0.0.1",
        4,
        "inc",
        VERSION,
        GPUS,
    )
    assert msg.running == (
        RunningGroup(JOB, 3, 1, pids=((0, 100), (1, 101)), global_ranks=(4, 5)),
        RunningGroup(JOB, 2, 1, pids=((0, 90),), global_ranks=(4,), stopped=True),
        # Its exits follow the welcome, and then its stop: not fenced off before them.
        RunningGroup(JOB, 1, 1, pids=(), global_ranks=(), stopped=False),
    )


def test_workers_started_names_each_pid_with_its_global_rank() -> None:
    h = HeldRound(_assignment(), pids={1: 101, 0: 100, 7: 107})
    started = h.workers_started()
    assert (started.job_id, started.round) == (JOB, 3)
    assert started.pids == ((1, 101), (0, 100), (7, 107))
    assert started.global_ranks == (5, 4, -1)  # local rank 7 is not in the assignment


def test_a_heartbeat_carries_each_groups_samples_and_the_gpus() -> None:
    samples = [
        WorkerHealth(
            local_rank=1,
            global_rank=5,
            pid=101,
            status="disk-sleep",
            cpu_percent=12.5,
            rss_bytes=2048,
            timestamp=9.0,
        )
    ]
    group = group_health(JOB, 3, samples, WorkerState.UNHEALTHY, "rank 5 is stuck")
    assert group.workers == (WorkerHealthSample(1, 101, 12.5, 2048, "disk-sleep", 5),)
    assert (group.job_id, group.round, group.state, group.reason) == (
        JOB,
        3,
        WorkerState.UNHEALTHY,
        "rank 5 is stuck",
    )
    beat = heartbeat_of(7, [group], [GpuHealth(0)])
    assert (beat.seq, beat.groups, beat.gpus) == (7, (group,), (GpuHealth(0),))


def test_a_rank_runs_until_it_exits_or_its_round_is_stopped() -> None:
    h = HeldRound(_assignment())
    held = {(JOB, 3): h}
    assert rank_running(held, JOB, 4) and rank_running(held, JOB, 5)
    assert not rank_running(held, JOB, 6) and not rank_running(held, "job-9999999999", 4)
    h.exits.append(_exit(0))
    assert not rank_running(held, JOB, 4) and rank_running(held, JOB, 5)
    h.stopped = True
    assert not rank_running(held, JOB, 5)


def test_the_grace_of_a_stop_of_the_agent() -> None:
    assert stop_grace(30.0, None, leave_first=False) == 30.0  # the job's own
    assert stop_grace(30.0, 5.0, leave_first=False) == 5.0
    assert stop_grace(30.0, 5.0, leave_first=True) == 5.0  # a drain: bounded by both
    assert stop_grace(2.0, 5.0, leave_first=True) == 2.0
