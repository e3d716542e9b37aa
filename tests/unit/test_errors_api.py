"""client.errors against torchelastic: files torch's reader parses, and the reverse."""

from __future__ import annotations

import faulthandler
import json
import logging
import os
import pickle
import re
import socket
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
from torch.distributed.elastic.multiprocessing import errors as torch_errors

import client.errors as errors_module
from client.errors import (
    ChildFailedError,
    ErrorHandler,
    read_error_file,
    record,
)
from client.model import ProcessFailure

ERRORS_PY = Path(errors_module.__file__)


@pytest.fixture
def error_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(path))
    return path


def _raise_boom() -> None:
    raise ValueError("boom")


def _load(path: Path) -> Any:
    return json.loads(path.read_text())


def _blocks(table: str) -> dict[str, str]:
    """The `[idx]:` entries of a failure table, keyed by their `[idx]:` line."""
    out: dict[str, str] = {}
    current: list[str] | None = None
    for line in table.split("\n"):
        if re.fullmatch(r"\[\d+\]:", line):
            current = [line]
            out[line] = ""
        elif current is not None and line.startswith("  "):
            current.append(line)
        else:
            current = None
        if current is not None:
            out[current[0]] = "\n".join(current)
    return out


# --- the error file --------------------------------------------------------------------------


def test_record_writes_torch_nested_format(error_file: Path) -> None:
    before = time.time()
    with pytest.raises(ValueError, match="boom"):
        record(_raise_boom)()
    after = time.time()

    data = _load(error_file)
    assert set(data) == {"message"}
    assert set(data["message"]) == {"message", "extraInfo"}
    assert data["message"]["message"] == "ValueError: boom"
    extra = data["message"]["extraInfo"]
    assert set(extra) == {"py_callstack", "timestamp", "timestamp_ns"}
    assert extra["py_callstack"].startswith("Traceback (most recent call last):\n")
    assert "in _raise_boom" in extra["py_callstack"]
    assert extra["py_callstack"].endswith("ValueError: boom\n")
    # Both timestamps are strings of digits, and describe the same instant.
    assert re.fullmatch(r"\d+", extra["timestamp"])
    assert re.fullmatch(r"\d+", extra["timestamp_ns"])
    assert int(extra["timestamp_ns"]) // 1_000_000_000 == int(extra["timestamp"])
    assert int(before) <= int(extra["timestamp"]) <= after
    assert before - 1e-3 <= int(extra["timestamp_ns"]) / 1e9 <= after + 1e-3


def test_torch_reader_parses_our_file(error_file: Path) -> None:
    with pytest.raises(ValueError):
        record(_raise_boom)()
    ours = _load(error_file)

    failure = torch_errors.ProcessFailure(
        local_rank=0, pid=1, exitcode=1, error_file=str(error_file)
    )
    assert failure.error_file == str(error_file)
    assert isinstance(failure.message, dict)
    assert failure.message["message"] == "ValueError: boom"
    assert failure.timestamp == int(ours["message"]["extraInfo"]["timestamp"])
    table = str(torch_errors.ChildFailedError("train.py", {0: failure}))
    assert 'raise ValueError("boom")' in table


def test_fractional_timestamp_breaks_torch_reader(tmp_path: Path) -> None:
    # Why the file keeps "timestamp" in whole seconds and puts precision in "timestamp_ns".
    path = tmp_path / "error.json"
    extra = {"py_callstack": "tb", "timestamp": f"{1795998706.123456:.6f}"}
    path.write_text(json.dumps({"message": {"message": "ValueError: x", "extraInfo": extra}}))
    with pytest.raises(ValueError):
        torch_errors.ProcessFailure(local_rank=0, pid=1, exitcode=1, error_file=str(path))


