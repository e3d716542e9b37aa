"""`gelastic run --dashboard`: the embedded cluster serves the dashboard for the life of the job."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from gelastic.local import poll_until

REPO = Path(__file__).resolve().parents[2]
WORKER = REPO / "tests" / "browser" / "scripts" / "dash_worker.py"
TIMEOUT = 60.0


def _get(url: str, token: str = "") -> tuple[int, dict]:  # type: ignore[type-arg]
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, {}


def test_run_serves_the_dashboard_while_the_job_runs(tmp_path: Path) -> None:
    gate = tmp_path / "gate"
    gate.mkdir()
    env = {**os.environ, "GATE_DIR": str(gate), "TMPDIR": str(tmp_path)}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "gelastic",
            "run",
            "--dashboard",
            "--nproc-per-node",
            "2",
            str(WORKER),
        ],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stderr is not None
        line = ""
        for _ in range(50):  # the first progress lines; the dashboard's comes before the job's
            line = proc.stderr.readline()
            if line.startswith("gelastic run: dashboard:") or not line:
                break
        found = re.fullmatch(
            r"gelastic run: dashboard: (http://127\.0\.0\.1:\d+/) \(log in with the token in "
            r"(\S+); it lasts as long as this run\)\n",
            line,
        )
        assert found, line
        url, token_file = found.groups()
        token = Path(token_file).read_text().strip()
        assert token not in url
        assert _get(url + "api/overview")[0] == 401
        poll_until(
            lambda: any(
                j["state"] == "RUNNING" for j in _get(url + "api/overview", token)[1]["jobs"]
            ),
            TIMEOUT,
            what="the job to run, seen through the dashboard",
        )
        status, overview = _get(url + "api/overview", token)
        assert status == 200 and len(overview["nodes"]) == 1
        (gate / "go0").touch()
        out, err = proc.communicate(timeout=TIMEOUT)
        assert proc.returncode == 0, err
        assert "rank 1 attempt 0 done" in out
        with pytest.raises(urllib.error.URLError):
            urllib.request.urlopen(url + "login", timeout=5)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate(timeout=30)
