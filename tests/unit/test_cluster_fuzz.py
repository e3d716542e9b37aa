"""Property tests: any sequence of node messages, submits, cancels, drains and ticks keeps the
cluster sane.

Hostile or confused agents (wrong rounds, unknown jobs, duplicate exits, absurd values) must never
crash the coordinator's state machine, corrupt another job or double-book a node's slots.
"""

from __future__ import annotations

from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from client.model import JobSpec, JobState, ProcessFailure, WorkerState
from client.node_protocol import (
    DrainRequest,
    GroupHealth,
    GroupStopped,
    Heartbeat,
    PortReserved,
    WorkerExited,
    WorkersStarted,
)
from coordinator._cluster import (
    STOP_MARGIN_S,
    AssignRound,
    Cluster,
    ClusterConfig,
    JobNotFound,
    NodeNameInUse,
    RequestPort,
    RunningGroupReport,
    StopRound,
    WorkerExitReport,
    WorkerHealthSample,
)

NODES = ["n0", "n1", "n2"]
JOBS = ["j0", "j1", "zz"]  # "zz" is never submitted

floats = st.floats(allow_nan=True, allow_infinity=True, width=64)
ints = st.integers(min_value=-(2**31), max_value=2**31 - 1)
small = st.integers(min_value=-2, max_value=5)
texts = st.text(max_size=40)

failure = st.builds(
    ProcessFailure,
    global_rank=small,
    local_rank=small,
    pid=ints,
    exitcode=ints,
    message=texts,
    timestamp=floats,
    node=texts,
    traceback=texts,
)
exit_report = st.builds(
    WorkerExitReport,
    local_rank=small,
    global_rank=small,
    pid=st.integers(min_value=0, max_value=50),
    exitcode=ints,
    stopped_by_agent=st.booleans(),
    failure=st.none() | failure,
    return_value=st.none() | st.binary(max_size=20),
    timestamp=floats,
)
node = st.sampled_from(NODES)
job = st.sampled_from(JOBS)
rnd = st.integers(min_value=-1, max_value=6)

action = st.one_of(
    st.tuples(
        st.just("connect"),
        node,
        st.sampled_from(["a", "b"]),
        st.integers(0, 4),
        st.lists(
            st.builds(
                RunningGroupReport,
                job_id=job,
                round=rnd,
                attempt=small,
                pids=st.lists(st.tuples(small, ints), max_size=3).map(tuple),
                exits=st.lists(exit_report, max_size=2).map(tuple),
                stopped=st.booleans(),
            ),
            max_size=2,
        ),
    ),
    st.tuples(st.just("disconnect"), node, st.sampled_from(["a", "b"])),
    st.tuples(st.just("port"), node, job, rnd, st.integers(-5, 70000), texts),
    st.tuples(st.just("started"), node, job, rnd, st.lists(st.tuples(small, ints), max_size=3)),
    st.tuples(st.just("exited"), node, job, rnd, exit_report),
    st.tuples(st.just("stopped"), node, job, rnd, st.lists(ints, max_size=2)),
    st.tuples(
        st.just("heartbeat"),
        node,
        job,
        rnd,
        st.lists(
            st.builds(
                WorkerHealthSample,
                local_rank=small,
                pid=ints,
                cpu_percent=floats,
                rss_bytes=ints,
                proc_state=texts,
            ),
            max_size=2,
        ),
    ),
    st.tuples(st.just("submit"), st.integers(1, 3), st.integers(1, 3), st.integers(0, 2)),
    st.tuples(st.just("cancel"), job),
    st.tuples(st.just("tick"), st.floats(min_value=0, max_value=40)),
    st.tuples(st.just("drain"), node, st.none() | st.floats(min_value=0.5, max_value=60)),
    st.tuples(st.just("drain_request"), node, st.none() | st.floats(min_value=0.5, max_value=60)),
    st.tuples(st.just("undrain"), node),
)


