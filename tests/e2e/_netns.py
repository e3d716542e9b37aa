"""Network namespaces for end-to-end tests: every process on its own address of a private subnet.

`Lab` builds, per run, a small network that lives entirely on this machine:

    root namespace (the test)  gel<id>  10.213.S.1 ─┐
                                                     hub namespace: bridge br0
    namespace <run>-coord      eth0     10.213.S.2 ─┤   (one bridge port per namespace)
    namespace <run>-node-a     eth0     10.213.S.11 ─┤
    ...                                              ┘

The bridge sits in a namespace of its own, so deleting the namespaces removes every link the run
created. `cut(name)` sets the namespace's bridge port down (the cable is pulled: the process
sees nothing, no reset, no FIN); `restore(name)` plugs it back in. Nothing outside the subnet is
ever contacted: the namespaces have no default route.

`NetnsCluster` runs a `coordinator serve` and `nodeagent`s in such namespaces with `ip netns
exec`, each in its own session and with `GELASTIC_CLUSTER_ID` set, so that whatever it started
(workers included) can be found again with psutil.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import ipaddress
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import pytest

from client._client import Client
from gelastic.local import (
    CLUSTER_ENV,
    KilledProcess,
    StartedProcess,
    kill_marked,
    marked_processes,
    poll_until,
    stop_processes,
)

__all__ = ["Host", "Lab", "NetnsCluster", "in_ci", "require_netns", "skip_reason"]

REPO = Path(__file__).resolve().parents[2]
NS_PREFIX = "gelnt"
IFNAME = "eth0"
"""The interface name inside every host namespace (so one GLOO_SOCKET_IFNAME fits all nodes)."""
SUPERNET = "10.213"
_LOCK = Path(tempfile.gettempdir()) / "gelastic-netns.lock"
_NS_NAME = re.compile(rf"^{NS_PREFIX}-(\d+)-([0-9a-f]+)-")


CI_ENV = "CI"


def in_ci() -> bool:
    """$CI is set (to anything but "", "0" or "false"): the run must not skip this test."""
    return os.environ.get(CI_ENV, "").strip().lower() not in ("", "0", "false", "no")


def skip_reason() -> str | None:
    """Why network-namespace tests cannot run here, or None."""
    if os.geteuid() != 0:
        return "network namespace tests need root (ip netns add); run pytest as root"
    if shutil.which("ip") is None:
        return "the ip command is missing; install it with: apt-get install iproute2"
    return _netns_add_refused()


@functools.cache
def _netns_add_refused() -> str | None:
    """Root is not enough in a container without CAP_SYS_ADMIN: try one namespace and see."""
    # Named like a run's namespaces, so that _sweep_stale removes it if this process dies here.
    probe = f"{NS_PREFIX}-{os.getpid()}-{uuid.uuid4().hex[:6]}-probe"
    try:
        proc = subprocess.run(
            ["ip", "netns", "add", probe], capture_output=True, text=True, timeout=30
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"ip netns add could not run: {exc}"
    if proc.returncode != 0:
        return (
            f"ip netns add is refused here ({proc.stderr.strip() or f'exit {proc.returncode}'}); "
            "a container needs CAP_SYS_ADMIN for network namespaces "
            "(docker run --cap-add SYS_ADMIN, or --privileged)"
        )
    ip("netns", "del", probe, check=False)
    return None


def require_netns() -> None:
    """Skip the calling test with the reason it cannot run here; under CI, fail with it instead.

    CI is where this test must run (root, iproute2 installed by `make setup`): a skip there would
    pass a build that never checked the network faults.
    """
    reason = skip_reason()
    if reason is None:
        return
    if in_ci():
        pytest.fail(
            f"the network-namespace test must run in CI (${CI_ENV} is set) but cannot: {reason}",
            pytrace=False,
        )
    pytest.skip(reason)


def ip(*args: str, check: bool = True) -> str:
    """Run `ip ARGS` and return its stdout; raise with its stderr on failure."""
    proc = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and proc.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)} failed ({proc.returncode}): {proc.stderr.strip()}")
    return proc.stdout


def _netns_names() -> list[str]:
    return [line.split()[0] for line in ip("netns", "list").splitlines() if line.strip()]


@dataclass(frozen=True)
class Host:
    name: str
    netns: str
    addr: str
    port: str
    """The host's port on the bridge, in the hub namespace."""


