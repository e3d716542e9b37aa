"""Browser tests: headless Chromium driven by Playwright, against a real LocalCluster.

`chromium_executable()` finds the system Chromium (Debian's `chromium`, which `make setup`
installs when it may); Playwright's own browser download is never used. Without Chromium or
Playwright a test skips, and under CI (CI set) it fails instead: the dashboard must be tested.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gelastic.local import LocalCluster
from tests.e2e.conftest import assert_no_leftovers

SCRIPTS = Path(__file__).resolve().parent / "scripts"
DOCS_IMG = Path(__file__).resolve().parents[2] / "docs" / "img"


def _missing(message: str) -> None:
    if os.environ.get("CI"):
        pytest.fail(message + ": the dashboard is not tested", pytrace=False)
    pytest.skip(message)


def chromium_executable() -> str:
    found = os.environ.get("GELASTIC_CHROMIUM") or next(
        (p for p in map(shutil.which, ("chromium", "chromium-browser")) if p), None
    )
    if not found:
        _missing(
            "chromium is not installed (Debian: apt-get install chromium; `make setup` does it)"
        )
    assert found is not None
    return found


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    executable = chromium_executable()
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        _missing("playwright is not installed (pip install -e '.[dev]')")
    with sync_playwright() as pw:
        b = pw.chromium.launch(
            executable_path=executable, headless=True, args=["--no-sandbox", "--disable-gpu"]
        )
        try:
            yield b
        finally:
            b.close()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, browser: Any) -> Iterator[LocalCluster]:
    """Two nodes of two slots, with the dashboard on a free port."""
    c = LocalCluster(
        nodes=2,
        slots=2,
        workdir=tmp_path_factory.mktemp("cluster"),
        lease=3.0,
        heartbeat_interval=0.5,
        dashboard_port=0,
    )
    with c:
        yield c
    assert_no_leftovers(c)


@pytest.fixture(scope="module")
def shots(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where the pages' screenshots go (copied to docs/img too with GELASTIC_UPDATE_SCREENSHOTS=1)."""
    return tmp_path_factory.mktemp("screenshots")
