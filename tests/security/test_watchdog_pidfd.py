"""The watchdog never signals a worker's pid after the worker has exited and been reaped.

Before the fix the watchdog kept a worker's timers until the agent got round to reporting its
exit, and on expiry called os.kill(pid): a pid reaped meanwhile (and perhaps handed to another
process) was signalled, and the exit reported as the watchdog's kill. Now it holds a pidfd of
each worker it arms a timer for, signals through it, and forgets the timers the moment the
pidfd says the process has exited.
"""

from __future__ import annotations

import asyncio
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from nodeagent._watchdog import FileTimerServer, TimerRequest

BOUND = 10.0


@pytest.fixture
def child() -> Iterator[subprocess.Popen[bytes]]:
    p = subprocess.Popen(["sleep", "120"])
    yield p
    if p.poll() is None:
        p.kill()
    p.wait()


class Expired:
    def __init__(self) -> None:
        self.calls: list[tuple[int, str, int, float]] = []

    def __call__(self, pid: int, scope: str, sig: int, exp: float) -> None:
        self.calls.append((pid, scope, sig, exp))


async def test_timers_of_an_exited_worker_are_forgotten_at_its_exit(
    tmp_path: Path, child: subprocess.Popen[bytes]
) -> None:
    expired = Expired()
    srv = FileTimerServer(
        tmp_path / "timer",
        allowed_pids=lambda p: p == child.pid,
        on_expired=expired,
        clock=lambda: 0.0,
    )
    srv.start()
    try:
        srv.register(TimerRequest(child.pid, "step", 100.0, signal.SIGKILL))
        assert set(srv.timers) == {(child.pid, "step")}
        child.terminate()
        await asyncio.to_thread(child.wait, BOUND)  # exited and reaped: the pid is free
        deadline = time.monotonic() + BOUND
        while srv.timers:
            assert time.monotonic() < deadline, "the exited worker's timers are still armed"
            await asyncio.sleep(0.01)
        assert srv.expire(200.0) == [] and expired.calls == []
    finally:
        srv.close()


def test_a_reaped_worker_is_not_signalled_nor_reported_killed(
    child: subprocess.Popen[bytes],
) -> None:
    # No event loop: nothing forgets the timer at the exit, so the expiry meets a reaped pid.
    expired = Expired()
    srv = FileTimerServer(
        "/nonexistent/timer", allowed_pids={child.pid}, on_expired=expired, clock=lambda: 0.0
    )
    srv.register(TimerRequest(child.pid, "step", 5.0, signal.SIGKILL))
    child.terminate()
    assert child.wait(BOUND) == -signal.SIGTERM
    assert srv.expire(10.0) == [] and expired.calls == []
    assert srv.timers == {}
    srv.close()


def test_a_live_worker_is_killed_through_its_pidfd(child: subprocess.Popen[bytes]) -> None:
    expired = Expired()
    srv = FileTimerServer(
        "/nonexistent/timer", allowed_pids={child.pid}, on_expired=expired, clock=lambda: 0.0
    )
    srv.register(TimerRequest(child.pid, "step", 5.0, signal.SIGKILL))
    assert [t.scope_id for t in srv.expire(10.0)] == ["step"]
    assert child.wait(BOUND) == -signal.SIGKILL
    assert expired.calls == [(child.pid, "step", signal.SIGKILL, 5.0)]
    srv.close()


def test_a_timer_for_a_pid_that_is_already_gone_is_not_armed() -> None:
    p = subprocess.Popen(["true"])
    p.wait()
    srv = FileTimerServer(
        "/nonexistent/timer", allowed_pids={p.pid}, on_expired=Expired(), clock=lambda: 0.0
    )
    srv.register(TimerRequest(p.pid, "step", 5.0, signal.SIGKILL))
    assert srv.timers == {}
    srv.close()