class _Driver:
    def __init__(self) -> None:
        self.c = Cluster(ClusterConfig(heartbeat_interval=1.0, lease=5.0))
        self.now = 1000.0
        self.submitted = 0
        self.inc: dict[str, str] = {}

    def step(self, a: tuple[Any, ...]) -> None:
        c, now = self.c, self.now
        kind = a[0]
        if kind == "connect":
            _, name, inc, slots, running = a
            try:
                c.node_connected(name, "127.0.0.1", max(slots, 1), inc, now, running)
                self.inc[name] = inc
            except NodeNameInUse:
                pass
        elif kind == "disconnect":
            c.node_disconnected(a[1], a[2], now)
        elif kind == "port":
            _, name, jid, r, port, err = a
            c.step(name, self.inc.get(name, ""), PortReserved(jid, r, port, err), now)
        elif kind == "started":
            _, name, jid, r, pids = a
            c.step(name, self.inc.get(name, ""), WorkersStarted(jid, r, tuple(pids)), now)
        elif kind == "exited":
            _, name, jid, r, rep = a
            c.step(name, self.inc.get(name, ""), WorkerExited(jid, r, rep), now)
        elif kind == "stopped":
            _, name, jid, r, unk = a
            c.step(name, self.inc.get(name, ""), GroupStopped(jid, r, tuple(unk)), now)
        elif kind == "heartbeat":
            _, name, jid, r, samples = a
            beat = Heartbeat(groups=(GroupHealth(jid, r, tuple(samples)),))
            c.step(name, self.inc.get(name, ""), beat, now)
        elif kind == "submit":
            _, lo, hi, restarts = a
            if self.submitted < 2:
                spec = JobSpec(
                    entrypoint=["x"],
                    min_nodes=min(lo, hi),
                    max_nodes=max(lo, hi),
                    nproc_per_node=1,
                    max_restarts=restarts,
                    last_call_timeout=1.0,
                    join_timeout=20.0,
                    stop_grace=1.0,
                    exit_barrier_timeout=5.0,
                )
                c.submit(f"j{self.submitted}", spec, now)
                self.submitted += 1
        elif kind == "cancel":
            try:
                c.cancel(a[1], now)
            except JobNotFound:
                assert a[1] not in c.job_ids()
        elif kind == "tick":
            self.now += a[1]
            c.tick(self.now)
        elif kind == "drain":
            c.drain(a[1], a[2], now)
        elif kind == "drain_request":
            c.step(a[1], self.inc.get(a[1], ""), DrainRequest(a[2]), now)
        elif kind == "undrain":
            c.undrain(a[1], now)

    def check(self) -> None:
        c = self.c
        for n in c.nodes():
            assert 0 <= n.slots_used <= n.slots, n
        for jid in c.job_ids():
            st_ = c.job_status(jid)
            if st_.state.is_terminal():
                assert c.job_result(jid) is not None
                r = c.job_result(jid)
                assert r is not None and not (set(r.return_values) & set(r.failures))
            else:
                assert c.job_result(jid) is None
            ranks = [w.global_rank for w in st_.workers]
            assert len(ranks) == len(set(ranks))
            if st_.state in (JobState.RUNNING, JobState.STOPPING):
                assert st_.members
            if st_.state in (JobState.RUNNING, JobState.RENDEZVOUS):
                # A drain stops every round with a member on its node: none runs on there.
                drained = {n.name for n in c.nodes() if n.drain_reason and n.state != "lost"}
                assert not [m.node for m in st_.members if m.node in drained and not m.done], st_


