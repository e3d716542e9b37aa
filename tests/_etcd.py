"""Real etcd for tests, on loopback: one member (`EtcdServer`) or a three-member cluster
(`EtcdCluster`), each member with its own temp data dir.

`etcd_binary()` finds `etcd` (Debian's etcd-server, which `make setup` installs when it may);
without it a test skips, and under CI (CI=true) it fails instead: the etcd store must be tested.
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import signal
import subprocess
import time
import urllib.request
from pathlib import Path
from typing import IO

import grpc
import pytest

from protos.etcd import rpc_pb2 as epb
from protos.etcd import rpc_pb2_grpc as epb_grpc
from tests._helpers import free_port

START_TIMEOUT_S = 30.0


def etcd_binary() -> str:
    """The etcd binary's path; skips the test (fails it under CI) when there is none."""
    found = os.environ.get("GELASTIC_ETCD") or shutil.which("etcd")
    if found:
        return found
    message = "etcd is not installed (Debian: apt-get install etcd-server; `make setup` does it)"
    if os.environ.get("CI"):
        pytest.fail(message + ": the etcd store is not tested", pytrace=False)
    pytest.skip(message)


class EtcdServer:
    """One etcd process; `restart()` brings it back on the same ports and data."""

    def __init__(
        self,
        workdir: Path,
        tls: tuple[str, str, str] | None = None,
        extra_args: tuple[str, ...] = (),
        name: str = "default",
    ) -> None:
        """`tls`: (CA, server certificate, server key) PEM files; clients then need a
        certificate that CA signed (etcd's --client-cert-auth). `name`: the member's name."""
        self.binary = etcd_binary()
        self.workdir = workdir
        self.tls = tls
        self.extra_args = extra_args
        self.name = name
        self.initial_cluster = ""
        """`--initial-cluster` (NAME=PEER_URL,...); "" = this member alone."""
        self.cluster_token = ""
        self.data_dir = workdir / "data"
        self.client_port = free_port()
        self.peer_port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.client_port}"

    def url(self, prefix: str) -> str:
        return f"etcd://{self.endpoint}/{prefix}"

    @property
    def peer_url(self) -> str:
        return f"http://127.0.0.1:{self.peer_port}"

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def start(self, deadline: float | None = None) -> None:
        """Start it and wait (until `deadline`, a monotonic time; default START_TIMEOUT_S from
        now) until it answers a linearizable read, that is has a leader."""
        self.spawn()
        self.wait_ready(deadline)

    def spawn(self) -> None:
        """Start the process without waiting for it (a cluster's members start together)."""
        if self.proc is not None and self.proc.poll() is None:
            raise RuntimeError("etcd is still running")
        self.workdir.mkdir(parents=True, exist_ok=True)
        client = f"{'https' if self.tls else 'http'}://{self.endpoint}"
        peer = self.peer_url
        argv = [
            self.binary,
            "--name",
            self.name,
            "--data-dir",
            str(self.data_dir),
            "--listen-client-urls",
            client,
            "--advertise-client-urls",
            client,
            "--listen-peer-urls",
            peer,
            "--initial-advertise-peer-urls",
            peer,
            "--initial-cluster",
            self.initial_cluster or f"{self.name}={peer}",
            "--log-level",
            "warn",
        ]
        if self.cluster_token:
            # Read only when the data dir is new; a restarted member rejoins from its data.
            argv += ["--initial-cluster-state", "new"]
            argv += ["--initial-cluster-token", self.cluster_token]
        if self.tls:
            ca, cert, key = self.tls
            argv += ["--cert-file", cert, "--key-file", key]
            argv += ["--trusted-ca-file", ca, "--client-cert-auth"]
        argv += self.extra_args
        self._log = open(self.workdir / "etcd.log", "ab")  # noqa: SIM115 - closed in stop()
        env = {k: v for k, v in os.environ.items() if not k.startswith("ETCD")}
        self.proc = subprocess.Popen(
            argv, stdout=self._log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )

    def channel(self, client_cert: tuple[str, str] | None = None) -> grpc.Channel:
        """A channel to this etcd (`client_cert`: PEM certificate and key, under TLS)."""
        if not self.tls:
            return grpc.insecure_channel(self.endpoint)
        cert, key = client_cert or (self.tls[1], self.tls[2])
        creds = grpc.ssl_channel_credentials(
            Path(self.tls[0]).read_bytes(), Path(key).read_bytes(), Path(cert).read_bytes()
        )
        return grpc.secure_channel(self.endpoint, creds)

    def enable_auth(self, root_password: str) -> None:
        """Turn on etcd's authentication, with user root (role root) as the only user."""
        with self.channel() as ch:
            auth = epb_grpc.AuthStub(ch)
            auth.UserAdd(epb.AuthUserAddRequest(name="root", password=root_password), timeout=5)
            auth.UserGrantRole(epb.AuthUserGrantRoleRequest(user="root", role="root"), timeout=5)
            auth.AuthEnable(epb.AuthEnableRequest(), timeout=5)

    def add_prefix_user(self, user: str, password: str, prefix: str) -> None:
        """Make etcd user `user` (role of the same name) that may read and write the keys
        under `prefix` only; before `enable_auth`. Through etcd's JSON gateway (plain text
        only): the store's own proto subset has no role calls."""
        if self.tls:
            raise RuntimeError("add_prefix_user needs a plain-text etcd")
        end = prefix[:-1] + chr(ord(prefix[-1]) + 1)

        def b64(text: str) -> str:
            return base64.b64encode(text.encode()).decode()

        for path, doc in (
            ("/v3/auth/role/add", {"name": user}),
            (
                "/v3/auth/role/grant",
                {
                    "name": user,
                    "perm": {"permType": "READWRITE", "key": b64(prefix), "range_end": b64(end)},
                },
            ),
            ("/v3/auth/user/add", {"name": user, "password": password}),
            ("/v3/auth/user/grant", {"user": user, "role": user}),
        ):
            req = urllib.request.Request(
                f"http://{self.endpoint}{path}",
                data=json.dumps(doc).encode(),
                headers={"Content-Type": "application/json"},
            )
            with urllib.request.urlopen(req, timeout=5) as resp:
                json.loads(resp.read())

    def wait_ready(self, deadline: float | None = None) -> None:
        if deadline is None:
            deadline = time.monotonic() + START_TIMEOUT_S
        with self.channel() as ch:
            stub = epb_grpc.KVStub(ch)
            while True:
                assert self.proc is not None
                if self.proc.poll() is not None:
                    raise RuntimeError(f"etcd exited with {self.proc.returncode}: {self.log()}")
                try:
                    # A linearizable read answers only once the member has a leader.
                    stub.Range(epb.RangeRequest(key=b"health"), timeout=1.0)
                    return
                except grpc.RpcError as exc:
                    if isinstance(exc, grpc.Call) and exc.code() in (
                        grpc.StatusCode.INVALID_ARGUMENT,
                        grpc.StatusCode.UNAUTHENTICATED,
                    ):
                        return  # it answers: auth is on (a restart of an etcd with auth)
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"etcd did not get ready: {self.log()}") from None
                    time.sleep(0.05)

    def log(self) -> str:
        path = self.workdir / "etcd.log"
        return path.read_text(errors="replace")[-2000:] if path.exists() else ""

    def stop(self, sig: int = signal.SIGTERM) -> None:
        """Stop it (SIGTERM, or SIGKILL after 10 s); safe to call twice."""
        proc, self.proc = self.proc, None
        if proc is not None and proc.poll() is None:
            proc.send_signal(sig)
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)
        if self._log is not None:
            self._log.close()
            self._log = None

    def restart(self) -> None:
        self.stop()
        self.start()


