"""The root cause across hosts whose clocks disagree.

The coordinator measures each node's clock (`coordinator._clock_offset`) and puts the failures
a node reports on its own clock before it picks the earliest; where two failures are closer than
their uncertainties together, a collective's communication error gives way to a failure that is
not one, and the reports say that the order was uncertain.
"""

from __future__ import annotations

import pytest

from client._tables import nodes_table
from client.model import (
    ProcessFailure,
    RunResult,
    WorkerState,
    first_failure,
    format_failures,
    is_collective_error,
    order_note,
)
from client.node_protocol import ClockReply
from coordinator._clock_offset import FAST_PROBES
from tests.unit._cluster_driver import Driver

from .test_cluster import running_job

T = 1_700_000_000.0

GLOO_CLOSED = (
    "RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by "
    "peer [10.0.0.1]:29500"
)
TRUE_FIRST = "ValueError: the true first failure"


def pf(
    rank: int, ts: float, message: str = "ValueError: boom", u: float = 0.0, **kw: object
) -> ProcessFailure:
    return ProcessFailure(
        global_rank=rank,
        local_rank=0,
        pid=100 + rank,
        exitcode=1,
        message=message,
        timestamp=ts,
        time_uncertainty=u,
        node=f"n{rank}",
        **kw,  # type: ignore[arg-type]
    )


# ---- the classifier ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "message",
    [
        GLOO_CLOSED,
        "RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:598] Read error "
        "[127.0.0.1]:45678: Connection reset by peer",
        "ConnectionResetError: [Errno 104] Connection reset by peer",
        "RuntimeError: [../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:81] Timed out "
        "waiting 5000ms for recv operation to complete",
        "torch.distributed.DistBackendError: NCCL error in: ProcessGroupNCCL.cpp:1970, remote "
        "process exited or there was a network error, NCCL version 2.19.3",
        "RuntimeError: NCCL communicator was aborted on rank 1.",
        "[Rank 1] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=7, "
        "OpType=ALLREDUCE, NumelIn=1, NumelOut=1, Timeout(ms)=600000) ran for 600041 "
        "milliseconds before timing out.",
        "torch.distributed.DistStoreError: Timed out after 301 seconds waiting for clients. 1/2 "
        "clients joined.",
        "RuntimeError: Rank 1 failed to pass monitoredBarrier in 30000 ms",
        "BrokenPipeError: [Errno 32] Broken pipe",
        "RuntimeError: [c10d] The client socket has timed out after 600s while trying to "
        "connect to (10.0.0.1, 29500).",
    ],
)
def test_collective_errors_are_recognised(message: str) -> None:
    assert is_collective_error(pf(0, T, message))


@pytest.mark.parametrize(
    "message",
    [
        TRUE_FIRST,
        "TimeoutError: timed out waiting for the data loader",
        "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB",
        "Signal 9 (SIGKILL) received by PID 1234",
        "Process exited with exit code 3 (pid 7); no error file was written",
        "node n1 lost: its stream to the coordinator ended",
    ],
)
def test_other_failures_are_not_collective_errors(message: str) -> None:
    assert not is_collective_error(pf(0, T, message))


def test_the_exception_line_of_the_traceback_and_the_stderr_tail_count_too() -> None:
    tb = f'Traceback (most recent call last):\n  File "t.py", line 3, in <module>\n{GLOO_CLOSED}\n'
    assert is_collective_error(pf(0, T, "boom", traceback=tb))
    # A frame's source line is not the error: a ValueError raised next to an all_reduce.
    tb_value = (
        'Traceback (most recent call last):\n  File "t.py", line 3, in <module>\n'
        "    dist.all_reduce(t)  # timed out before\nValueError: bad batch\n"
    )
    assert not is_collective_error(pf(0, T, "ValueError: bad batch", traceback=tb_value))
    tail = "terminate called after throwing\n  what():  Connection reset by peer\n"
    assert is_collective_error(pf(0, T, "Process exited with exit code 134", stderr_tail=tail))


def test_the_text_classified_is_bounded() -> None:
    far = "x" * 100_000 + " Connection reset by peer"
    assert not is_collective_error(pf(0, T, far))