@settings(
    max_examples=15 * settings().max_examples,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(st.lists(action, max_size=40))
def test_random_message_sequences_never_break_the_cluster(actions: list[tuple[Any, ...]]) -> None:
    d = _Driver()
    for a in actions:
        d.step(a)
        d.check()


_RUNNING_WORKER = (WorkerState.INIT, WorkerState.HEALTHY, WorkerState.UNHEALTHY)


def _assert_ends_or_waits(c: Cluster, job_id: str) -> None:
    """The job has ended with a result, or names something outstanding that it waits for."""
    status = c.job_status(job_id)
    if status.state.is_terminal():
        assert c.job_result(job_id) is not None, status
        return
    assert status.reason, status
    if status.state == JobState.RUNNING:
        # Waiting for a worker to exit, or in the exit barrier for a node that is not done yet.
        running = [w for w in status.workers if w.state in _RUNNING_WORKER]
        pending = [m for m in status.members if not m.done]
        assert running or (pending and "exit barrier" in status.reason), status
    else:
        # Waiting for the nodes to confirm the stop (a deadline bounds it).
        assert status.state == JobState.STOPPING, status


def _start_round(d: _Driver) -> int:
    """Job j0 on n0 and n1, two workers each (pids 10 and 11), all started; returns the round."""
    c = d.c
    c.submit("j0", JobSpec(entrypoint=["x"], nproc_per_node=2, min_nodes=2, max_nodes=2), d.now)
    effects = []
    for name in NODES[:2]:
        effects += c.node_connected(name, "127.0.0.1", 2, "a", d.now)
        d.inc[name] = "a"
    ports = [e for e in effects if isinstance(e, RequestPort)]
    assert len(ports) == 1
    assigns = [
        e
        for e in c.step(ports[0].node, "a", PortReserved("j0", ports[0].round, 4000, ""), d.now)
        if isinstance(e, AssignRound)
    ]
    assert len(assigns) == 2
    rnd = assigns[0].assignment.round
    for e in assigns:
        c.step(
            e.node,
            "a",
            WorkersStarted(
                "j0",
                rnd,
                (
                    (0, 10),
                    (1, 11),
                ),
            ),
            d.now,
        )
    return rnd


def _run_out_the_deadlines(d: _Driver) -> None:
    """Let the job's own deadlines pass (barrier, stop) while heartbeats keep both nodes live."""
    spec = d.c.job_spec("j0")
    for _ in range(2):
        d.now += max(spec.exit_barrier_timeout, spec.stop_grace + STOP_MARGIN_S) + 1
        for name in NODES[:2]:
            d.c.step(name, "a", Heartbeat(), d.now)
        d.c.tick(d.now)
        d.check()


@settings(max_examples=3 * settings().max_examples, deadline=None)
@given(st.lists(exit_report, min_size=1, max_size=6))
def test_a_well_behaved_round_with_hostile_exits_ends_or_waits(
    reports: list[WorkerExitReport],
) -> None:
    d = _Driver()
    c = d.c
    rnd = _start_round(d)
    stops: set[str] = set()
    for i, rep in enumerate(reports):
        out = c.step(NODES[i % 2], "a", WorkerExited("j0", rnd, rep), d.now)
        stops |= {e.node for e in out if isinstance(e, StopRound)}
        d.check()
        _assert_ends_or_waits(c, "j0")
    # Then the agents behave: every worker still running exits 0, and a node told to stop
    # confirms it. Whatever the hostile reports were, the job must end (no restarts are allowed).
    for w in c.job_status("j0").workers:
        if w.state in _RUNNING_WORKER and not c.job_state("j0").is_terminal():
            ok = WorkerExitReport(w.local_rank, w.global_rank, w.pid + 100, 0, timestamp=d.now)
            out = c.step(w.node, "a", WorkerExited("j0", rnd, ok), d.now)
            stops |= {e.node for e in out if isinstance(e, StopRound)}
            d.check()
            _assert_ends_or_waits(c, "j0")
    for name in sorted(stops):
        c.step(name, "a", GroupStopped("j0", rnd, ()), d.now)
        d.check()
    # What may be left is a bounded wait: the exit barrier or the stop deadline.
    _run_out_the_deadlines(d)
    status = c.job_status("j0")
    assert status.state.is_terminal(), status
    result = c.job_result("j0")
    assert result is not None
    assert result.is_failed() == (status.state != JobState.SUCCEEDED), (status, result)


def test_an_unasked_stopped_by_agent_exit_does_not_wedge_the_job() -> None:
    d = _Driver()
    rnd = _start_round(d)
    for i, name in enumerate(NODES[:2]):
        for local_rank in (0, 1):
            rep = WorkerExitReport(local_rank, 2 * i + local_rank, 10 + local_rank, 0, True)
            d.c.step(name, "a", WorkerExited("j0", rnd, rep), d.now)
            d.check()
    _run_out_the_deadlines(d)
    status = d.c.job_status("j0")
    assert status.state.is_terminal(), status


def test_an_oversized_return_value_is_a_failure_that_names_the_limit() -> None:
    from client.model import MAX_RETURN_VALUE_BYTES

    c = Cluster()
    c.submit("j", JobSpec(entrypoint="pkg.mod:fn", nproc_per_node=1), 0.0)
    effects = c.node_connected("a", "127.0.0.1", 1, "i", 0.0)
    (port,) = [e for e in effects if isinstance(e, RequestPort)]
    c.step("a", "i", PortReserved("j", port.round, 4000, ""), 0.1)
    c.step("a", "i", WorkersStarted("j", port.round, ((0, 7),)), 0.2)
    big = b"x" * (MAX_RETURN_VALUE_BYTES + 1)
    c.step(
        "a", "i", WorkerExited("j", port.round, WorkerExitReport(0, 0, 7, 0, return_value=big)), 0.3
    )
    c.step("a", "i", GroupStopped("j", port.round, ()), 0.4)
    result = c.job_result("j")
    assert result is not None and result.is_failed()
    assert result.return_values == {}
    assert "over the limit" in result.failures[0].message
    assert str(MAX_RETURN_VALUE_BYTES) in result.failures[0].message


def test_a_round_assigned_just_before_a_crash_is_adopted_after_restore() -> None:
    import json

    from coordinator._codec import encode

    c = Cluster()
    c.submit("j", JobSpec(entrypoint=["x"], nproc_per_node=1, min_nodes=2, max_nodes=2), 0.0)
    c.node_connected("a", "10.0.0.1", 1, "ia", 0.0)
    effects = c.node_connected("b", "10.0.0.2", 1, "ib", 0.0)
    (port,) = [e for e in effects if isinstance(e, RequestPort)]
    # The state on disk still says "choosing the port"; the agents got their assignment anyway.
    jobs = [json.loads(json.dumps(c.dump_job("j")))]
    nodes = [json.loads(json.dumps(d)) for d in c.dump_nodes()]
    events = [encode(e) for e in c.job_events("j")]
    c2 = Cluster()
    c2.restore(jobs, events, nodes, 100.0, reconnect_grace=15.0)
    assert {n.state for n in c2.nodes()} == {"reconnecting"}
    for name, inc, pid in (("a", "ia", 11), ("b", "ib", 12)):
        report = RunningGroupReport(job_id="j", round=port.round, attempt=0, pids=((0, pid),))
        out = c2.node_connected(name, "10.0.0.1", 1, inc, 101.0, [report])
        assert not [e for e in out if isinstance(e, RequestPort)]
    status = c2.job_status("j")
    assert status.state == JobState.RUNNING and status.round == port.round
    assert sorted(w.pid for w in status.workers) == [11, 12]
    assert {n.state for n in c2.nodes()} == {"live"}


drain_action = st.one_of(
    st.tuples(st.just("drain"), node, st.none() | st.floats(min_value=0.5, max_value=60)),
    st.tuples(st.just("drain_request"), node, st.none() | st.floats(min_value=0.5, max_value=60)),
    st.tuples(st.just("undrain"), node),
    st.tuples(st.just("tick"), st.floats(min_value=0, max_value=40)),
    st.tuples(st.just("connect"), st.just("n2"), st.just("a"), st.just(2), st.just([])),
)


@settings(max_examples=3 * settings().max_examples, deadline=None)
@given(st.lists(drain_action, min_size=1, max_size=12))
def test_drains_at_any_moment_never_leave_a_round_running_on_a_drained_node(
    actions: list[tuple[Any, ...]],
) -> None:
    d = _Driver()
    _start_round(d)
    for a in actions:
        d.step(a)
        # The agents behave: they answer every port request and assignment, and confirm stops.
        for _ in range(10):
            if not _answer(d):
                break
        d.check()


def _answer(d: _Driver) -> bool:
    """Play the agents once for job j0; whether anything was answered."""
    c, now = d.c, d.now
    status = c.job_status("j0")
    if status.state == JobState.STOPPING:
        for m in status.members:
            c.step(m.node, d.inc.get(m.node, ""), GroupStopped("j0", status.round, ()), now)
        return True
    if status.state == JobState.RENDEZVOUS and status.members:
        first = status.members[0].node
        c.step(first, d.inc.get(first, ""), PortReserved("j0", status.round, 4000, ""), now)
        return c.job_status("j0").state != JobState.RENDEZVOUS
    if status.state == JobState.RUNNING and any(w.pid == 0 for w in status.workers):
        for m in status.members:
            pids = tuple((lr, 100 + lr) for lr in range(m.nproc))
            c.step(m.node, d.inc.get(m.node, ""), WorkersStarted("j0", status.round, pids), now)
        return True
    return False
