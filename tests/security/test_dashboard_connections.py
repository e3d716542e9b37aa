"""Connections that only wait can neither keep the dashboard from answering nor stay open.

Before the fix the dashboard took every connection it was offered and kept an idle one for
aiohttp's keep-alive time (an hour), or for ever where aiohttp never times out a connection
that sends nothing: a few hundred idle connections used up the coordinator's descriptors and
nobody could reach the dashboard (nor, out of descriptors, the gRPC port). `coordinator serve`
kept the usual soft limit of 1,024 open files, and asyncio logged a failed accept every second.
"""

from __future__ import annotations

import asyncio
import logging
import os
import resource
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from coordinator._dashboard import Dashboard
from coordinator._dashboard_guard import LISTEN_BACKLOG, AcceptErrorLog
from coordinator.server import Coordinator
from tests.service.test_dashboard import TOKEN, _next_event, coord  # noqa: F401 - fixture

REPO = Path(__file__).resolve().parents[2]
BEARER = {"Authorization": f"Bearer {TOKEN}"}
FLOOD = 300
CAP = 64
STEP = 60.0

# Opens N connections (the first PARTIAL send half a request), says how many connected, then on
# a line from stdin waits (at most WAIT s) for the server to close them and says how many it did.
FLOODER = r"""
import resource, select, socket, sys, time
port, n, partial, wait = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
socks = []
for _ in range(n):
    s = socket.socket()
    s.setblocking(False)
    s.connect_ex(("127.0.0.1", port))
    socks.append(s)
poll = select.poll()
for s in socks:
    poll.register(s, select.POLLOUT)
pending, connected = {s.fileno(): s for s in socks}, 0
deadline = time.monotonic() + 30
while pending and time.monotonic() < deadline:
    for fd, _ in poll.poll(500):
        s = pending.pop(fd, None)
        if s is None:
            continue
        poll.unregister(fd)
        if s.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) == 0:
            connected += 1
for s in socks[:partial]:
    try:
        s.send(b"GET /api/overview HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ")
    except OSError:
        pass
print("connected", connected, flush=True)
sys.stdin.readline()
poll = select.poll()
for s in socks:
    poll.register(s, select.POLLIN)
open_ = {s.fileno(): s for s in socks}
deadline = time.monotonic() + wait
while open_ and time.monotonic() < deadline:
    for fd, _ in poll.poll(500):
        s = open_.get(fd)
        if s is None:
            continue
        try:
            data = s.recv(4096)
        except OSError:
            data = b""
        if not data:
            del open_[fd]
            poll.unregister(fd)
print("closed", n - len(open_), flush=True)
"""


class _Flooder:
    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self.proc = proc

    async def line(self, word: str) -> int:
        assert self.proc.stdout is not None
        raw = await asyncio.wait_for(self.proc.stdout.readline(), STEP)
        name, _, value = raw.decode().partition(" ")
        assert name == word, raw
        return int(value)

    async def count_closed(self) -> int:
        assert self.proc.stdin is not None
        self.proc.stdin.write(b"go\n")
        await self.proc.stdin.drain()
        return await self.line("closed")


@asynccontextmanager
async def flooder(
    port: int, n: int, partial: int = 0, wait: float = 0.0
) -> AsyncIterator[_Flooder]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        FLOODER,
        str(port),
        str(n),
        str(partial),
        str(wait),
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
    )
    try:
        yield _Flooder(proc)
    finally:
        if proc.returncode is None:
            proc.kill()
        await asyncio.wait_for(proc.wait(), STEP)


@asynccontextmanager
async def dashboard(c: Coordinator, **kw: Any) -> AsyncIterator[Dashboard]:
    d = Dashboard(c.service, "127.0.0.1", 0, TOKEN, **kw)
    await d.start()
    try:
        yield d
    finally:
        await d.stop()


