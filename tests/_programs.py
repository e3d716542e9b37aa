"""Run gelastic's real programs (coordinator, nodeagent, gelastic) as a user would, bounded."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RUN_TIMEOUT_S = 30.0
START_TIMEOUT_S = 20.0
NOISE = ("Task was destroyed", "aclose()", "Traceback")
"""What must never reach a user's terminal."""

PROGRAMS = {
    "coordinator": "coordinator.cli",
    "nodeagent": "nodeagent.cli",
    "gelastic": "gelastic",
}


def argv(program: str, *args: str) -> list[str]:
    return [sys.executable, "-m", PROGRAMS[program], *args]


def run(
    program: str, *args: str, timeout: float = RUN_TIMEOUT_S
) -> subprocess.CompletedProcess[str]:
    """Run to its end (bounded); stdout and stderr captured."""
    return subprocess.run(
        argv(program, *args),
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )


def last_line(text: str) -> str:
    lines = [line for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else ""


@contextmanager
def coordinator(tmp: Path, *args: str) -> Iterator[str]:
    """A `coordinator serve` on 127.0.0.1 (any free port) until the block ends; yields HOST:PORT."""
    port_file = tmp / f"port-{time.monotonic_ns()}"
    log = (tmp / f"{port_file.name}.log").open("w")
    proc = subprocess.Popen(
        argv(
            "coordinator",
            "serve",
            "--port",
            "0",
            "--state-dir",
            ":memory:",
            "--port-file",
            str(port_file),
            *args,
        ),
        stdout=log,
        stderr=subprocess.STDOUT,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while not port_file.exists():
            assert proc.poll() is None, (tmp / f"{port_file.name}.log").read_text()
            assert time.monotonic() < deadline, "coordinator did not start in time"
            time.sleep(0.05)
        yield f"127.0.0.1:{port_file.read_text().strip()}"
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def agent_args(address: str, tmp: Path, name: str, *extra: str) -> list[str]:
    return [
        "--coordinator",
        address,
        "--name",
        name,
        "--slots",
        "1",
        "--log-dir",
        str(tmp / f"logs-{name}-{time.monotonic_ns()}"),
        *extra,
    ]


def popen_agent(args: Sequence[str]) -> subprocess.Popen[str]:
    return subprocess.Popen(
        argv("nodeagent", *args),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