class EtcdCluster:
    """Three etcd members on loopback that form one cluster (each its own ports and data dir).

    `start()` starts every member at once and waits, bounded, until each answers a linearizable
    read; `kill(i)` SIGKILLs one, `start_member(i)` brings it back on its ports and data.
    """

    def __init__(self, workdir: Path, size: int = 3) -> None:
        self.workdir = workdir
        self.members = [EtcdServer(workdir / f"m{i}", name=f"m{i}") for i in range(size)]
        initial = ",".join(f"{m.name}={m.peer_url}" for m in self.members)
        token = f"gelastic-test-{os.getpid()}-{self.members[0].peer_port}"
        for m in self.members:
            m.initial_cluster = initial
            m.cluster_token = token

    @property
    def endpoints(self) -> list[str]:
        return [m.endpoint for m in self.members]

    def url(self, prefix: str, first: int = 0) -> str:
        """A store URL that lists every member, member `first` first (the store's first try)."""
        order = self.endpoints[first:] + self.endpoints[:first]
        return f"etcd://{','.join(order)}/{prefix}"

    def index(self, endpoint: str) -> int:
        return self.endpoints.index(endpoint)

    def raft_leader(self) -> int:
        """Index of the member that is etcd's own (raft) leader now."""
        for i, m in enumerate(self.members):
            if not m.running:
                continue
            with m.channel() as ch:
                st = epb_grpc.MaintenanceStub(ch).Status(epb.StatusRequest(), timeout=5)
            if st.leader == st.header.member_id:
                return i
        raise RuntimeError("no member of the etcd cluster leads")

    def start(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        try:
            for m in self.members:
                m.spawn()
            for m in self.members:
                m.wait_ready(deadline)
        except BaseException:
            self.stop()
            raise

    def kill(self, i: int) -> None:
        """SIGKILL member `i` (its data stays)."""
        self.members[i].stop(signal.SIGKILL)

    def start_member(self, i: int) -> None:
        """Start member `i` again; returns once it answers (it needs a quorum to)."""
        self.members[i].start()

    def stop(self) -> None:
        for m in self.members:
            m.stop()

    def log(self) -> str:
        return "\n".join(f"--- {m.name}:\n{m.log()}" for m in self.members)
