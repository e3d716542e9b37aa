"""How gelastic's processes prove who they are: tokens and TLS settings, shared by all three.

A token is a shared secret read from a file and sent as `authorization: Bearer <token>` call
metadata; the coordinator compares it in constant time. TLS is the standard grpc channel
credentials, optionally with a client certificate (mTLS). TLS without a CA file verifies the
coordinator against the system trust store. A token is never sent in plain text to an address
off this host unless `insecure` says so.
"""

from __future__ import annotations

import ipaddress
import itertools
import os
import secrets
import socket
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path

import grpc
import grpc.aio

__all__ = [
    "AUTH_HEADER",
    "Security",
    "is_loopback",
    "new_token_file",
    "read_token",
    "system_trust_store",
    "target_hosts",
]

AUTH_HEADER = "authorization"
MAX_TOKEN_BYTES = 4096
MAX_TRUST_STORE_BYTES = 16 * 1024 * 1024
"""The system trust store is read whole; past this size it is refused rather than read."""
MAX_TRUST_STORE_FILES = 10_000
"""Entries of the trust store's directory looked at."""
_TRUE = ("1", "true", "yes", "on")


def is_loopback(host: str) -> bool:
    """True when `host` (a name or address) means this host only."""
    if host in ("localhost",):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        try:
            return all(
                ipaddress.ip_address(info[4][0]).is_loopback
                for info in socket.getaddrinfo(host, None)
            )
        except OSError:
            return False


def target_hosts(target: str) -> list[str]:
    """The hosts of a gRPC target (HOST:PORT, [V6]:PORT, dns:, ipv4: and ipv6: forms, lists of
    addresses); none for a unix socket, which never leaves this host."""
    t = target.strip()
    if t.startswith(("unix:", "unix-abstract:")):
        return []
    parts = [t]
    for scheme in ("dns:///", "dns:", "ipv4:", "ipv6:"):
        if t.startswith(scheme):
            parts = t[len(scheme) :].split(",")[:64]
            break
    hosts = []
    for part in parts:
        if part.startswith("["):
            hosts.append(part[1:].split("]")[0])
        elif part.count(":") > 1:  # a bare IPv6 address without a port
            hosts.append(part)
        else:
            hosts.append(part.rpartition(":")[0] if ":" in part else part)
    return hosts


def system_trust_store() -> bytes:
    """The PEM certificates of this host's trust store (what OpenSSL verifies with by default).

    grpc otherwise trusts a root bundle of its own; a coordinator certificate signed by a CA the
    operator installed on the host is found here. Raises ValueError when there is none.
    """
    import ssl  # here, not at the top: the agent keeps ssl out unless it needs it

    paths = ssl.get_default_verify_paths()
    # OpenSSL's default: the CA file ($SSL_CERT_FILE) and the CA directory ($SSL_CERT_DIR).
    files: list[Path] = []
    if paths.cafile:
        files.append(Path(paths.cafile))
    if paths.capath and os.path.isdir(paths.capath):
        entries = itertools.islice(Path(paths.capath).iterdir(), MAX_TRUST_STORE_FILES)
        files.extend(sorted(p for p in entries if p.suffix in (".pem", ".crt") and p.is_file()))
    data = bytearray()
    for f in files:
        try:
            with f.open("rb") as fh:
                chunk = fh.read(MAX_TRUST_STORE_BYTES + 1 - len(data))
        except OSError:
            continue
        data += chunk
        if len(data) > MAX_TRUST_STORE_BYTES:
            raise ValueError(
                f"the system trust store is larger than {MAX_TRUST_STORE_BYTES} bytes: "
                "pass --tls-ca"
            )
        data += b"\n"
    if b"-----BEGIN CERTIFICATE-----" not in data:
        raise ValueError(
            "TLS without --tls-ca needs the system trust store, and none was found "
            f"(looked at {paths.cafile or paths.openssl_cafile}, {paths.capath or paths.openssl_capath}): "
            "pass --tls-ca"
        )
    return bytes(data)


def new_token_file(prefix: str = "gelastic-token-") -> Path:
    """A fresh random token in a new private temp dir (0700), in a file of its own (0600).

    The caller owns the directory (the file's parent) and removes it when done.
    """
    directory = Path(tempfile.mkdtemp(prefix=prefix))
    path = directory / "token"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_urlsafe(32) + "\n")
    return path


def read_token(path: str | os.PathLike[str]) -> str:
    """The token in a file (surrounding white space stripped); raises ValueError naming the file."""
    p = Path(path)
    try:
        data = p.read_bytes()
    except OSError as exc:
        raise ValueError(f"cannot read token file {p}: {exc.strerror or exc}") from None
    if len(data) > MAX_TOKEN_BYTES:
        raise ValueError(f"token file {p} is larger than {MAX_TOKEN_BYTES} bytes")
    token = data.decode("utf-8", errors="strict").strip()
    if len(token) < 16:
        raise ValueError(
            f"token in {p} is too short: use at least 16 characters (32+ random is better)"
        )
    if any(c.isspace() for c in token):
        raise ValueError(f"token in {p} must not contain white space")
    return token