def test_our_reader_parses_torch_record_output(error_file: Path) -> None:
    @torch_errors.record
    def main() -> None:
        raise RuntimeError("from torch")

    with pytest.raises(RuntimeError):
        main()
    data = _load(error_file)
    assert set(data["message"]) == {"message", "extraInfo"}
    assert set(data["message"]["extraInfo"]) == {"py_callstack", "timestamp"}

    parsed = read_error_file(str(error_file))
    assert parsed.message == "RuntimeError: from torch"
    assert 'raise RuntimeError("from torch")' in parsed.traceback
    assert parsed.timestamp == float(data["message"]["extraInfo"]["timestamp"])
    assert parsed.error_code is None


def test_our_reader_prefers_nanoseconds(error_file: Path) -> None:
    with pytest.raises(ValueError):
        record(_raise_boom)()
    extra = _load(error_file)["message"]["extraInfo"]
    parsed = read_error_file(str(error_file))
    assert parsed.timestamp == int(extra["timestamp_ns"]) / 1e9
    assert parsed.message == "ValueError: boom"
    assert parsed.traceback == extra["py_callstack"]


def test_our_reader_flat_format_and_malformed(tmp_path: Path) -> None:
    flat = tmp_path / "flat.json"
    flat.write_text(json.dumps({"message": "custom failure", "timestamp": "1700000000"}))
    parsed = read_error_file(str(flat))
    assert (parsed.message, parsed.traceback, parsed.timestamp) == (
        "custom failure",
        "",
        1700000000.0,
    )
    no_ts = tmp_path / "no_ts.json"
    no_ts.write_text(json.dumps({"message": "m"}))
    assert read_error_file(str(no_ts)).timestamp == 0.0

    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"msg": "x"}))
    with pytest.raises(ValueError, match="no `message`"):
        read_error_file(str(bad))


def test_record_exception_outside_except_block(error_file: Path) -> None:
    try:
        _raise_boom()
    except ValueError as e:
        caught = e
    ErrorHandler().record_exception(caught)
    callstack = _load(error_file)["message"]["extraInfo"]["py_callstack"]
    assert "NoneType: None" not in callstack
    assert "in _raise_boom" in callstack


def test_env_var_unset_writes_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TORCHELASTIC_ERROR_FILE", raising=False)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match="boom"):
        record(_raise_boom)()
    ErrorHandler().record_exception(ValueError("x"))
    assert list(tmp_path.iterdir()) == []


