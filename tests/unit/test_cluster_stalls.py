"""Progress, stalls and stragglers in the pure state machine (`coordinator._cluster_stalls`),
on a fake clock: which ranks are named behind, what each stall_action does, when a straggler
is flagged."""

from __future__ import annotations

from client.model import FailureCategory, JobState
from client.node_protocol import (
    GroupHealth,
    Heartbeat,
    ProgressReport,
    RankProgress,
    WorkerHealthSample,
)
from coordinator._cluster import StallDetected
from coordinator._cluster_stalls import STALL_STACKS_S

from ._cluster_driver import Driver, of_type


def running(nodes: int = 2, nproc: int = 2, **kw: object) -> Driver:
    d = Driver()
    for i in range(nodes):
        d.connect(f"n{i}", addr=f"10.0.0.{i + 1}", slots=nproc)
    kw.setdefault("last_call_timeout", 0.0)
    d.submit("j", nproc_per_node=nproc, min_nodes=nodes, max_nodes=nodes, **kw)
    d.settle()
    assert d.state("j") == JobState.RUNNING
    d.clear()
    return d


def report(d: Driver, node: str, steps: dict[int, int], rate: float = 0.0) -> None:
    """Node `node` reports local rank -> step for its ranks of the job's current round."""
    status = d.cluster.job_status("j")
    by_local = {w.local_rank: w.global_rank for w in status.workers if w.node == node}
    msg = ProgressReport(
        "j",
        status.round,
        tuple(RankProgress(lr, by_local[lr], s, rate, (("loss", 0.5),)) for lr, s in steps.items()),
    )
    n = d.nodes[node]
    d._take(d.cluster.step(node, n.incarnation, msg, d.now))


def step_all(d: Driver, step: int, skip: int = -1, rate: float = 0.0) -> None:
    for node in ("n0", "n1"):
        ranks = {0: step, 1: step}
        if node == "n1" and skip >= 0:
            ranks.pop(skip)
        report(d, node, ranks, rate)


def events(d: Driver, kind: str) -> list[str]:
    return [e.reason for e in d.cluster.job_events("j") if e.kind == kind]


def test_progress_shows_in_status_with_step_rate_age_and_metrics() -> None:
    d = running()
    step_all(d, 7, rate=10.0)
    d.advance(2.0)
    workers = d.cluster.job_status("j").workers
    assert [w.step for w in workers] == [7, 7, 7, 7]
    assert all(w.steps_per_s == 10.0 and w.metrics == {"loss": 0.5} for w in workers)
    assert all(1.5 <= (w.last_step_age or 0) <= 2.5 for w in workers)


def test_a_rank_that_stopped_stepping_shows_no_steps_per_second() -> None:
    d = running()
    step_all(d, 7, rate=10.0)
    d.advance(1.0)
    assert [w.steps_per_s for w in d.cluster.job_status("j").workers] == [10.0] * 4
    for step in (8, 9, 10):
        d.advance(1.0)
        step_all(d, step, skip=0, rate=10.0)  # rank 2 (n1, local 0) is stuck at step 7
    rates = {w.global_rank: w.steps_per_s for w in d.cluster.job_status("j").workers}
    assert rates == {0: 10.0, 1: 10.0, 2: 0.0, 3: 10.0}


def test_a_rank_that_stops_while_the_others_step_is_named_behind_with_its_node() -> None:
    d = running(stall_timeout=3.0)
    for step in range(1, 5):
        step_all(d, step)
        d.advance(0.5)
    # Rank 2 (n1, local 0) hangs at step 4; the others go on for a while, then block.
    for step in range(5, 8):
        step_all(d, step, skip=0)
        d.advance(0.5)
    assert not d.cluster.job_status("j").stalled
    out = d.advance(2.0)
    status = d.cluster.job_status("j")
    assert status.stalled and "rank 2 (n1)" in status.stall_reason
    assert status.state == JobState.RUNNING  # report: it keeps running
    assert [w.global_rank for w in status.workers if w.behind] == [2]
    [stalled] = events(d, "stalled")
    assert "rank 2 (n1)" in stalled and "rank 3" not in stalled
    [effect] = of_type(out, StallDetected)
    assert effect.ranks == (2,) and effect.nodes == ("n1",) and effect.job_id == "j"
    # Said once, and cleared once every rank steps again.
    d.advance(3.0)
    assert len(events(d, "stalled")) == 1
    step_all(d, 8)
    d.advance(1.0)
    assert not d.cluster.job_status("j").stalled and events(d, "stall_cleared")


def test_when_every_rank_stops_the_ones_at_a_lower_step_are_behind() -> None:
    d = running(stall_timeout=3.0)
    step_all(d, 4)
    step_all(d, 5, skip=0)  # the others entered step 5's collective; rank 2 never did
    out = d.advance(2.5)
    assert not of_type(out, StallDetected)
    out = d.advance(1.0)
    [effect] = of_type(out, StallDetected)
    assert effect.ranks == (2,)
    assert "the others at step 5" in events(d, "stalled")[0]


