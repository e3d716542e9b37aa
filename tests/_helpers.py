"""What tests of every tier share: one bounded wait, a free loopback port, whether a pid is gone.

`wait_for` is the wait of async tests (the event loop keeps running while it polls); sync tests
use `gelastic.local.poll_until`. Neither is a fixed sleep: both return the moment the condition
holds and fail naming what they waited for.
"""

from __future__ import annotations

import asyncio
import random
import socket
import time
from collections.abc import Callable

import psutil

__all__ = ["free_port", "gone", "wait_for"]

POLL_S = 0.02
"""How often `wait_for` looks, unless told otherwise."""


async def wait_for(
    predicate: Callable[[], object], timeout: float, interval: float = POLL_S, *, what: str
) -> None:
    """Return as soon as `predicate()` is true; after `timeout` seconds raise an AssertionError
    naming `what` ("the worker to start")."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")
        await asyncio.sleep(interval)


FREE_PORTS = range(20_000, 32_000)
"""Where `free_port` looks: below Linux's ephemeral range (32768-60999 by default), so a server
that binds port 0 (a coordinator's gRPC port, etcd's peers) never takes a port handed out here
between the moment it was checked and the moment its test binds it."""
_handed_out: set[int] = set()


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now and this process has not handed out
    before: two calls in one test never name the same port."""
    for _ in range(1000):
        port = random.choice(FREE_PORTS)
        if port in _handed_out:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _handed_out.add(port)
        return port
    raise RuntimeError(f"no free port in {FREE_PORTS.start}-{FREE_PORTS.stop - 1} after 1000 tries")


def gone(pid: int) -> bool:
    """The process has exited (a zombie waiting for its parent counts as gone)."""
    try:
        return psutil.Process(pid).status() in (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD)
    except psutil.NoSuchProcess:
        return True
