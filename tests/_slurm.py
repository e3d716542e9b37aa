"""A private single-host Slurm for tests: its own munged (key, socket, pid file in a temp dir),
one `slurmctld` and one `slurmd` on free ports, all configured by a generated slurm.conf that
`SLURM_CONF` names. Nothing of the machine's own munge or Slurm setup is read or touched.

`slurm_binaries()` finds the daemons and tools (Debian's slurm-wlm and munge, which `make setup`
installs when it may); without them, or without root (the daemons run as SlurmUser=root), a test
skips, and under CI (CI=true) it fails instead: `gelastic run` under srun must be tested.

`private_slurm(workdir)` starts it, waits (bounded) until the one node is idle, and yields a
`SlurmCluster` whose `env()` is what a test passes to srun, scancel and squeue; on the way out it
stops every daemon it started, by pid, and checks that each is gone.
"""

from __future__ import annotations

import ctypes
import os
import secrets
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

import psutil
import pytest

from tests._helpers import free_port

START_TIMEOUT_S = 60.0
"""How long the daemons may take until the node is idle."""
STOP_TIMEOUT_S = 15.0
"""How long a daemon may take to exit on SIGTERM before it is SIGKILLed (and the stop fails)."""
CALL_TIMEOUT_S = 30.0
"""The bound on one sinfo/squeue/scancel call."""

KILL_WAIT_S = 60
"""slurm.conf's KillWait: scancel sends SIGKILL this long after SIGTERM."""

DAEMON_MARKER_ENV = "GELASTIC_TEST_SLURM"
"""Set in the daemons' environment (a value per cluster), so what they leave can be found."""

_TOOLS = ("munged", "slurmctld", "slurmd", "srun", "sinfo", "squeue", "scancel")


def slurm_binaries() -> dict[str, str]:
    """Each of munged, slurmctld, slurmd, srun, sinfo, squeue and scancel by its path; skips the
    test (fails it under CI) when one is missing or when not running as root."""
    found = {name: shutil.which(name, path=_search_path()) for name in _TOOLS}
    missing = [name for name, path in found.items() if path is None]
    message = ""
    if missing:
        message = (
            f"Slurm is not installed (no {', '.join(missing)}; Debian: apt-get install "
            "slurm-wlm munge; `make setup` does it)"
        )
    elif os.geteuid() != 0:
        message = "a private Slurm needs root (its daemons run as SlurmUser=root)"
    if message:
        if os.environ.get("CI"):
            pytest.fail(message + ": gelastic run under Slurm is not tested", pytrace=False)
        pytest.skip(message)
    return {name: path for name, path in found.items() if path is not None}


def _search_path() -> str:
    # The daemons live in sbin, which a non-login PATH may lack.
    return os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/sbin"])


def slurm_conf(
    workdir: Path,
    *,
    host: str,
    cpus: int,
    ctld_port: int,
    slurmd_port: int,
    munge_socket: Path,
) -> str:
    """The slurm.conf of a one-node cluster whose files all live under `workdir`."""
    lines = {
        "ClusterName": "gelastic-test",
        # Every daemon binds the loopback address it is named by, not every interface.
        "SlurmctldHost": f"{host}(127.0.0.1)",
        "CommunicationParameters": "NoCtldInAddrAny,NoInAddrAny",
        "SlurmctldPort": str(ctld_port),
        "SlurmdPort": str(slurmd_port),
        "AuthType": "auth/munge",
        "AuthInfo": f"socket={munge_socket}",
        "CredType": "cred/munge",
        "StateSaveLocation": str(workdir / "state"),
        "SlurmdSpoolDir": str(workdir / "spool"),
        "SlurmctldPidFile": str(workdir / "slurmctld.pid"),
        "SlurmdPidFile": str(workdir / "slurmd.pid"),
        "SlurmctldLogFile": str(workdir / "slurmctld.log"),
        "SlurmdLogFile": str(workdir / "slurmd.log"),
        "ProctrackType": "proctrack/linuxproc",
        "TaskPlugin": "task/none",
        "SwitchType": "switch/none",
        "MpiDefault": "none",
        "SlurmUser": "root",
        "SlurmdUser": "root",
        "ReturnToService": "2",
        "SchedulerType": "sched/builtin",
        "SelectType": "select/cons_tres",
        "SelectTypeParameters": "CR_CPU",
        "JobAcctGatherType": "jobacct_gather/none",
        "AccountingStorageType": "accounting_storage/none",
        # scancel's SIGKILL follows its SIGTERM this long after: well beyond what a test waits
        # for a launcher to stop its workers on SIGTERM, so Slurm's SIGKILL never does it.
        "KillWait": str(KILL_WAIT_S),
        "NodeName": f"{host} NodeAddr=127.0.0.1 CPUs={cpus} State=UNKNOWN",
        "PartitionName": (
            f"debug Nodes={host} Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:4"
        ),
    }
    return "".join(f"{key}={value}\n" for key, value in lines.items())