@dataclass(frozen=True)
class Security:
    """What a client or agent presents to the coordinator."""

    token: str = field(default="", repr=False)
    """Shared secret sent with every call ("" = none); never in repr or str."""
    tls_ca: str = ""
    """PEM file of the CA that signed the coordinator's certificate ("" = plain text)."""
    tls_cert: str = ""
    """PEM client certificate for mTLS ("" = none)."""
    tls_key: str = ""
    """PEM private key of tls_cert."""
    tls_server_name: str = ""
    """Override of the name checked in the coordinator's certificate."""
    tls: bool = False
    """Use TLS even without tls_ca, verifying the coordinator against the system trust store."""
    insecure: bool = False
    """Allow sending the token in plain text to an address off this host."""

    @classmethod
    def from_files(
        cls,
        token_file: str = "",
        tls_ca: str = "",
        tls_cert: str = "",
        tls_key: str = "",
        tls_server_name: str = "",
        *,
        tls: bool = False,
        insecure: bool = False,
    ) -> Security:
        token = read_token(token_file) if token_file else ""
        if bool(tls_cert) != bool(tls_key):
            raise ValueError("--tls-cert and --tls-key go together")
        return cls(token, tls_ca, tls_cert, tls_key, tls_server_name, tls, insecure)

    @classmethod
    def from_env(
        cls,
        token_file: str | None = None,
        tls_ca: str | None = None,
        *,
        tls: bool | None = None,
        insecure: bool | None = None,
    ) -> Security:
        """Settings given here, else `$GELASTIC_TOKEN_FILE`, `$GELASTIC_TLS_CA`, `$GELASTIC_TLS`
        and `$GELASTIC_INSECURE` (1/true/yes/on)."""
        env = os.environ

        def flag(name: str) -> bool:
            return env.get(name, "").strip().lower() in _TRUE

        return cls.from_files(
            token_file if token_file is not None else env.get("GELASTIC_TOKEN_FILE", ""),
            tls_ca if tls_ca is not None else env.get("GELASTIC_TLS_CA", ""),
            tls=tls if tls is not None else flag("GELASTIC_TLS"),
            insecure=insecure if insecure is not None else flag("GELASTIC_INSECURE"),
        )

    @property
    def uses_tls(self) -> bool:
        return bool(self.tls or self.tls_ca or self.tls_cert)

    def check_target(self, target: str) -> None:
        """Raise ValueError if a call to `target` would carry the token in plain text off this host."""
        if not self.token or self.uses_tls or self.insecure:
            return
        if all(is_loopback(host) for host in target_hosts(target)):
            return
        raise ValueError(
            f"refusing to send the token in plain text to {target}: anyone on the network could "
            "read it. Use TLS (--tls-ca FILE, or --tls to verify against the system trust store), "
            "or --insecure ($GELASTIC_INSECURE=1) to accept the risk"
        )

    def __repr__(self) -> str:
        # A repr lands in logs and tracebacks: it says whether a token is set, never which.
        shown = ", ".join(
            f"{f.name}={getattr(self, f.name)!r}" for f in fields(self) if f.name != "token"
        )
        return f"Security(token_set={bool(self.token)}, {shown})"

    __str__ = __repr__

    @property
    def metadata(self) -> tuple[tuple[str, str], ...]:
        return ((AUTH_HEADER, f"Bearer {self.token}"),) if self.token else ()

    def _credentials(self) -> grpc.ChannelCredentials | None:
        if not self.uses_tls:
            return None
        root = Path(self.tls_ca).read_bytes() if self.tls_ca else system_trust_store()
        key = Path(self.tls_key).read_bytes() if self.tls_key else None
        cert = Path(self.tls_cert).read_bytes() if self.tls_cert else None
        return grpc.ssl_channel_credentials(
            root_certificates=root, private_key=key, certificate_chain=cert
        )

    def _options(self, options: Sequence[tuple[str, object]]) -> list[tuple[str, object]]:
        out = list(options)
        if self.tls_server_name:
            out.append(("grpc.ssl_target_name_override", self.tls_server_name))
        return out

    def channel(self, target: str, options: Sequence[tuple[str, object]] = ()) -> grpc.Channel:
        self.check_target(target)
        creds = self._credentials()
        if creds is None:
            return grpc.insecure_channel(target, options=self._options(options))
        return grpc.secure_channel(target, creds, options=self._options(options))

    def aio_channel(
        self, target: str, options: Sequence[tuple[str, object]] = ()
    ) -> grpc.aio.Channel:
        self.check_target(target)
        creds = self._credentials()
        if creds is None:
            return grpc.aio.insecure_channel(target, options=self._options(options))
        return grpc.aio.secure_channel(target, creds, options=self._options(options))
