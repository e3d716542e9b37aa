"""With mTLS, a node may be required to use the name its certificate was issued for.

Before the fix any agent with a certificate from the cluster's CA could register under any node
name, taking over another node's name and its work. With `--require-cert-node-names` the Hello's
name must be a DNS name of the agent's certificate (its common name when it has none); another
name is refused with PERMISSION_DENIED, saying why.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import grpc.aio
import pytest

from client import Client
from client.security import Security
from coordinator.server import Coordinator, CoordinatorConfig
from protos.gelastic.v1 import gelastic_pb2 as pb
from protos.gelastic.v1 import gelastic_pb2_grpc as pb_grpc
from tests.security._certs import Pair, TestCA

TOKEN = "cert-names-token-for-tests-0123456789"


async def _hello(address: str, security: Security, name: str) -> pb.CoordinatorMessage:
    async with security.aio_channel(address) as ch:
        stop = asyncio.Event()

        async def gen() -> AsyncIterator[pb.NodeMessage]:
            yield pb.NodeMessage(
                hello=pb.Hello(name=name, addr="127.0.0.1", slots=1, incarnation="i-" + name)
            )
            await asyncio.wait_for(stop.wait(), 30)

        call = pb_grpc.NodeSessionStub(ch).Session(gen(), metadata=security.metadata)
        try:
            return await asyncio.wait_for(call.read(), 20)  # type: ignore[no-any-return]
        finally:
            stop.set()
            call.cancel()


async def _code(address: str, security: Security, name: str) -> tuple[grpc.StatusCode, str]:
    try:
        msg = await _hello(address, security, name)
    except grpc.aio.AioRpcError as err:
        return err.code(), err.details() or ""
    assert msg.WhichOneof("kind") == "welcome"
    return grpc.StatusCode.OK, ""


def _as(pair: Pair, ca: TestCA, token_file: str) -> Security:
    return Security.from_files(token_file, tls_ca=ca.ca, tls_cert=pair.cert, tls_key=pair.key)


@pytest.fixture
def pki(tmp_path: Path) -> tuple[TestCA, str]:
    token = tmp_path / "token"
    token.write_text(TOKEN)
    return TestCA(tmp_path / "pki"), str(token)


def _config(ca: TestCA, token_file: str, require: bool) -> CoordinatorConfig:
    server = ca.server()
    return CoordinatorConfig(
        state_dir=":memory:",
        port=0,
        token_file=token_file,
        tls_cert=server.cert,
        tls_key=server.key,
        tls_client_ca=ca.ca,
        require_cert_node_names=require,
    )


async def test_a_node_name_must_be_in_its_certificate(pki: tuple[TestCA, str]) -> None:
    ca, token_file = pki
    node_a = _as(
        ca.leaf("node-a", "ignored-cn", dns=["node-a", "node-a.example.com"]), ca, token_file
    )
    cn_only = _as(ca.leaf("node-c", "node-c"), ca, token_file)
    ip_only = _as(ca.leaf("node-ip", "10.1.2.3-cn", ips=["10.1.2.3"]), ca, token_file)
    async with Coordinator(_config(ca, token_file, require=True)) as c:
        assert await _code(c.address, node_a, "node-a") == (grpc.StatusCode.OK, "")
        assert await _code(c.address, node_a, "node-a.example.com") == (grpc.StatusCode.OK, "")
        code, details = await _code(c.address, node_a, "node-b")
        assert code == grpc.StatusCode.PERMISSION_DENIED
        assert "node name 'node-b' is not in this agent's certificate" in details
        assert "'node-a'" in details
        # A DNS name wins over the common name.
        code, _ = await _code(c.address, node_a, "ignored-cn")
        assert code == grpc.StatusCode.PERMISSION_DENIED
        # Without any DNS name, the common name is the node's name.
        assert await _code(c.address, cn_only, "node-c") == (grpc.StatusCode.OK, "")
        code, _ = await _code(c.address, cn_only, "node-d")
        assert code == grpc.StatusCode.PERMISSION_DENIED
        # An address in the certificate is not a name.
        code, _ = await _code(c.address, ip_only, "10.1.2.3")
        assert code == grpc.StatusCode.PERMISSION_DENIED
        client = Client(c.address, security=node_a, timeout=10)
        names = {n.name for n in await asyncio.to_thread(client.list_nodes)}
        client.close()
        assert names == {"node-a", "node-a.example.com", "node-c"}


async def test_without_the_flag_any_name_is_accepted(pki: tuple[TestCA, str]) -> None:
    ca, token_file = pki
    node_a = _as(ca.leaf("node-a", "node-a", dns=["node-a"]), ca, token_file)
    async with Coordinator(_config(ca, token_file, require=False)) as c:
        assert await _code(c.address, node_a, "node-b") == (grpc.StatusCode.OK, "")


def test_the_flag_needs_mtls(pki: tuple[TestCA, str]) -> None:
    ca, token_file = pki
    server = ca.server()
    with pytest.raises(ValueError, match="needs mTLS"):
        CoordinatorConfig(
            token_file=token_file,
            tls_cert=server.cert,
            tls_key=server.key,
            require_cert_node_names=True,
        ).validate()
    proc = subprocess.run(
        [
            sys.executable, "-m", "coordinator.cli", "serve", "--port", "0",
            "--state-dir", ":memory:", "--require-cert-node-names",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )  # fmt: skip
    assert proc.returncode == 2
    assert "--require-cert-node-names" in proc.stderr and "--tls-client-ca" in proc.stderr
