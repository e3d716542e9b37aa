"""The reaper believes only a pid file of ours from this boot, and kills only marked processes.

Before the fix `reap_previous` SIGKILLed the process group of any pid in the file whose psutil
create_time matched, whoever wrote the file, in whichever boot: a planted (or stale) record
got an unrelated process group killed. A record with a negative pid raised out of psutil and
the agent did not start at all.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from nodeagent._reaper import boot_id
from nodeagent._sentinel import MARK_ENV, start_ticks
from nodeagent.session import AgentConfig, NodeAgent

PREFIX = "f" * 32 + "."
BOUND = 30.0


@pytest.fixture
def sleeps() -> Iterator[list[subprocess.Popen[bytes]]]:
    """`sleep` processes this test starts (and kills at the end, if still there)."""
    started: list[subprocess.Popen[bytes]] = []
    yield started
    for p in started:
        if p.poll() is None:
            p.kill()
        p.wait()


def start_sleep(
    sleeps: list[subprocess.Popen[bytes]], mark: str | None = None
) -> subprocess.Popen[bytes]:
    env = {k: v for k, v in os.environ.items() if k != MARK_ENV}
    if mark is not None:
        env[MARK_ENV] = mark
    p = subprocess.Popen(["sleep", "120"], env=env, start_new_session=True)
    sleeps.append(p)
    return p


def record(pid: int) -> dict[str, object]:
    return {
        "pid": pid,
        "create_time": psutil.Process(pid).create_time(),
        "job_id": "j",
        "rank": 0,
        "start_ticks": start_ticks(pid) or 0,
    }


def plant(
    state: Path, workers: list[object], *, boot: str | None = None, mode: int = 0o600
) -> Path:
    state.mkdir(mode=0o700, exist_ok=True)
    path = state / "agent-n1.pids.json"
    data = {
        "agent_pid": 999999,
        "boot_id": boot_id() if boot is None else boot,
        "mark_prefix": PREFIX,
        "workers": workers,
    }
    path.write_text(json.dumps(data))
    path.chmod(mode)
    return path


async def start_agent(state: Path) -> None:
    agent = NodeAgent(
        AgentConfig(coordinator="127.0.0.1:1", name="n1", addr="127.0.0.1", log_dir=str(state))
    )
    await agent.start()
    await agent.stop(0)


async def killed(p: subprocess.Popen[bytes]) -> bool:
    try:
        await asyncio.to_thread(p.wait, BOUND)
    except subprocess.TimeoutExpired:
        return False
    return True


async def test_records_of_another_boot_are_ignored(
    tmp_path: Path, sleeps: list[subprocess.Popen[bytes]]
) -> None:
    worker = start_sleep(sleeps, f"{PREFIX}1")
    plant(tmp_path / "s", [record(worker.pid)], boot=str(uuid.uuid4()))
    await start_agent(tmp_path / "s")
    assert worker.poll() is None, "a record of another boot got a process killed"
    # The same record from this boot is acted on: the test can tell the two apart.
    plant(tmp_path / "s", [record(worker.pid)])
    await start_agent(tmp_path / "s")
    assert await killed(worker)


async def test_a_live_process_without_our_mark_is_not_signalled(
    tmp_path: Path, sleeps: list[subprocess.Popen[bytes]], caplog: pytest.LogCaptureFixture
) -> None:
    stranger = start_sleep(sleeps)  # right pid, right start time, this boot: but not ours
    other_mark = start_sleep(sleeps, "0" * 32 + ".1")  # another agent's worker
    plant(tmp_path / "s", [record(stranger.pid), record(other_mark.pid)])
    with caplog.at_level(logging.WARNING):
        await start_agent(tmp_path / "s")
    assert stranger.poll() is None and other_mark.poll() is None
    assert f"recorded worker pid {stranger.pid} is alive but does not carry" in caplog.text


@pytest.mark.parametrize("mode", [0o666, 0o620])
async def test_a_pid_file_others_may_write_is_not_believed(
    tmp_path: Path, sleeps: list[subprocess.Popen[bytes]], mode: int
) -> None:
    worker = start_sleep(sleeps, f"{PREFIX}1")
    plant(tmp_path / "s", [record(worker.pid)], mode=mode)
    await start_agent(tmp_path / "s")
    assert worker.poll() is None


async def test_a_symlinked_pid_file_is_not_followed(
    tmp_path: Path, sleeps: list[subprocess.Popen[bytes]]
) -> None:
    worker = start_sleep(sleeps, f"{PREFIX}1")
    elsewhere = plant(tmp_path / "elsewhere", [record(worker.pid)])
    state = tmp_path / "s"
    state.mkdir(mode=0o700)
    (state / "agent-n1.pids.json").symlink_to(elsewhere)
    await start_agent(state)
    assert worker.poll() is None
    assert elsewhere.exists()


async def test_bad_records_are_reported_and_ignored_and_the_agent_starts(
    tmp_path: Path, sleeps: list[subprocess.Popen[bytes]], caplog: pytest.LogCaptureFixture
) -> None:
    worker = start_sleep(sleeps, f"{PREFIX}1")
    bad: list[object] = [
        {"pid": -5, "create_time": 0, "start_ticks": 0},
        {"pid": -1, "create_time": 0},
        {"pid": 0},
        {"pid": 1, "create_time": psutil.Process(1).create_time(), "start_ticks": 0},
        {"pid": "12"},
        {"pid": 1 << 40},
        {"pid": 2, "start_ticks": -3},
        "garbage",
        None,
    ]
    plant(tmp_path / "s", [*bad, record(worker.pid)])
    with caplog.at_level(logging.WARNING):
        await start_agent(tmp_path / "s")
    ignored = [r for r in caplog.records if "ignoring record" in r.getMessage()]
    assert len(ignored) == len(bad), caplog.text
    assert await killed(worker), "the good record next to the bad ones was not acted on"


async def test_a_pid_file_that_is_not_json_does_not_stop_the_agent(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    state = tmp_path / "s"
    state.mkdir(mode=0o700)
    (state / "agent-n1.pids.json").write_bytes(b"-5\n\x00\xff{")
    with caplog.at_level(logging.WARNING):
        await start_agent(state)
    assert "ignoring unreadable worker pid file" in caplog.text


@pytest.mark.parametrize("pid", [-5, -1, 0, 1])
async def test_a_lone_record_of_pid_1_or_below_does_not_stop_the_agent(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, pid: int
) -> None:
    # Well-formed but for the pid (before, psutil.Process(-5) raised out of the reaper).
    plant(tmp_path / "s", [{"pid": pid, "create_time": 0.0, "job_id": "j", "rank": 0}])
    with caplog.at_level(logging.WARNING):
        await start_agent(tmp_path / "s")
    assert f"pid '{pid}' is not one of a worker" in caplog.text
