"""The metrics endpoint serves connections side by side, each within a timeout, a bounded number.

Before the fix it served one request at a time with no timeout: one connection that sent
nothing held every later scrape until it went away.
"""

from __future__ import annotations

import select
import socket
import time
import urllib.request
from collections.abc import Iterator

import pytest
from prometheus_client import CollectorRegistry, Counter

from client.metrics_http import MetricsEndpoint

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


def test_connections_over_the_bound_are_closed_and_scrapes_resume(
    endpoint: MetricsEndpoint,
) -> None:
    held = [_idle(endpoint) for _ in range(4)]
    try:
        extra = _idle(endpoint)
        try:
            # Accepted and closed at once: the bound holds however many come.
            assert extra.recv(1) == b""
        finally:
            extra.close()
    finally:
        for s in held:
            s.close()
    deadline = time.monotonic() + BOUND_S
    while True:  # the held ones go as their close is seen; a scrape answers then
        try:
            assert "gelastic_test_total" in _scrape(endpoint)
            break
        except (ConnectionError, OSError):
            if time.monotonic() > deadline:
                raise
            time.sleep(0.02)  # a poll interval: the loop is bounded by the deadline


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
