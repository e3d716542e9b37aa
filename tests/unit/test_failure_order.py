"""The root cause when the failures' times are uncertain.

Where two failures are closer than their uncertainties together, a collective's communication
error gives way to a failure that is not one, and the reports say that the order was uncertain.
"""

from __future__ import annotations

import pytest

from client.model import (
    ProcessFailure,
    RunResult,
    WorkerState,
    first_failure,
    format_failures,
    is_collective_error,
    order_note,
)

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
