"""A token never crosses the network in clear text unless someone says --insecure.

Before the fix a token alone let the coordinator listen on any address without TLS, and clients
and agents sent their token in plain text to any address, silently. Now, off loopback, the
coordinator refuses a token without TLS, and clients and agents refuse to send a token over
plain text, each with a message naming the way out (TLS flags, or --insecure); loopback is
unchanged. TLS without a CA file verifies against the system trust store.
"""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
from pathlib import Path

import grpc
import psutil
import pytest

from client import Client, GelasticError
from client.security import Security, system_trust_store
from coordinator.server import Coordinator, CoordinatorConfig
from nodeagent.session import AgentConfig, NodeAgent
from tests.security._certs import TestCA

REPO = Path(__file__).resolve().parents[2]
TOKEN = "plain-text-token-for-tests-0123456789"
OFF_HOST = "192.0.2.77:29400"
"""An address that is not this host's loopback (TEST-NET-1); nothing needs to listen there."""


@pytest.fixture
def token_file(tmp_path: Path) -> str:
    path = tmp_path / "token"
    path.write_text(TOKEN + "\n")
    path.chmod(0o600)
    return str(path)


def _cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, *args],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
        env={**os.environ, **(env or {})},
    )


def _local_non_loopback_address() -> str | None:
    for addrs in psutil.net_if_addrs().values():
        for a in addrs:
            if a.family == socket.AF_INET and not a.address.startswith("127."):
                return str(a.address)
    return None


# ---- the coordinator ------------------------------------------------------------------------