def test_env_var_unset_logs_what_would_be_written(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # torch's ErrorHandler documents it: without the variable the structured error is logged.
    monkeypatch.delenv("TORCHELASTIC_ERROR_FILE", raising=False)
    try:
        _raise_boom()
    except ValueError as e:
        with caplog.at_level(logging.INFO, logger="client.errors"):
            ErrorHandler().record_exception(e)
    (logged,) = [r.getMessage() for r in caplog.records if "would have held" in r.getMessage()]
    data = json.loads(logged.split("\n", 1)[1])
    assert data["message"]["message"] == "ValueError: boom"
    assert "in _raise_boom" in data["message"]["extraInfo"]["py_callstack"]
    assert int(data["message"]["extraInfo"]["timestamp"]) > 0


def test_unwritable_error_file_keeps_original_exception(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(tmp_path / "missing-dir" / "error.json"))
    with (
        caplog.at_level(logging.WARNING, logger="client.errors"),
        pytest.raises(ValueError, match="boom"),
    ):
        record(_raise_boom)()
    assert "cannot write error file" in caplog.text
    assert not (tmp_path / "missing-dir").exists()


# --- record: SystemExit and decorator forms ---------------------------------------------------


@pytest.mark.parametrize("code", [0, None])
def test_clean_system_exit_returns_none(error_file: Path, code: int | None) -> None:
    @record
    def main() -> int:
        raise SystemExit(code)

    assert main() is None
    assert not error_file.exists()


def test_bare_sys_exit_returns_none(error_file: Path) -> None:
    @record
    def main() -> int:
        sys.exit()

    assert main() is None
    assert not error_file.exists()


@pytest.mark.parametrize("code", [1, 2, "fatal: bad config"])
def test_failing_system_exit_is_reraised_without_file(error_file: Path, code: int | str) -> None:
    @record
    def main() -> None:
        raise SystemExit(code)

    with pytest.raises(SystemExit) as info:
        main()
    assert info.value.code == code
    assert not error_file.exists()


def test_decorator_forms(error_file: Path) -> None:
    @record
    def bare(x: int) -> int:
        """Doubles."""
        return 2 * x

    @record()
    def called(x: int, *, y: int = 1) -> int:
        return x + y

    assert bare(21) == 42
    assert called(1, y=2) == 3
    assert bare.__name__ == "bare"
    assert bare.__doc__ == "Doubles."
    assert called.__name__ == "called"
    assert not error_file.exists()

    @record()
    def fails() -> None:
        raise KeyError("k")

    with pytest.raises(KeyError):
        fails()
    assert _load(error_file)["message"]["message"] == "KeyError: 'k'"


def test_custom_error_handler_is_used(error_file: Path) -> None:
    class Counting(ErrorHandler):
        def __init__(self) -> None:
            self.initialized = 0
            self.recorded: list[BaseException] = []

        def initialize(self) -> None:
            self.initialized += 1

        def record_exception(self, e: BaseException) -> None:
            self.recorded.append(e)

    handler = Counting()
    with pytest.raises(ValueError):
        record(_raise_boom, error_handler=handler)()
    assert handler.initialized == 1
    assert [str(e) for e in handler.recorded] == ["boom"]
    assert not error_file.exists()

    handler2 = Counting()
    wrapped = record(error_handler=handler2)(lambda: 7)
    assert wrapped() == 7
    assert handler2.initialized == 1
    assert handler2.recorded == []


def test_initialize_enables_faulthandler_for_all_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[dict[str, Any]] = []
    monkeypatch.setattr(faulthandler, "enable", lambda **kwargs: calls.append(kwargs))
    record(lambda: None)()
    assert calls == [{"all_threads": True}]


def test_keyboard_interrupt_is_not_recorded(error_file: Path) -> None:
    @record
    def main() -> None:
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        main()
    assert not error_file.exists()


# --- dump_error_file -------------------------------------------------------------------------


def _child_file(tmp_path: Path, data: Any, name: str = "child.json") -> Path:
    path = tmp_path / name
    path.write_text(json.dumps(data))
    return path


NESTED = {"message": {"message": "ValueError: c", "extraInfo": {"timestamp": "5"}}}


def test_dump_error_file_adds_error_code(tmp_path: Path, error_file: Path) -> None:
    child = _child_file(tmp_path, NESTED)
    ErrorHandler().dump_error_file(str(child), error_code=-9)
    assert _load(error_file) == {
        "message": {"message": "ValueError: c", "extraInfo": {"timestamp": "5"}, "errorCode": -9}
    }
    # The child's file is left as it was.
    assert _load(child) == NESTED


def test_dump_error_file_code_zero_copies_as_is(tmp_path: Path, error_file: Path) -> None:
    child = _child_file(tmp_path, NESTED)
    ErrorHandler().dump_error_file(str(child))
    assert _load(error_file) == NESTED


def test_dump_error_file_flat_message_gets_no_code(tmp_path: Path, error_file: Path) -> None:
    flat = {"message": "plain", "timestamp": 3}
    child = _child_file(tmp_path, flat)
    ErrorHandler().dump_error_file(str(child), error_code=1)
    assert _load(error_file) == flat


def test_dump_error_file_matches_torch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    child = _child_file(tmp_path, NESTED)
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(tmp_path / "torch.json"))
    torch_errors.ErrorHandler().dump_error_file(str(child), 7)
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(tmp_path / "ours.json"))
    ErrorHandler().dump_error_file(str(child), 7)
    assert _load(tmp_path / "ours.json") == _load(tmp_path / "torch.json")


