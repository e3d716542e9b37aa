"""A local cluster on this host: a `coordinator serve` and N `nodeagent` processes.

Public API (`from gelastic import LocalCluster`), used by `make demo`, the end-to-end tests and
the benchmarks. Every process it starts carries `GELASTIC_CLUSTER_ID` in its environment
(workers inherit it from their agent), so `leftovers()` finds anything the cluster left behind,
and `stop()` kills only what it started.

Each agent gets a directory of its own (`node_dir(name)`: its worker logs, its state, its temp
dir), as separate hosts would have: a request served by the wrong agent then finds nothing.
`stop()` stops the agents, then the coordinator, with SIGTERM; whatever it still has to SIGKILL
afterwards is returned (and kept in `killed`), so a caller can treat it as the bug it is.

The coordinator listens on loopback, which every user of this host can reach, so it requires a
random token: kept in a file (0600) in a private temp dir (0700), handed to the agents and to
`client`/`connect()`, and to the CLI through `client_env`; nothing prints it.

Return values come back as from any cluster: JSON values decoded, pickles left unloaded. Every
node here is a child process of the caller's, holding a token only the caller's user can read,
so trusting the pickles of its jobs is sound (`job.wait(trust_pickles=True)`); it is still not
the default, so that code written against a LocalCluster behaves the same on a shared cluster,
where it is not (docs/deployment.md, "What a node can do to a client").
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
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

from client import Client
from client.model import JobState
from client.security import new_token_file

__all__ = [
    "AGENT_ENV",
    "CLUSTER_ENV",
    "KilledProcess",
    "LocalCluster",
    "StartedProcess",
    "kill_marked",
    "marked_processes",
    "poll_until",
    "stop_processes",
]

CLUSTER_ENV = "GELASTIC_CLUSTER_ID"
AGENT_ENV = "GELASTIC_LOCAL_AGENT"
"""Set to the agent's name in each agent's environment (its workers inherit it): where a worker
really ran, told by the process tree rather than by what the coordinator believes."""


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


@dataclass(frozen=True)
class KilledProcess:
    """A process that a graceful stop did not end, so it had to be SIGKILLed."""

    pid: int
    name: str
    cmdline: str
    why: str

    def __str__(self) -> str:
        return f"{self.name} (pid {self.pid}, {self.why}): {self.cmdline}"


def stop_processes(procs: Sequence[StartedProcess], timeout: float) -> list[KilledProcess]:
    """SIGTERM each process (in the order given), then SIGKILL the group of any that hangs.

    Returns the processes that had to be killed: a process that ignores SIGTERM for `timeout`
    seconds is a bug of its own, which the caller should see rather than have hidden.
    """
    for p in procs:
        if p.popen.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(p.popen.pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    killed = []
    for p in procs:
        try:
            p.popen.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            killed.append(
                KilledProcess(
                    p.popen.pid,
                    p.name,
                    " ".join(map(str, p.argv))[:200],
                    f"still running {timeout:g} s after SIGTERM",
                )
            )
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.popen.pid, signal.SIGKILL)
            p.popen.wait(timeout=10)
        p.log.close()
    return killed


def kill_marked(cluster_id: str, grace: float) -> list[KilledProcess]:
    """Wait up to `grace` s for the cluster's marked processes to exit; SIGKILL the rest.

    Returns what had to be killed. Called once the cluster's own processes were stopped, so
    anything still marked (a worker, a child of a worker) outlived the agent that owned it.
    """
    with contextlib.suppress(TimeoutError):
        poll_until(lambda: not marked_processes(cluster_id), grace, interval=0.1, what="stragglers")
    killed = []
    for proc in marked_processes(cluster_id):
        with contextlib.suppress(psutil.Error):
            cmdline = " ".join(proc.cmdline())[:200]
            killed.append(
                KilledProcess(proc.pid, proc.name(), cmdline, "alive after its cluster stopped")
            )
            proc.kill()
    with contextlib.suppress(TimeoutError):
        # A SIGKILLed process is gone at once unless it sits in the kernel (D state).
        poll_until(
            lambda: not marked_processes(cluster_id), 10, interval=0.1, what="killed stragglers"
        )
    return killed


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
    argv: Sequence[str] = ()


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
        dashboard_port: int | None = None,
    ) -> None:
        """`dashboard_port`: serve the coordinator's web dashboard on this port (0: a free
        one, chosen at start; None: no dashboard); `dashboard_url` then says where."""
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
        self.dashboard_port = dashboard_port
        self.env = dict(os.environ)
        self.env.update(env or {})
        self.env[CLUSTER_ENV] = self.cluster_id
        self.coordinator: StartedProcess | None = None
        self.agents: dict[str, StartedProcess] = {}
        self.port = 0
        self.killed: list[KilledProcess] = []
        """Every process a `stop()` had to SIGKILL (empty when everything stopped on its own)."""
        self.kept: Path | None = None
        """The directory `stop()` kept because a job failed (its own temp dir only), or None."""
        self._client: Client | None = None
        self._token_file: Path | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def token_file(self) -> str:
        """The file (0600, in a private dir) holding the token the coordinator requires."""
        if self._token_file is None:
            self._token_file = new_token_file("gelastic-cluster-token-")
        return str(self._token_file)

    @property
    def client_env(self) -> dict[str, str]:
        """What a `gelastic` CLI process needs in its environment to use this cluster."""
        return {"GELASTIC_COORDINATOR": self.address, "GELASTIC_TOKEN_FILE": self.token_file}

    @property
    def dashboard_url(self) -> str:
        """The dashboard's URL, as the coordinator reports it ("" without a dashboard)."""
        return self.client.dashboard_url() if self.dashboard_port is not None else ""

    def connect(self, timeout: float | None = None) -> Client:
        """A new client of this cluster's coordinator, with its token; the caller closes it.

        `timeout`: the deadline of each call (None: the Client's default)."""
        if timeout is None:
            return Client(self.address, token_file=self.token_file)
        return Client(self.address, timeout=timeout, token_file=self.token_file)

    @property
    def client(self) -> Client:
        if self._client is None:
            self._client = self.connect()
        return self._client

    def node_dir(self, name: str) -> Path:
        """The directory of agent `name` alone, as if it ran on a host of its own."""
        return self.workdir / "nodes" / name

    def agent_log_dir(self, name: str) -> Path:
        """Where agent `name` keeps its workers' logs (its `--log-dir`)."""
        return self.node_dir(name) / "logs"

    # ---- processes -------------------------------------------------------------------------

    def _spawn(
        self, name: str, argv: list[str], env: dict[str, str] | None = None
    ) -> StartedProcess:
        log_path = self.workdir / f"{name}.out"
        log = open(log_path, "ab")  # noqa: SIM115 - closed by stop_processes or kill_*
        popen = subprocess.Popen(
            argv,
            stdout=None if not self.quiet else log,
            stderr=subprocess.STDOUT if self.quiet else None,
            stdin=subprocess.DEVNULL,
            env=self.env if env is None else env,
            start_new_session=True,
        )
        return StartedProcess(name, popen, log, log_path, tuple(argv))

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
            "--token-file",
            self.token_file,
            *self._dashboard_args(),
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

    def _dashboard_args(self) -> list[str]:
        if self.dashboard_port is None:
            return []
        if self.dashboard_port == 0:
            # Kept once chosen: a restarted coordinator serves its dashboard where it was.
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                self.dashboard_port = int(s.getsockname()[1])
        return ["--dashboard-port", str(self.dashboard_port)]

    def start_agent(
        self,
        name: str,
        slots: int | None = None,
        wait: bool = True,
        env: dict[str, str] | None = None,
    ) -> None:
        """Start agent `name` with its own directories; a restarted agent gets the same ones.

        `env`: more environment for this agent (and its workers) alone, over the cluster's."""
        home = self.node_dir(name)
        tmp = home / "tmp"
        tmp.mkdir(parents=True, exist_ok=True)
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
            str(self.agent_log_dir(name)),
            "--state-dir",
            str(home / "state"),
            "--token-file",
            self.token_file,
            # Every agent here shares this host's GPUs: none is offered unless asked for.
            *([] if "--gpus" in self.agent_args else ["--gpus", "none"]),
            # A SIGTERMed agent gives its workers their job's grace, bounded here so that the
            # cluster's stop (20 s an agent) never has to SIGKILL one.
            *([] if "--stop-grace" in self.agent_args else ["--stop-grace", "10"]),
            *self.agent_args,
        ]
        # Workers inherit the agent's environment: their temp files stay on "their host" too.
        agent_env = {**self.env, **(env or {}), AGENT_ENV: name, "TMPDIR": str(tmp)}
        old = self.agents.get(name)
        if old is not None:
            if old.popen.poll() is None:
                raise RuntimeError(f"agent {name} is still running")
            old.log.close()
        self.agents[name] = self._spawn(name, argv, agent_env)
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

    def stop(self, timeout: float = 20.0, grace: float = 5.0) -> list[KilledProcess]:
        """Stop gracefully, then SIGKILL what is left; return (and keep in `killed`) the latter.

        The agents go first, with SIGTERM, so that they stop their workers while the
        coordinator still listens; then the coordinator. Each gets `timeout` seconds. What
        still carries the cluster's marker `grace` seconds later outlived its agent. Bounded,
        and safe to call twice.
        """
        failed = self._failed_jobs() if self._own_tmp and self.kept is None else []
        if self._client is not None:
            self._client.close()
            self._client = None
        killed = stop_processes(list(self.agents.values()), timeout)
        if self.coordinator is not None:
            killed += stop_processes([self.coordinator], timeout)
        # Anything still carrying our marker was started by this cluster: it must not survive.
        killed += kill_marked(self.cluster_id, grace)
        self.killed.extend(killed)
        if self._own_tmp and failed:
            # The failure reports name files in here (worker logs, error files): keep them.
            self.kept = self.workdir
            print(
                f"gelastic: {len(failed)} job{'' if len(failed) == 1 else 's'} failed "
                f"({', '.join(failed[:5])}); kept the "
                f"cluster's directory {self.workdir} (worker logs in nodes/*/logs)",
                file=sys.stderr,
            )
        elif self._own_tmp and self.kept is None:
            shutil.rmtree(self.workdir, ignore_errors=True)
        if self._token_file is not None:
            shutil.rmtree(self._token_file.parent, ignore_errors=True)
            self._token_file = None
        return killed

    def _failed_jobs(self) -> list[str]:
        """Ids of the jobs that failed, asked (bounded) of a coordinator that still runs."""
        if self.coordinator is None or self.coordinator.popen.poll() is not None:
            return []
        try:
            with self.connect(timeout=5.0) as client:
                jobs = client.list_jobs(include_finished=True)
        except Exception:
            return []
        return [j.job_id for j in jobs if j.state == JobState.FAILED]

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
