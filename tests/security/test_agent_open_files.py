"""The node agent raises its soft limit on open files to the hard one at start.

Before the fix only `coordinator serve` did: an agent kept the usual 1,024, though each of its
workers holds pipes to it and each log relay and metrics scrape a descriptor.
"""

from __future__ import annotations

import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests._helpers import free_port

REPO = Path(__file__).resolve().parents[2]
START_S = 30.0


def test_the_node_agent_raises_its_open_files_limit(tmp_path: Path) -> None:
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    if hard == resource.RLIM_INFINITY or hard <= 512:
        pytest.skip(f"needs a finite hard limit on open files above 512, not {hard}")
    start = (
        "import os, resource, sys; "
        "resource.setrlimit(resource.RLIMIT_NOFILE, (256, resource.getrlimit(resource.RLIMIT_NOFILE)[1])); "
        "os.execv(sys.executable, [sys.executable, '-m', 'nodeagent.cli', *sys.argv[1:]])"
    )
    log_path = tmp_path / "log"
    log = log_path.open("w")
    proc = subprocess.Popen(
        [
            *(sys.executable, "-c", start, "--coordinator", f"127.0.0.1:{free_port()}"),
            *("--name", "node-a", "--addr", "127.0.0.1", "--log-dir", str(tmp_path / "logs")),
            *("--state-dir", str(tmp_path / "state")),
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    try:
        deadline = time.monotonic() + START_S
        while "nodeagent node-a" not in log_path.read_text():
            assert proc.poll() is None, log_path.read_text()
            assert time.monotonic() < deadline, "the agent did not start in time"
            time.sleep(0.05)  # a poll interval: the loop is bounded by the deadline
        assert resource.prlimit(proc.pid, resource.RLIMIT_NOFILE) == (hard, hard)
    finally:
        proc.terminate()
        try:
            proc.wait(START_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(START_S)
        log.close()
    assert f"open files limit raised from 256 to {hard}" in log_path.read_text()