def test_dump_error_file_warns_and_overwrites(
    tmp_path: Path, error_file: Path, caplog: pytest.LogCaptureFixture
) -> None:
    error_file.write_text('{"message": "stale"}')
    child = _child_file(tmp_path, NESTED)
    with caplog.at_level(logging.WARNING, logger="client.errors"):
        ErrorHandler().dump_error_file(str(child), error_code=2)
    assert _load(error_file)["message"]["errorCode"] == 2
    assert "already exists" in caplog.text
    assert '"message": "stale"' in caplog.text  # pretty-printed, as torch logs it


def test_dump_error_file_without_env_var(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.delenv("TORCHELASTIC_ERROR_FILE", raising=False)
    child = _child_file(tmp_path, NESTED)
    with caplog.at_level(logging.ERROR, logger="client.errors"):
        ErrorHandler().dump_error_file(str(child), error_code=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["child.json"]
    # torch's own line, word for word.
    assert f"no error file defined for parent, to copy child error file ({child})" in caplog.text


def test_dump_error_file_over_existing_file_like_torch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    child = _child_file(tmp_path, NESTED)
    texts: dict[str, str] = {}
    for who, handler in (("torch", torch_errors.ErrorHandler()), ("ours", ErrorHandler())):
        target = tmp_path / f"{who}.json"
        target.write_text('{"message": "stale"}')
        monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(target))
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            handler.dump_error_file(str(child), 3)
        texts[who] = "\n".join(
            r.getMessage().replace(str(target), "<target>")
            for r in caplog.records
            if "already exists" in r.getMessage()
        )
    assert texts["ours"] == texts["torch"]
    assert '"message": "stale"' in texts["ours"]
    assert _load(tmp_path / "ours.json") == _load(tmp_path / "torch.json")
    assert (tmp_path / "ours.json").stat().st_mode & 0o777 == 0o600
    assert [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")] == []


# --- ChildFailedError ------------------------------------------------------------------------


def _failure(rank: int, timestamp: float, **kw: Any) -> ProcessFailure:
    fields: dict[str, Any] = {
        "global_rank": rank,
        "local_rank": rank,
        "pid": 100 + rank,
        "exitcode": 1,
        "message": f"failure {rank}",
        "timestamp": timestamp,
        "node": "node-a",
    }
    fields.update(kw)
    return ProcessFailure(**fields)


def test_child_failed_error_first_failure_and_ties() -> None:
    err = ChildFailedError("nanny", {3: _failure(3, 20.0), 1: _failure(1, 10.5)})
    assert err.get_first_failure() == (1, err.failures[1])
    # Equal timestamps: the first one given wins, as in torchelastic.
    tie = ChildFailedError("nanny", {5: _failure(5, 10.0), 2: _failure(2, 10.0)})
    assert tie.get_first_failure()[0] == 5


def test_child_failed_error_pickles() -> None:
    err = ChildFailedError("nanny", {2: _failure(2, 3.0), 0: _failure(0, 1.0)})
    copy = pickle.loads(pickle.dumps(err))
    assert isinstance(copy, ChildFailedError)
    assert (copy.name, copy.failures, str(copy)) == (err.name, err.failures, str(err))


def test_child_failed_error_needs_failures() -> None:
    with pytest.raises(ValueError):
        ChildFailedError("nanny", {})


def test_child_failed_error_table_in_torch_order() -> None:
    err = ChildFailedError(
        "nanny",
        {
            0: _failure(0, 1795998707.0, exitcode=-15, message="Signal 15 (SIGTERM)"),
            1: _failure(1, 1795998706.0, traceback="Traceback:\n  line\nValueError: x\n"),
        },
    )
    text = str(err)
    assert text == err.format_msg()
    assert text.startswith("\n")
    lines = text.split("\n")
    assert lines[2] == "nanny FAILED"
    # torch's order, which tools parse: the other failures first, the root cause last.
    others_at = lines.index("Failures:")
    root_at = lines.index("Root Cause (first observed failure):")
    assert others_at < root_at
    assert "Other Failures:" not in lines
    assert lines[others_at + 1] == "[0]:"
    assert lines[root_at + 1] == "[1]:"
    assert "  exitcode  : -15 (pid: 100)  (SIGTERM)" in lines
    assert "  exitcode  : 1 (pid: 101) " in lines
    assert "  traceback : Traceback:" in lines
    assert "    line" in lines
    assert "  host      : node-a" in lines


def test_child_failed_error_blocks_match_torch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(socket, "getfqdn", lambda *a: "host-under-test")
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(tmp_path / "rank1.json"))
    with pytest.raises(ValueError):
        record(_raise_boom)()
    failures = {
        0: torch_errors.ProcessFailure(
            local_rank=0, pid=40, exitcode=-15, error_file=str(tmp_path / "none.json")
        ),
        1: torch_errors.ProcessFailure(
            local_rank=1, pid=41, exitcode=1, error_file=str(tmp_path / "rank1.json")
        ),
    }
    failures[0].timestamp = failures[1].timestamp + 1
    ours = ChildFailedError("train.py", failures)
    theirs = torch_errors.ChildFailedError("train.py", failures)
    assert set(_blocks(str(ours))) == {"[0]:", "[1]:"}
    # Character for character: frame, width, section order, blocks.
    assert str(ours) == str(theirs)
    assert ours.format_msg() == theirs.format_msg()  # type: ignore[no-untyped-call]
    assert ours.format_msg("#", "~") == theirs.format_msg("#", "~")  # type: ignore[no-untyped-call]


def test_child_failed_error_single_failure_matches_torch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(socket, "getfqdn", lambda *a: "h")
    failures = {
        3: torch_errors.ProcessFailure(
            local_rank=0, pid=7, exitcode=-9, error_file=str(tmp_path / "none.json")
        )
    }
    assert str(ChildFailedError("t", failures)) == str(torch_errors.ChildFailedError("t", failures))


# --- ProcessFailure as torch builds it ---------------------------------------------------------


@pytest.mark.parametrize(
    "content,exitcode",
    [
        (NESTED, 1),
        (NESTED, -11),
        ({"message": "flat text", "timestamp": 17}, 2),
        ({"message": "flat, no time"}, 1),
        (None, -9),  # no file, killed by a signal
        (None, 3),  # no file, a plain exit code
    ],
)
def test_process_failure_built_as_torch_builds_it(
    tmp_path: Path, content: Any, exitcode: int
) -> None:
    path = tmp_path / "child.json"
    if content is not None:
        path.write_text(json.dumps(content))
    ours = errors_module.ProcessFailure(0, 4242, exitcode, str(path))
    theirs = torch_errors.ProcessFailure(0, 4242, exitcode, str(path))
    for name in ("local_rank", "pid", "exitcode", "error_file", "message", "error_file_data"):
        assert getattr(ours, name) == getattr(theirs, name), name
    if content is None:
        assert abs(ours.timestamp - theirs.timestamp) <= 1
    else:
        assert ours.timestamp == theirs.timestamp
    assert ours.signal_name() == theirs.signal_name()
    assert ours.timestamp_isoformat() == datetime.fromtimestamp(ours.timestamp).isoformat(sep="_")


def test_process_failure_malformed_file_raises_like_torch(tmp_path: Path) -> None:
    path = tmp_path / "child.json"
    for text in ('{"no_message": 1}', "{not json", '{"message": {"extraInfo": {}}}'):
        path.write_text(text)
        with pytest.raises((KeyError, ValueError)):
            torch_errors.ProcessFailure(0, 1, 1, str(path))
        with pytest.raises(ValueError):
            errors_module.ProcessFailure(0, 1, 1, str(path))


def test_process_failure_feeds_record_like_torch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A nanny parent: its child's file, read through our ProcessFailure, becomes the parent's
    # error file exactly as torch's record makes it.
    child = _child_file(tmp_path, NESTED)
    written = {}
    for who, mod in (("ours", errors_module), ("torch", torch_errors)):
        monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(tmp_path / f"{who}.json"))
        failures = {0: mod.ProcessFailure(0, 5, -6, str(child))}

        def nanny(mod: Any = mod, failures: Any = failures) -> None:
            raise mod.ChildFailedError("nanny", failures)

        with pytest.raises(mod.ChildFailedError):
            mod.record(nanny)()
        written[who] = _load(tmp_path / f"{who}.json")
    assert written["ours"] == written["torch"]
    assert written["ours"]["message"]["errorCode"] == -6