@dataclass
class Lab:
    """`with Lab() as lab: lab.add_host("coord")` — a private subnet; torn down on exit."""

    run_id: str = field(default_factory=lambda: f"{os.getpid()}-{uuid.uuid4().hex[:6]}")
    hosts: dict[str, Host] = field(default_factory=dict)
    subnet: ipaddress.IPv4Network | None = None
    hub: str = ""
    root_link: str = ""
    _namespaces: list[str] = field(default_factory=list)

    @property
    def gateway(self) -> str:
        """The root namespace's address on the subnet (where the test process talks from)."""
        assert self.subnet is not None
        return str(self.subnet.network_address + 1)

    def _ns(self, suffix: str) -> str:
        return f"{NS_PREFIX}-{self.run_id}-{suffix}"

    def _add_netns(self, name: str) -> None:
        ip("netns", "add", name)
        self._namespaces.append(name)
        ip("-n", name, "link", "set", "lo", "up")

    def setup(self) -> Lab:
        with _locked():
            _sweep_stale()
            self.subnet = _free_subnet()
            self.hub = self._ns("hub")
            self._add_netns(self.hub)
            ip("-n", self.hub, "link", "add", "br0", "type", "bridge")
            ip("-n", self.hub, "link", "set", "br0", "up")
            # The root end is named after the run, so two runs never collide.
            self.root_link = f"gel{self.run_id.split('-')[1]}"
            ip(
                "link",
                "add",
                self.root_link,
                "type",
                "veth",
                "peer",
                "name",
                "up0",
                "netns",
                self.hub,
            )
            ip("-n", self.hub, "link", "set", "up0", "master", "br0", "up")
            ip("addr", "add", f"{self.gateway}/{self.subnet.prefixlen}", "dev", self.root_link)
            ip("link", "set", self.root_link, "up")
        return self

    def add_host(self, name: str, host_octet: int) -> Host:
        """A namespace with `eth0` = 10.213.S.<host_octet> plugged into the bridge."""
        assert self.subnet is not None
        netns = self._ns(name)
        self._add_netns(netns)
        port = f"p{len(self.hosts)}"
        ip(
            "-n",
            self.hub,
            "link",
            "add",
            port,
            "type",
            "veth",
            "peer",
            "name",
            IFNAME,
            "netns",
            netns,
        )
        ip("-n", self.hub, "link", "set", port, "master", "br0", "up")
        addr = str(self.subnet.network_address + host_octet)
        ip("-n", netns, "addr", "add", f"{addr}/{self.subnet.prefixlen}", "dev", IFNAME)
        ip("-n", netns, "link", "set", IFNAME, "up")
        host = Host(name, netns, addr, port)
        self.hosts[name] = host
        return host

    def cut(self, name: str) -> None:
        """Pull the host's cable: its bridge port goes down, its packets go nowhere."""
        ip("-n", self.hub, "link", "set", self.hosts[name].port, "down")

    def restore(self, name: str) -> None:
        ip("-n", self.hub, "link", "set", self.hosts[name].port, "up")

    def port_is_up(self, name: str) -> bool:
        return "state UP" in ip("-n", self.hub, "link", "show", self.hosts[name].port)

    def teardown(self) -> list[str]:
        """Remove everything this run created; return what could not be removed."""
        problems = []
        if self.root_link:
            ip("link", "del", self.root_link, check=False)
        for ns in reversed(self._namespaces):
            try:
                ip("netns", "del", ns)
            except RuntimeError as exc:
                problems.append(str(exc))
        self._namespaces.clear()
        left = [ns for ns in _netns_names() if ns.startswith(self._ns(""))]
        problems += [f"namespace {ns} is still there" for ns in left]
        if self.root_link and ip("link", "show", self.root_link, check=False).strip():
            problems.append(f"link {self.root_link} is still there")
        return problems

    def __enter__(self) -> Lab:
        try:
            return self.setup()
        except BaseException:
            self.teardown()
            raise

    def __exit__(self, *exc: object) -> None:
        problems = self.teardown()
        if problems and exc[0] is None:
            raise AssertionError("network teardown: " + "; ".join(problems))