def test_a_node_whose_reports_lag_is_not_behind_while_its_ranks_are_at_the_top_step() -> None:
    d = running(stall_timeout=3.0)
    step_all(d, 4)
    report(d, "n1", {0: 5, 1: 5})  # n1's report of step 5 came first...
    d.now += 0.6
    report(d, "n0", {0: 5, 1: 5})  # ... n0's a little later; then every rank blocks
    out = d._take(d.cluster.tick(d.now + 2.6))  # n1's ranks quiet for 3.2 s, n0's for 2.6 s
    assert not of_type(out, StallDetected)
    out = d._take(d.cluster.tick(d.now + 3.1))  # all quiet, all at step 5: every rank
    [effect] = of_type(out, StallDetected)
    assert effect.ranks == (0, 1, 2, 3)


def test_a_job_without_a_stall_timeout_is_never_stalled() -> None:
    d = running()
    step_all(d, 4)
    out = d.advance(600.0)
    assert not of_type(out, StallDetected) and not d.cluster.job_status("j").stalled


def rank_2_hangs_at_step_5(d: Driver, stacks_taken: bool) -> None:
    """The others enter step 5's collective; past the stall_timeout the stall is said, and its
    action waits for the ranks' stacks: until the service says they are kept, or until
    STALL_STACKS_S. Then the agents do as told."""
    step_all(d, 4)
    step_all(d, 5, skip=0)
    out = d.advance(4.0)
    [stall] = of_type(out, StallDetected)
    d.settle()
    # The workers live on while their stacks are read.
    status = d.cluster.job_status("j")
    assert status.state == JobState.RUNNING and status.attempt == 0 and status.stalled
    assert all(w.state.is_running() for w in status.workers)
    if stacks_taken:
        d._take(d.cluster.stall_stacks_taken("j", stall.round, d.now))
    else:
        d.advance(STALL_STACKS_S - 0.5)
        assert d.cluster.job_status("j").attempt == 0
        d.advance(1.0)
    d.settle()


def test_stall_action_restart_is_a_hang_failure_of_the_ranks_behind_and_a_restart() -> None:
    d = running(stall_timeout=3.0, stall_action="restart", max_restarts=1)
    rank_2_hangs_at_step_5(d, stacks_taken=True)
    assert d.state("j") == JobState.RUNNING
    status = d.cluster.job_status("j")
    assert status.attempt == 1 and not status.stalled
    [summary] = [a for a in d.cluster.job_attempts("j") if a.attempt == 0]
    [failure] = summary.failures
    assert failure.global_rank == 2 and failure.category == FailureCategory.HANG
    assert "stalled at step 4" in failure.message


def test_stall_action_fail_fails_the_job_without_a_restart() -> None:
    d = running(stall_timeout=3.0, stall_action="fail", max_restarts=3)
    rank_2_hangs_at_step_5(d, stacks_taken=False)
    assert d.state("j") == JobState.FAILED
    result = d.cluster.job_result("j")
    assert result is not None and list(result.failures) == [2]
    assert result.failures[2].category == FailureCategory.HANG


def cpu_beat(d: Driver, node: str, cpu: dict[int, float]) -> None:
    status = d.cluster.job_status("j")
    samples = tuple(
        WorkerHealthSample(w.local_rank, w.pid, cpu[w.local_rank], 1, "sleeping", w.global_rank)
        for w in status.workers
        if w.node == node
    )
    n = d.nodes[node]
    beat = Heartbeat(groups=(GroupHealth("j", status.round, samples),))
    d._take(d.cluster.step(node, n.incarnation, beat, d.now))


def test_without_progress_an_idle_rank_whose_peers_spin_is_behind() -> None:
    d = running(stall_timeout=3.0)
    out: list[object] = []
    # Still starting: a first sample reads 0% and counts for nothing.
    for _ in range(5):
        cpu_beat(d, "n0", {0: 0.0, 1: 0.0})
        cpu_beat(d, "n1", {0: 0.0, 1: 0.0})
        out += d.advance(1.0)
    assert not of_type(out, StallDetected)
    cpu_beat(d, "n1", {0: 50.0, 1: 50.0})
    for _ in range(5):
        cpu_beat(d, "n0", {0: 100.0, 1: 99.0})
        cpu_beat(d, "n1", {0: 0.0, 1: 100.0})
        out += d.advance(1.0)
    [effect] = of_type(out, StallDetected)
    assert effect.ranks == (2,)
    assert "idle on the CPU" in events(d, "stalled")[0]


def test_a_rank_slower_than_the_median_for_the_window_is_a_straggler_the_others_not() -> None:
    d = running(straggler_window=5.0)
    for i in range(12):
        report(d, "n0", {0: i, 1: i}, rate=20.0)
        report(d, "n1", {0: i, 1: i // 2}, rate=20.0)
        d._take(
            d.cluster.step(
                "n1",
                d.nodes["n1"].incarnation,
                ProgressReport(
                    "j", d.cluster.job_status("j").round, (RankProgress(1, 3, i // 2, 12.0),)
                ),
                d.now,
            )
        )
        d.advance(0.5)
        if i == 8:  # 4.5 s slow: not yet
            assert not events(d, "straggler")
    status = d.cluster.job_status("j")
    assert [w.global_rank for w in status.workers if w.straggler] == [3]
    [flag] = events(d, "straggler")
    assert "rank 3 on n1" in flag
    # It catches up: cleared.
    report(d, "n1", {1: 100}, rate=20.0)
    d.advance(1.0)
    assert not any(w.straggler for w in d.cluster.job_status("j").workers)
    assert events(d, "straggler_cleared")