def test_record_copies_root_cause_child_file(tmp_path: Path, error_file: Path) -> None:
    child = _child_file(tmp_path, NESTED)
    err = ChildFailedError(
        "nanny",
        {
            0: _failure(0, 9.0, exitcode=-15),
            1: _failure(1, 5.0, exitcode=-11, error_file=str(child)),
        },
    )

    @record
    def nanny() -> None:
        raise err

    with pytest.raises(ChildFailedError) as info:
        nanny()
    assert info.value is err
    assert _load(error_file)["message"]["errorCode"] == -11
    assert _load(error_file)["message"]["message"] == "ValueError: c"


def test_record_child_without_file_writes_nothing(
    error_file: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    err = ChildFailedError("nanny", {4: _failure(4, 5.0, exitcode=-9)})

    @record
    def nanny() -> None:
        raise err

    with pytest.raises(ChildFailedError):
        nanny()
    assert not error_file.exists()
    # torch's record does the same.
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(tmp_path / "torch.json"))
    failures = {4: torch_errors.ProcessFailure(0, 9, -9, str(tmp_path / "none.json"))}

    def torch_nanny() -> None:
        raise torch_errors.ChildFailedError("nanny", failures)

    with pytest.raises(torch_errors.ChildFailedError):
        torch_errors.record(torch_nanny)()
    assert not (tmp_path / "torch.json").exists()


