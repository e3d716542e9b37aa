"""The sentinel with real processes: a worker's children die when it exits, when the agent is
SIGKILLed, and when the agent stops; a sentinel that dies is replaced and told every worker.

The "workers" are tests/workloads/orphans.py trees (a session leader with one child in its
session, one in a session of its own, one with an empty env); every pid is killed at the end.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from nodeagent import _process as process_module
from nodeagent._process import Sentinel
from nodeagent._reaper import PidRegistry, reap_previous
from nodeagent._sentinel import MARK_ENV, start_ticks
from tests._helpers import gone, wait_for

PY = sys.executable
ROOT = Path(__file__).resolve().parents[2]
ORPHANS = str(ROOT / "tests" / "workloads" / "orphans.py")
BOUND = 3.0


@pytest.fixture
def started() -> Iterator[list[int]]:
    """Pids this test started; any still alive at the end are killed (and fail the test)."""
    pids: list[int] = []
    yield pids
    left = [p for p in pids if not gone(p)]
    for p in left:
        with contextlib.suppress(ProcessLookupError):
            os.kill(p, signal.SIGKILL)
    assert not left, f"left behind: {left}"


def start_tree(
    out: Path, mark: str, *, exit_at_once: bool = False
) -> tuple[subprocess.Popen[bytes], list[int]]:
    """A worker like the agent starts one: a session leader carrying `mark`; and its children."""
    report = out / "0.json"
    report.unlink(missing_ok=True)
    env = {
        **os.environ,
        "OUT_DIR": str(out),
        "RANK": "0",
        "ORPHAN_CHILDREN": "plain,setsid,noenv",
        "ORPHAN_EXIT": "1" if exit_at_once else "0",
        MARK_ENV: mark,
    }
    worker = subprocess.Popen([PY, ORPHANS], env=env, start_new_session=True)
    deadline = time.monotonic() + 30
    while not report.exists():
        assert time.monotonic() < deadline, "the worker did not report its children"
        assert exit_at_once or worker.poll() is None, "the worker died"
        time.sleep(0.01)
    children = json.loads(report.read_text())["children"]
    return worker, children


async def test_a_worker_that_exits_takes_its_children_with_it(
    tmp_path: Path, started: list[int]
) -> None:
    sentinel = Sentinel()
    sentinel.start()
    try:
        assert sentinel.pid is not None
        started.append(sentinel.pid)
        mark = sentinel.next_mark()
        worker, children = start_tree(tmp_path, mark, exit_at_once=True)
        started.extend([worker.pid, *children])
        sentinel.watch(worker.pid, start_ticks(worker.pid) or 0, mark)
        await asyncio.to_thread(worker.wait, 30)
        assert not any(gone(c) for c in children), "children died before the worker's exit"
        sentinel.forget(worker.pid)
        await wait_for(lambda: all(gone(c) for c in children), BOUND, what="the children to die")
        assert sentinel.watched == {}
    finally:
        await sentinel.stop()
    assert gone(started[0])


async def test_stop_kills_the_workers_still_watched(tmp_path: Path, started: list[int]) -> None:
    sentinel = Sentinel()
    sentinel.start()
    assert sentinel.pid is not None
    started.append(sentinel.pid)
    mark = sentinel.next_mark()
    worker, children = start_tree(tmp_path, mark)
    started.extend([worker.pid, *children])
    sentinel.watch(worker.pid, start_ticks(worker.pid) or 0, mark)
    await sentinel.stop()
    await asyncio.to_thread(worker.wait, BOUND)
    await wait_for(lambda: all(gone(p) for p in started), BOUND, what="every process to die")


async def test_a_sentinel_that_dies_is_replaced_and_told_every_worker(
    tmp_path: Path, started: list[int]
) -> None:
    sentinel = Sentinel()
    sentinel.start()
    try:
        first = sentinel.pid
        assert first is not None
        started.append(first)
        mark = sentinel.next_mark()
        worker, children = start_tree(tmp_path, mark)
        started.extend([worker.pid, *children])
        sentinel.watch(worker.pid, start_ticks(worker.pid) or 0, mark)
        os.kill(first, signal.SIGKILL)
        await wait_for(
            lambda: sentinel.pid not in (None, first), 10, what="a new sentinel to be started"
        )
        assert sentinel.pid is not None
        started.append(sentinel.pid)
        assert all(not gone(p) for p in [worker.pid, *children])
    finally:
        await sentinel.stop()  # the new one sweeps the replayed worker
    await asyncio.to_thread(worker.wait, BOUND)
    await wait_for(lambda: all(gone(p) for p in started), BOUND, what="every process to die")


AGENT = textwrap.dedent(
    """
    import asyncio, json, os, subprocess, sys
    from nodeagent._process import Sentinel
    from nodeagent._sentinel import MARK_ENV, start_ticks

    async def main():
        sentinel = Sentinel()
        sentinel.start()
        workers = []
        for rank in range(2):
            mark = sentinel.next_mark()
            env = {**os.environ, "RANK": str(rank), MARK_ENV: mark}
            w = subprocess.Popen([sys.executable, sys.argv[1]], env=env, start_new_session=True)
            sentinel.watch(w.pid, start_ticks(w.pid), mark)
            workers.append(w.pid)
        print(json.dumps({"sentinel": sentinel.pid, "workers": workers}), flush=True)
        await asyncio.sleep(300)

    asyncio.run(main())
    """
)


async def test_a_sigkilled_agent_takes_every_process_of_its_workers(
    tmp_path: Path, started: list[int]
) -> None:
    env = {
        **os.environ,
        "OUT_DIR": str(tmp_path),
        "ORPHAN_CHILDREN": "plain,setsid,noenv",
        "PYTHONPATH": str(ROOT),
    }
    agent = subprocess.Popen(
        [PY, "-c", AGENT, ORPHANS], env=env, stdout=subprocess.PIPE, cwd=str(ROOT)
    )
    started.append(agent.pid)
    assert agent.stdout is not None
    line = await asyncio.to_thread(agent.stdout.readline)
    info: dict[str, Any] = json.loads(line)
    started.extend([info["sentinel"], *info["workers"]])
    deadline = time.monotonic() + 30
    while len(list(tmp_path.glob("*.json"))) < 2:
        assert time.monotonic() < deadline, "the workers did not report their children"
        await asyncio.sleep(0.01)
    for report in tmp_path.glob("*.json"):
        started.extend(json.loads(report.read_text())["children"])
    assert all(not gone(p) for p in started)
    agent.kill()
    await asyncio.to_thread(agent.wait, 10)
    agent.stdout.close()
    await wait_for(lambda: all(gone(p) for p in started), BOUND, what="every process to die")


async def test_a_restarted_agent_reaps_what_a_dead_sentinel_left(
    tmp_path: Path, started: list[int]
) -> None:
    # Agent and sentinel both gone (say, the OOM killer): the next agent's reaper finds the
    # worker's session, and the child that left it by the previous agent's mark.
    prefix = "c" * 32 + "."
    registry = PidRegistry(tmp_path / "agent.pids.json", mark_prefix=prefix)
    worker, children = start_tree(tmp_path, f"{prefix}1")
    started.extend([worker.pid, *children])
    registry.add(worker.pid, job_id="job1", global_rank=0)
    killed = await asyncio.to_thread(reap_previous, registry.path)
    await asyncio.to_thread(worker.wait, BOUND)
    await wait_for(lambda: all(gone(p) for p in started), BOUND, what="every process to die")
    # The leader's group went with the leader; only the mark finds the setsid child.
    assert worker.pid in killed and children[1] in killed
    assert not registry.path.exists()


async def test_a_worker_that_exits_while_no_sentinel_runs_is_swept_by_the_next(
    tmp_path: Path, started: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(process_module, "SENTINEL_RESTART_S", 2.0)
    sentinel = Sentinel()
    sentinel.start()
    try:
        first = sentinel.pid
        assert first is not None
        started.append(first)
        mark = sentinel.next_mark()
        worker, children = start_tree(tmp_path, mark)
        started.extend([worker.pid, *children])
        sentinel.watch(worker.pid, start_ticks(worker.pid) or 0, mark)
        os.kill(first, signal.SIGKILL)
        await wait_for(
            lambda: sentinel.pid is None, BOUND, what="the agent to see the sentinel die"
        )
        worker.kill()
        await asyncio.to_thread(worker.wait, BOUND)
        sentinel.forget(worker.pid)
        assert not any(gone(c) for c in children)  # nobody swept them yet
        await wait_for(lambda: sentinel.pid is not None, 10, what="a new sentinel")
        assert sentinel.pid is not None
        started.append(sentinel.pid)
        await wait_for(lambda: all(gone(c) for c in children), BOUND, what="the children to die")
    finally:
        await sentinel.stop()


async def test_a_full_pipe_never_blocks_the_agent_and_nothing_is_lost(
    tmp_path: Path, started: list[int]
) -> None:
    sentinel = Sentinel()
    sentinel.start()
    try:
        assert sentinel.pid is not None
        started.append(sentinel.pid)
        mark = sentinel.next_mark()
        worker, children = start_tree(tmp_path, mark)
        started.extend([worker.pid, *children])
        os.kill(sentinel.pid, signal.SIGSTOP)  # it reads nothing until SIGCONT
        sentinel.watch(worker.pid, start_ticks(worker.pid) or 0, mark)
        # Far more than a pipe holds (64 KiB). Start ticks no process can have: these sessions
        # can never match a real process.
        for i in range(5000):
            sentinel.watch(4_000_000 + i, 2**62, f"{sentinel.token}.fake{i}")
            sentinel.forget(4_000_000 + i)
        assert sentinel.backlog > 0  # the pipe is full: the rest waits in the agent
        worker.kill()
        await asyncio.to_thread(worker.wait, BOUND)
        sentinel.forget(worker.pid)  # queued behind the rest
        assert not any(gone(c) for c in children)
        os.kill(sentinel.pid, signal.SIGCONT)
        await wait_for(lambda: all(gone(c) for c in children), 15, what="the children to die")
        assert sentinel.backlog == 0
    finally:
        await sentinel.stop()
