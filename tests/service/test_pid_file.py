"""The agent's worker pid file written behind: off the event loop, changes coalesced, and
saying what the registry holds once `flushed`.

Real processes (`sleep`) are recorded, since a pid is recorded only while it is alive; each is
killed and reaped at the end.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from nodeagent import _reaper
from nodeagent._reaper import PidRegistry

PREFIX = "f" * 32 + "."


@pytest.fixture
def sleepers() -> Iterator[list[subprocess.Popen[bytes]]]:
    procs = [subprocess.Popen(["sleep", "60"]) for _ in range(4)]
    try:
        yield procs
    finally:
        for p in procs:
            p.kill()
            p.wait()


def _recorded(path: Path) -> list[int]:
    return sorted(w["pid"] for w in json.loads(path.read_text())["workers"])


async def test_the_pid_file_is_written_off_the_loop_once_per_burst(
    tmp_path: Path, sleepers: list[subprocess.Popen[bytes]], monkeypatch: pytest.MonkeyPatch
) -> None:
    writes: list[tuple[int, list[int]]] = []
    real_write = _reaper._write

    def counted(path: Path, workers: list[_reaper.RecordedWorker], mark_prefix: str = "") -> None:
        writes.append((threading.get_ident(), sorted(w.pid for w in workers)))
        real_write(path, workers, mark_prefix)

    monkeypatch.setattr(_reaper, "_write", counted)
    registry = PidRegistry(tmp_path / "agent.pids.json", mark_prefix=PREFIX, write_behind=True)
    pids = sorted(p.pid for p in sleepers)
    # A round's start: every worker recorded in one go on the loop, none written yet.
    for pid in pids:
        registry.add(pid, job_id="j", global_rank=pid)
    assert writes == []
    await registry.flushed()
    assert _recorded(registry.path) == pids
    assert all(ident != threading.get_ident() for ident, _ in writes)
    assert len(writes) == 1 and writes[0][1] == pids
    registry.remove(pids[0])
    registry.remove(pids[1])
    await registry.flushed()
    assert _recorded(registry.path) == pids[2:]
    assert len(writes) == 2


async def test_changes_made_during_a_write_are_written_after_it(
    tmp_path: Path, sleepers: list[subprocess.Popen[bytes]], monkeypatch: pytest.MonkeyPatch
) -> None:
    registry = PidRegistry(tmp_path / "agent.pids.json", mark_prefix=PREFIX, write_behind=True)
    pids = sorted(p.pid for p in sleepers)
    in_write = threading.Event()
    go_on = threading.Event()
    real_write = _reaper._write

    def held(path: Path, workers: list[_reaper.RecordedWorker], mark_prefix: str = "") -> None:
        in_write.set()
        assert go_on.wait(10.0)
        real_write(path, workers, mark_prefix)

    monkeypatch.setattr(_reaper, "_write", held)
    registry.add(pids[0])
    # The first write is under way (in its thread) when the next change comes.
    assert await asyncio.to_thread(in_write.wait, 10.0)
    registry.add(pids[1])
    registry.remove(pids[0])
    go_on.set()
    await registry.flushed()
    assert _recorded(registry.path) == [pids[1]]


def test_without_a_running_loop_the_file_is_written_at_once(
    tmp_path: Path, sleepers: list[subprocess.Popen[bytes]]
) -> None:
    registry = PidRegistry(tmp_path / "agent.pids.json", mark_prefix=PREFIX, write_behind=True)
    registry.add(sleepers[0].pid)
    assert _recorded(registry.path) == [sleepers[0].pid]
