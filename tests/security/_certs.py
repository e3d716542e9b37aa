"""Throw-away certificates for TLS tests: one CA, a server certificate, client certificates."""

from __future__ import annotations

import datetime
import ipaddress
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID


@dataclass(frozen=True)
class Pair:
    cert: str
    key: str


class TestCA:
    """A CA in `directory` that signs leaves with the names a test asks for."""

    __test__ = False  # not a test class, whatever pytest thinks of the name

    def __init__(self, directory: Path) -> None:
        self.dir = directory
        self.dir.mkdir(parents=True, exist_ok=True)
        self._now = datetime.datetime.now(datetime.UTC)
        self._key = ec.generate_private_key(ec.SECP256R1())
        self._name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "gelastic test CA")])
        ca = (
            self._builder(self._name, self._key.public_key())
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(self._key, hashes.SHA256())
        )
        self.ca = self._write_cert(ca, "ca.pem")

    def _builder(
        self, subject: x509.Name, public_key: ec.EllipticCurvePublicKey
    ) -> x509.CertificateBuilder:
        return (
            x509.CertificateBuilder()
            .subject_name(subject)
            .issuer_name(self._name)
            .public_key(public_key)
            .serial_number(x509.random_serial_number())
            .not_valid_before(self._now - datetime.timedelta(minutes=5))
            .not_valid_after(self._now + datetime.timedelta(days=1))
        )

    def _write_cert(self, cert: x509.Certificate, name: str) -> str:
        path = self.dir / name
        path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        return str(path)

    def leaf(
        self, file_name: str, cn: str, dns: Sequence[str] = (), ips: Sequence[str] = ()
    ) -> Pair:
        """A certificate with common name `cn` and these DNS and IP SANs (none: no SAN at all)."""
        key = ec.generate_private_key(ec.SECP256R1())
        builder = self._builder(
            x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)]), key.public_key()
        )
        san: list[x509.GeneralName] = [x509.DNSName(d) for d in dns]
        san += [x509.IPAddress(ipaddress.ip_address(i)) for i in ips]
        if san:
            builder = builder.add_extension(x509.SubjectAlternativeName(san), critical=False)
        cert = builder.sign(self._key, hashes.SHA256())
        key_path = self.dir / f"{file_name}.key"
        key_path.write_bytes(
            key.private_bytes(
                serialization.Encoding.PEM,
                serialization.PrivateFormat.PKCS8,
                serialization.NoEncryption(),
            )
        )
        key_path.chmod(0o600)
        return Pair(self._write_cert(cert, f"{file_name}.pem"), str(key_path))

    def server(self) -> Pair:
        return self.leaf("server", "localhost", dns=["localhost"], ips=["127.0.0.1"])
