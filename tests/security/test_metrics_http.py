"""The metrics endpoint serves connections side by side, each within a timeout, a bounded number.

Before the fix it served one request at a time with no timeout: one connection that sent
nothing held every later scrape until it went away. At its bound it then closed every new
connection, so connections that only waited still kept scrapes out, and out of descriptors it
logged a failed accept in a busy loop.
"""

from __future__ import annotations

import logging
import os
import resource
import select
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
from prometheus_client import CollectorRegistry, Counter

from client.metrics_http import ACCEPT_PAUSE_S, MetricsEndpoint
from gelastic.local import poll_until

TIMEOUT_S = 2.0
"""The endpoint's per-connection timeout in these tests."""
BOUND_S = 10.0
"""How long a test waits for what must happen; far more than it takes."""


@pytest.fixture
def endpoint() -> Iterator[MetricsEndpoint]:
    registry = CollectorRegistry()
    Counter("gelastic_test_total", "a counter", registry=registry).inc()
    ep = MetricsEndpoint(registry, "127.0.0.1", 0, connection_timeout=TIMEOUT_S, max_connections=4)
    ep.start()
    yield ep
    ep.stop()


def _scrape(ep: MetricsEndpoint) -> str:
    with urllib.request.urlopen(ep.url, timeout=BOUND_S) as resp:
        assert resp.status == 200
        return bytes(resp.read()).decode()


def _idle(ep: MetricsEndpoint, partial: bytes = b"") -> socket.socket:
    s = socket.create_connection(("127.0.0.1", ep.port), timeout=BOUND_S)
    if partial:
        s.sendall(partial)
    return s


def test_an_idle_connection_does_not_hold_up_a_scrape(endpoint: MetricsEndpoint) -> None:
    idle = _idle(endpoint)
    slow = _idle(endpoint, b"GET /metrics HTTP/1.1\r\nHost: x\r\n")  # never finishes its headers
    try:
        started = time.monotonic()
        assert "gelastic_test_total 1.0" in _scrape(endpoint)
        # Answered while both others are still open (the endpoint has not closed them).
        assert select.select([idle, slow], [], [], 0)[0] == []
        # The idle ones are closed once their time is up (recv sees the end of the stream).
        for s in (idle, slow):
            assert s.recv(1) == b""
        assert time.monotonic() - started < BOUND_S
    finally:
        idle.close()
        slow.close()


def test_at_the_bound_the_longest_waiting_connection_makes_room_for_a_scrape(
    endpoint: MetricsEndpoint,
) -> None:
    # Before, a connection over the bound was closed at once: four that only waited kept
    # every scrape out for as long as they lasted.
    held = [_idle(endpoint) for _ in range(4)]
    try:
        assert "gelastic_test_total 1.0" in _scrape(endpoint)
        assert endpoint.evicted == 1
        assert held[0].recv(1) == b""  # the one that waited longest went
        assert select.select(held[1:], [], [], 0)[0] == []  # the others still wait
    finally:
        for s in held:
            s.close()


@contextmanager
def _open_files_limit(extra: int) -> Iterator[None]:
    """This process may open only `extra` more descriptors than it has open now."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    used = len(os.listdir("/proc/self/fd"))
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(soft, used + extra), hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


# On a line from stdin opens N connections to PORT and says so; exits on the next line.
CONNECTOR = """
import socket, sys
port, n = int(sys.argv[1]), int(sys.argv[2])
sys.stdin.readline()
socks = [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(n)]
print(len(socks), flush=True)
sys.stdin.readline()
"""


def test_out_of_descriptors_the_endpoint_pauses_its_accepts_and_logs_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Before, an accept that failed for want of descriptors was logged and tried again at once:
    # a busy loop writing a warning per try for as long as the descriptors lacked.
    registry = CollectorRegistry()
    Counter("gelastic_test_total", "a counter", registry=registry).inc()
    ep = MetricsEndpoint(
        registry, "127.0.0.1", 0, connection_timeout=TIMEOUT_S, max_connections=1000
    )
    ep.start()
    connector = subprocess.Popen(
        [sys.executable, "-c", CONNECTOR, str(ep.port), "40"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert connector.stdin is not None and connector.stdout is not None
    try:
        with caplog.at_level(logging.WARNING, logger="client.metrics_http"):
            with _open_files_limit(8):
                connector.stdin.write("go\n")
                connector.stdin.flush()
                assert int(connector.stdout.readline()) == 40  # queued, most never accepted
                poll_until(
                    lambda: ep.failed_accepts >= 3, BOUND_S, what="three tries of the accept"
                )
            lines = [r.getMessage() for r in caplog.records]
        assert len(lines) == 1 and "cannot accept connections" in lines[0], lines
        assert ep.failed_accepts < 3 + BOUND_S / ACCEPT_PAUSE_S  # once a pause, not a spin
        # Descriptors back: the endpoint accepts again, times the idle ones out and scrapes.
        poll_until(lambda: _scraped(ep), BOUND_S * 2, what="a scrape to answer")
    finally:
        connector.stdin.close()
        connector.wait(BOUND_S)
        connector.stdout.close()
        ep.stop()


def _scraped(ep: MetricsEndpoint) -> bool:
    try:
        return "gelastic_test_total" in _scrape(ep)
    except OSError:
        return False


def test_a_bad_request_gets_a_status_and_the_endpoint_stays(endpoint: MetricsEndpoint) -> None:
    for request in (b"garbage\r\n\r\n", b"POST /metrics HTTP/1.1\r\n\r\n", b"x" * 9000):
        s = _idle(endpoint, request)
        try:
            answer = s.recv(100)
            assert answer.startswith(b"HTTP/1.0 4"), answer
        finally:
            s.close()
    assert "gelastic_test_total" in _scrape(endpoint)


def test_a_failing_collector_is_a_500_and_the_endpoint_stays() -> None:
    class Broken:
        fail = True

        def collect(self) -> list[object]:
            if Broken.fail:
                raise RuntimeError("collector broke")
            return []

    registry = CollectorRegistry()
    registry.register(Broken())  # type: ignore[arg-type]
    ep = MetricsEndpoint(registry, "127.0.0.1", 0, connection_timeout=TIMEOUT_S)
    ep.start()
    try:
        s = _idle(ep, b"GET /metrics HTTP/1.0\r\n\r\n")
        try:
            assert s.recv(100).startswith(b"HTTP/1.0 500")
        finally:
            s.close()
        Broken.fail = False
        _scrape(ep)
    finally:
        ep.stop()
