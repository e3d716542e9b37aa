"""TLS failures name their reason, the CLI can present a client certificate, and refused callers
are logged by the coordinator at a bounded rate.

Before: with a server-name mismatch or a missing client certificate the agent logged only
"session ... ended: UNAVAILABLE", forever; the CLI without --tls-ca against a TLS coordinator said
"UNAVAILABLE: ipv4:127.0.0.1:PORT: Socket closed"; the CLI had no --tls-cert/--tls-key, so it could
not talk to an mTLS coordinator at all; `Security` was not part of the `client` API; every refused
call was one WARNING line, however fast an agent retried.
"""

from __future__ import annotations

import logging
import subprocess
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

import client
from client import Client, Security
from coordinator.server import Coordinator, CoordinatorConfig
from tests import _programs as progs
from tests.security._certs import Pair, TestCA
from tests.service._fakes import FakeNode

TOKEN = "tls-messages-token-0123456789abcdef"


@pytest.fixture(scope="module")
def tmp(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("tls")


@pytest.fixture(scope="module")
def ca(tmp: Path) -> TestCA:
    return TestCA(tmp / "ca")


@pytest.fixture(scope="module")
def server(ca: TestCA) -> Pair:
    return ca.server()


@pytest.fixture(scope="module")
def client_pair(ca: TestCA) -> Pair:
    return ca.leaf("client", "client-a", dns=["client-a"])


@pytest.fixture(scope="module")
def token_file(tmp: Path) -> str:
    path = tmp / "token"
    path.write_text(TOKEN + "\n")
    path.chmod(0o600)
    return str(path)


@pytest.fixture(scope="module")
def tls_address(tmp: Path, server: Pair, token_file: str) -> Iterator[str]:
    with progs.coordinator(
        tmp, "--tls-cert", server.cert, "--tls-key", server.key, "--token-file", token_file
    ) as addr:
        yield addr


@pytest.fixture(scope="module")
def mtls_address(tmp: Path, server: Pair, ca: TestCA) -> Iterator[str]:
    with progs.coordinator(
        tmp, "--tls-cert", server.cert, "--tls-key", server.key, "--tls-client-ca", ca.ca
    ) as addr:
        yield addr


@pytest.fixture(scope="module")
def plain_address(tmp: Path, token_file: str) -> Iterator[str]:
    with progs.coordinator(tmp, "--token-file", token_file) as addr:
        yield addr


def _line(proc: subprocess.CompletedProcess[str], prefix: str) -> str:
    for noise in progs.NOISE:
        assert noise not in proc.stderr, proc.stderr
    assert proc.returncode == 2, proc.stderr
    line = progs.last_line(proc.stderr)
    assert line.startswith(prefix), proc.stderr
    return line


def _agent(address: str, tmp: Path, name: str, *extra: str) -> str:
    proc = progs.run("nodeagent", *progs.agent_args(address, tmp, name, *extra))
    return _line(proc, "nodeagent: ")


def test_agent_names_a_server_name_mismatch(
    tls_address: str, tmp: Path, ca: TestCA, token_file: str
) -> None:
    line = _agent(
        tls_address, tmp, "n-sni", "--token-file", token_file, "--tls-ca", ca.ca,
        "--tls-server-name", "other.example",
    )  # fmt: skip
    assert line.startswith(
        "nodeagent: the coordinator's certificate does not name 'other.example' (Hostname mismatch"
    ), line
    assert line.endswith("pass --tls-server-name NAME")


def test_agent_names_a_missing_client_certificate(mtls_address: str, tmp: Path, ca: TestCA) -> None:
    assert _agent(mtls_address, tmp, "n-nocert", "--tls-ca", ca.ca) == (
        "nodeagent: the coordinator requires a client certificate (mTLS): "
        "pass --tls-cert and --tls-key"
    )


def test_agent_names_plain_text_meeting_tls(tls_address: str, tmp: Path, token_file: str) -> None:
    assert _agent(tls_address, tmp, "n-plain", "--token-file", token_file) == (
        f"nodeagent: the coordinator at {tls_address} speaks TLS and this side plain text: "
        "pass --tls-ca FILE (or --tls to verify it against the system trust store)"
    )


def test_cli_names_plain_text_meeting_tls_both_ways(
    tls_address: str, plain_address: str, ca: TestCA, token_file: str
) -> None:
    proc = progs.run("gelastic", "--coordinator", tls_address, "--token-file", token_file, "nodes")
    assert _line(proc, "gelastic nodes: ") == (
        f"gelastic nodes: cannot reach the coordinator at {tls_address}: the coordinator at "
        f"{tls_address} speaks TLS and this side plain text: pass --tls-ca FILE (or --tls to "
        "verify it against the system trust store)"
    )
    proc = progs.run(
        "gelastic", "--coordinator", plain_address, "--token-file", token_file,
        "--tls-ca", ca.ca, "nodes",
    )  # fmt: skip
    assert "speaks plain text and this side TLS: drop --tls-ca/--tls" in _line(
        proc, "gelastic nodes: "
    )


def test_cli_presents_a_client_certificate(
    mtls_address: str, ca: TestCA, client_pair: Pair
) -> None:
    proc = progs.run("gelastic", "--coordinator", mtls_address, "--tls-ca", ca.ca, "nodes")
    assert _line(proc, "gelastic nodes: ").endswith(
        "the coordinator requires a client certificate (mTLS): pass --tls-cert and --tls-key"
    )
    proc = progs.run(
        "gelastic", "--coordinator", mtls_address, "--tls-ca", ca.ca,
        "--tls-cert", client_pair.cert, "--tls-key", client_pair.key, "nodes",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("NODE")


def test_security_is_public_and_does_mtls(mtls_address: str, ca: TestCA, client_pair: Pair) -> None:
    assert "Security" in client.__all__
    security = Security.from_files(tls_ca=ca.ca, tls_cert=client_pair.cert, tls_key=client_pair.key)
    with Client(mtls_address, security=security) as c:
        assert c.list_nodes() == []
    with pytest.raises(ValueError, match="does not belong to the certificate"):
        Security.from_files(tls_ca=ca.ca, tls_cert=client_pair.cert, tls_key=ca.server().key)


class _Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _refusal_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == "coordinator._auth" and r.levelno == logging.WARNING
    ]


async def test_coordinator_logs_refusals_at_a_bounded_rate(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    token = tmp_path / "token"
    token.write_text(TOKEN)
    token.chmod(0o600)
    config = CoordinatorConfig(state_dir=":memory:", port=0, token_file=str(token), lease=600.0)
    caplog.set_level(logging.WARNING, logger="coordinator._auth")
    async with Coordinator(config) as coord:
        clock = _Clock()
        coord.service.refusals._clock = clock
        for _ in range(5):
            node = FakeNode(coord.address, "node-x", "127.0.0.1")  # no token
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await node.connect()
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
            await node.close()
        assert _refusal_lines(caplog) == [
            "refused /gelastic.v1.NodeSession/Session from 127.0.0.1: "
            "no agent token: pass --token-file"
        ]
        clock.now += 11.0
        node = FakeNode(coord.address, "node-x", "127.0.0.1")
        with pytest.raises(grpc.aio.AioRpcError):
            await node.connect()
        await node.close()
        assert _refusal_lines(caplog)[1:] == [
            "refused /gelastic.v1.NodeSession/Session from 127.0.0.1: "
            "no agent token: pass --token-file (4 more like it since the last line)"
        ]


async def test_a_name_in_use_is_logged_and_says_how_long_it_can_be_held(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="coordinator._auth")
    config = CoordinatorConfig(state_dir=":memory:", port=0, lease=7.0, reconnect_grace=3.0)
    async with Coordinator(config) as coord:
        owner = FakeNode(coord.address, "node-a", "127.0.0.1", incarnation="inc-1")
        await owner.connect()
        other = FakeNode(coord.address, "node-a", "127.0.0.1", incarnation="inc-2")
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await other.connect()
        await other.close()
        assert err.value.code() == grpc.StatusCode.ALREADY_EXISTS
        assert ("gelastic-name-held-ms", "7000") in tuple(err.value.trailing_metadata() or ())
        assert _refusal_lines(caplog) == [
            "refused a node session from 127.0.0.1: node name 'node-a' already has a live "
            "session; a new one is refused until that one ends"
        ]
        await owner.close()


def test_refusals_are_keyed_by_peer_host_and_bounded(caplog: pytest.LogCaptureFixture) -> None:
    from coordinator._auth import REFUSAL_LOG_KEYS, RefusalLog, peer_host

    assert peer_host("ipv4:10.0.0.1:5000") == "10.0.0.1"
    assert peer_host("ipv6:[::1]:5000") == "::1"
    caplog.set_level(logging.WARNING, logger="coordinator._auth")
    clock = _Clock()
    log = RefusalLog(clock=clock)
    log.refused("ipv4:10.0.0.1:5000", "x", "bad")
    log.refused("ipv4:10.0.0.1:5001", "x", "bad")  # another port, same peer: left out
    log.refused("ipv4:10.0.0.2:5000", "x", "bad")
    assert len(_refusal_lines(caplog)) == 2
    for i in range(REFUSAL_LOG_KEYS + 10):
        log.refused(f"ipv4:10.1.{i // 256}.{i % 256}:1", "x", "bad")
    assert len(log._seen) == REFUSAL_LOG_KEYS