def test_record_child_with_corrupt_file_records_the_exception(
    tmp_path: Path, error_file: Path
) -> None:
    corrupt = tmp_path / "corrupt.json"
    corrupt.write_text("{not json")
    err = ChildFailedError("nanny", {0: _failure(0, 1.0, error_file=str(corrupt))})
    with pytest.raises(ChildFailedError):
        record(lambda: (_ for _ in ()).throw(err))()
    assert _load(error_file)["message"]["message"].startswith("ChildFailedError:")


# --- stdlib only -----------------------------------------------------------------------------

_BOOTSTRAP = """
import importlib.util, sys
spec = importlib.util.spec_from_file_location("gelastic_errors", sys.argv[1])
mod = importlib.util.module_from_spec(spec)
spec.loader.exec_module(mod)
ours = sorted(m for m in sys.modules
              if m.split(".")[0] in {"client", "coordinator", "nodeagent", "protos", "grpc",
                                     "torch"})
assert not ours, ours

@mod.record
def main():
    raise ValueError("from bootstrap")

main()
"""


def test_loads_by_path_without_site_packages(tmp_path: Path) -> None:
    path = tmp_path / "error.json"
    env = {"TORCHELASTIC_ERROR_FILE": str(path), "PATH": os.environ.get("PATH", "")}
    proc = subprocess.run(
        [sys.executable, "-I", "-S", "-c", _BOOTSTRAP, str(ERRORS_PY)],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 1, proc.stderr
    assert "ValueError: from bootstrap" in proc.stderr
    assert _load(path)["message"]["message"] == "ValueError: from bootstrap"
