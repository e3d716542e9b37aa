"""Without a client token the dashboard does not start, unless that is asked for by name.

Before, a coordinator without a token (the loopback default) served its dashboard to anyone
who reached the port, every local user included, and every web page their browsers opened
that found a way past the Host check. `gelastic run` on one host and `LocalCluster` make a
token of their own, so their dashboards keep working.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from unittest import mock

import aiohttp
import pytest

from coordinator.server import Coordinator, CoordinatorConfig
from gelastic._cli_run import RunError, plan_run, run_parser
from tests._helpers import free_port

REPO = Path(__file__).resolve().parents[2]
REFUSED = "refusing to serve the dashboard without a token"


def _token_file(tmp_path: Path) -> str:
    path = tmp_path / "token"
    path.write_text("a-client-token-of-the-right-length")
    path.chmod(0o600)
    return str(path)


def test_a_config_with_a_dashboard_and_no_token_is_refused(tmp_path: Path) -> None:
    for host in ("127.0.0.1", "::1", "localhost"):
        with pytest.raises(ValueError, match=REFUSED):
            CoordinatorConfig(host=host, dashboard_port=8400, state_dir=":memory:").validate()
    CoordinatorConfig(
        dashboard_port=8400, state_dir=":memory:", dashboard_without_token=True
    ).validate()
    CoordinatorConfig(
        dashboard_port=8400, state_dir=":memory:", token_file=_token_file(tmp_path)
    ).validate()
    CoordinatorConfig(state_dir=":memory:").validate()  # no dashboard: gRPC's rules alone


def test_coordinator_serve_says_why_and_exits_2() -> None:
    argv = ["serve", "--port", "0", "--state-dir", ":memory:", "--dashboard-port", "8400"]
    # A process of its own: one that served instead would be killed at the timeout.
    done = subprocess.run(
        [sys.executable, "-m", "coordinator.cli", *argv],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2, done.stderr
    assert REFUSED in done.stderr and "--dashboard-without-token" in done.stderr


async def test_start_dashboard_without_a_token_refuses_unless_asked() -> None:
    coord = Coordinator(CoordinatorConfig(port=0, state_dir=":memory:"))
    await coord.start()
    try:
        with pytest.raises(ValueError, match=REFUSED):
            await coord.start_dashboard(free_port())
        assert coord.dashboard is None and coord.service.dashboard is None
    finally:
        await coord.stop()
    coord = Coordinator(
        CoordinatorConfig(port=0, state_dir=":memory:", dashboard_without_token=True)
    )
    await coord.start()
    try:
        url = await coord.start_dashboard(free_port())
        async with aiohttp.ClientSession() as http, http.get(url + "api/overview") as resp:
            assert resp.status == 200, "asked for by name: open to whoever reaches it"
    finally:
        await coord.stop()


def _plan(*argv: str) -> object:
    with mock.patch.dict(os.environ, {"GELASTIC_TOKEN_FILE": ""}):
        return plan_run(run_parser().parse_args(list(argv)))


def test_gelastic_run_on_several_nodes_needs_a_token_for_its_dashboard(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "t.py").write_text("")
    c10d = ("--nnodes", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", "head:29511")
    with pytest.raises(RunError, match="--dashboard needs a token on several nodes"):
        _plan(*c10d, "--rdzv-id", "j", "--dashboard", "t.py")
    conf = f"token_file={_token_file(tmp_path)}"
    _plan(*c10d, "--rdzv-id", "j", "--rdzv-conf", conf, "--dashboard", "t.py")
    _plan(*c10d, "--rdzv-id", "j", "t.py")  # no dashboard: the run's own warning only
    _plan("--dashboard", "t.py")  # one host: the run makes a token of its own