def test_serve_refuses_a_token_without_tls_off_loopback(token_file: str, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="without TLS") as err:
        CoordinatorConfig(host="0.0.0.0", port=0, token_file=token_file).validate()
    assert "--insecure" in str(err.value) and "--tls-cert" in str(err.value)
    # The ways out: TLS, or --insecure; and loopback needs neither.
    ca = TestCA(tmp_path / "pki")
    server = ca.server()
    CoordinatorConfig(
        host="0.0.0.0", port=0, token_file=token_file, tls_cert=server.cert, tls_key=server.key
    ).validate()
    CoordinatorConfig(host="0.0.0.0", port=0, token_file=token_file, insecure=True).validate()
    CoordinatorConfig(host="127.0.0.1", port=0, token_file=token_file).validate()
    proc = _cli(
        "-m", "coordinator.cli", "serve", "--host", "0.0.0.0", "--port", "0",
        "--state-dir", ":memory:", "--token-file", token_file,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert "refusing to listen on 0.0.0.0 with a token but without TLS" in lines[0]
    assert "--insecure" in lines[0] and "--tls-cert" in lines[0]
    assert TOKEN not in proc.stderr


# ---- clients --------------------------------------------------------------------------------


def test_client_refuses_to_send_a_token_in_plain_text_off_host(token_file: str) -> None:
    with pytest.raises(ValueError, match="refusing to send the token in plain text") as err:
        Client(OFF_HOST, security=Security.from_files(token_file))
    assert "--insecure" in str(err.value) and "--tls-ca" in str(err.value)
    assert TOKEN not in str(err.value)
    # Explicitly insecure, by argument or by environment: allowed (the channel is lazy).
    Client(OFF_HOST, security=Security.from_files(token_file, insecure=True)).close()
    env = {"GELASTIC_TOKEN_FILE": token_file, "GELASTIC_INSECURE": "1"}
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        Client(OFF_HOST).close()
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    # No token, nothing to leak: a tokenless client may talk plain text anywhere.
    Client(OFF_HOST, security=Security()).close()


def test_cli_refuses_before_connecting_and_insecure_lets_it_try(token_file: str) -> None:
    proc = _cli(
        "-m", "gelastic", "--coordinator", OFF_HOST, "--token-file", token_file, "nodes"
    )  # fmt: skip
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert f"refusing to send the token in plain text to {OFF_HOST}" in lines[0]
    assert "--insecure" in lines[0]
    # With --insecure it goes on to connect (and finds nothing there).
    proc = _cli(
        "-m", "gelastic", "--coordinator", OFF_HOST, "--token-file", token_file,
        "--connect-timeout", "1", "--insecure", "nodes",
    )  # fmt: skip
    assert proc.returncode == 2
    assert "refusing" not in proc.stderr and "cannot reach the coordinator" in proc.stderr


async def test_loopback_plain_text_with_a_token_still_works(token_file: str) -> None:
    async with Coordinator(
        CoordinatorConfig(state_dir=":memory:", port=0, token_file=token_file)
    ) as c:
        for target in (c.address, f"localhost:{c.port}"):
            client = Client(target, security=Security.from_files(token_file), timeout=10)
            assert await asyncio.to_thread(client.list_nodes) == []
            client.close()


async def test_insecure_lets_a_token_cross_a_real_non_loopback_address(token_file: str) -> None:
    host = _local_non_loopback_address()
    if host is None:
        pytest.skip("this host has no non-loopback IPv4 address")
    cfg = CoordinatorConfig(
        host=host, port=0, state_dir=":memory:", token_file=token_file, insecure=True
    )
    async with Coordinator(cfg) as c:
        with pytest.raises(ValueError, match="plain text"):
            Client(c.address, security=Security.from_files(token_file))
        client = Client(c.address, security=Security.from_files(token_file, insecure=True))
        assert await asyncio.to_thread(client.list_nodes) == []
        client.close()


# ---- agents ---------------------------------------------------------------------------------


def test_agent_refuses_to_send_its_token_in_plain_text_off_host(
    token_file: str, tmp_path: Path
) -> None:
    dirs = {"log_dir": str(tmp_path / "logs"), "state_dir": str(tmp_path / "state")}
    with pytest.raises(ValueError, match="refusing to send the token in plain text"):
        NodeAgent(AgentConfig(coordinator=OFF_HOST, name="n1", token_file=token_file, **dirs))
    NodeAgent(
        AgentConfig(coordinator=OFF_HOST, name="n1", token_file=token_file, insecure=True, **dirs)
    )
    NodeAgent(AgentConfig(coordinator="127.0.0.1:29400", name="n1", token_file=token_file, **dirs))
    proc = _cli(
        "-m", "nodeagent.cli", "--coordinator", OFF_HOST, "--name", "n1",
        "--token-file", token_file, "--log-dir", dirs["log_dir"], "--state-dir", dirs["state_dir"],
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("nodeagent: refusing to send the token in plain text")
    assert "--insecure" in lines[0]


# ---- the system trust store -----------------------------------------------------------------


async def test_tls_without_a_ca_file_verifies_against_the_system_trust_store(
    token_file: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ca = TestCA(tmp_path / "pki")
    server = ca.server()
    cfg = CoordinatorConfig(
        state_dir=":memory:",
        port=0,
        token_file=token_file,
        tls_cert=server.cert,
        tls_key=server.key,
    )
    async with Coordinator(cfg) as c:
        sec = Security.from_files(token_file, tls=True)
        # Our CA is in no trust store of this host: the coordinator is not trusted.
        client = Client(c.address, security=sec, timeout=5)
        with pytest.raises(GelasticError) as err:
            await asyncio.to_thread(client.list_nodes)
        assert err.value.code == grpc.StatusCode.UNAVAILABLE
        client.close()
        # Made the host's trust store (what OpenSSL reads, $SSL_CERT_FILE): now it is trusted.
        monkeypatch.setenv("SSL_CERT_FILE", ca.ca)
        assert b"BEGIN CERTIFICATE" in system_trust_store()
        client = Client(c.address, security=sec, timeout=5)
        assert await asyncio.to_thread(client.list_nodes) == []
        client.close()


async def test_an_agent_with_tls_and_no_ca_file_joins_through_the_system_trust_store(
    token_file: str, tmp_path: Path
) -> None:
    # The agent process keeps Python's ssl module out unless it needs it; --tls needs it.
    ca = TestCA(tmp_path / "pki")
    server = ca.server()
    cfg = CoordinatorConfig(
        state_dir=":memory:",
        port=0,
        token_file=token_file,
        tls_cert=server.cert,
        tls_key=server.key,
    )
    async with Coordinator(cfg) as c:
        agent = subprocess.Popen(
            [
                sys.executable, "-m", "nodeagent.cli", "--coordinator", c.address,
                "--name", "tls-node", "--slots", "1", "--token-file", token_file, "--tls",
                "--log-dir", str(tmp_path / "logs"), "--state-dir", str(tmp_path / "state"),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            cwd=REPO,
            env={**os.environ, "SSL_CERT_FILE": ca.ca},
            start_new_session=True,
        )  # fmt: skip
        try:
            client = Client(c.address, security=Security(token=TOKEN, tls_ca=ca.ca), timeout=10)

            async def joined() -> bool:
                names = {n.name for n in await asyncio.to_thread(client.list_nodes)}
                return "tls-node" in names

            deadline = asyncio.get_running_loop().time() + 60
            while not await joined():
                assert agent.poll() is None, agent.communicate()
                assert asyncio.get_running_loop().time() < deadline, "the agent never joined"
                await asyncio.sleep(0.1)
            client.close()
        finally:
            agent.terminate()
            try:
                await asyncio.to_thread(agent.communicate, timeout=60)
            except subprocess.TimeoutExpired:
                agent.kill()
                await asyncio.to_thread(agent.communicate, timeout=30)
        assert agent.returncode == 0


@pytest.mark.parametrize(
    ("target", "refused"),
    [
        ("127.0.0.1:29400", False),
        ("localhost:29400", False),
        ("[::1]:29400", False),
        ("ipv4:127.0.0.1:29400", False),
        ("dns:///localhost:29400", False),
        ("unix:/tmp/gelastic.sock", False),
        ("10.0.0.1:29400", True),
        ("[2001:db8::1]:29400", True),
        ("ipv4:10.0.0.1:29400,127.0.0.1:29400", True),
        ("ipv4:127.0.0.1:29400,10.0.0.1:29400", True),
        ("ipv4:127.0.0.1:29400,127.0.0.2:29400", False),
        ("dns:///coordinator.invalid:29400", True),
        ("0.0.0.0:29400", True),
    ],
)
def test_which_targets_count_as_this_host(target: str, refused: bool) -> None:
    sec = Security(token=TOKEN)
    if refused:
        with pytest.raises(ValueError, match="plain text"):
            sec.check_target(target)
    else:
        sec.check_target(target)
    Security(token=TOKEN, insecure=True).check_target(target)
    Security(token=TOKEN, tls=True).check_target(target)
