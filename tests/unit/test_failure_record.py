"""`client.model.ProcessFailure` reads as torch's where code reads it: `message` exactly torch's,
`timestamp` an int; the precise time, the executable and gelastic's own account of the exit are
fields of their own, and they survive the wire and reach the failure table."""

from __future__ import annotations

import dataclasses
import math

from client.errors import NO_ERROR_FILE_MESSAGE
from client.model import ProcessFailure, RunResult, WorkerState
from client.wire import failure_from_pb, failure_to_pb


def _failure(**kw: object) -> ProcessFailure:
    base: dict[str, object] = {
        "global_rank": 1,
        "local_rank": 1,
        "pid": 7,
        "exitcode": 3,
        "message": NO_ERROR_FILE_MESSAGE,
        "timestamp": 1795998706.25,
        "node": "node-a",
        "executable": "/usr/bin/python3",
        "detail": "Process exited with exit code 3 (pid 7); no error file was written",
        "root_cause": True,
    }
    base.update(kw)
    return ProcessFailure(**base)  # type: ignore[arg-type]


def test_timestamp_is_torchs_int_and_the_precise_time_is_kept() -> None:
    f = _failure()
    assert (f.timestamp, type(f.timestamp), f.precise_timestamp) == (1795998706, int, 1795998706.25)
    # A float given again (a time corrected, skewed) moves both; an int keeps the precise time.
    moved = dataclasses.replace(f, timestamp=f.precise_timestamp - 0.5)
    assert (moved.timestamp, moved.precise_timestamp) == (1795998705, 1795998705.75)
    assert dataclasses.replace(f, pid=8).precise_timestamp == 1795998706.25
    assert _failure(timestamp=12).precise_timestamp == 12.0
    bad = _failure(timestamp=math.nan)
    assert bad.timestamp == 0 and math.isnan(bad.precise_timestamp)


def test_the_wire_keeps_the_precise_time_executable_and_detail() -> None:
    f = _failure()
    back = failure_from_pb(failure_to_pb(f))
    assert back == f
    assert (back.executable, back.detail, back.precise_timestamp) == (
        "/usr/bin/python3",
        f.detail,
        1795998706.25,
    )


def test_the_table_shows_the_detail_and_the_message_stays_torchs() -> None:
    f = _failure()
    assert f.message == NO_ERROR_FILE_MESSAGE and f.report_text == f.detail
    table = RunResult(state=WorkerState.FAILED, failures={1: f}, job_id="j").format_failures()
    assert f"  traceback : {f.detail}" in table
    assert "  executable: /usr/bin/python3" in table
    assert NO_ERROR_FILE_MESSAGE not in table