@dataclass
class _Daemon:
    name: str
    proc: subprocess.Popen[bytes]
    log: IO[bytes]
    pid_file: Path | None = None


@dataclass
class SlurmCluster:
    """One private single-host Slurm; see `private_slurm`."""

    workdir: Path
    host: str = field(default_factory=lambda: socket.gethostname().split(".")[0])
    cpus: int = field(default_factory=lambda: len(os.sched_getaffinity(0)))  # as nproc
    bins: dict[str, str] = field(default_factory=slurm_binaries)
    marker: str = field(default_factory=lambda: secrets.token_hex(8))
    _daemons: list[_Daemon] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.workdir = self.workdir.resolve()

    @property
    def conf(self) -> Path:
        return self.workdir / "slurm.conf"

    @property
    def munge_socket(self) -> Path:
        return self.workdir / "munge-run" / "munge.socket"

    def env(self, **extra: str) -> dict[str, str]:
        """The environment for srun, scancel, squeue and sinfo against this cluster: this
        process's, less any Slurm variables it inherited (a test run inside a Slurm job must
        not reach that job's cluster), with SLURM_CONF and `extra`."""
        base = {
            k: v
            for k, v in os.environ.items()
            if not k.startswith(("SLURM_", "SBATCH_", "SALLOC_", "SRUN_"))
        }
        base["PATH"] = _search_path()
        return {**base, "SLURM_CONF": str(self.conf), **extra}

    def start(self) -> None:
        """Start munged, slurmctld and slurmd; return once the node is idle. Bounded by
        START_TIMEOUT_S; on any failure every daemon started so far is stopped."""
        deadline = time.monotonic() + START_TIMEOUT_S
        try:
            self._write_files()
            self._start_munged(deadline)
            self._spawn("slurmctld", [self.bins["slurmctld"], "-D"], "slurmctld.pid")
            self._spawn("slurmd", [self.bins["slurmd"], "-D"], "slurmd.pid")
            self._wait_idle(deadline)
        except BaseException:
            self.stop()
            raise

    def _write_files(self) -> None:
        for d in ("state", "spool"):
            (self.workdir / d).mkdir(parents=True, exist_ok=True)
        key_dir = self.workdir / "munge-key"
        key_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        key = key_dir / "munge.key"
        key.write_bytes(secrets.token_bytes(1024))
        key.chmod(0o400)
        # Clients (srun, slurmd) reach the socket as any user: the directory must be searchable.
        self.munge_socket.parent.mkdir(mode=0o755, parents=True, exist_ok=True)
        longest = self.workdir / "spool" / f"{self.host}_4294967295.4294967295"
        if len(str(longest)) > 100:  # sun_path holds 108 bytes; slurmstepd's socket lives here
            raise ValueError(f"{self.workdir}: too long a path for Slurm's unix sockets")
        self.conf.write_text(
            slurm_conf(
                self.workdir,
                host=self.host,
                cpus=self.cpus,
                ctld_port=free_port(),
                slurmd_port=free_port(),
                munge_socket=self.munge_socket,
            )
        )

    def _start_munged(self, deadline: float) -> None:
        run = self.munge_socket.parent
        argv = [
            self.bins["munged"],
            "--foreground",  # its log goes to stderr: munged.out
            # The temp dir's parents (/tmp is world-writable, sticky) fail munged's strict
            # ownership checks; --force lets it run with a warning.
            "--force",
            f"--socket={self.munge_socket}",
            f"--key-file={self.workdir / 'munge-key' / 'munge.key'}",
            f"--pid-file={run / 'munged.pid'}",
            f"--seed-file={run / 'munged.seed'}",
        ]
        self._spawn("munged", argv, None)
        self._poll(
            deadline,
            lambda: self.munge_socket.exists() and (run / "munged.pid").exists(),
            "munged to create its socket",
        )

    def _spawn(self, name: str, argv: list[str], pid_file: str | None) -> None:
        log = open(self.workdir / f"{name}.out", "ab")  # noqa: SIM115 - closed in stop()
        proc = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=self.env(**{DAEMON_MARKER_ENV: self.marker}),
            cwd=self.workdir,
            start_new_session=True,
            preexec_fn=_die_with_parent,
        )
        self._daemons.append(
            _Daemon(name, proc, log, self.workdir / pid_file if pid_file else None)
        )

    def _poll(self, deadline: float, pred: Callable[[], bool], what: str) -> None:
        while not pred():
            for d in self._daemons:
                if d.proc.poll() is not None:
                    raise RuntimeError(
                        f"{d.name} exited with {d.proc.returncode} while waiting for {what}:\n"
                        + self.logs()
                    )
            if time.monotonic() > deadline:
                raise TimeoutError(f"timed out waiting for {what}:\n" + self.logs())
            time.sleep(0.1)

    def node_state(self) -> str:
        """The node's state as sinfo prints it ("idle", "alloc", "down*", ...; "" if unknown)."""
        proc = self.tool("sinfo", "-h", "-N", "-o", "%T", check=False)
        return proc.stdout.strip() if proc.returncode == 0 else ""

    def _wait_idle(self, deadline: float) -> None:
        self._poll(deadline, lambda: self.node_state() == "idle", f"node {self.host} to be idle")

    def tool(self, name: str, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        """Run one Slurm client (sinfo, squeue, scancel) against this cluster, bounded."""
        return subprocess.run(
            [self.bins[name], *args],
            env=self.env(),
            capture_output=True,
            text=True,
            timeout=CALL_TIMEOUT_S,
            check=check,
        )

    def job_ids(self) -> list[str]:
        """The ids of the jobs the controller holds (any state squeue shows)."""
        return self.tool("squeue", "-h", "-o", "%i").stdout.split()

    def logs(self) -> str:
        parts = []
        for name in ("munged.out", "slurmctld.log", "slurmd.log", "slurmctld.out", "slurmd.out"):
            path = self.workdir / name
            if path.exists():
                parts.append(f"--- {name}:\n{path.read_text(errors='replace')[-3000:]}")
        return "\n".join(parts)

    def daemon_pids(self) -> dict[str, int]:
        """Each running daemon's pid, as its pid file says (munged's and the others')."""
        pids = {}
        for d in self._daemons:
            pid_file = d.pid_file or self.munge_socket.parent / "munged.pid"
            if pid_file.exists() and pid_file.read_text().strip():
                pids[d.name] = int(pid_file.read_text().strip())
        return pids

    def stop(self) -> None:
        """Cancel what is left in the queue, then stop slurmd, slurmctld and munged (in that
        order) by pid: SIGTERM, then SIGKILL after STOP_TIMEOUT_S. Raises if a daemon needed
        SIGKILL, if its pid file named another process, or if one is still alive; safe to call
        twice."""
        if not self._daemons:
            return
        problems: list[str] = []
        if any(d.name == "slurmctld" and d.proc.poll() is None for d in self._daemons):
            problems += self._cancel_all()
        from_files = self.daemon_pids()
        for d in reversed(self._daemons):
            if d.name in from_files and from_files[d.name] != d.proc.pid:
                problems.append(
                    f"{d.name}: pid file says {from_files[d.name]}, started as {d.proc.pid}"
                )
            if d.proc.poll() is None:
                d.proc.send_signal(signal.SIGTERM)
                try:
                    d.proc.wait(timeout=STOP_TIMEOUT_S)
                except subprocess.TimeoutExpired:
                    d.proc.kill()
                    d.proc.wait(timeout=STOP_TIMEOUT_S)
                    problems.append(f"{d.name} (pid {d.proc.pid}) ignored SIGTERM: killed")
            d.log.close()
        for d in self._daemons:
            if psutil.pid_exists(d.proc.pid) and _alive(d.proc.pid):
                problems.append(f"{d.name} (pid {d.proc.pid}) is still running")
        self._daemons.clear()
        for p in _strays(self.marker, self.workdir):
            problems.append(f"left behind: pid {p.pid} {p.name()} {p.cmdline()}")
            p.kill()
        if problems:
            raise AssertionError("private Slurm did not stop cleanly:\n  " + "\n  ".join(problems))

    def _cancel_all(self) -> list[str]:
        try:
            ids = self.job_ids()
            if not ids:
                return []
            self.tool("scancel", "--full", *ids, check=False)
            deadline = time.monotonic() + KILL_WAIT_S + STOP_TIMEOUT_S
            while self.job_ids():
                if time.monotonic() > deadline:
                    return [f"jobs still queued after scancel: {self.job_ids()}"]
                time.sleep(0.2)
        except (subprocess.SubprocessError, OSError) as exc:
            return [f"could not empty the queue: {exc}"]
        return []


def _die_with_parent() -> None:
    """In the child before exec: SIGKILL it when the test process dies without stopping it (a
    killed pytest must not leave a Slurm running). Linux only; elsewhere a no-op."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _strays(marker: str, workdir: Path) -> list[psutil.Process]:
    """Live processes of this cluster: those that carry its daemon marker, and the slurmstepd of
    a step (slurmd clears the environment of what it starts, but a slurmstepd works in slurmd's
    directory)."""
    found = []
    me = os.getpid()
    for proc in psutil.process_iter(["pid"]):
        try:
            if proc.pid == me or not _alive(proc.pid):
                continue
            if proc.environ().get(DAEMON_MARKER_ENV) == marker or (
                proc.name().startswith("slurmstepd") and Path(proc.cwd()) == workdir
            ):
                found.append(proc)
        except psutil.Error:
            continue
    return found


@contextmanager
def private_slurm(workdir: Path) -> Iterator[SlurmCluster]:
    """A running private Slurm in `workdir`, stopped (and checked) on the way out."""
    cluster = SlurmCluster(workdir)
    cluster.start()
    try:
        yield cluster
    finally:
        cluster.stop()
