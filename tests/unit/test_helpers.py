"""tests/_helpers.py, which every tier leans on: the bounded wait gives up on time and names what
it waited for; free_port's port is free; gone() tells a live process from an ended one."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import pytest

from tests._helpers import free_port, gone, wait_for


async def test_the_wait_returns_once_the_condition_holds() -> None:
    calls = []

    def third_time() -> bool:
        calls.append(1)
        return len(calls) == 3

    await wait_for(third_time, 5.0, 0.001, what="the third call")
    assert len(calls) == 3


async def test_the_wait_gives_up_after_its_timeout_naming_what_it_waited_for() -> None:
    started = time.monotonic()
    with pytest.raises(AssertionError, match=r"^timed out after 0.2 s waiting for the moon$"):
        await wait_for(lambda: False, 0.2, what="the moon")
    assert 0.2 <= time.monotonic() - started < 5.0


def test_a_free_port_can_be_listened_on() -> None:
    port = free_port()
    assert 0 < port < 65536
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))
        s.listen()


def test_a_process_is_gone_once_it_has_exited_zombie_or_reaped() -> None:
    assert not gone(os.getpid())
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    deadline = time.monotonic() + 30
    while not gone(proc.pid):  # a zombie until reaped: gone already
        assert time.monotonic() < deadline, "the child never exited"
        time.sleep(0.01)
    proc.wait()
    assert gone(proc.pid)