# ---- the root cause ----------------------------------------------------------------------------


def test_clear_times_pick_the_earliest_even_a_collective_error() -> None:
    failures = {0: pf(0, T, GLOO_CLOSED, u=0.01), 1: pf(1, T + 0.05, TRUE_FIRST, u=0.01)}
    root = first_failure(failures)
    assert root is not None and root.global_rank == 0
    assert order_note(failures.values(), root) == ""


def test_a_near_tie_prefers_the_failure_that_is_not_a_collective_error_and_says_so() -> None:
    # 0.1 s apart, each +/- 0.2 s: which came first is not known.
    failures = {0: pf(0, T, GLOO_CLOSED, u=0.2), 1: pf(1, T + 0.1, TRUE_FIRST, u=0.2)}
    root = first_failure(failures)
    assert root is not None and root.global_rank == 1
    assert order_note(failures.values(), root) == (
        "uncertain within 0.400 s (clock offsets, time resolution); chosen because the "
        "failures before it are collective errors"
    )
    table = format_failures(RunResult(WorkerState.FAILED, failures=failures), "train")
    root_section = table.split("Other Failures:")[0]
    assert (
        "order     : uncertain within 0.400 s (clock offsets, time resolution); chosen because "
        "the failures before it are collective errors"
    ) in root_section
    assert "rank      : 1 (local_rank: 0)" in root_section
    other = table.split("Other Failures:")[1]
    assert "0.100 s before the root cause, within the uncertainty of the times (0.400 s)" in other


def test_a_near_tie_of_two_collective_errors_keeps_the_earliest() -> None:
    failures = {0: pf(0, T, GLOO_CLOSED, u=0.2), 1: pf(1, T + 0.1, GLOO_CLOSED, u=0.2)}
    root = first_failure(failures)
    assert root is not None and root.global_rank == 0
    assert order_note(failures.values(), root).endswith("; chosen as the earliest")


def test_a_near_tie_after_a_non_collective_root_says_the_others_are_collective_errors() -> None:
    failures = {0: pf(0, T, TRUE_FIRST, u=0.2), 1: pf(1, T + 0.1, GLOO_CLOSED, u=0.2)}
    root = first_failure(failures)
    assert root is not None and root.global_rank == 0
    assert order_note(failures.values(), root).endswith(
        "; chosen because the others are collective errors"
    )


def test_without_uncertainty_the_order_is_the_timestamps_as_before() -> None:
    failures = {0: pf(0, T, GLOO_CLOSED), 1: pf(1, T + 0.001, TRUE_FIRST)}
    assert first_failure(failures) == failures[0]
    tie = {3: pf(3, T), 1: pf(1, T)}
    assert first_failure(tie) == tie[1]


# ---- the coordinator: a node's clock measured, its failures put on the coordinator's clock ----


def measure(d: Driver, name: str, offset: float, trip: float = 0.002) -> None:
    """Answer every probe a fresh session gets: node `name`'s clock reads `offset` ahead."""
    n = d.nodes[name]
    for _ in range(FAST_PROBES):
        t1 = d.now
        assert d.cluster.clock_probe_due(name, n.incarnation, t1)
        t2 = t1 + trip / 2 + offset
        d.cluster.step(name, n.incarnation, ClockReply(t1, t2, t2), t1 + trip)
        d.now += 0.5


def skewed_failures(d: Driver, *, second: str = GLOO_CLOSED, late: float = 0.15) -> None:
    """Rank 0 on n0 fails for real at d.now, rank 1 on n1 `late` s later with `second`; n0's
    agent stamps its time on a clock 0.5 s ahead."""
    for n in d.nodes.values():
        n.auto_stop = False
    first_at = d.now
    d.exit("n0", 0, 1, timestamp=first_at + 0.5, failure=pf(0, first_at + 0.5, TRUE_FIRST))
    d.now += late
    d.exit("n1", 0, 1, timestamp=d.now, failure=pf(1, d.now, second))
    d.group_stopped("n0", "j", 1)
    d.group_stopped("n1", "j", 1)


