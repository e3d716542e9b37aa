"""The coordinator a simulated fleet talks to: a real `coordinator serve` in a process of its
own (`CoordinatorProcess`), and how the benches read its CPU; node names of the fleet."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import IO

import psutil

PY = sys.executable


def node_name(index: int) -> str:
    return f"sim-{index:05d}"


def cpu_seconds(proc: psutil.Process) -> float:
    """user + system CPU seconds of a process (its own threads, not its children)."""
    t = proc.cpu_times()
    return float(t.user + t.system)


# ---- the coordinator under test --------------------------------------------------------------


class CoordinatorProcess:
    """`coordinator serve --port 0` as a process of its own, its durable state and its output
    in a fresh temporary directory (removed by `stop()`)."""

    def __init__(
        self,
        *,
        lease: float,
        heartbeat_interval: float,
        log_level: str = "INFO",
        extra_args: tuple[str, ...] = (),
    ) -> None:
        self.workdir = Path(tempfile.mkdtemp(prefix="gelastic-bench-coord-"))
        self.lease = lease
        self.heartbeat_interval = heartbeat_interval
        self.log_level = log_level
        self.extra_args = extra_args
        self.popen: subprocess.Popen[bytes] | None = None
        self.port = 0
        self._log: IO[bytes] | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def pid(self) -> int:
        assert self.popen is not None
        return self.popen.pid

    def start(self, timeout: float = 30.0, poll: float = 0.02) -> CoordinatorProcess:
        """Start it (again, after `kill()`: same port, same state directory); returns once it
        listens (the port file appears, checked every `poll` seconds)."""
        if self.popen is not None and self.popen.poll() is None:
            raise RuntimeError("the coordinator is still running")
        port_file = self.workdir / "port"
        port_file.unlink(missing_ok=True)
        if self._log is not None:
            self._log.close()
        self._log = open(self.workdir / "coordinator.out", "ab")  # noqa: SIM115 - closed in stop
        self.popen = subprocess.Popen(
            [
                PY, "-m", "coordinator.cli", "serve",
                "--port", str(self.port),
                "--port-file", str(port_file),
                "--lease", str(self.lease),
                "--heartbeat-interval", str(self.heartbeat_interval),
                "--state-dir", str(self.workdir / "state"),
                "--log-level", self.log_level,
                *self.extra_args,
            ],
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip
        deadline = time.monotonic() + timeout
        while not port_file.exists():
            if self.popen.poll() is not None:
                raise RuntimeError(f"the coordinator exited with {self.popen.returncode}")
            if time.monotonic() > deadline:
                self.stop()
                raise TimeoutError(f"the coordinator did not listen within {timeout:g} s")
            time.sleep(poll)
        self.port = int(port_file.read_text().strip())
        return self

    def kill(self) -> None:
        """SIGKILL the coordinator (not its state: `start()` brings it back on the same port)."""
        p = self.popen
        if p is not None and p.poll() is None:
            os.kill(p.pid, signal.SIGKILL)
            p.wait(timeout=30)

    def process(self) -> psutil.Process:
        return psutil.Process(self.pid)

    def peak_rss(self) -> int:
        """The process's peak resident set size (VmHWM), in bytes."""
        for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
        return self.process().memory_info().rss

    def output(self) -> str:
        path = self.workdir / "coordinator.out"
        return path.read_text(errors="replace") if path.exists() else ""

    def stop(self, grace: float = 10.0) -> None:
        """SIGTERM, SIGKILL to its process group after `grace`; idempotent."""
        p = self.popen
        if p is not None and p.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(p.pid, signal.SIGTERM)
            try:
                p.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)
                p.wait(timeout=10)
        if self._log is not None:
            self._log.close()
            self._log = None
        shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> CoordinatorProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


# ---- the parent's side: a fleet of fleet processes -------------------------------------------
