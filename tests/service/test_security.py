"""Tokens, TLS and the safe default, against a real in-process coordinator."""

from __future__ import annotations

import asyncio
import datetime
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from client import Client, GelasticError, JobSpec
from client.security import Security
from coordinator.server import Coordinator, CoordinatorConfig
from protos.gelastic.v1 import gelastic_pb2 as pb
from protos.gelastic.v1 import gelastic_pb2_grpc as pb_grpc

TOKEN = "s3cret-token-for-tests-0123456789"


def _write(path: Path, text: str) -> str:
    path.write_text(text)
    return str(path)


async def _hello(address: str, security: Security) -> pb.CoordinatorMessage:
    async with security.aio_channel(address) as ch:

        async def gen() -> AsyncIterator[pb.NodeMessage]:
            yield pb.NodeMessage(
                hello=pb.Hello(name="n1", addr="127.0.0.1", slots=1, incarnation="i1")
            )
            await asyncio.sleep(5)

        call = pb_grpc.NodeSessionStub(ch).Session(gen(), metadata=security.metadata)
        msg = await asyncio.wait_for(call.read(), 10)
        call.cancel()
        return msg  # type: ignore[no-any-return]


async def test_token_is_required_for_clients_and_agents(tmp_path: Path) -> None:
    token_file = _write(tmp_path / "token", TOKEN + "\n")
    wrong_file = _write(tmp_path / "wrong", "x" * 32)
    async with Coordinator(
        CoordinatorConfig(state_dir=":memory:", port=0, token_file=token_file)
    ) as c:
        for sec in (Security(), Security.from_files(wrong_file)):
            client = Client(c.address, security=sec, timeout=5)
            with pytest.raises(GelasticError) as err:
                await asyncio.to_thread(client.list_nodes)
            assert err.value.code == grpc.StatusCode.UNAUTHENTICATED
            client.close()
            with pytest.raises(grpc.aio.AioRpcError) as aerr:
                await _hello(c.address, sec)
            assert aerr.value.code() == grpc.StatusCode.UNAUTHENTICATED
        good = Security.from_files(token_file)
        client = Client(c.address, security=good, timeout=5)
        assert await asyncio.to_thread(client.list_nodes) == []
        job = await asyncio.to_thread(client.submit, JobSpec(entrypoint=["true"]))
        assert job.job_id
        client.close()
        msg = await _hello(c.address, good)
        assert msg.WhichOneof("kind") == "welcome"


async def test_separate_agent_and_client_tokens(tmp_path: Path) -> None:
    agent_file = _write(tmp_path / "agent", "agent-token-" + "a" * 20)
    client_file = _write(tmp_path / "client", "client-token-" + "c" * 20)
    cfg = CoordinatorConfig(
        state_dir=":memory:", port=0, agent_token_file=agent_file, client_token_file=client_file
    )
    async with Coordinator(cfg) as c:
        as_agent, as_client = Security.from_files(agent_file), Security.from_files(client_file)
        with pytest.raises(grpc.aio.AioRpcError) as aerr:
            await _hello(c.address, as_client)
        assert aerr.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert (await _hello(c.address, as_agent)).WhichOneof("kind") == "welcome"
        client = Client(c.address, security=as_agent, timeout=5)
        with pytest.raises(GelasticError) as err:
            await asyncio.to_thread(client.list_jobs)
        assert err.value.code == grpc.StatusCode.UNAUTHENTICATED
        client.close()
        client = Client(c.address, security=as_client, timeout=5)
        assert await asyncio.to_thread(client.list_jobs) == []
        client.close()


def _ca(tmp: Path) -> tuple[str, str, str, str, str]:
    """A throw-away CA, a server certificate for 127.0.0.1/localhost and a client certificate."""
    now = datetime.datetime.now(datetime.UTC)

    def key() -> ec.EllipticCurvePrivateKey:
        return ec.generate_private_key(ec.SECP256R1())

    def pem_key(k: ec.EllipticCurvePrivateKey, name: str) -> str:
        data = k.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
        (tmp / name).write_bytes(data)
        return str(tmp / name)

    def pem_cert(cert: x509.Certificate, name: str) -> str:
        (tmp / name).write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        return str(tmp / name)

    ca_key = key()
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "gelastic test CA")])
    ca = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(ca_key, hashes.SHA256())
    )

    def leaf(
        cn: str, san: list[x509.GeneralName]
    ) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
        k = key()
        cert = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)]))
            .issuer_name(ca_name)
            .public_key(k.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName(san), critical=False)
            .sign(ca_key, hashes.SHA256())
        )
        return cert, k

    import ipaddress

    server, server_key = leaf(
        "localhost", [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
    )
    client, client_key = leaf("agent-1", [x509.DNSName("agent-1")])
    return (
        pem_cert(ca, "ca.pem"),
        pem_cert(server, "server.pem"),
        pem_key(server_key, "server.key"),
        pem_cert(client, "client.pem"),
        pem_key(client_key, "client.key"),
    )


async def test_mtls_with_a_token_end_to_end(tmp_path: Path) -> None:
    ca, cert, key, ccert, ckey = _ca(tmp_path)
    token_file = _write(tmp_path / "token", TOKEN)
    cfg = CoordinatorConfig(
        state_dir=":memory:",
        port=0,
        token_file=token_file,
        tls_cert=cert,
        tls_key=key,
        tls_client_ca=ca,
    )
    async with Coordinator(cfg) as c:
        good = Security.from_files(token_file, tls_ca=ca, tls_cert=ccert, tls_key=ckey)
        client = Client(c.address, security=good, timeout=5)
        assert await asyncio.to_thread(client.list_nodes) == []
        client.close()
        assert (await _hello(c.address, good)).WhichOneof("kind") == "welcome"
        # No client certificate: the TLS handshake itself is refused.
        no_cert = Security.from_files(token_file, tls_ca=ca)
        client = Client(c.address, security=no_cert, timeout=5)
        with pytest.raises(GelasticError) as err:
            await asyncio.to_thread(client.list_nodes)
        assert err.value.code == grpc.StatusCode.UNAVAILABLE
        client.close()
        # Plain text against a TLS server fails too.
        plain = Client(c.address, security=Security(token=TOKEN), timeout=5)
        with pytest.raises(GelasticError):
            await asyncio.to_thread(plain.list_nodes)
        plain.close()


def test_non_loopback_without_a_token_is_refused_with_a_reason() -> None:
    with pytest.raises(ValueError, match="without a token"):
        CoordinatorConfig(host="0.0.0.0", port=0).validate()
    CoordinatorConfig(host="0.0.0.0", port=0, insecure=True).validate()
    proc = subprocess.run(
        [sys.executable, "-m", "coordinator.cli", "serve", "--host", "0.0.0.0", "--port", "0"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2
    assert "refusing to listen on 0.0.0.0 without a token" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


def test_bad_token_files_are_named(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="cannot read token file"):
        CoordinatorConfig(token_file=str(tmp_path / "missing")).validate()
    short = _write(tmp_path / "short", "abc")
    with pytest.raises(ValueError, match="too short"):
        CoordinatorConfig(token_file=short).validate()
