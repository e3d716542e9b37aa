"""A real single-member etcd for tests: on loopback, with its own temp data dir.

`etcd_binary()` finds `etcd` (Debian's etcd-server, which `make setup` installs when it may);
without it a test skips, and under CI (CI=true) it fails instead: the etcd store must be tested.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import IO

import grpc
import pytest

from protos.etcd import rpc_pb2 as epb
from protos.etcd import rpc_pb2_grpc as epb_grpc

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


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


class EtcdServer:
    """One etcd process; `restart()` brings it back on the same ports and data."""

    def __init__(
        self,
        workdir: Path,
        tls: tuple[str, str, str] | None = None,
        extra_args: tuple[str, ...] = (),
    ) -> None:
        """`tls`: (CA, server certificate, server key) PEM files; clients then need a
        certificate that CA signed (etcd's --client-cert-auth)."""
        self.binary = etcd_binary()
        self.workdir = workdir
        self.tls = tls
        self.extra_args = extra_args
        self.data_dir = workdir / "data"
        self.client_port = _free_port()
        self.peer_port = _free_port()
        self.proc: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.client_port}"

    def url(self, prefix: str) -> str:
        return f"etcd://{self.endpoint}/{prefix}"

    def start(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            raise RuntimeError("etcd is still running")
        self.workdir.mkdir(parents=True, exist_ok=True)
        client = f"{'https' if self.tls else 'http'}://{self.endpoint}"
        peer = f"http://127.0.0.1:{self.peer_port}"
        argv = [
            self.binary,
            "--name",
            "default",
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
            f"default={peer}",
            "--log-level",
            "warn",
        ]
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
        self._wait_ready()

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

    def _wait_ready(self) -> None:
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
