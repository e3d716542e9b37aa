"""Error files, stderr tails and the failures built from them (files only, no processes)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from client.errors import NO_ERROR_FILE_MESSAGE
from client.model import FailureCategory
from nodeagent._errorfile import (
    MAX_ERROR_FILE_BYTES,
    ErrorFileResult,
    build_failure,
    read_error_file,
    read_stderr_tail,
)

TORCH_FILE = {
    "message": {
        "message": "ValueError: boom from rank 1",
        "extraInfo": {
            "py_callstack": "Traceback (most recent call last):\n  ...\nValueError: boom\n",
            "timestamp": "1795998706",
        },
    }
}


def write(tmp_path: Path, content: str | bytes) -> Path:
    p = tmp_path / "error.json"
    if isinstance(content, str):
        p.write_text(content)
    else:
        p.write_bytes(content)
    return p


def test_torch_nested_format(tmp_path: Path) -> None:
    r = read_error_file(write(tmp_path, json.dumps(TORCH_FILE)))
    assert r.usable and r.problem is None
    assert r.message == "ValueError: boom from rank 1"
    assert r.traceback.startswith("Traceback")
    assert r.timestamp == 1795998706.0
    assert r.error_code is None


def test_timestamp_ns_is_preferred(tmp_path: Path) -> None:
    data = json.loads(json.dumps(TORCH_FILE))
    data["message"]["extraInfo"]["timestamp_ns"] = "1795998706123456789"
    r = read_error_file(write(tmp_path, json.dumps(data)))
    assert r.timestamp == pytest.approx(1795998706.123456789)
    # Nanoseconds that disagree with the seconds are not trusted.
    data["message"]["extraInfo"]["timestamp_ns"] = "5"
    assert read_error_file(write(tmp_path, json.dumps(data))).timestamp == 1795998706.0


def test_sub_second_timestamp_and_error_code(tmp_path: Path) -> None:
    data = json.loads(json.dumps(TORCH_FILE))
    data["message"]["extraInfo"]["timestamp"] = "1795998706.123456"
    data["message"]["errorCode"] = 3
    r = read_error_file(write(tmp_path, json.dumps(data)))
    assert r.timestamp == pytest.approx(1795998706.123456)
    assert r.error_code == 3


@pytest.mark.parametrize(
    ("data", "timestamp"),
    [
        ({"message": "flat", "timestamp": 1795998706}, 1795998706.0),
        ({"message": "flat", "timestamp": "1795998706"}, 1795998706.0),
        ({"message": "flat", "timestamp": 1795998706.5}, 1795998706.5),
        ({"message": "flat"}, None),
    ],
)
def test_flat_format(tmp_path: Path, data: dict[str, object], timestamp: float | None) -> None:
    r = read_error_file(write(tmp_path, json.dumps(data)))
    assert r.usable
    assert r.message == "flat"
    assert r.timestamp == timestamp


def test_nested_without_extra_info(tmp_path: Path) -> None:
    r = read_error_file(write(tmp_path, json.dumps({"message": {"message": "m"}})))
    assert r.usable and r.message == "m" and r.traceback == "" and r.timestamp is None


def test_missing_file_is_not_a_problem(tmp_path: Path) -> None:
    r = read_error_file(tmp_path / "nope.json")
    assert not r.found and r.problem is None and not r.usable


@pytest.mark.parametrize(
    ("content", "problem"),
    [
        ("", "is empty"),
        ("  \n", "is empty"),
        ('{"message": {"message": "Val', "is not valid JSON: Unterminated string"),
        ("not json", "is not valid JSON: Expecting value at line 1 column 1"),
        ("[1, 2]", "must hold a JSON object, got list"),
        ('"just a string"', "must hold a JSON object, got str"),
        ("{}", "has no 'message' field"),
        ('{"msg": "x"}', "has no 'message' field"),
        ('{"message": 3}', "'message' must be a string or an object, got int"),
        ('{"message": null}', "'message' must be a string or an object, got NoneType"),
        ('{"message": {"extraInfo": {}}}', "'message.message' is missing"),
        ('{"message": {"message": 5}}', "'message.message' is of type int, not a string"),
        ('{"message": {"message": "m", "extraInfo": []}}', "'message.extraInfo' must be an object"),
        (
            '{"message": {"message": "m", "extraInfo": {"py_callstack": 1}}}',
            "'message.extraInfo.py_callstack' must be a string",
        ),
        (
            '{"message": {"message": "m", "extraInfo": {"timestamp": "soon"}}}',
            "'message.extraInfo.timestamp' is not a number: 'soon'",
        ),
        (
            '{"message": {"message": "m", "extraInfo": {"timestamp": true}}}',
            "'message.extraInfo.timestamp' must be a number",
        ),
        ('{"message": "m", "timestamp": "NaN"}', "'timestamp' is not a valid time"),
        ('{"message": "m", "timestamp": -5}', "'timestamp' is not a valid time"),
        ('{"message": "m", "timestamp": [1]}', "'timestamp' must be a number"),
        ('{"message": "m", "traceback": 7}', "'traceback' must be a string"),
    ],
)
def test_malformed_files_say_what_is_wrong(tmp_path: Path, content: str, problem: str) -> None:
    p = write(tmp_path, content)
    r = read_error_file(p)
    assert r.found and not r.usable
    assert r.problem is not None
    assert r.problem.startswith(f"error file {p}")
    assert problem in r.problem


def test_invalid_utf8(tmp_path: Path) -> None:
    r = read_error_file(write(tmp_path, b'{"message": "\xff\xfe"}'))
    assert r.problem is not None and "is not valid UTF-8" in r.problem


def test_deeply_nested_json(tmp_path: Path) -> None:
    r = read_error_file(write(tmp_path, "[" * 100_000 + "]" * 100_000))
    assert r.problem is not None and "not valid JSON" in r.problem


def test_too_big(tmp_path: Path) -> None:
    big = json.dumps({"message": "x" * (MAX_ERROR_FILE_BYTES + 10)})
    p = write(tmp_path, big)
    r = read_error_file(p)
    assert r.problem == (
        f"error file {p} is {len(big)} bytes, over the limit of {MAX_ERROR_FILE_BYTES} bytes"
    )


def test_directory_fifo_and_unreadable(tmp_path: Path) -> None:
    d = tmp_path / "dir.json"
    d.mkdir()
    assert read_error_file(d).problem == f"error file {d} is not a regular file"
    fifo = tmp_path / "fifo.json"
    os.mkfifo(fifo)
    assert read_error_file(fifo).problem == f"error file {fifo} is not a regular file"
    if os.geteuid() != 0:
        secret = write(tmp_path, "{}")
        secret.chmod(0)
        r = read_error_file(secret)
        assert r.problem is not None and "cannot be read" in r.problem


def test_stderr_tail(tmp_path: Path) -> None:
    p = tmp_path / "stderr.log"
    p.write_text("".join(f"line {i}\n" for i in range(1000)))
    assert read_stderr_tail(p, 3) == "line 997\nline 998\nline 999"
    assert read_stderr_tail(p, 0) == ""
    # Bounded read from the end: the cut first line is dropped.
    tail = read_stderr_tail(p, 10_000, max_bytes=30)
    assert tail.splitlines()[-1] == "line 999"
    assert all(line.startswith("line ") for line in tail.splitlines())
    assert len(tail) <= 30
    assert read_stderr_tail(tmp_path / "missing.log", 5) == ""
    q = tmp_path / "bin.log"
    q.write_bytes(b"ok\n\xff\xfe bad bytes")
    assert read_stderr_tail(q, 5) == "ok\n\ufffd\ufffd bad bytes"


BASE = {
    "stderr_tail": "last words",
    "observed_at": 2000.5,
    "local_rank": 1,
    "global_rank": 5,
    "node": "nodeA",
    "attempt": 2,
    "round_": 4,
    "role": "trainer",
    "role_rank": 3,
}


def test_failure_from_signal() -> None:
    f = build_failure(exitcode=-9, pid=1234, error_file=None, **BASE)  # type: ignore[arg-type]
    assert f.message == "Signal 9 (SIGKILL) received by PID 1234"
    assert f.signal == "SIGKILL"
    assert f.error_file == "<N/A>"
    assert f.precise_timestamp == 2000.5
    assert f.stderr_tail == "last words"
    assert (f.global_rank, f.local_rank, f.node, f.attempt, f.round, f.role, f.role_rank) == (
        5,
        1,
        "nodeA",
        2,
        4,
        "trainer",
        3,
    )
    assert f.category is FailureCategory.USER


def test_failure_from_exit_code_without_file() -> None:
    missing = ErrorFileResult("/x/error.json")
    f = build_failure(exitcode=3, pid=77, error_file=missing, **BASE)  # type: ignore[arg-type]
    # torch's message exactly; what gelastic knows of the exit is the detail reports show.
    assert (
        f.message
        == NO_ERROR_FILE_MESSAGE
        == ("To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html")
    )
    assert f.detail == "Process exited with exit code 3 (pid 77); no error file was written"
    assert f.report_text == f.detail
    assert f.signal == "" and f.error_file == "<N/A>" and f.exitcode == 3


def test_failure_from_error_file_uses_its_time() -> None:
    ef = ErrorFileResult("/x/error.json", True, "ValueError: v", "Traceback...", 1500.25)
    f = build_failure(exitcode=1, pid=77, error_file=ef, **BASE)  # type: ignore[arg-type]
    assert (f.message, f.traceback, f.precise_timestamp, f.error_file) == (
        "ValueError: v",
        "Traceback...",
        1500.25,
        "/x/error.json",
    )
    assert f.timestamp == 1500 and type(f.timestamp) is int and f.detail == ""
    no_time = ErrorFileResult("/x/error.json", True, "m", "", None)
    g = build_failure(exitcode=1, pid=77, error_file=no_time, **BASE)  # type: ignore[arg-type]
    assert g.precise_timestamp == 2000.5 and g.timestamp == 2000


def test_failure_with_a_malformed_file() -> None:
    bad = ErrorFileResult("/x/error.json", True, problem="error file /x/error.json is empty")
    f = build_failure(exitcode=1, pid=77, error_file=bad, **BASE)  # type: ignore[arg-type]
    assert f.message == NO_ERROR_FILE_MESSAGE
    assert f.detail == "Process exited with exit code 1 (pid 77); error file /x/error.json is empty"
    assert f.error_file == "/x/error.json"
    s = build_failure(exitcode=-15, pid=77, error_file=bad, **BASE)  # type: ignore[arg-type]
    assert s.message == "Signal 15 (SIGTERM) received by PID 77"
    assert s.detail == "Signal 15 (SIGTERM) received by PID 77; error file /x/error.json is empty"


def test_agent_message_overrides_and_keeps_file_message() -> None:
    ef = ErrorFileResult("/x/error.json", True, "RuntimeError: r", "", 1500.0)
    f = build_failure(
        exitcode=-9,
        pid=8,
        error_file=ef,
        message="watchdog timer 's' expired",
        **BASE,  # type: ignore[arg-type]
    )
    assert f.message == "watchdog timer 's' expired"
    assert f.traceback == "RuntimeError: r"
    assert f.signal == "SIGKILL"


@pytest.mark.parametrize(
    ("ef", "timestamp", "resolution"),
    [
        # gelastic's writer (nanoseconds) and a float time: exact.
        (ErrorFileResult("/e", True, "m", "", 1999.123456789), 1999.123456789, 0.0),
        # torch's whole seconds, refined by the file's modification time: one kernel tick.
        (ErrorFileResult("/e", True, "m", "", 1999.0, written_at=1999.75), 1999.75, 0.01),
        # ... by the exit seen after it: somewhere between the second and the exit.
        (ErrorFileResult("/e", True, "m", "", 1999.0), 2000.5, 1.5),
        # ... by nothing (the exit came much later): the whole second.
        (ErrorFileResult("/e", True, "m", "", 1990.0), 1990.0, 1.0),
        # No time in the file: the agent saw the exit itself.
        (ErrorFileResult("/e", True, "m", "", None), 2000.5, 0.0),
        (None, 2000.5, 0.0),
    ],
)
def test_a_failure_says_how_precise_its_time_is(
    ef: ErrorFileResult | None, timestamp: float, resolution: float
) -> None:
    f = build_failure(exitcode=1, pid=7, error_file=ef, **BASE)  # type: ignore[arg-type]
    assert f.precise_timestamp == timestamp
    assert f.time_uncertainty == pytest.approx(resolution)
