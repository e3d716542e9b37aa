"""A local cluster on this host: a `coordinator serve` and N `nodeagent` processes.

Used by `make demo`, the end-to-end tests and the benchmarks. Every process it starts carries
`GELASTIC_CLUSTER_ID` in its environment (workers inherit it from their agent), so `leftovers()`
finds anything the cluster left behind, and `stop()` kills only what it started.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import IO

import psutil

from client._client import Client

__all__ = ["LocalCluster", "StartedProcess", "marked_processes", "poll_until", "stop_processes"]

CLUSTER_ENV = "GELASTIC_CLUSTER_ID"


def poll_until(
    pred: Callable[[], bool], timeout: float, interval: float = 0.05, what: str = ""
) -> None:
    """Wait until `pred()` is true; raise TimeoutError naming `what` after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        if pred():
            return
        if time.monotonic() >= deadline:
            raise TimeoutError(f"timed out after {timeout:g} s waiting for {what or pred}")
        time.sleep(interval)


def stop_processes(procs: Sequence[StartedProcess], timeout: float) -> None:
    """SIGTERM each process (in the order given), then SIGKILL the group of any that hangs."""
    for p in procs:
        if p.popen.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(p.popen.pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    for p in procs:
        try:
            p.popen.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.popen.pid, signal.SIGKILL)
            p.popen.wait(timeout=10)
        p.log.close()


def marked_processes(cluster_id: str) -> list[psutil.Process]:
    """Live processes (not zombies) whose environment carries this cluster's marker."""
    found = []
    me = os.getpid()
    for proc in psutil.process_iter(["pid"]):
        if proc.pid == me:
            continue
        try:
            if (
                proc.environ().get(CLUSTER_ENV) == cluster_id
                and proc.status() != psutil.STATUS_ZOMBIE
            ):
                found.append(proc)
        except psutil.Error:
            continue
    return found


@dataclass
class StartedProcess:
    """A process this module started, with the file its output goes to."""

    name: str
    popen: subprocess.Popen[bytes]
    log: IO[bytes]
    log_path: Path


