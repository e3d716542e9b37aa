"""`gelastic dashboard` hands a browser only an http(s) URL of a host and a port.

Before the fix the CLI built the URL from whatever scheme and host the coordinator reported
and passed it to `webbrowser.open`: a coordinator (or whoever poses as one) could make the
operator's desktop open `file:`, `javascript:` or any other handler's URL.
"""

from __future__ import annotations

import asyncio
import io
from collections.abc import AsyncIterator

import pytest

import client.cli as cli
from coordinator.server import Coordinator, CoordinatorConfig


@pytest.fixture
async def coordinator() -> AsyncIterator[Coordinator]:
    async with Coordinator(CoordinatorConfig(state_dir=":memory:", port=0)) as c:
        yield c


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.fixture
def browser(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    import webbrowser

    opened: list[str] = []
    monkeypatch.setattr(webbrowser, "open", lambda url, *a, **k: opened.append(url) or True)
    monkeypatch.setattr(cli, "_desktop_browser", lambda: True)
    return opened


async def _dashboard(coordinator: Coordinator, monkeypatch: pytest.MonkeyPatch) -> int:
    # Here, not in a fixture: pytest puts its own stdout back before the test runs.
    monkeypatch.setattr(cli.sys, "stdout", _Terminal())
    return await asyncio.to_thread(cli.main, ["--coordinator", coordinator.address, "dashboard"])


@pytest.mark.parametrize(
    ("scheme", "host"),
    [
        ("file", "127.0.0.1"),
        ("javascript", "127.0.0.1"),
        ("x-scheme-handler", "127.0.0.1"),
        ("http", "evil.example/phish#"),
        ("http", "user@127.0.0.1"),
        ("https", "a b"),
    ],
)
async def test_a_url_that_is_no_http_page_of_a_host_is_not_opened(
    coordinator: Coordinator,
    browser: list[str],
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    scheme: str,
    host: str,
) -> None:
    coordinator.service.dashboard = (scheme, host, 8400)
    assert await _dashboard(coordinator, monkeypatch) == cli.EXIT_USAGE
    assert browser == []
    assert "the coordinator reported a dashboard URL that" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("scheme", "host", "url"),
    [
        ("http", "127.0.0.1", "http://127.0.0.1:8400/"),
        ("https", "coord.example.com", "https://coord.example.com:8400/"),
        ("https", "::1", "https://[::1]:8400/"),
    ],
)
async def test_an_http_url_of_a_host_is_opened(
    coordinator: Coordinator,
    browser: list[str],
    monkeypatch: pytest.MonkeyPatch,
    scheme: str,
    host: str,
    url: str,
) -> None:
    coordinator.service.dashboard = (scheme, host, 8400)
    assert await _dashboard(coordinator, monkeypatch) == cli.EXIT_OK
    assert browser == [url]
