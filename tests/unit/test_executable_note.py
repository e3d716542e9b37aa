"""A worker's own failure names the executable that ran in a field of its own (its message is
torch's, exactly), and the failure table shows it in a row of its own, beside the traceback or
the message. A message from an older agent, with the note appended, reads the same."""

from __future__ import annotations

import os
from pathlib import Path

from client.model import (
    ProcessFailure,
    RunResult,
    WorkerState,
    executable_note,
)
from nodeagent._launch import bounded, resolve_executable


def _result(message: str, traceback: str, executable: str = "") -> RunResult:
    f = ProcessFailure(
        global_rank=0,
        local_rank=0,
        pid=7,
        exitcode=1,
        message=message,
        timestamp=1.0,
        node="node-a",
        traceback=traceback,
        root_cause=True,
        executable=executable,
    )
    return RunResult(state=WorkerState.FAILED, failures={0: f}, job_id="j")


def test_the_table_shows_the_executable_next_to_the_traceback() -> None:
    note = executable_note("/usr/bin/python3", "node-a")
    assert note == "(ran /usr/bin/python3 on node node-a)"
    tb = "Traceback (most recent call last):\nModuleNotFoundError: No module named 'torch'"
    table = _result(f"ModuleNotFoundError: No module named 'torch' {note}", tb).format_failures()
    assert "  executable: /usr/bin/python3\n  traceback : Traceback" in table
    # Without the note (an older agent, or the agent's own verdict), no such row.
    assert "executable" not in _result("ModuleNotFoundError: x", tb).format_failures()
    # Without a traceback the message is the row, and the executable a row of its own still.
    plain = _result(f"Process exited with exit code 3 (pid 7) {note}", "").format_failures()
    assert (
        "  executable: /usr/bin/python3\n  traceback : Process exited with exit code 3 (pid 7)\n"
    ) in plain
    assert "(ran " not in plain


def test_the_executable_field_gives_the_row_and_the_message_stays_torchs() -> None:
    tb = "Traceback (most recent call last):\nValueError: boom"
    result = _result("ValueError: boom", tb, executable="/usr/bin/python3")
    assert result.failures[0].message == "ValueError: boom"
    assert "  executable: /usr/bin/python3\n  traceback : Traceback" in result.format_failures()


def test_resolve_executable_follows_the_workers_path_and_cwd(tmp_path: Path) -> None:
    prog = tmp_path / "bin" / "trainer"
    prog.parent.mkdir()
    prog.write_text("#!/bin/sh\n")
    prog.chmod(0o755)
    env = {"PATH": f"/nonexistent:{prog.parent}"}
    assert resolve_executable("trainer", env, "/") == str(prog)
    assert resolve_executable("trainer", {"PATH": "/nonexistent"}, "/") is None
    assert resolve_executable("bin/trainer", {}, str(tmp_path)) == os.path.join(
        tmp_path, "bin/trainer"
    )
    assert resolve_executable("./missing", {}, str(tmp_path)) is None
    assert bounded("x" * 1000) == "x" * 297 + "..." and bounded("short") == "short"