@contextlib.contextmanager
def _locked() -> Iterator[None]:
    """Serialise subnet choice between concurrent runs on this machine."""
    with open(_LOCK, "a+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _sweep_stale() -> None:
    """Delete namespaces of earlier runs whose test process no longer exists (it was killed)."""
    for ns in _netns_names():
        m = _NS_NAME.match(ns)
        if m and not psutil.pid_exists(int(m.group(1))):
            ip("netns", "del", ns, check=False)


def _free_subnet() -> ipaddress.IPv4Network:
    """A 10.213.S.0/24 that no address or route of the root namespace is in."""
    used = set()
    for line in (ip("-4", "-o", "addr", "show") + ip("-4", "route", "show")).splitlines():
        for word in line.split():
            if word.startswith(f"{SUPERNET}."):
                used.add(int(word.split("/")[0].split(".")[2]))
    free = [s for s in range(1, 255) if s not in used]
    if not free:
        raise RuntimeError(f"no free /24 left in {SUPERNET}.0.0/16")
    return ipaddress.IPv4Network(f"{SUPERNET}.{random.choice(free)}.0/24")


# ---- processes ---------------------------------------------------------------------------------


class NetnsCluster:
    """A coordinator and node agents, each in its own namespace of `lab`."""

    def __init__(
        self,
        lab: Lab,
        workdir: Path,
        *,
        lease: float,
        heartbeat_interval: float,
        slots: int = 1,
    ) -> None:
        self.lab = lab
        self.workdir = workdir
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.lease = lease
        self.heartbeat_interval = heartbeat_interval
        self.slots = slots
        self.cluster_id = uuid.uuid4().hex
        self.env = dict(os.environ)
        self.env[CLUSTER_ENV] = self.cluster_id
        self.procs: dict[str, StartedProcess] = {}
        self.killed: list[KilledProcess] = []
        """What `stop()` had to SIGKILL because SIGTERM did not end it."""
        self.address = ""
        self._client: Client | None = None

    @property
    def client(self) -> Client:
        if self._client is None:
            self._client = Client(self.address)
        return self._client

    def _spawn(self, name: str, host: Host, argv: Sequence[str]) -> StartedProcess:
        log_path = self.workdir / f"{name}.out"
        log = open(log_path, "ab")  # noqa: SIM115 - closed in stop()
        full = ["ip", "netns", "exec", host.netns, *argv]
        popen = subprocess.Popen(
            full,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=self.env,
            cwd=REPO,
            start_new_session=True,
        )
        proc = StartedProcess(name, popen, log, log_path, tuple(full))
        self.procs[name] = proc
        return proc

    def start_coordinator(self, host: Host) -> None:
        port_file = self.workdir / "coordinator.port"
        argv = [
            sys.executable, "-m", "coordinator.cli", "serve",
            "--host", host.addr, "--port", "0", "--port-file", str(port_file),
            "--lease", str(self.lease), "--heartbeat-interval", str(self.heartbeat_interval),
            "--insecure", "--state-dir", str(self.workdir / "coordinator-state"),
        ]  # fmt: skip
        popen = self._spawn("coordinator", host, argv).popen
        poll_until(
            lambda: port_file.exists() or popen.poll() is not None,
            30,
            what="the coordinator to listen",
        )
        if popen.poll() is not None:
            raise RuntimeError(
                f"the coordinator exited with {popen.returncode}: {self.output('coordinator')}"
            )
        self.address = f"{host.addr}:{int(port_file.read_text())}"

    def start_agent(self, host: Host) -> None:
        argv = [
            sys.executable, "-m", "nodeagent.cli",
            "--coordinator", self.address, "--name", host.name, "--addr", host.addr,
            "--slots", str(self.slots), "--log-dir", str(self.workdir / "logs" / host.name),
            "--state-dir", str(self.workdir / "state" / host.name),
        ]  # fmt: skip
        self._spawn(host.name, host, argv)

    def live_nodes(self) -> dict[str, str]:
        """name -> incarnation of every node the coordinator holds live."""
        try:
            return {n.name: n.incarnation for n in self.client.list_nodes() if n.state == "live"}
        except Exception:
            return {}

    def output(self, name: str) -> str:
        path = self.workdir / f"{name}.out"
        return path.read_text(errors="replace") if path.exists() else ""

    def stop(self, timeout: float = 20.0) -> None:
        """SIGTERM every process started here (agents first), then SIGKILL its group if it hangs."""
        if self._client is not None:
            self._client.close()
            self._client = None
        procs = sorted(self.procs.values(), key=lambda p: p.name == "coordinator")
        self.killed += stop_processes(procs, timeout)

    def leftovers(self) -> list[psutil.Process]:
        """Live processes carrying this cluster's marker (coordinator, agents, workers)."""
        return marked_processes(self.cluster_id)

    def kill_leftovers(self) -> list[tuple[int, str]]:
        """Wait a little for stragglers to exit, then SIGKILL them; return what had to be killed
        (by `stop()` too: a process that hung on SIGTERM)."""
        self.killed += kill_marked(self.cluster_id, 15)
        return [(k.pid, str(k)) for k in self.killed]
