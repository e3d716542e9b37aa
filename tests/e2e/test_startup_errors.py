"""Startup and refusal errors of the real programs: one `prog: ...` line naming the problem, exit 2.

Before: a busy port or a bad certificate ended `coordinator serve` with a traceback ending in
grpc's "RuntimeError: Failed to bind to address 127.0.0.1:0" (exit 1); `nodeagent --tls-ca
missing.pem` logged a FileNotFoundError traceback on every retry, forever; `gelastic --tls-ca
missing.pem nodes` printed a traceback (exit 1); an agent with a wrong token, or a second agent
under a live agent's name, retried forever, the latter printing "Task was destroyed but it is
pending!" and "aclose(): asynchronous generator is already running".
"""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from client import Client
from client.security import Security
from tests import _programs as progs
from tests.security._certs import TestCA

TOKEN = "startup-errors-token-0123456789abcdef"


@pytest.fixture(scope="module")
def tmp(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("startup")


@pytest.fixture(scope="module")
def token_file(tmp: Path) -> str:
    path = tmp / "token"
    path.write_text(TOKEN + "\n")
    path.chmod(0o600)
    return str(path)


@pytest.fixture(scope="module")
def bad_token_file(tmp: Path) -> str:
    path = tmp / "bad-token"
    path.write_text("not-the-token-0123456789abcdef\n")
    path.chmod(0o600)
    return str(path)


@pytest.fixture(scope="module")
def ca(tmp: Path) -> TestCA:
    return TestCA(tmp / "ca")


@pytest.fixture(scope="module")
def address(tmp: Path, token_file: str) -> Iterator[str]:
    # A short lease and grace: a name held by a gone agent is free again within ~1 s.
    with progs.coordinator(
        tmp,
        "--token-file",
        token_file,
        "--heartbeat-interval",
        "0.3",
        "--lease",
        "1",
        "--reconnect-grace",
        "0.5",
    ) as addr:
        yield addr


@pytest.fixture
def listener() -> Iterator[int]:
    """A port someone else listens on (no gelastic behind it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(8)
        yield s.getsockname()[1]


def _one_line(proc: object, prog: str) -> str:
    import subprocess

    assert isinstance(proc, subprocess.CompletedProcess)
    for noise in progs.NOISE:
        assert noise not in proc.stderr, proc.stderr
    line = progs.last_line(proc.stderr)
    assert line.startswith(f"{prog}: "), proc.stderr
    assert proc.returncode == 2, proc.stderr
    return line


def test_a_busy_port_is_named(listener: int) -> None:
    proc = progs.run("coordinator", "serve", "--state-dir", ":memory:", "--port", str(listener))
    line = _one_line(proc, "coordinator")
    assert line == (
        f"coordinator: cannot listen on 127.0.0.1:{listener}: the port is in use "
        "(is another coordinator running? pick another port)"
    )


def test_an_address_this_host_does_not_have_is_named() -> None:
    proc = progs.run(
        "coordinator", "serve", "--state-dir", ":memory:", "--port", "0", "--host", "192.0.2.7",
        "--insecure",
    )  # fmt: skip
    assert "cannot listen on 192.0.2.7:0: this host has no such address" in _one_line(
        proc, "coordinator"
    )


@pytest.mark.parametrize(
    ("which", "expected"),
    [
        ("key-as-cert", "--tls-cert {key}: not a PEM certificate (it holds a private key)"),
        (
            "other-key",
            "--tls-key {other_key}: this private key does not belong to the certificate {cert}",
        ),
    ],
)
def test_a_bad_certificate_file_is_named(ca: TestCA, tmp: Path, which: str, expected: str) -> None:
    server = ca.server()
    other = ca.leaf("other", "other.example", dns=["other.example"])
    missing = str(tmp / "missing.pem")
    cert, key, client_ca = {
        "key-as-cert": (server.key, server.key, ""),
        "other-key": (server.cert, other.key, ""),
    }[which]
    args = ["serve", "--state-dir", ":memory:", "--port", "0", "--tls-cert", cert, "--tls-key", key]
    if client_ca:
        args += ["--tls-client-ca", client_ca]
    line = _one_line(progs.run("coordinator", *args), "coordinator")
    want = expected.format(key=server.key, missing=missing, other_key=other.key, cert=server.cert)
    assert want in line


def test_the_agent_checks_its_files_and_address_at_start(tmp: Path, listener: int) -> None:
    target = f"127.0.0.1:{listener}"
    missing = str(tmp / "missing.pem")
    started = time.monotonic()
    proc = progs.run("nodeagent", *progs.agent_args(target, tmp, "n-ca", "--tls-ca", missing))
    assert _one_line(proc, "nodeagent") == f"nodeagent: --tls-ca {missing}: no such file"
    proc = progs.run("nodeagent", *progs.agent_args(target, tmp, "n-addr", "--addr", "192.0.2.7"))
    assert "nodeagent: --addr 192.0.2.7: not an address of this host" in _one_line(
        proc, "nodeagent"
    )
    assert time.monotonic() - started < 20  # nothing was retried


def test_gelastic_checks_its_files_before_connecting(tmp: Path, listener: int) -> None:
    missing = str(tmp / "missing.pem")
    proc = progs.run(
        "gelastic", "--coordinator", f"127.0.0.1:{listener}", "--tls-ca", missing, "nodes"
    )
    assert _one_line(proc, "gelastic nodes") == f"gelastic nodes: --tls-ca {missing}: no such file"


def test_an_agent_with_a_wrong_token_ends_with_exit_2(
    address: str, tmp: Path, bad_token_file: str
) -> None:
    proc = progs.run(
        "nodeagent", *progs.agent_args(address, tmp, "n-token", "--token-file", bad_token_file)
    )
    assert _one_line(proc, "nodeagent") == (
        f"nodeagent: coordinator {address} refused this agent: missing or wrong agent token"
    )


def test_a_second_agent_under_a_live_name_ends_with_exit_2(
    address: str, tmp: Path, token_file: str
) -> None:
    first = progs.popen_agent(progs.agent_args(address, tmp, "n-dup", "--token-file", token_file))
    try:
        client = Client(address, security=Security.from_files(token_file))
        deadline = time.monotonic() + progs.START_TIMEOUT_S
        while not any(n.name == "n-dup" for n in client.list_nodes()):
            assert first.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
        proc = progs.run(
            "nodeagent", *progs.agent_args(address, tmp, "n-dup", "--token-file", token_file)
        )
        line = _one_line(proc, "nodeagent")
        assert line.startswith(
            "nodeagent: node name 'n-dup' is in use by another live agent (coordinator "
        ), line
        assert line.endswith("give this agent another --name")
        # One line per backoff step, not one per retry.
        assert proc.stderr.count("refused this agent for now") <= 8, proc.stderr
        # The first agent kept its session all along.
        assert first.poll() is None
        assert [n.name for n in client.list_nodes() if n.name == "n-dup"] == ["n-dup"]
        client.close()
    finally:
        first.terminate()
        _, err = first.communicate(timeout=30)
    for noise in progs.NOISE:
        assert noise not in err, err