def test_the_root_cause_is_the_true_first_failure_on_a_node_whose_clock_is_ahead() -> None:
    d = running_job(nodes=2, nproc=1)
    measure(d, "n0", +0.5)
    measure(d, "n1", 0.0)
    first_at = d.now
    skewed_failures(d)
    result = d.cluster.job_result("j")
    assert result is not None and result.is_failed()
    root = result.root_cause
    assert root is not None and root.global_rank == 0 and root.message == TRUE_FIRST
    assert result.failures[0].root_cause and not result.failures[1].root_cause
    # On the coordinator's clock, the offset kept, and how sure it is.
    assert root.precise_timestamp == pytest.approx(first_at, abs=0.002)
    assert root.clock_offset == pytest.approx(0.5, abs=0.002)
    assert 0 < root.time_uncertainty <= 0.002
    assert result.failures[1].clock_offset == pytest.approx(0.0, abs=0.002)
    assert "uncertain" not in result.reason
    nodes = {n.name: n for n in d.cluster.nodes()}
    assert nodes["n0"].clock_offset == pytest.approx(0.5, abs=0.002)
    assert 0 < nodes["n0"].clock_uncertainty <= 0.002
    rows = nodes_table(d.cluster.nodes(), now=d.now).splitlines()
    assert "CLOCK_MS" in rows[0]
    assert "+500.0 +/-1.0" in rows[1] and "+0.0 +/-1.0" in rows[2], rows


def test_a_node_whose_clock_is_not_measured_is_taken_at_its_word() -> None:
    d = running_job(nodes=2, nproc=1)
    skewed_failures(d)
    result = d.cluster.job_result("j")
    assert result is not None
    root = result.root_cause
    assert root is not None and root.global_rank == 1
    assert root.clock_offset == 0.0 and result.failures[0].clock_offset == 0.0
    assert all(n.clock_uncertainty == 0.0 for n in d.cluster.nodes())
    assert nodes_table(d.cluster.nodes(), now=d.now).splitlines()[1].split()[5] == "-"


def test_a_near_tie_on_the_coordinators_clock_prefers_the_non_collective_error() -> None:
    d = running_job(nodes=2, nproc=1)
    # A slow trip to n0: its offset is known to +/- 0.2 s only.
    measure(d, "n0", +0.5, trip=0.4)
    measure(d, "n1", 0.0)
    for n in d.nodes.values():
        n.auto_stop = False
    at = d.now
    d.exit("n1", 0, 1, timestamp=at, failure=pf(1, at, GLOO_CLOSED))
    # n0's rank failed 0.1 s after by the corrected clocks: the order is not known.
    d.exit("n0", 0, 1, timestamp=at + 0.6, failure=pf(0, at + 0.6, TRUE_FIRST))
    d.group_stopped("n0", "j", 1)
    d.group_stopped("n1", "j", 1)
    result = d.cluster.job_result("j")
    assert result is not None
    root = result.root_cause
    assert root is not None and root.global_rank == 0
    assert result.failures[0].root_cause and not result.failures[1].root_cause
    assert "; root cause rank 0 on n0: order uncertain within 0.20" in result.reason
    assert result.reason.endswith("chosen because the failures before it are collective errors")
    assert "order     : uncertain within 0.20" in result.format_failures("j")


def test_the_order_note_of_a_result_follows_a_failure_reported_after_it() -> None:
    d = running_job(nodes=2, nproc=1)
    measure(d, "n0", +0.5, trip=0.4)
    measure(d, "n1", 0.0)
    for n in d.nodes.values():
        n.auto_stop = False
    at = d.now
    d.exit("n1", 0, 1, timestamp=at, failure=pf(1, at, GLOO_CLOSED))
    d.group_stopped("n1", "j", 1)
    first = d.cluster.job_result("j")
    assert first is not None and first.root_cause is not None
    assert first.root_cause.global_rank == 1 and "uncertain" not in first.reason
    # Its collateral error came first; the true root cause's report comes after the result.
    d.exit("n0", 0, 1, timestamp=at + 0.6, failure=pf(0, at + 0.6, TRUE_FIRST))
    amended = d.cluster.job_result("j")
    assert amended is not None and amended.root_cause is not None
    assert amended.root_cause.global_rank == 0
    assert amended.reason.count("; root cause rank ") == 1
    assert amended.reason.startswith(first.reason)
