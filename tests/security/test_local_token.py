"""Loopback is not a trust boundary: the local clusters take only a token their owner holds.

Before the fix `LocalCluster` and `gelastic run` started their coordinator on 127.0.0.1 with no
token, so any user of the host who found the port (`ss -ltn`) could submit jobs that ran as the
cluster's owner. A raw gRPC client without the token now gets UNAUTHENTICATED from both, and a
coordinator started without a token says, in its log, who can use it.
"""

from __future__ import annotations

import logging
import os
import stat
import subprocess
import sys
from pathlib import Path

import grpc
import psutil
import pytest

from coordinator.server import Coordinator, CoordinatorConfig
from gelastic.local import LocalCluster, poll_until
from protos.gelastic.v1 import gelastic_pb2 as pb
from protos.gelastic.v1 import gelastic_pb2_grpc as pb_grpc

REPO = Path(__file__).resolve().parents[2]


def _list_nodes_without_token(address: str) -> grpc.StatusCode:
    with grpc.insecure_channel(address) as ch:
        try:
            pb_grpc.CoordinatorStub(ch).ListNodes(pb.ListNodesRequest(), timeout=10)
        except grpc.RpcError as err:
            return err.code()  # type: ignore[no-any-return]
    return grpc.StatusCode.OK


@pytest.mark.timeout(180)
def test_local_cluster_refuses_a_caller_without_its_token(tmp_path: Path) -> None:
    with LocalCluster(nodes=1, slots=1, workdir=tmp_path / "cluster") as c:
        assert _list_nodes_without_token(c.address) == grpc.StatusCode.UNAUTHENTICATED
        # Its own client, its agents and the CLI environment it hands out carry the token.
        assert [n.name for n in c.client.list_nodes()] == ["node-0"]
        assert c.client_env["GELASTIC_TOKEN_FILE"] == c.token_file
        token_file = Path(c.token_file)
        assert stat.S_IMODE(token_file.stat().st_mode) == 0o600
        assert stat.S_IMODE(token_file.parent.stat().st_mode) == 0o700
        assert token_file.parent.stat().st_uid == os.getuid()
        token = token_file.read_text().strip()
        assert len(token) >= 32
        assert c.coordinator is not None
        for proc in [c.coordinator, *c.agents.values()]:
            assert token not in " ".join(proc.argv)
        proc = subprocess.run(
            [sys.executable, "-m", "gelastic", "nodes", "--json"],
            capture_output=True,
            text=True,
            timeout=60,
            env={**os.environ, **c.client_env},
            cwd=REPO,
        )
        assert proc.returncode == 0, proc.stderr
        assert "node-0" in proc.stdout
        outputs = c.output("coordinator") + c.output("node-0")
    assert token not in outputs
    # The private directory goes with the cluster.
    assert not token_file.parent.exists()


@pytest.mark.timeout(180)
def test_gelastic_run_refuses_a_caller_without_its_token(tmp_path: Path) -> None:
    ready, gate = tmp_path / "ready", tmp_path / "gate"
    script = tmp_path / "wait.py"
    script.write_text(
        "import os, pathlib, time\n"
        f"pathlib.Path({str(ready)!r}).write_text(str(os.getpid()))\n"
        "deadline = time.monotonic() + 120\n"
        f"while not pathlib.Path({str(gate)!r}).exists() and time.monotonic() < deadline:\n"
        "    time.sleep(0.05)\n"
    )
    run = subprocess.Popen(
        [sys.executable, "-m", "gelastic", "run", "--log-level", "INFO", str(script)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=REPO,
    )
    try:
        poll_until(lambda: ready.exists() or run.poll() is not None, 120, what="the worker")
        assert run.poll() is None, run.communicate()
        # The embedded coordinator listens in the `gelastic run` process itself; whatever that
        # process listens on, nothing answers a caller without the token.
        ports = {
            conn.laddr.port
            for conn in psutil.Process(run.pid).net_connections(kind="tcp")
            if conn.status == psutil.CONN_LISTEN
        }
        assert ports
        codes = {_list_nodes_without_token(f"127.0.0.1:{port}") for port in ports}
        assert grpc.StatusCode.UNAUTHENTICATED in codes, codes
        assert grpc.StatusCode.OK not in codes, codes
        gate.write_text("go")
        out, err = run.communicate(timeout=120)
    finally:
        if run.poll() is None:
            run.kill()
            run.communicate(timeout=30)
    assert run.returncode == 0, err
    assert "Bearer" not in out + err
    assert "has no token" not in err


async def test_a_coordinator_without_a_token_warns_who_can_use_it(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="coordinator.server"):
        async with Coordinator(CoordinatorConfig(state_dir=":memory:", port=0)):
            pass
    warned = [r.getMessage() for r in caplog.records if r.name == "coordinator.server"]
    assert any("has no token: every local user" in m for m in warned), warned
    caplog.clear()
    token = tmp_path / "token"
    token.write_text("t" * 32)
    with caplog.at_level(logging.WARNING, logger="coordinator.server"):
        async with Coordinator(
            CoordinatorConfig(state_dir=":memory:", port=0, token_file=str(token))
        ):
            pass
    assert not [r for r in caplog.records if "has no token" in r.getMessage()]


def test_coordinator_serve_without_a_token_warns_on_stderr(tmp_path: Path) -> None:
    port_file = tmp_path / "port"
    serve = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "coordinator.cli",
            "serve",
            "--port",
            "0",
            "--state-dir",
            ":memory:",
            "--port-file",
            str(port_file),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        cwd=REPO,
    )
    try:
        poll_until(lambda: port_file.exists() or serve.poll() is not None, 60, what="serve")
        assert serve.poll() is None
        serve.terminate()
        _, err = serve.communicate(timeout=60)
    finally:
        if serve.poll() is None:
            serve.kill()
            serve.communicate(timeout=30)
    assert "WARNING" in err and "has no token: every local user" in err, err
