"""The root cause written to a scheduler's TORCHELASTIC_ERROR_FILE, read back by torch."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

import pytest
from torch.distributed.elastic.multiprocessing import errors as torch_errors

from client._scheduler_error import (
    MAX_SCHEDULER_ERROR_FILE_BYTES,
    scheduler_error_data,
    write_scheduler_error_file,
)
from client.model import ProcessFailure, RunResult, WorkerState

NOW = 1_795_998_800.0


def _failure(rank: int, timestamp: float, **kw: Any) -> ProcessFailure:
    fields: dict[str, Any] = {
        "global_rank": rank,
        "local_rank": rank,
        "pid": 100 + rank,
        "exitcode": 1,
        "message": f"ValueError: boom {rank}",
        "timestamp": timestamp,
        "node": "node-a",
    }
    fields.update(kw)
    return ProcessFailure(**fields)


def _failed(*failures: ProcessFailure, reason: str = "rank failed") -> RunResult:
    return RunResult(
        state=WorkerState.FAILED,
        failures={f.global_rank: f for f in failures},
        reason=reason,
        name="train",
    )


def _write(result: RunResult, path: Path, **kw: Any) -> str | None:
    return write_scheduler_error_file(
        result, "train", env={"TORCHELASTIC_ERROR_FILE": str(path)}, now=NOW, **kw
    )


def _torch_reads(path: Path, exitcode: int = 1) -> Any:
    """What torch's agent makes of the file, as it would of a child's error file."""
    return torch_errors.ProcessFailure(local_rank=0, pid=1, exitcode=exitcode, error_file=str(path))


def test_root_cause_from_a_remote_worker_file(tmp_path: Path) -> None:
    path = tmp_path / "error.json"
    result = _failed(
        _failure(0, NOW - 5, exitcode=-15, message="Signal 15 (SIGTERM) received by PID 100"),
        _failure(
            1,
            NOW - 9.25,
            error_file="/logs/job/attempt_0/1/error.json",
            traceback='Traceback (most recent call last):\n  File "t.py"\nValueError: boom 1\n',
        ),
    )
    assert _write(result, path) == str(path)
    data = json.loads(path.read_text())
    # dump_error_file's shape: the worker's record plus its exit code.
    assert data == {
        "message": {
            "message": "ValueError: boom 1",
            "extraInfo": {
                "py_callstack": result.failures[1].traceback,
                "timestamp": str(int(NOW - 9.25)),
            },
            "errorCode": 1,
        }
    }
    read = _torch_reads(path)
    assert read.message["message"] == "ValueError: boom 1"
    assert read.timestamp == int(NOW - 9.25)
    assert path.stat().st_mode & 0o777 == 0o600


def test_local_worker_file_is_copied_as_torch_dump_error_file_copies_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    worker_file = tmp_path / "worker.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(worker_file))
    try:
        raise RuntimeError("from the worker")
    except RuntimeError as e:
        torch_errors.ErrorHandler().record_exception(e)
    # torch's nanny copy of the same file, for comparison.
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(tmp_path / "torch.json"))
    torch_errors.ErrorHandler().dump_error_file(str(worker_file), -11)
    monkeypatch.delenv("TORCHELASTIC_ERROR_FILE")

    result = _failed(_failure(2, NOW, exitcode=-11, error_file=str(worker_file)))
    ours = tmp_path / "ours.json"
    assert _write(result, ours, local_error_files=True) == str(ours)
    assert json.loads(ours.read_text()) == json.loads((tmp_path / "torch.json").read_text())
    assert _torch_reads(ours, -11).message["errorCode"] == -11


def test_local_file_that_is_not_an_error_file_is_rebuilt(tmp_path: Path) -> None:
    bogus = tmp_path / "bogus.json"
    bogus.write_text("[1, 2]")
    link = tmp_path / "link.json"
    link.symlink_to(bogus)
    for error_file in (bogus, link, tmp_path / "gone.json"):
        result = _failed(_failure(0, NOW, error_file=str(error_file)))
        data = scheduler_error_data(result, "train", local_error_files=True, now=NOW)
        assert data["message"]["message"] == "ValueError: boom 0"
        assert data["message"]["errorCode"] == 1


def test_failure_without_error_file_is_what_record_exception_writes(tmp_path: Path) -> None:
    path = tmp_path / "error.json"
    tail = 'Traceback (most recent call last):\n  File "x.py"\nKeyError: 3\n'
    result = _failed(
        _failure(0, NOW - 1, exitcode=-9, message="Signal 9 (SIGKILL) received by PID 100"),
        _failure(1, NOW, exitcode=2, stderr_tail=tail),
    )
    _write(result, path)
    data = json.loads(path.read_text())
    assert set(data) == {"message"}
    assert set(data["message"]) == {"message", "extraInfo"}
    assert set(data["message"]["extraInfo"]) == {"py_callstack", "timestamp"}
    assert data["message"]["message"] == "Signal 9 (SIGKILL) received by PID 100"
    assert _torch_reads(path, -9).timestamp == int(NOW - 1)

    _write(_failed(_failure(1, NOW, exitcode=2, stderr_tail=tail)), path)
    assert json.loads(path.read_text())["message"]["extraInfo"]["py_callstack"] == tail


def test_failed_job_without_failures_records_its_reason(tmp_path: Path) -> None:
    path = tmp_path / "error.json"
    _write(_failed(reason="rendezvous timed out:\n1/2 nodes joined"), path)
    read = _torch_reads(path)
    assert read.message["message"] == "train FAILED: rendezvous timed out: 1/2 nodes joined"
    assert read.timestamp == int(NOW)


@pytest.mark.parametrize("state", [WorkerState.SUCCEEDED, WorkerState.STOPPED])
def test_nothing_written_unless_failed(tmp_path: Path, state: WorkerState) -> None:
    path = tmp_path / "error.json"
    assert _write(RunResult(state=state), path) is None
    assert not path.exists()


def test_nothing_written_without_the_variable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    for env in ({}, {"TORCHELASTIC_ERROR_FILE": ""}):
        assert write_scheduler_error_file(_failed(_failure(0, NOW)), "t", env=env) is None
    assert list(tmp_path.iterdir()) == []


def test_existing_file_is_logged_and_replaced_atomically(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "error.json"
    path.write_text('{"message": "earlier"}')
    path.chmod(0o644)
    with caplog.at_level(logging.WARNING):
        _write(_failed(_failure(0, NOW)), path)
    assert "already exists and will be overwritten" in caplog.text
    assert '"message": "earlier"' in caplog.text
    assert json.loads(path.read_text())["message"]["message"] == "ValueError: boom 0"
    assert path.stat().st_mode & 0o777 == 0o600
    assert [p.name for p in tmp_path.iterdir()] == ["error.json"]


def test_symlink_at_the_path_is_replaced_not_followed(tmp_path: Path) -> None:
    target = tmp_path / "precious.txt"
    target.write_text("keep me")
    path = tmp_path / "error.json"
    path.symlink_to(target)
    _write(_failed(_failure(0, NOW)), path)
    assert target.read_text() == "keep me"
    assert not path.is_symlink()
    assert _torch_reads(path).message["message"] == "ValueError: boom 0"


def test_size_is_bounded_and_keeps_the_end_of_the_traceback(tmp_path: Path) -> None:
    path = tmp_path / "error.json"
    traceback = "Traceback (most recent call last):\n" + "  frame\n" * 100_000 + "ValueError: end\n"
    result = _failed(
        _failure(0, NOW, error_file="/remote/error.json", traceback=traceback, message="m" * 10**6)
    )
    _write(result, path)
    assert os.path.getsize(path) <= MAX_SCHEDULER_ERROR_FILE_BYTES
    read = _torch_reads(path)
    assert read.message["extraInfo"]["py_callstack"].endswith("ValueError: end\n")
    assert len(read.message["message"]) <= 4096


def test_unwritable_path_is_a_warning(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "missing-dir" / "error.json"
    with caplog.at_level(logging.WARNING):
        assert _write(_failed(_failure(0, NOW)), path) is None
    assert "cannot write the root cause" in caplog.text
    assert (
        write_scheduler_error_file(
            _failed(_failure(0, NOW)), "t", env={"TORCHELASTIC_ERROR_FILE": "a\0b"}
        )
        is None
    )
