"""The failure table and result summary: layout, root cause first, and robustness."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from client._report import format_result
from client.model import (
    AttemptSummary,
    FailureCategory,
    ProcessFailure,
    RunResult,
    WorkerState,
    format_failures,
)

T0 = 1800000000.0  # 2027-01-15_08:00:00 UTC
TB = (
    "Traceback (most recent call last):\n"
    '  File "/job/train.py", line 9, in main\n'
    '    raise ValueError("bad batch")\n'
    "ValueError: bad batch\n"
)


@pytest.fixture(autouse=True)
def utc(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    # The table shows local time; pin it so expected strings are exact.
    monkeypatch.setenv("TZ", "UTC")
    time.tzset()
    yield
    monkeypatch.undo()
    time.tzset()


def _failure(rank: int, timestamp: float, **kw: Any) -> ProcessFailure:
    fields: dict[str, Any] = {
        "global_rank": rank,
        "local_rank": rank % 2,
        "pid": 1000 + rank,
        "exitcode": 1,
        "message": f"failure of rank {rank}",
        "timestamp": timestamp,
        "node": "node-a" if rank < 2 else "node-b",
        "attempt": 1,
        "round": 3,
    }
    fields.update(kw)
    return ProcessFailure(**fields)


def _failed(*failures: ProcessFailure, **kw: Any) -> RunResult:
    return RunResult(WorkerState.FAILED, failures={f.global_rank: f for f in failures}, **kw)


def _result_three_nodes() -> RunResult:
    return _failed(
        _failure(
            0,
            T0 + 1.5,
            exitcode=-15,
            signal="SIGTERM",
            message="Signal 15 (SIGTERM) received by PID 1000",
        ),
        _failure(
            2,
            T0 + 0.25,
            error_file="/logs/2/error.json",
            message="ValueError: bad batch",
            traceback=TB,
        ),
        _failure(
            3,
            T0 + 2,
            message="To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html",
            stderr_tail="CUDA error: out of memory\nAborted\n",
            node="node-c",
        ),
    )


def test_exact_layout_root_cause_first() -> None:
    expected = "\n".join(
        [
            "=" * 60,
            "train FAILED",
            "-" * 60,
            "Root Cause (first observed failure):",
            "[0]:",
            "  time      : 2027-01-15_08:00:00.250",
            "  node      : node-b",
            "  attempt   : 1 (round: 3)",
            "  rank      : 2 (local_rank: 0)",
            "  exitcode  : 1 (pid: 1002) ",
            "  error_file: /logs/2/error.json",
            "  traceback : Traceback (most recent call last):",
            '    File "/job/train.py", line 9, in main',
            '      raise ValueError("bad batch")',
            "  ValueError: bad batch",
            "  ",
            "-" * 60,
            "Other Failures:",
            "[1]:",
            "  time      : 2027-01-15_08:00:01.500",
            "  order     : failed 1.250 s after the root cause, perhaps because of it",
            "  node      : node-a",
            "  attempt   : 1 (round: 3)",
            "  rank      : 0 (local_rank: 0)",
            "  exitcode  : -15 (pid: 1000)  (SIGTERM)",
            "  error_file: <N/A>",
            "  traceback : Signal 15 (SIGTERM) received by PID 1000",
            "[2]:",
            "  time      : 2027-01-15_08:00:02.000",
            "  order     : failed 1.750 s after the root cause, perhaps because of it",
            "  node      : node-c",
            "  attempt   : 1 (round: 3)",
            "  rank      : 3 (local_rank: 1)",
            "  exitcode  : 1 (pid: 1003) ",
            "  error_file: <N/A>",
            "  traceback : To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html",
            "  stderr    : last 2 lines",
            "    CUDA error: out of memory",
            "    Aborted",
            "=" * 60,
        ]
    )
    result = _result_three_nodes()
    assert format_failures(result, "train") == expected
    assert result.format_failures("train") == expected


def test_border_width_follows_longest_line_up_to_60() -> None:
    short = format_failures(_failed(_failure(0, T0, message="x")), "j")
    lines = short.split("\n")
    longest = max(len(line) for line in lines if not set(line) <= {"=", "-"})
    assert longest < 60
    assert lines[0] == "=" * longest
    assert lines[2] == "-" * longest

    long_title = format_failures(_failed(_failure(0, T0, message="x")), "n" * 80)
    assert long_title.split("\n")[0] == "=" * 60


def test_single_failure_has_no_other_failures() -> None:
    text = format_failures(_failed(_failure(5, T0)), "solo")
    lines = text.split("\n")
    assert lines[lines.index("Other Failures:") + 1] == "  <NO_OTHER_FAILURES>"
    assert "order" not in text


def test_root_cause_from_another_node_comes_first() -> None:
    result = _failed(
        _failure(0, T0 + 3, node="node-a"),
        _failure(1, T0 + 4, node="node-a"),
        _failure(6, T0 + 1, node="node-z"),
        _failure(4, T0 + 2, node="node-b"),
    )
    lines = format_failures(result, "multi").split("\n")
    ranks = [line for line in lines if line.startswith("  rank      : ")]
    assert ranks == [
        "  rank      : 6 (local_rank: 0)",
        "  rank      : 4 (local_rank: 0)",
        "  rank      : 0 (local_rank: 0)",
        "  rank      : 1 (local_rank: 1)",
    ]
    nodes = [line for line in lines if line.startswith("  node      : ")]
    assert nodes[0] == "  node      : node-z"
    assert [line for line in lines if line.startswith("[")] == ["[0]:", "[1]:", "[2]:", "[3]:"]


def test_tie_goes_to_smallest_rank_and_is_not_after_the_root_cause() -> None:
    result = _failed(_failure(3, T0), _failure(1, T0), _failure(2, T0 + 0.001))
    text = format_failures(result, "tie")
    root_section, other_section = text.split("Other Failures:")
    assert "  rank      : 1 (local_rank: 1)" in root_section
    assert "  rank      : 3 (local_rank: 1)" not in root_section
    order = [line for line in other_section.split("\n") if line.startswith("  order     :")]
    assert order == [
        "  order     : failed at the same time as the root cause",
        "  order     : failed 0.001 s after the root cause, perhaps because of it",
    ]


def test_a_later_failure_with_the_same_error_also_failed() -> None:
    # Every rank ran the same bad line: not a consequence of the root cause, the same bug. The
    # executable's note (which names each rank's node) is no part of the error compared.
    same = "ValueError: bad batch"
    result = _failed(
        _failure(0, T0, message=f"{same} (ran /usr/bin/python3 on node node-a)"),
        _failure(2, T0 + 0.25, message=f"{same} (ran /usr/bin/python3 on node node-b)"),
        _failure(3, T0 + 0.5, message="RuntimeError: peer went away"),
    )
    other_section = format_failures(result, "same").split("Other Failures:")[1]
    order = [line for line in other_section.split("\n") if line.startswith("  order     :")]
    assert order == [
        "  order     : also failed, 0.250 s after the root cause, with the same error",
        "  order     : failed 0.500 s after the root cause, perhaps because of it",
    ]


def test_marked_root_cause_wins_over_timestamps() -> None:
    result = _failed(_failure(0, T0), _failure(1, T0 + 5, root_cause=True))
    text = format_failures(result, "marked")
    root_section, other_section = text.split("Other Failures:")
    assert "  rank      : 1 (local_rank: 1)" in root_section
    assert (
        "  order     : failed before the root cause by its node's clock (the root cause was "
        "seen first)" in other_section
    )


def test_signal_name_derived_from_exit_code_when_missing() -> None:
    text = format_failures(_failed(_failure(0, T0, exitcode=-9, signal="")), "sig")
    assert "  exitcode  : -9 (pid: 1000)  (SIGKILL)\n" in text
    unknown = format_failures(_failed(_failure(0, T0, exitcode=-200, signal="")), "sig")
    assert "  exitcode  : -200 (pid: 1000) \n" in unknown


def test_missing_traceback_uses_message_and_placeholder() -> None:
    text = format_failures(_failed(_failure(0, T0, message="worker lost", traceback="")), "m")
    assert "  traceback : worker lost\n" in text
    empty = format_failures(_failed(_failure(0, T0, message="", traceback="")), "m")
    assert "  traceback : <N/A>\n" in empty


def test_stderr_tail_only_without_traceback() -> None:
    with_tb = format_failures(_failed(_failure(0, T0, traceback=TB, stderr_tail="noise\n")), "s")
    assert "stderr" not in with_tb
    assert "noise" not in with_tb
    one = format_failures(_failed(_failure(0, T0, stderr_tail="Segmentation fault")), "s")
    assert "  stderr    : last 1 line\n    Segmentation fault\n" in one
    blank = format_failures(_failed(_failure(0, T0, stderr_tail="\n\n")), "s")
    assert "stderr" not in blank


def test_title_falls_back_to_result_name_and_job_id() -> None:
    failure = _failure(0, T0)
    assert format_failures(_failed(failure, name="named"), "").split("\n")[1] == "named FAILED"
    assert format_failures(_failed(failure, job_id="job-7"), "").split("\n")[1] == "job-7 FAILED"
    assert _failed(failure, name="n2").format_failures().split("\n")[1] == "n2 FAILED"


def test_failed_without_process_failures() -> None:
    text = format_failures(RunResult(WorkerState.FAILED, reason="join timeout"), "empty")
    assert "  <NO_ROOT_CAUSE>" in text
    assert "  <NO_OTHER_FAILURES>" in text


# --- format_result ---------------------------------------------------------------------------


class _BadRepr:
    def __repr__(self) -> str:
        raise RuntimeError("no repr")


def test_format_result_success() -> None:
    result = RunResult(
        WorkerState.SUCCEEDED,
        return_values={1: "x" * 500, 0: {"loss": 0.5}, 2: _BadRepr()},
        attempts=(AttemptSummary(attempt=0, round=1, nodes=("a",), end_reason="succeeded"),),
        name="train",
    )
    lines = format_result(result).split("\n")
    assert lines[0] == "train SUCCEEDED"
    assert lines[1] == "attempts: 1"
    assert lines[2] == "return values:"
    assert lines[3] == "  rank 0: {'loss': 0.5}"
    assert lines[4].startswith("  rank 1: 'xxx")
    shown = lines[4].removeprefix("  rank 1: ")
    assert len(shown) == 200
    assert shown.endswith("...")
    assert lines[5] == "  rank 2: <repr failed: RuntimeError>"
    assert len(lines) == 6
    assert "FAILED" not in format_result(result)


def test_format_result_multiline_repr_is_indented() -> None:
    class Multi:
        def __repr__(self) -> str:
            return "tensor([1,\n        2])"

    text = format_result(RunResult(WorkerState.SUCCEEDED, return_values={0: Multi()}))
    assert text.split("\n")[2:] == ["  rank 0: tensor([1,", "            2])"]


def test_format_result_failure_has_reason_and_table() -> None:
    result = _result_three_nodes()
    result = RunResult(
        result.state,
        failures=result.failures,
        reason="max_restarts (0) exhausted",
        job_id="j-1",
    )
    text = format_result(result)
    first, rest = text.split("\n", 1)
    assert first == "j-1 FAILED: max_restarts (0) exhausted"
    assert rest == format_failures(result, "j-1")


# --- robustness ------------------------------------------------------------------------------

_text = st.text(max_size=40)
_floats = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([0.0, -1.0, 1e20, -1e20, T0]),
)
_ints = st.integers(min_value=-(2**70), max_value=2**70)

_failures = st.builds(
    ProcessFailure,
    global_rank=_ints,
    local_rank=_ints,
    pid=_ints,
    exitcode=_ints,
    message=_text,
    timestamp=_floats,
    node=_text,
    signal=_text,
    error_file=_text,
    traceback=_text,
    attempt=_ints,
    round=_ints,
    root_cause=st.booleans(),
    category=st.sampled_from(FailureCategory),
    stderr_tail=_text,
    role=_text,
    role_rank=_ints,
)


@settings(max_examples=300, deadline=None)
@given(failures=st.lists(_failures, max_size=5), name=_text)
def test_format_failures_never_raises(failures: list[ProcessFailure], name: str) -> None:
    result = RunResult(WorkerState.FAILED, failures={i: f for i, f in enumerate(failures)})
    text = format_failures(result, name)
    lines = text.split("\n")
    assert lines[0] == lines[-1]
    assert set(lines[0]) == {"="}
    assert "Root Cause (first observed failure):" in lines
    # Every failure gets an entry; multi-line values never start a line of their own.
    assert sum(1 for line in lines if line.startswith("  rank      : ")) >= len(failures)
    assert sum(1 for line in lines if line == f"[{len(failures) - 1}]:") == (1 if failures else 0)
    assert format_result(result).endswith(format_failures(result, ""))