class LocalCluster:
    """`with LocalCluster(nodes=2, slots=2) as c: submit(spec, coordinator=c.address)`."""

    def __init__(
        self,
        nodes: int = 2,
        slots: int = 2,
        *,
        workdir: str | os.PathLike[str] | None = None,
        lease: float = 3.0,
        heartbeat_interval: float = 0.5,
        coordinator_args: Sequence[str] = (),
        agent_args: Sequence[str] = (),
        env: dict[str, str] | None = None,
        quiet: bool = True,
    ) -> None:
        self.cluster_id = uuid.uuid4().hex
        self._own_tmp = workdir is None
        self.workdir = Path(workdir or tempfile.mkdtemp(prefix="gelastic-cluster-")).resolve()
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.n_nodes = nodes
        self.slots = slots
        self.lease = lease
        self.heartbeat_interval = heartbeat_interval
        self.coordinator_args = list(coordinator_args)
        self.agent_args = list(agent_args)
        self.quiet = quiet
        self.env = dict(os.environ)
        self.env.update(env or {})
        self.env[CLUSTER_ENV] = self.cluster_id
        self.coordinator: StartedProcess | None = None
        self.agents: dict[str, StartedProcess] = {}
        self.port = 0
        self._client: Client | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def client(self) -> Client:
        if self._client is None:
            self._client = Client(self.address)
        return self._client

    @property
    def log_dir(self) -> Path:
        return self.workdir / "logs"

    # ---- processes -------------------------------------------------------------------------

    def _spawn(self, name: str, argv: list[str]) -> StartedProcess:
        log_path = self.workdir / f"{name}.out"
        log = open(log_path, "ab")  # noqa: SIM115 - closed in _reap
        popen = subprocess.Popen(
            argv,
            stdout=None if not self.quiet else log,
            stderr=subprocess.STDOUT if self.quiet else None,
            stdin=subprocess.DEVNULL,
            env=self.env,
            start_new_session=True,
        )
        return StartedProcess(name, popen, log, log_path)

    def start_coordinator(self, port: int = 0) -> None:
        port_file = self.workdir / "coordinator.port"
        port_file.unlink(missing_ok=True)
        argv = [
            sys.executable,
            "-m",
            "coordinator.cli",
            "serve",
            "--port",
            str(port or self.port or 0),
            "--port-file",
            str(port_file),
            "--lease",
            str(self.lease),
            "--state-dir",
            str(self.workdir / "coordinator-state"),
            "--heartbeat-interval",
            str(self.heartbeat_interval),
            *self.coordinator_args,
        ]
        if self.coordinator is not None and self.coordinator.popen.poll() is None:
            raise RuntimeError("the coordinator is still running")
        self.coordinator = self._spawn("coordinator", argv)
        proc = self.coordinator.popen
        poll_until(
            lambda: port_file.exists() or proc.poll() is not None,
            30,
            what="the coordinator to listen",
        )
        if proc.poll() is not None:
            raise RuntimeError(
                f"the coordinator exited with {proc.returncode}: {self._tail('coordinator')}"
            )
        self.port = int(port_file.read_text().strip())

    def start_agent(self, name: str, slots: int | None = None, wait: bool = True) -> None:
        argv = [
            sys.executable,
            "-m",
            "nodeagent.cli",
            "--coordinator",
            self.address,
            "--name",
            name,
            "--slots",
            str(slots or self.slots),
            "--log-dir",
            str(self.log_dir),
            "--state-dir",
            str(self.workdir / "state" / name),
            *self.agent_args,
        ]
        old = self.agents.get(name)
        if old is not None:
            if old.popen.poll() is None:
                raise RuntimeError(f"agent {name} is still running")
            old.log.close()
        self.agents[name] = self._spawn(name, argv)
        if wait:
            self.wait_nodes(lambda live: name in live, f"node {name} to register")

    def wait_nodes(self, pred: Callable[[set[str]], bool], what: str, timeout: float = 30) -> None:
        def check() -> bool:
            try:
                live = {n.name for n in self.client.list_nodes() if n.state == "live"}
            except Exception:
                return False
            return pred(live)

        poll_until(check, timeout, what=what)

    def start(self) -> LocalCluster:
        self.start_coordinator()
        for i in range(self.n_nodes):
            self.start_agent(f"node-{i}", wait=False)
        names = {f"node-{i}" for i in range(self.n_nodes)}
        self.wait_nodes(lambda live: names <= live, f"{self.n_nodes} nodes to register")
        return self

    def kill_agent(self, name: str, sig: int = signal.SIGKILL) -> int:
        proc = self.agents[name]
        pid = proc.popen.pid
        os.kill(pid, sig)
        proc.popen.wait(timeout=30)
        proc.log.close()
        return pid

    def kill_coordinator(self, sig: int = signal.SIGKILL) -> None:
        assert self.coordinator is not None
        os.kill(self.coordinator.popen.pid, sig)
        self.coordinator.popen.wait(timeout=30)
        self.coordinator.log.close()

    def stop(self, timeout: float = 20.0) -> None:
        """SIGTERM everything started here, then SIGKILL what is left; bounded."""
        if self._client is not None:
            self._client.close()
            self._client = None
        procs = [*self.agents.values(), *([self.coordinator] if self.coordinator else [])]
        stop_processes(procs, timeout)
        # Anything still carrying our marker was started by this cluster: it must not survive.
        for proc in self.leftovers():
            with contextlib.suppress(psutil.Error):
                proc.kill()
        if self._own_tmp:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def leftovers(self) -> list[psutil.Process]:
        """Live processes started by this cluster (coordinator, agents, workers)."""
        return marked_processes(self.cluster_id)

    def output(self, name: str) -> str:
        path = self.workdir / f"{name}.out"
        return path.read_text(errors="replace") if path.exists() else ""

    def _tail(self, name: str, lines: int = 20) -> str:
        return "\n".join(self.output(name).splitlines()[-lines:])

    def __enter__(self) -> LocalCluster:
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()
