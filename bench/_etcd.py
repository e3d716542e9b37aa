"""etcd for the benchmarks: one member or a three-member cluster on 127.0.0.1, each member with
its own ports and data directory in a fresh temporary directory (removed by `stop()`).

`etcd_binary()` is `$GELASTIC_ETCD` or `etcd` on PATH (Debian: etcd-server), None without one:
the scenarios that need etcd then say so and skip those rows.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path
from typing import IO

import grpc

from bench._common import free_port
from protos.etcd import rpc_pb2 as epb
from protos.etcd import rpc_pb2_grpc as epb_grpc

__all__ = ["EtcdCluster", "etcd_binary"]

START_TIMEOUT_S = 30.0


def etcd_binary() -> str | None:
    return os.environ.get("GELASTIC_ETCD") or shutil.which("etcd")


class _Member:
    def __init__(self, binary: str, workdir: Path, name: str) -> None:
        self.binary, self.workdir, self.name = binary, workdir, name
        self.client_port, self.peer_port = free_port(), free_port()
        self.proc: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.client_port}"

    @property
    def peer_url(self) -> str:
        return f"http://127.0.0.1:{self.peer_port}"

    def spawn(self, initial_cluster: str, token: str) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        client = f"http://{self.endpoint}"
        argv = [
            self.binary,
            "--name", self.name,
            "--data-dir", str(self.workdir / "data"),
            "--listen-client-urls", client,
            "--advertise-client-urls", client,
            "--listen-peer-urls", self.peer_url,
            "--initial-advertise-peer-urls", self.peer_url,
            "--initial-cluster", initial_cluster,
            "--initial-cluster-token", token,
            "--log-level", "warn",
        ]  # fmt: skip
        self._log = open(self.workdir / "etcd.log", "ab")  # noqa: SIM115 - closed in stop
        env = {k: v for k, v in os.environ.items() if not k.startswith("ETCD")}
        self.proc = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )

    def wait_ready(self, deadline: float) -> None:
        """Until it answers a linearizable read (it has a leader); bounded by `deadline`."""
        with grpc.insecure_channel(self.endpoint) as ch:
            stub = epb_grpc.KVStub(ch)
            while True:
                assert self.proc is not None
                if self.proc.poll() is not None:
                    raise RuntimeError(f"etcd {self.name} exited with {self.proc.returncode}")
                try:
                    stub.Range(epb.RangeRequest(key=b"health"), timeout=1.0)
                    return
                except grpc.RpcError:
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"etcd {self.name} did not get ready") from None
                    time.sleep(0.05)

    def stop(self, sig: int = signal.SIGTERM) -> None:
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


class EtcdCluster:
    """`size` etcd members that form one cluster; `url(prefix)` lists every member."""

    def __init__(self, size: int = 3) -> None:
        binary = etcd_binary()
        if binary is None:
            raise RuntimeError("etcd is not installed (Debian: apt-get install etcd-server)")
        self.workdir = Path(tempfile.mkdtemp(prefix="gelastic-bench-etcd-"))
        self.members = [_Member(binary, self.workdir / f"m{i}", f"m{i}") for i in range(size)]
        self._initial = ",".join(f"{m.name}={m.peer_url}" for m in self.members)
        self._token = f"gelastic-bench-{os.getpid()}-{self.members[0].peer_port}"

    @property
    def endpoints(self) -> list[str]:
        return [m.endpoint for m in self.members]

    def url(self, prefix: str) -> str:
        return f"etcd://{','.join(self.endpoints)}/{prefix}"

    def start(self) -> EtcdCluster:
        deadline = time.monotonic() + START_TIMEOUT_S
        try:
            for m in self.members:
                m.spawn(self._initial, self._token)
            for m in self.members:
                m.wait_ready(deadline)
        except BaseException:
            self.stop()
            raise
        return self

    def kill(self, i: int) -> None:
        """SIGKILL member `i` (its data stays)."""
        self.members[i].stop(signal.SIGKILL)

    def start_member(self, i: int) -> None:
        self.members[i].spawn(self._initial, self._token)
        self.members[i].wait_ready(time.monotonic() + START_TIMEOUT_S)

    def stop(self) -> None:
        """Stop every member and remove the data; idempotent."""
        for m in self.members:
            with contextlib.suppress(OSError):
                m.stop()
        shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> EtcdCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