@contextmanager
def open_files_limit(extra: int) -> Iterator[None]:
    """This process may open only `extra` more descriptors than it has open now."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    used = len(os.listdir("/proc/self/fd"))
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(soft, used + extra), hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


async def _overview_status(d: Dashboard) -> int:
    timeout = aiohttp.ClientTimeout(total=STEP / 4)
    async with (
        aiohttp.ClientSession(headers=BEARER, timeout=timeout) as http,
        http.get(f"{d.url}api/overview") as resp,
    ):
        await resp.read()
        return resp.status


async def test_an_idle_flood_does_not_keep_a_request_out(coord: Coordinator) -> None:  # noqa: F811
    # The idle timeout is longer than the test: only the cap protects the dashboard here.
    async with dashboard(coord, max_connections=CAP, idle_timeout=STEP * 5) as d:
        # Room for the cap, the accepts under way and this test's own files, not for the flood.
        with open_files_limit(CAP + LISTEN_BACKLOG + 64):
            async with flooder(d.port, FLOOD) as flood:
                connected = await flood.line("connected")
                assert connected > CAP + LISTEN_BACKLOG
                assert await _overview_status(d) == 200
                assert d.guard is not None and d.guard.open <= CAP
                assert d.guard.evicted > 0  # room was made at the cap, not refused


async def test_idle_connections_are_closed_after_the_timeout(coord: Coordinator) -> None:  # noqa: F811
    idle_timeout = 1.0
    async with dashboard(coord, idle_timeout=idle_timeout) as d:
        # A stream outlives the idle timeout: it is a request being handled.
        async with (
            aiohttp.ClientSession(headers=BEARER) as http,
            http.get(f"{d.url}api/stream/overview") as stream,
        ):
            assert stream.status == 200
            await _next_event(stream)
            async with flooder(d.port, 20, partial=5, wait=STEP / 2) as flood:
                assert await flood.line("connected") == 20
                assert await flood.count_closed() == 20
            # The keep-alive comment comes SSE_KEEPALIVE_S after the snapshot, well past
            # the idle timeout.
            line = await asyncio.wait_for(stream.content.readline(), STEP / 4)
            while line == b"\n":
                line = await asyncio.wait_for(stream.content.readline(), STEP / 4)
            assert line.startswith((b": keepalive", b"event: ")), line
        assert d.guard is not None and d.guard.closed_idle >= 20


def test_coordinator_serve_raises_its_open_files_limit(tmp_path: Path) -> None:
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    if hard == resource.RLIM_INFINITY or hard <= 512:
        pytest.skip(f"needs a finite hard limit on open files above 512, not {hard}")
    port_file = tmp_path / "port"
    start = (
        "import os, resource, sys; "
        "resource.setrlimit(resource.RLIMIT_NOFILE, (256, resource.getrlimit(resource.RLIMIT_NOFILE)[1])); "
        "os.execv(sys.executable, [sys.executable, '-m', 'coordinator.cli', *sys.argv[1:]])"
    )
    log = (tmp_path / "log").open("w")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-c",
            start,
            "serve",
            "--port",
            "0",
            "--state-dir",
            ":memory:",
            "--port-file",
            str(port_file),
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    try:
        deadline = time.monotonic() + STEP
        while not port_file.exists():
            assert proc.poll() is None, (tmp_path / "log").read_text()
            assert time.monotonic() < deadline, "coordinator did not start in time"
            time.sleep(0.05)
        assert resource.prlimit(proc.pid, resource.RLIMIT_NOFILE) == (hard, hard)
    finally:
        proc.terminate()
        try:
            proc.wait(STEP)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(STEP)
        log.close()
    assert f"open files limit raised from 256 to {hard}" in (tmp_path / "log").read_text()


class _Loop:
    def __init__(self) -> None:
        self.default: list[dict[str, Any]] = []

    def default_exception_handler(self, context: dict[str, Any]) -> None:
        self.default.append(context)


def test_failed_accepts_are_logged_once_a_minute(caplog: pytest.LogCaptureFixture) -> None:
    now = [0.0]
    handler = AcceptErrorLog(interval=60.0, clock=lambda: now[0])
    loop = _Loop()
    emfile = {"message": AcceptErrorLog.MESSAGE, "exception": OSError(24, "Too many open files")}
    with caplog.at_level(logging.ERROR, logger="coordinator._dashboard_guard"):
        for second in range(121):  # asyncio retries the accept once a second
            now[0] = float(second)
            handler(loop, emfile)  # type: ignore[arg-type]
        handler(loop, {"message": "something else"})  # type: ignore[arg-type]
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 3, lines
    assert "Too many open files" in lines[0] and "more since" not in lines[0]
    assert lines[1].endswith("(59 more since the last line)")
    assert lines[2].endswith("(59 more since the last line)")
    assert loop.default == [{"message": "something else"}]
